"""Load Debian's OpenBLAS before MLX on Linux.

The ``mlx[cpu]`` wheel links the netlib *reference* BLAS, which runs an fp32 matmul
50-100x slower than OpenBLAS. Loading OpenBLAS with ``RTLD_GLOBAL`` before
``mlx.core`` is first imported makes MLX's BLAS calls resolve to it. It is optional:
without it everything still works, only slowly. Set ``KVSHELF_NO_OPENBLAS=1`` to skip.
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
