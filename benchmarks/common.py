"""What the benchmark scripts share: ``kvbench``'s helpers, and JSON output into
``benchmarks/results/`` with a description of the machine."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from kvbench.common import drop_from_page_cache, prompt_of_tokens  # noqa: F401  (re-exported)
from kvbench.machine import describe

RESULTS = Path(__file__).parent / "results"


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": describe(), **data}, indent=2))
    return path


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """The median of ``repeats`` timed calls of ``fn`` in ms, after ``warmup`` untimed ones
    (the first calls pay for allocation and, in MLX, for building kernels)."""
    times = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def interleaved_times(
    kernels: dict[str, Callable[[Any], Any]], inputs: dict[int, Any], repeats: int
) -> dict[tuple[str, int], list[float]]:
    """ms of every kernel on every input, by (kernel, input key): ``repeats`` rounds, each
    kernel once on each input a round, after one untimed round that warms them all up; so
    a burst of other work spoils a few samples of each rather than all of one."""
    times: dict[tuple[str, int], list[float]] = {(k, r): [] for k in kernels for r in inputs}
    for i in range(repeats + 1):
        for r, x in inputs.items():
            for k, fn in kernels.items():
                t = time.perf_counter()
                fn(x)
                if i:
                    times[(k, r)].append((time.perf_counter() - t) * 1e3)
    return times
