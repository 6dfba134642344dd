"""The OpenBLAS of the opt-in extra ``kvshelf[openblas]``, and whether it is safe to load here.

For a user without sudo (no ``apt-get install libopenblas0-pthread``) the only fast BLAS is
one from PyPI. Of those checked (README "Set up"), one fits MLX: ``ngsolve-openblas``
(OpenBLAS 0.3.33) exports plain ``cblas_*`` symbols, so MLX's ``cblas_sgemm`` resolves to
it, and is a ``DYNAMIC_ARCH`` build: it picks its kernels for the CPU at run time (Prescott
to Sapphire Rapids and Zen), and its common code uses no AVX at all. Not a default, because
it is a package built for another project (NGSolve's wheels), Linux x86-64 only, and it
links the system's ``libgfortran.so.5``, which a machine without Debian's OpenBLAS
usually lacks. The other candidates fail outright: ``scipy-openblas32`` prefixes every
symbol (``scipy_cblas_sgemm``, so MLX never calls it), ``cmeel-openblas`` is built for one
CPU (``SKYLAKEX``, no dispatch: an illegal instruction on an AVX2 machine), and
``pythran-openblas``, ``pylib-openblas`` and ``python-openblas-build`` ship only a static
``libopenblas.a``.

So this module never imports the package (its ``__init__`` loads the library on its own);
it finds the file, and ``check`` says why it must not be loaded, or None: the machine is
not Linux x86-64, the CPU lacks the instruction sets the build's kernels need (read from
``/proc/cpuinfo``, or from the file ``KVSHELF_CPUINFO`` names, so a test can stand in
another CPU), the build does not dispatch at run time, or ``libgfortran.so.5`` is missing.
A missing ``libgfortran.so.5`` has one way out without sudo: the ``mlx[cpu]`` wheel bundles
the same GNU Fortran runtime (under a hashed name, for its reference LAPACK), so
``loadable_path`` lays symlinks that give the library the name the OpenBLAS
asks for, beside a symlink to the OpenBLAS (whose ``$ORIGIN`` run path then finds it).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import mmap
import os
import platform
import sys
from pathlib import Path

DISTRIBUTION = "ngsolve-openblas"
MODULE = "ngsolve_openblas"
EXTRA = "pip install 'kvshelf[openblas]'"

# The instruction sets the build's code needs whatever kernels it picks: its common code is
# compiled for the x86-64 baseline (SSE2) and the oldest kernels it dispatches to are SSE2's.
# Checked on the tested wheel: every exported function that touches a ymm/zmm register is a
# kernel named after its core (sgemm_kernel_HASWELL, ...), chosen at run time by CPUID.
NEEDED_FLAGS = frozenset({"sse2"})
RUNTIME_DISPATCH = b"DYNAMIC_ARCH"  # in the build's configuration string (openblas_get_config)
FORTRAN_RUNTIME = "libgfortran.so.5"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's instruction-set flags, from ``cpuinfo`` text, else the file ``KVSHELF_CPUINFO``
    names, else ``/proc/cpuinfo`` (empty where there is none)."""
    if cpuinfo is None:
        source = os.environ.get("KVSHELF_CPUINFO") or "/proc/cpuinfo"
        try:
            cpuinfo = Path(source).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, arm
            return frozenset(value.split())
    return frozenset()


def installed_file() -> Path | None:
    """The extra's OpenBLAS library file, if the extra is installed (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("libopenblas*.so*"))
        if found:
            return found[0]
    return None


def version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dispatches_at_run_time(path: Path) -> bool:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(RUNTIME_DISPATCH) >= 0


def system_fortran_runtime_loads() -> bool:
    try:
        ctypes.CDLL(FORTRAN_RUNTIME)
    except OSError:
        return False
    return True


def bundled_fortran_runtime() -> tuple[Path, Path] | None:
    """The GNU Fortran runtime (and its libquadmath) that the mlx[cpu] wheel bundles."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        libs = Path(folder).parent / "mlx_cpu.libs"
        gfortran = sorted(libs.glob("libgfortran-*.so.5*"))
        quadmath = sorted(libs.glob("libquadmath-*.so*"))
        if gfortran and quadmath:
            return gfortran[0], quadmath[0]
    return None


def check(path: Path, cpuinfo: str | None = None) -> str | None:
    """Why the extra's OpenBLAS at ``path`` must not be loaded on this machine, or None."""
    return _unsupported_machine(cpuinfo) or _one_cpu_build(path) or _no_fortran_runtime()


def machine_refusal(cpuinfo: str | None = None) -> str | None:
    """Why the extra could not be loaded on this machine whatever its build (the platform,
    the CPU, the Fortran runtime), or None: where it would work once installed."""
    return _unsupported_machine(cpuinfo) or _no_fortran_runtime()


def _unsupported_machine(cpuinfo: str | None) -> str | None:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"it is built for Linux x86-64, not {sys.platform} {platform.machine()}"
    missing = NEEDED_FLAGS - cpu_flags(cpuinfo)
    if missing:
        return f"this CPU lacks the instruction set(s) its kernels need ({', '.join(sorted(missing))})"
    return None


def _one_cpu_build(path: Path) -> str | None:
    try:
        if not _dispatches_at_run_time(path):
            return "this build is for one CPU (no DYNAMIC_ARCH), so its kernels may not run on this one"
    except (OSError, ValueError) as e:
        return f"it cannot be read ({e})"
    return None


def _no_fortran_runtime() -> str | None:
    if not system_fortran_runtime_loads() and bundled_fortran_runtime() is None:
        return f"it needs {FORTRAN_RUNTIME} (Debian/Ubuntu: sudo apt-get install -y libgfortran5)"
    return None


def loadable_path(path: Path, home: Path) -> Path:
    """The path to load the extra's OpenBLAS from: its own file where the system has
    ``libgfortran.so.5``, else a symlink to it in ``home`` beside the mlx wheel's copy."""
    if system_fortran_runtime_loads():
        return path
    bundled = bundled_fortran_runtime()
    if bundled is None:
        return path  # the load fails with the loader's own message
    gfortran, quadmath = bundled
    home.mkdir(parents=True, exist_ok=True)
    # the OpenBLAS's run path is $ORIGIN, and so is the bundled runtime's: the folder of the symlinks
    for name, target in ((path.name, path), (FORTRAN_RUNTIME, gfortran), (quadmath.name, quadmath)):
        link = home / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        fresh = home / f".{name}.{os.getpid()}"
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(target)
        os.replace(fresh, link)  # atomic: a process loading at the same time sees the old or the new link
    return home / path.name
