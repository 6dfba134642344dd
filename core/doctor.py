"""``kvshelf doctor``: what a user needs to know before blaming the model for being slow.

It reports the BLAS behind MLX's CPU matmuls, which OpenBLAS candidate was loaded (the
override, the system's, the ``kvshelf[openblas]`` extra: ``kvshelf.model.blas``) and the
measured fp32 GFLOP/s (the one thing that makes a first turn take seconds or minutes), the MLX device, the converted
model cache, the agent store, and which optional extras are installed. It loads no
model, so it answers in a couple of seconds. Exit status 1 when something makes
kvshelf slow or unusable (the reference BLAS), else 0.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import TextIO

from kvshelf.model import blas, blas_check
from kvshelf.paths import default_cache_dir, kvshelf_home, models_dir

EXTRAS = {
    "server": ("fastapi", "uvicorn"),
    "autogen": ("autogen_core", "autogen_agentchat"),
    "crewai": ("crewai",),
    "langchain": ("langchain_core", "langchain"),
    "bench": ("matplotlib",),
    "openblas": ("ngsolve_openblas",),
}

# Below this, CPU prefill is dominated by BLAS (the reference BLAS gives 1-2 GFLOP/s).
SLOW_GFLOPS = 10.0


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_doctor(cache_dir: Path | None = None, out: TextIO | None = None) -> int:
    """Print the report; 1 if the BLAS (or anything else) makes kvshelf slow, else 0."""
    import mlx.core as mx

    stream = out or sys.stdout

    def say(label: str, text: str) -> None:
        print(f"{label:<12s} {text}", file=stream)

    problems = 0
    say("kvshelf", f"{_version('kvshelf')} (mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')})")
    say("machine", blas_check.machine_line())
    info = blas_check.detect()
    gflops = blas_check.measure_gflops()
    say("BLAS", info.line().removeprefix("BLAS: "))
    if (config := blas.openblas_config()) is not None:
        say("build", config)
    say("candidates", blas_check.candidates_line())
    say("matmul", f"{gflops:.1f} GFLOP/s fp32 (512x512, CPU)")
    if (warning := blas_check.warning_line(info)) is not None:
        print(warning, file=stream)
        problems += 1
    elif gflops < SLOW_GFLOPS and not info.slow:
        print(f"note: {gflops:.1f} GFLOP/s is low for {info.name}; is the machine busy?", file=stream)
    say("device", str(mx.default_device()))
    say("home", str(kvshelf_home()))
    models = models_dir()
    converted = (
        sorted(p.name for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")) if models.is_dir() else []
    )
    say(
        "models",
        f"{models}: " + (", ".join(f"{n} ({_mb(_size(models / n))})" for n in converted) or "none converted yet"),
    )
    store = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    records = [p for p in store.rglob("*.safetensors")] if store.is_dir() else []
    say("store", f"{store}: {len(records)} record files, {_mb(_size(store))} on disk")
    extras = []
    for extra, modules in EXTRAS.items():
        present = all(importlib.util.find_spec(m) is not None for m in modules)
        extras.append(f"{extra} {'yes' if present else 'no'}")
    say("extras", ", ".join(extras))
    print("ok" if problems == 0 else f"{problems} problem(s) found", file=stream)
    return 1 if problems else 0
