"""Which BLAS MLX's CPU matmuls really call, how fast it is, and what to do when it is slow.

On Linux the ``mlx[cpu]`` wheel links the netlib *reference* BLAS that it bundles
(``mlx_cpu.libs/libblas-*.so``): an fp32 matmul runs at about 1.5 GFLOP/s against about
100 with OpenBLAS, which turns a first demo turn of 6-18 s into two minutes. Nothing
fails, it is only slow, so kvshelf says which BLAS is in use at the start of ``demo``,
``serve`` and ``bench``, warns loudly on the reference one (with the fix for this OS),
and ``kvshelf doctor`` measures it.

How the answer is found, without guessing from file names: MLX's extension is loaded
with local symbol scope, so its ``cblas_sgemm`` resolves to the process's global scope
first (the executable, ``LD_PRELOAD``, libraries loaded ``RTLD_GLOBAL`` such as the one
``kvshelf.model.blas`` preloads) and only then to the wheel's own copy. ``dladdr`` on
the globally visible ``cblas_sgemm`` names the library that wins; when there is none,
MLX uses the reference BLAS it bundles.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from kvshelf.model import blas, pip_openblas
from kvshelf.switches import env_on


@dataclass(frozen=True)
class BlasInfo:
    """The BLAS behind MLX's CPU matmuls."""

    name: str  # "OpenBLAS", "Accelerate", "reference BLAS (netlib, bundled with mlx)", ...
    path: str | None  # the library file, where one is known
    slow: bool  # True for the reference BLAS: expect 50-100x slower CPU matmuls
    source: str | None = None  # which candidate kvshelf.model.blas loaded: KVSHELF_OPENBLAS, system, kvshelf[openblas]

    def line(self) -> str:
        """One line for the start of a command."""
        where = f" ({self.path})" if self.path else ""
        source = f", from {self.source}" if self.source else ""
        return f"BLAS: {self.name}{where}{source}"


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_provider(symbol: str) -> str | None:
    """The file of the library that the process's global scope resolves ``symbol`` to."""
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p).value
        libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    dladdr = libdl.dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not address or not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def _name_of(path: str) -> str:
    lower = os.path.basename(path).lower()
    if "openblas" in lower or "openblas" in path.lower():
        return "OpenBLAS"
    if "mkl" in lower:
        return "Intel MKL"
    if "blis" in lower:
        return "BLIS"
    if "atlas" in lower:
        return "ATLAS"
    return "a system BLAS"


def detect() -> BlasInfo:
    """The BLAS MLX's CPU backend uses in this process."""
    if sys.platform == "darwin":
        return BlasInfo("Accelerate (macOS)", None, slow=False)
    path = _global_provider("cblas_sgemm")
    if path is None:
        return BlasInfo("reference BLAS (netlib, bundled with mlx)", None, slow=True)
    name = _name_of(path)
    if name == "a system BLAS" and "libblas" in os.path.basename(path) and "openblas" not in path:
        return BlasInfo("reference BLAS (netlib, system)", path, slow=True)
    loaded = os.path.realpath(blas.loaded_path) if blas.loaded_path else None
    return BlasInfo(name, path, slow=False, source=blas.loaded_source if loaded == path else None)


def extra_would_work() -> bool:
    """Whether ``kvshelf[openblas]`` would load here: Linux x86-64, the CPU's instruction sets,
    and a GNU Fortran runtime (the system's, or the one the mlx[cpu] wheel bundles)."""
    return pip_openblas.machine_refusal() is None


def fix_for_this_os() -> str:
    """The command that gets a fast BLAS here (and the pip route, where it would work)."""
    if env_on("KVSHELF_NO_OPENBLAS"):
        return "unset KVSHELF_NO_OPENBLAS (it turns the OpenBLAS preload off)"
    if blas.mlx_first:
        return "import kvshelf before mlx (OpenBLAS must be loaded before mlx.core)"
    if env_on("KVSHELF_NO_SYSTEM_OPENBLAS") and blas.installed_path() is not None:
        system = "unset KVSHELF_NO_SYSTEM_OPENBLAS (the system's OpenBLAS is installed, and it skips it)"
    else:
        system = _system_fix()
    if blas.extra_refused is not None:
        return f"{system} (kvshelf[openblas] is installed but was not loaded: {blas.extra_refused})"
    if extra_would_work():
        return f"{system}, or without sudo: {pip_openblas.EXTRA}"
    return system


def _system_fix() -> str:
    os_id = _os_release().get("ID", "")
    like = _os_release().get("ID_LIKE", "")
    if os_id in ("debian", "ubuntu") or "debian" in like:
        return "sudo apt-get install -y libopenblas0-pthread"
    if os_id in ("fedora", "rhel", "centos", "rocky", "almalinux") or "fedora" in like or "rhel" in like:
        return "sudo dnf install -y openblas"
    if os_id in ("arch", "manjaro") or "arch" in like:
        return "sudo pacman -S openblas"
    if os_id in ("opensuse-leap", "opensuse-tumbleweed", "sles") or "suse" in like:
        return "sudo zypper install libopenblas_pthreads0"
    return "install your distribution's OpenBLAS (libopenblas) package"


def candidates_line() -> str:
    """Each OpenBLAS candidate in ``kvshelf.model.blas``'s order, and which one was loaded."""
    override = os.environ.get(blas.OVERRIDE)
    extra = pip_openblas.installed_file()
    if extra is None:
        extra_state = "not installed" + (f" (would work here: {pip_openblas.EXTRA})" if extra_would_work() else "")
    elif blas.extra_refused is not None:
        extra_state = f"{pip_openblas.DISTRIBUTION} {pip_openblas.version()}, refused: {blas.extra_refused}"
    else:
        extra_state = f"{pip_openblas.DISTRIBUTION} {pip_openblas.version()}"
    parts = [
        f"{blas.OVERRIDE} {override or 'unset'}",
        f"system {blas.installed_path() or 'not installed'}",
        f"kvshelf[openblas] {extra_state}",
    ]
    return "; ".join(parts) + f" -> loaded: {blas.loaded_source or 'none'}"


def _os_release() -> dict[str, str]:
    try:
        lines = open("/etc/os-release", encoding="utf-8").read().splitlines()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in lines if "=" in line)
    return {k: v.strip().strip('"') for k, v in pairs}


def warning_line(info: BlasInfo) -> str | None:
    """The loud one-line warning for a slow BLAS, with the fix; None when the BLAS is fine."""
    if not info.slow:
        return None
    return (
        f"WARNING: MLX is using the {info.name}: CPU matmuls run 50-100x slower than with OpenBLAS "
        f"(a first turn takes minutes, not seconds). Fix: {fix_for_this_os()}"
    )


def announce(out: TextIO | None = None) -> BlasInfo:
    """Print which BLAS is in use (and the warning, on the reference BLAS) to stderr."""
    info = detect()
    stream = out if out is not None else sys.stderr
    print(info.line(), file=stream)
    if (warning := warning_line(info)) is not None:
        print(warning, file=stream)
    return info


def measure_gflops(n: int = 512, seconds: float = 1.0) -> float:
    """fp32 matmul throughput of MLX on the CPU, in GFLOP/s (what BLAS gives the model)."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((n, n), dtype=mx.float32)
        b = mx.random.normal((n, n), dtype=mx.float32)
        mx.eval(a @ b)  # warm up
        runs, start = 0, time.perf_counter()
        while True:
            mx.eval(a @ b)
            runs += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds or runs >= 1000:
                break
    return 2 * n**3 * runs / elapsed / 1e9


def machine_line() -> str:
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
