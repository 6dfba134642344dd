"""Load a fast OpenBLAS before MLX on Linux.

The ``mlx[cpu]`` wheel links the netlib *reference* BLAS, which runs an fp32 matmul
50-100x slower than OpenBLAS. Loading OpenBLAS with ``RTLD_GLOBAL`` before
``mlx.core`` is first imported makes MLX's BLAS calls resolve to it. It is optional:
without it everything still works, only slowly. The first that loads wins, in this order:

1. ``KVSHELF_OPENBLAS=/path/to/libopenblas.so``: the user's own choice, loaded as given;
2. the system's OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``, Fedora ``openblas``),
   unless ``KVSHELF_NO_SYSTEM_OPENBLAS=1`` (to use the extra instead, or to test it);
3. the opt-in extra ``kvshelf[openblas]`` (``kvshelf.model.pip_openblas``), only where its
   checks pass (Linux x86-64, the CPU's instruction sets, a build that dispatches at run
   time, ``libgfortran.so.5``); otherwise one line on stderr says why it was not used;
4. none: MLX's reference BLAS, which ``kvshelf.model.blas_check`` warns about loudly.

``KVSHELF_NO_OPENBLAS=1`` skips all of them.

Both BLAS libraries run one thread per core this process may use (``usable_cpus``:
its CPU affinity, not the machine's core count), so a node started under ``taskset -c
0`` or in a one-core cpuset runs one BLAS thread instead of several fighting over its
core. ``OPENBLAS_NUM_THREADS`` and ``BLIS_NUM_THREADS`` still override.

OpenBLAS's idle worker threads sleep almost at once (``OPENBLAS_THREAD_TIMEOUT``, unless
set, becomes ``THREAD_TIMEOUT``) instead of spinning on ``sched_yield`` for about 2**28
cycles after every call, OpenBLAS's default. A decode step calls the BLAS between other
work (MLX's elementwise kernels on its own thread, ``kvshelf.model.skinny``'s products on
numba's), and on 2 cores a spinning worker takes one of them from that work: a profile of
an embedded Gemma 3 step at batch 1 found it spinning 65 of every 117 ms, and with it
asleep the step took 106 ms against 117 (``benchmarks/decode.py``, 2026-12-03).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

from kvshelf.model import pip_openblas
from kvshelf.paths import kvshelf_home
from kvshelf.switches import env_on

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)

OVERRIDE = "KVSHELF_OPENBLAS"
SOURCE_OVERRIDE, SOURCE_SYSTEM, SOURCE_EXTRA = "KVSHELF_OPENBLAS", "system", "kvshelf[openblas]"

loaded_path: str | None = None
loaded_source: str | None = None  # which of the candidates above was loaded
extra_refused: str | None = None  # why the installed extra was not loaded (None: loaded, not needed or absent)
mlx_first = False  # mlx.core was imported before kvshelf: too late to preload anything

# log2 of the cycles an idle OpenBLAS worker spins before it sleeps (OpenBLAS's minimum is 4).
THREAD_TIMEOUT = 4


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


def openblas_config() -> str | None:
    """The loaded OpenBLAS's build configuration (version, DYNAMIC_ARCH, the core it runs)."""
    if loaded_path is None:
        return None
    try:
        get_config = ctypes.CDLL(loaded_path).openblas_get_config
    except (OSError, AttributeError):
        return None
    get_config.restype = ctypes.c_char_p
    config = get_config()
    return config.decode(errors="replace").strip() if config else None


def installed_path() -> str | None:
    """The first system OpenBLAS that ``load_openblas`` would load, if one is installed."""
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def _try_load(path: str | Path) -> str | None:
    """The loader's error, or None once ``path`` is loaded into the global symbol scope."""
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return str(e)
    if not hasattr(library, "cblas_sgemm"):  # e.g. scipy-openblas32's, whose symbols are all prefixed
        return "it exports no cblas_sgemm, so MLX would never call it"
    return None


def _loaded(path: str | Path, source: str) -> str:
    global loaded_path, loaded_source
    loaded_path, loaded_source = str(path), source
    return loaded_path


def _say(line: str) -> None:
    print(f"kvshelf: {line}", file=sys.stderr)


def _load_extra(cpuinfo: str | None) -> str | None:
    global extra_refused
    path = pip_openblas.installed_file()
    if path is None:
        return None
    why = pip_openblas.check(path, cpuinfo)
    if why is None:
        home = kvshelf_home() / "openblas"
        try:
            target = pip_openblas.loadable_path(path, home)
        except OSError as e:  # the symlinks to the mlx wheel's Fortran runtime could not be made
            why = f"no {pip_openblas.FORTRAN_RUNTIME} here, and none could be linked in {home} ({e})"
        else:
            if (error := _try_load(target)) is None:
                return _loaded(target, SOURCE_EXTRA)
            why = f"it did not load ({error})"
    extra_refused = why
    _say(
        f"the OpenBLAS of kvshelf[openblas] ({path}) was not loaded: {why}. MLX uses its slow reference BLAS; "
        f"install the system's OpenBLAS (Debian/Ubuntu: sudo apt-get install -y libopenblas0-pthread) "
        f"or point {OVERRIDE} at a libopenblas.so that runs on this machine."
    )
    return None


def load_openblas(cpuinfo: str | None = None) -> str | None:
    """Preload the first OpenBLAS that loads (see the module's docstring for the order), on
    Linux, unless disabled. ``cpuinfo`` stands in for ``/proc/cpuinfo`` in the extra's check."""
    global mlx_first
    if loaded_path or not sys.platform.startswith("linux"):
        return loaded_path
    if env_on("KVSHELF_NO_OPENBLAS"):
        return None
    if "mlx.core" in sys.modules:
        mlx_first = True
        warnings.warn(
            "mlx.core was imported before kvshelf; OpenBLAS could not be preloaded "
            "and MLX's CPU matmuls will use the slow reference BLAS.",
            stacklevel=3,
        )
        return None
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(THREAD_TIMEOUT))  # read when OpenBLAS loads
    if override := os.environ.get(OVERRIDE):
        if (error := _try_load(override)) is None:
            return _loaded(override, SOURCE_OVERRIDE)
        _say(f"{OVERRIDE}={override} is not used ({error}); trying the other OpenBLAS candidates.")
    if not env_on("KVSHELF_NO_SYSTEM_OPENBLAS"):
        for path in OPENBLAS_CANDIDATES:
            if os.path.exists(path) and _try_load(path) is None:
                return _loaded(path, SOURCE_SYSTEM)
    return _load_extra(cpuinfo)
