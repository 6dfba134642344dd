"""MLX's CPU attention against ``kvshelf.model.grouped_attention`` for decode, side by side.

A decode step's attention, every layer in one evaluation as a step evaluates it, over
keys and values laid out as the decode working set hands them over (a view of the last
columns of a wider buffer), for the embedded Gemma 3's heads (4 query heads on 1 KV head
of 256) and the 30-layer llama's (9 on 3 of 64), at batch 1 and 4 (a batch with its
left-padding mask) and contexts 1K and 4K:

- ``mx.fast.scaled_dot_product_attention`` (on the CPU its fallback: a product per query
  head, the keys broadcast over the group), and
- ``grouped_decode_attention`` (a product per KV head, its query heads as the rows),

alternated, repeat by repeat, so that drift in the machine's load touches both alike;
medians, the largest difference between their outputs, and the bytes of K/V read against
the bandwidth floor (the K/V bytes over the best read bandwidth seen in the same run:
``kvbench.decode_steps.bandwidth``'s sums of a 512 MB buffer).

    python benchmarks/grouped_attention.py [--repeats 15]

Run it through kv-bench; it writes ``results/grouped-attention-*.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import write_json

from kvbench.decode_steps import bandwidth, describe_bandwidth
from kvshelf.model.grouped_attention import grouped_decode_attention

# (name, query heads, KV heads, head dim, layers)
SHAPES = (("embedded", 4, 1, 256, 18), ("llama30", 9, 3, 64, 30))


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t) * 1e3


def case(heads: int, kv: int, d: int, layers: int, batch: int, context: int, repeats: int) -> dict[str, Any]:
    key = mx.random.key(batch * 7 + context)
    q = mx.random.normal((batch, heads, 1, d), key=key)
    keys = mx.random.split(key, layers)
    buffers = [mx.random.normal((batch, kv, context + 128, d), key=keys[i]) for i in range(layers)]
    kvs = [(b[:, :, 64 : 64 + context], b[:, :, 32 : 32 + context]) for b in buffers]
    mask = None
    if batch > 1:  # members of other lengths, left-padded as a decode batch is
        lengths = mx.array([context - 97 * m for m in range(batch)])
        mask = (mx.arange(context)[None] >= (context - lengths)[:, None])[:, None, None, :]
    scale = d**-0.5
    mx.eval(q, buffers, mask if mask is not None else q)

    def mlx() -> list[mx.array]:
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) for k, v in kvs]

    def grouped() -> list[mx.array]:
        return [grouped_decode_attention(q, k, v, scale, mask) for k, v in kvs]

    diff = max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(mlx(), grouped()))
    times: dict[str, list[float]] = {"mlx_sdpa": [], "grouped": []}
    for i in range(repeats + 2):
        for name, fn in (("mlx_sdpa", mlx), ("grouped", grouped)):
            t = timed(fn)
            if i >= 2:
                times[name].append(t)
    kv_bytes = 2 * batch * kv * context * d * 4 * layers
    return {
        "batch": batch,
        "context": context,
        "mlx_sdpa_ms": round(statistics.median(times["mlx_sdpa"]), 2),
        "grouped_ms": round(statistics.median(times["grouped"]), 2),
        "max_abs_difference": diff,
        "kv_mb": round(kv_bytes / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    bw = bandwidth(megabytes=512)
    gbs = bw["gbs"]
    print(f"load average {load_start}; read GB/s: {describe_bandwidth(bw)}")
    rows = []
    for name, heads, kv, d, layers in SHAPES:
        for context in (1024, 4096):
            for batch in (1, 4):
                row = {"model": name, "layers": layers, **case(heads, kv, d, layers, batch, context, args.repeats)}
                row["floor_ms"] = round(row["kv_mb"] / 1e3 / gbs * 1e3, 2)
                row["speedup"] = round(row["mlx_sdpa_ms"] / row["grouped_ms"], 2)
                rows.append(row)
                print(
                    f"{name} ({layers} layers) {context} batch {batch}: MLX sdpa {row['mlx_sdpa_ms']} ms, "
                    f"grouped {row['grouped_ms']} ms ({row['speedup']}x), K/V floor {row['floor_ms']} ms, "
                    f"max |diff| {row['max_abs_difference']:.2e}"
                )
    load_end = list(os.getloadavg())
    print(f"load average at end {load_end}")
    loads = {"load_average_at_start": load_start, "load_average_at_end": load_end}
    out = write_json("grouped-attention", {"bandwidth": bw, "stream_gbs": gbs, **loads, "rows": rows})
    print("wrote", out)


if __name__ == "__main__":
    main()
