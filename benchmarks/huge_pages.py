"""Decode steps over weights in 2 MB pages against the same weights in 4 KB pages.

``kvshelf.model.huge_pages`` moves a loaded model's weights into huge pages (Linux's
``MADV_COLLAPSE``); that cannot be undone in a process, so both sides are in one run as two
copies of the same model, one collapsed, with their own agents (random K/V of the given
context, the default KV scheme, the decode working set: the scheduler's path), and their
steps interleaved: copy A, copy B, A, B... Medians and minima of the step times, the bytes
``collapse`` moved, and the huge-page bytes of the mappings that hold each copy's weights
(/proc/self/smaps; Linux merges adjacent anonymous mappings, so two copies' small weights
can share one mapping and that figure then counts both).

    python benchmarks/huge_pages.py [--models embedded,llama30] [--batches 1,4] [--context 1024] [--steps 12]

Run it alone (the exclusive benchmark lock). Each copy of the embedded model is 1.07 GB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
from common import write_json
from decode import build_model

from kvbench.decode_steps import fill
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.huge_pages import collapse, huge_page_bytes, weights_of
from kvshelf.model.spec import ModelCacheSpec


def run(models: list[str], batches: list[int], context: int, steps: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    load_start = list(os.getloadavg())
    for name in models:
        small, huge = build_model(name, huge_pages=False), build_model(name, huge_pages=False)
        started = time.perf_counter()
        moved = collapse(weights_of(huge))
        took = time.perf_counter() - started
        spec = ModelCacheSpec.from_model(small)
        forwards = {"4 KB pages": with_fast_linears(small), "2 MB pages": with_fast_linears(huge)}
        held = {k: huge_page_bytes(weights_of(m)) for k, m in (("4 KB pages", small), ("2 MB pages", huge))}
        print(f"{name}: collapsed {moved / 1e6:.0f} MB in {took:.2f} s; in huge pages: {held}")
        for batch in batches:
            agents: dict[str, list[Any]] = {}
            sets: dict[str, WorkingSets] = {}
            for kind in forwards:
                agents[kind] = []
                for b in range(batch):
                    cache = AgentCache.empty(spec, SCHEMES[DEFAULT_SCHEME])
                    fill(cache.layers, spec, context, seed=10 + b)
                    agents[kind].append(cache.layers)
                sets[kind] = WorkingSets()
            x = mx.array([[1]] * batch)

            def step(kind: str) -> float:
                caches = sets[kind].caches(list(range(batch)), agents[kind])
                t = time.perf_counter()
                logits = forwards[kind](x, cache=caches)[:, -1]
                mx.eval(mx.argmax(logits, axis=-1), sets[kind].arrays())
                return (time.perf_counter() - t) * 1e3

            for _ in range(3):
                for kind in forwards:
                    step(kind)
            times: dict[str, list[float]] = {kind: [] for kind in forwards}
            for _ in range(steps):
                for kind in forwards:
                    times[kind].append(step(kind))
            for kind, ts in times.items():
                row = {
                    "model": name, "context": context, "batch": batch, "pages": kind,
                    "median_ms": round(statistics.median(ts), 1), "min_ms": round(min(ts), 1),
                    "huge_page_bytes_of_mappings": held[kind], "times_ms": [round(t, 2) for t in ts],
                }  # fmt: skip
                rows.append(row)
                print(f"  {name} {context} batch {batch} {kind}: median {row['median_ms']} ms, min {row['min_ms']}")
        rows.append({"model": name, "collapsed_bytes": moved, "collapse_s": round(took, 2)})
    load_end = list(os.getloadavg())
    print(f"load average at start {load_start}, at end {load_end}")
    return {"load_average_at_start": load_start, "load_average_at_end": load_end, "steps": steps, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="embedded,llama30")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"wrote {write_json('huge-pages', run(args.models.split(','), batches, args.context, args.steps))}")


if __name__ == "__main__":
    main()
