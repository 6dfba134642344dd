"""The machine description every report starts with: CPU, memory, MLX backend, BLAS.

Figures mean little without it, and on a shared machine the load average says how
much of the CPU the benchmark really had, so it is sampled around each section.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata

import mlx.core as mx

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from kvshelf.model import blas as _blas


def cpu_model() -> str:
    if sys.platform.startswith("linux"):
        try:
            for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpus_usable() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe() -> dict:
    device = mx.default_device()
    backend = "Metal GPU" if device == mx.gpu else "CPU"
    mem = memory_bytes()
    return {
        "cpu": cpu_model(),
        "cpus_usable": cpus_usable(),
        "memory_gb": round(mem / 1e9, 1) if mem else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "kvshelf": kvshelf.__version__,
        "mlx_backend": f"{backend} ({device})",
        "blas": _blas.loaded_path or ("Accelerate" if sys.platform == "darwin" else "MLX bundled reference BLAS"),
        "load_average_at_start": load_average(),
    }
