"""A prefill chunk's row-invariant products: the row plan against one sgemv per row, beside MLX's own.

The shape-invariant kernels (what a temperature-0 request runs) need every row of a
projection with the bits of that row alone. ``kvshelf.model.row_plan`` gets them from MLX's
own matmul (OpenBLAS's sgemm), laid out so that real rows sit where the product gives one-row
bits; ``kvshelf.model.sgemv.each_row`` (one sgemv a row) is what it replaces for the layers.
This measures both, and MLX's plain product (not row-invariant: the peer's speed), on the
first layer's weights of the embedded Gemma 3 and the 30-layer llama at the row counts of a
prefill chunk (256, and a short turn's 64) and of a decode batch (1, 8), with each row's bits
checked against its one-row product, and prints the plan's layout (which positions of a
48-row product carry one-row bits). Rounds are interleaved, every kernel once a round.

    python benchmarks/row_plan.py [--models embedded,llama30] [--repeats 7]

Run it alone (the exclusive benchmark lock); it writes ``results/row-plan-*.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import interleaved_times, write_json
from decode import build_model
from head_rows import weights

from kvshelf.model.head import buffer_view
from kvshelf.model.row_plan import RowPlan, measure
from kvshelf.model.sgemv import each_row, system_sgemv

ROWS = (1, 8, 64, 256)


def kernels(weight: mx.array, plan: RowPlan) -> dict[str, Callable[[mx.array], np.ndarray]]:
    sgemv = system_sgemv()
    if sgemv is None:
        raise SystemExit("needs the system OpenBLAS (apt-get install libopenblas0-pthread)")
    w = buffer_view(weight)
    return {
        "row plan": lambda x: np.array(plan.matmul(x, weight)),
        "each_row": lambda x: each_row(sgemv, np.array(x), w),
        "mlx matmul": lambda x: np.array(x @ weight.T),
    }


def layout(plan: RowPlan) -> str:
    """The first size's positions as a string: 'x' carries one-row bits, '.' is a copy."""
    size, positions = plan.sizes[0]
    marks = np.full(size, ".")
    marks[positions] = "x"
    return f"{size} rows: " + "".join(marks)


def run(models: list[str], repeats: int) -> dict:
    load_start = list(os.getloadavg())
    rows = []
    for name in models:
        model = build_model(name)
        rng = np.random.default_rng(0)
        for wname, weight in weights(model).items():
            if wname == "head":  # the head keeps each_row (one row per agent a step)
                continue
            t = time.perf_counter()
            plan = measure(weight)
            measured_ms = (time.perf_counter() - t) * 1e3
            if plan is None:
                print(f"{name} {wname} {tuple(weight.shape)}: no plan")
                continue
            ks = kernels(weight, plan)
            xs = {r: mx.array(rng.standard_normal((r, weight.shape[1]), dtype=np.float32)) for r in ROWS}
            alone = {r: np.concatenate([np.array(xs[r][i : i + 1] @ weight.T) for i in range(r)]) for r in ROWS}
            exact = {r: bool(np.array_equal(ks["row plan"](xs[r]), alone[r])) for r in ROWS}
            times = interleaved_times(ks, xs, repeats)
            for (k, r), ts in times.items():
                ms = statistics.median(ts)
                peer = statistics.median(times[("mlx matmul", r)])
                rows.append(
                    dict(model=name, weight=wname, shape=list(weight.shape), kernel=k, rows=r, ms=round(ms, 3),
                         x_mlx=round(ms / peer, 2), one_row_bits=exact[r] if k == "row plan" else None)
                )  # fmt: skip
            line = "  ".join(f"{k} " + "/".join(f"{statistics.median(times[(k, r)]):.2f}" for r in ROWS) for k in ks)
            print(
                f"{name} {wname} {tuple(weight.shape)} plan measured in {measured_ms:.0f} ms, one-row bits "
                f"{all(exact.values())}; ms for rows {ROWS}: {line}",
                flush=True,
            )
            print(f"   small={plan.small}, sizes {[(c, len(p)) for c, p in plan.sizes]}; {layout(plan)}")
        del model
    load_end = list(os.getloadavg())
    print(f"load average at start {load_start}, at end {load_end}")
    return {"row_counts": list(ROWS), "repeats": repeats, "load_average_at_start": load_start,
            "load_average_at_end": load_end, "rows": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--models", default="embedded,llama30")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    path = write_json("row-plan", {"args": vars(args), **run(args.models.split(","), args.repeats)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
