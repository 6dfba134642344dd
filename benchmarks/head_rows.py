"""The row-invariant products of a decode step: the skinny product, BLIS's and one sgemv per row.

The shape-invariant kernels (``kvshelf.model.gemv.SHAPE_INVARIANT``, what a temperature-0
request runs) need products whose rows do not depend on how many rows come with them. Two
kernels give that here: BLIS's small-matrix product (each element reduced over the inner
dimension alone) and OpenBLAS's ``sgemv`` called once per row (a row alone, trivially),
plainly and as ``kvshelf.model.sgemv.each_row`` runs it (a weight larger than the cache in
blocks of rows, every row by one block before the next). ``kvshelf.model.skinny``'s product
(numba: each weight row read once and dotted with every row) is row-invariant by
construction, and what the temperature-0 kernels' head rows run; its blocked variant
(``blocked_product``: 2, 4 or 8 rows at once in registers, each weight row asked for
``PREFETCH_ROWS`` rows ahead, not row-invariant) is what the default kernels' decode steps
run, timed beside it and beside its loops as they were before the prefetch.
This measures both side by side on the embedded Gemma 3's and the 30-layer llama's own
weights, at the row counts of a decode step (1, 2, 4, 8, 16 agents), with MLX's own matmul
(OpenBLAS ``sgemm``, not row-invariant) beside them, and the floor (the weight's bytes over
the read bandwidth measured in the same run). Rounds are interleaved (every kernel once at
every row count, then again) so a burst of other work spoils a few samples of each.

    python benchmarks/head_rows.py [--models embedded,llama30] [--repeats 9]

Run it alone (the exclusive benchmark lock).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import interleaved_times, write_json
from decode import build_model

from kvbench.decode_steps import bandwidth
from kvshelf.model.few_rows import system_gemm
from kvshelf.model.head import buffer_view
from kvshelf.model.sgemv import each_row, system_sgemv
from kvshelf.model.skinny import blocked_product, blocked_without_prefetch, skinny_product

ROWS = (1, 2, 4, 8, 16)


def weights(model: object) -> dict[str, mx.array]:
    """The head and the first layer's projections, by name."""
    inner = model.model  # type: ignore[attr-defined]
    head = model["lm_head"]["weight"] if "lm_head" in model else inner.embed_tokens.weight  # type: ignore[operator,index]
    layer = inner.layers[0]
    out = {"head": head}
    for name, m in layer.named_modules():
        if name.endswith("proj") and "weight" in m:
            out[name] = m["weight"]
    return out


def kernels(weight: mx.array) -> dict[str, Callable[[np.ndarray], object]]:
    w = buffer_view(weight)
    gemm, sgemv, skinny, blocked = system_gemm(), system_sgemv(), skinny_product(), blocked_product()
    unprefetched = blocked_without_prefetch()
    if gemm is None or sgemv is None or skinny is None or blocked is None:
        raise SystemExit(
            "needs the system OpenBLAS and BLIS (apt-get install libopenblas0-pthread libblis4-pthread) and numba"
        )
    return {
        "skinny": lambda x: skinny(x, w),
        "blocked": lambda x: blocked(x, w),  # the default kernels' (not row-invariant: register blocks)
        # the blocks as before skinny.PREFETCH_ROWS: eights against four weight rows, no prefetch
        "blocked without prefetch": lambda x: unprefetched(x, w),
        "blis product": lambda x: gemm(x, w),
        "sgemv per row": lambda x: np.stack([sgemv(w, row) for row in x]),
        "each_row": lambda x: each_row(sgemv, x, w),  # per row, a large weight in cache-sized blocks
        "mlx matmul": lambda x: mx.eval(mx.array(x) @ weight.T),
    }


def run(models: list[str], repeats: int) -> dict:
    load_start = list(os.getloadavg())
    rows = []
    for name in models:
        model = build_model(name)
        gbs = bandwidth(model)["gbs"]
        rng = np.random.default_rng(0)
        for wname, weight in weights(model).items():
            floor_ms = weight.nbytes / (gbs * 1e9) * 1e3
            ks = kernels(weight)
            xs = {r: rng.standard_normal((r, weight.shape[1]), dtype=np.float32) for r in ROWS}
            times = interleaved_times(ks, xs, repeats)
            for (k, r), ts in times.items():
                ms = statistics.median(ts)
                rows.append(
                    dict(
                        model=name,
                        weight=wname,
                        shape=list(weight.shape),
                        kernel=k,
                        rows=r,
                        ms=round(ms, 3),
                        floor_ms=round(floor_ms, 3),
                        x_floor=round(ms / floor_ms, 2),
                    )
                )
            line = "  ".join(f"{k} " + "/".join(f"{statistics.median(times[(k, r)]):.2f}" for r in ROWS) for k in ks)
            print(f"{name} {wname} {tuple(weight.shape)} floor {floor_ms:.2f} ms; rows {ROWS}: {line}", flush=True)
        del model
    load_end = list(os.getloadavg())
    print(f"load average at start {load_start}, at end {load_end}")
    return {
        "rows_counts": list(ROWS),
        "repeats": repeats,
        "load_average_at_start": load_start,
        "load_average_at_end": load_end,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="embedded,llama30")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(f"wrote {write_json('head-rows', run(args.models.split(','), args.repeats))}")


if __name__ == "__main__":
    main()
