"""Load Debian's OpenBLAS before MLX on Linux.

The ``mlx[cpu]`` wheel links the netlib *reference* BLAS, which runs an fp32 matmul
50-100x slower than OpenBLAS. Loading OpenBLAS with ``RTLD_GLOBAL`` before
``mlx.core`` is first imported makes MLX's BLAS calls resolve to it. It is optional:
without it everything still works, only slowly. Set ``KVSHELF_NO_OPENBLAS=1`` to skip.

Both BLAS libraries run one thread per core this process may use (``usable_cpus``:
its CPU affinity, not the machine's core count), so a node started under ``taskset -c
0`` or in a one-core cpuset runs one BLAS thread instead of several fighting over its
core. ``OPENBLAS_NUM_THREADS`` and ``BLIS_NUM_THREADS`` still override.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)

loaded_path: str | None = None


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a cpuset), else
    the machine's count. OpenBLAS counts the same way; ``os.cpu_count`` does not."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity API (macOS)
        return os.cpu_count() or 1


def openblas_threads() -> int | None:
    """The threads the preloaded OpenBLAS runs (None when none was loaded)."""
    if loaded_path is None:
        return None
    try:
        return int(ctypes.CDLL(loaded_path).openblas_get_num_threads())
    except (OSError, AttributeError):  # a BLAS without OpenBLAS's extensions
        return None


def installed_path() -> str | None:
    """The first OpenBLAS that ``load_openblas`` would load, if one is installed."""
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def load_openblas() -> str | None:
    """Preload OpenBLAS if we are on Linux, it is installed and not disabled."""
    global loaded_path
    if loaded_path or not sys.platform.startswith("linux"):
        return loaded_path
    if os.environ.get("KVSHELF_NO_OPENBLAS", "").lower() in ("1", "true", "yes"):
        return None
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx.core was imported before kvshelf; OpenBLAS could not be preloaded "
            "and MLX's CPU matmuls will use the slow reference BLAS.",
            stacklevel=3,
        )
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            return path
    return None
