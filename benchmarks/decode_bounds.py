"""The fastest decode step this machine allows, against each of issue 14's goals.

Issue 14's goals put batch 1 within 1.2x of the floor (the fp32 weights' bytes over the
memory's bandwidth) at 1K and 1.4x at 16K, and batches 4 and 8 at 3x and 5x batch 1's
tokens/s. Some of them stay missed after every change measured so far. This asks, for
each goal cell, whether any decode step could meet it on this machine, from two rates
measured in the same run:

- the read rate: the best pass of a plain sum on every core (``attention_bounds``), or of
  the floor's own readings (``kvbench.decode_steps.bandwidth``, which ``decode.py``'s floor
  takes), whichever is higher;
- the multiply-add rate: the best pass of MLX's sgemm of two 2048x2048 fp32 matrices
  (the OpenBLAS kvshelf preloads), which runs at about these cores' fp32 peak.

A step must read its weights (as the default path does: 16-bit codes where they hold a
weight; an untied embedding table only for the rows it looks up, so not at all here) and
each agent's visible K/V, and it must do its multiply-adds: every weight by every agent's
row, and every query head against its visible keys and values. The bound here is the
larger of the two times, as if reading and arithmetic overlapped perfectly, which no step
does, so every bound errs low. It is given for K/V read as fp32 rows (what the working
set holds) and as Q4 rows read in place (4.5 bits an element with the scales), where the
unpacking's own arithmetic is not counted.

Batch 1's bound is set against the floor as ``decode.py`` measures it (the fp32 weights at
the best of the floor's readings); batch B's against batch 1's step as measured in
this run (kvshelf's default scheme, its working set, one agent): ``B * t1 / bound`` is the
most a batch could gain on batch 1's tokens/s, unless batch 1 itself got faster, which
would only lower it.

    python benchmarks/decode_bounds.py [--models embedded,llama30-bf16,deepseek12-bf16]

Run it under the exclusive benchmark lock; it writes ``results/decode-bounds-*.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from attention_bounds import parallel_read_gbs
from common import write_json
from decode import build_model, code_bytes, engine_forward
from mlx.utils import tree_flatten

from kvbench.decode_steps import bandwidth, fill, step_ms, weight_bytes
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.model.spec import ModelCacheSpec

MODELS = ("embedded", "llama30-bf16", "deepseek12-bf16")
CONTEXTS = (1024, 4096, 16384)
BATCHES = (1, 4, 8)
GEMM_SIDE = 2048
Q4_BITS = 4.5  # a 4-bit code, and an fp16 scale and offset for each group of 64
# issue 14's goals: batch 1 against the floor by context, and each batch against batch 1's tokens/s
FLOOR_GOALS = {1024: 1.2, 16384: 1.4}
BATCH_GOALS = {4: 3.0, 8: 5.0}


def fma_rate(repeats: int) -> float:
    """Best pass of MLX's fp32 sgemm, in multiply-adds a second."""
    a = mx.random.normal((GEMM_SIDE, GEMM_SIDE))
    b = mx.random.normal((GEMM_SIDE, GEMM_SIDE))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return GEMM_SIDE**3 / best


@dataclass(frozen=True)
class StepWork:
    """What one agent's share of a decode step reads and multiplies, and what all agents share."""

    weight_bytes: int  # read once for the whole batch
    product_fmas: int  # per agent: each weight element by its row
    attention_fmas: int  # per agent: each query head by its visible keys and values
    kv_elements: int  # per agent: visible K/V elements, each read once for its query heads

    def bound_ms(self, batch: int, kv_bits: float, read_gbs: float, fmas_per_s: float) -> tuple[float, str]:
        """The larger of the step's read time and its arithmetic time, and which it is."""
        read = (self.weight_bytes + batch * self.kv_elements * kv_bits / 8) / (read_gbs * 1e9)
        arithmetic = batch * (self.product_fmas + self.attention_fmas) / fmas_per_s
        return max(read, arithmetic) * 1e3, "read" if read >= arithmetic else "arithmetic"


def step_work(model: nn.Module, context: int) -> StepWork:
    """One decode step's work at ``context`` cached tokens: every weight a product (a tied
    embedding is the head; an untied one is only looked up), every query head against the
    columns its layer sees (a sliding layer its window)."""
    params = tree_flatten(model.parameters())
    assert isinstance(params, list)
    untied = any(name.endswith("lm_head.weight") for name, _ in params)
    read = [v for name, v in params if not (untied and "embed_tokens" in name)]
    products = [v for v in read if v.ndim == 2]
    heads = model.args.num_attention_heads
    spec = ModelCacheSpec.from_model(model)
    attention = elements = 0
    for layer in spec.layers:
        columns = context if layer.window is None else min(context, layer.window)
        attention += heads * columns * (layer.k_head_dim + layer.v_head_dim)
        elements += layer.kv_heads * columns * (layer.k_head_dim + layer.v_head_dim)
    return StepWork(
        weight_bytes=sum(code_bytes(v) for v in read),
        product_fmas=sum(v.size for v in products),
        attention_fmas=attention,
        kv_elements=elements,
    )


def batch_1_ms(model: nn.Module, context: int, steps: int) -> float:
    """kvshelf's default step for one agent at ``context`` (its working set), median ms."""
    spec = ModelCacheSpec.from_model(model)
    cache = AgentCache.empty(spec, SCHEMES[DEFAULT_SCHEME])
    fill(cache.layers, spec, context, seed=10)
    times, _ = step_ms(engine_forward(model), [cache.layers], steps, warmup=2, working=True)
    return statistics.median(times)


def cells(name: str, model: nn.Module, sum_gbs: float, fmas_per_s: float, steps: int) -> list[dict[str, Any]]:
    floor_gbs = bandwidth(model)["gbs"]
    floor_ms = weight_bytes(model) / (floor_gbs * 1e9) * 1e3  # issue 14's floor: every weight as fp32
    read_gbs = max(sum_gbs, floor_gbs)
    print(f"{name}: the floor's read {floor_gbs:.1f} GB/s, {floor_ms:.1f} ms; the bounds read at {read_gbs:.1f} GB/s")
    rows = []
    for context in CONTEXTS:
        work = step_work(model, context)
        t1 = batch_1_ms(model, context, steps)
        for batch in BATCHES:
            fp32_ms, fp32_by = work.bound_ms(batch, 32, read_gbs, fmas_per_s)
            q4_ms, q4_by = work.bound_ms(batch, Q4_BITS, read_gbs, fmas_per_s)
            row: dict[str, Any] = {
                "model": name,
                "context": context,
                "batch": batch,
                "floor_ms": round(floor_ms, 2),
                "floor_gbs": round(floor_gbs, 1),
                "bound_read_gbs": round(read_gbs, 1),
                "batch_1_ms": round(t1, 2),
                "bound_fp32_rows_ms": round(fp32_ms, 2),
                "bound_fp32_rows_by": fp32_by,
                "bound_q4_rows_ms": round(q4_ms, 2),
                "bound_q4_rows_by": q4_by,
                "gb_read_fp32_rows": round((work.weight_bytes + batch * work.kv_elements * 4) / 1e9, 3),
                "gfma": round(batch * (work.product_fmas + work.attention_fmas) / 1e9, 3),
            }
            if batch == 1:
                row["goal_x_floor"] = FLOOR_GOALS.get(context)
                row["best_x_floor_fp32_rows"] = round(fp32_ms / floor_ms, 2)
                row["best_x_floor_q4_rows"] = round(q4_ms / floor_ms, 2)
                row["measured_x_floor"] = round(t1 / floor_ms, 2)
            else:
                row["goal_x_batch_1"] = BATCH_GOALS[batch]
                row["best_x_batch_1_fp32_rows"] = round(batch * t1 / fp32_ms, 2)
                row["best_x_batch_1_q4_rows"] = round(batch * t1 / q4_ms, 2)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    head = (
        f"{row['model']} {row['context']} batch {row['batch']}: bound {row['bound_fp32_rows_ms']} ms fp32 rows "
        f"({row['bound_fp32_rows_by']}), {row['bound_q4_rows_ms']} Q4 rows ({row['bound_q4_rows_by']})"
    )
    if row["batch"] == 1:
        goal = row["goal_x_floor"]
        return (
            f"{head}; x floor ({row['floor_ms']} ms) at best {row['best_x_floor_fp32_rows']} / "
            f"{row['best_x_floor_q4_rows']}, measured {row['measured_x_floor']} ({row['batch_1_ms']} ms)"
            + (f", goal {goal}" if goal else "")
        )
    return (
        f"{head}; x batch 1's tokens/s at best {row['best_x_batch_1_fp32_rows']} / "
        f"{row['best_x_batch_1_q4_rows']}, goal {row['goal_x_batch_1']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=9, help="timed batch-1 steps a context")
    parser.add_argument("--repeats", type=int, default=15, help="passes of each rate")
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    sum_gbs = parallel_read_gbs(repeats=args.repeats)
    fmas_per_s = fma_rate(args.repeats)
    print(f"load average {load_start}; a parallel sum {sum_gbs:.1f} GB/s, sgemm {fmas_per_s / 1e9:.1f} GFMA/s")
    rows = []
    for name in args.models.split(","):
        model = build_model(name)
        rows += cells(name, model, sum_gbs, fmas_per_s, args.steps)
        del model
    load_end = list(os.getloadavg())
    print(f"load average at end {load_end}")
    out = write_json(
        "decode-bounds",
        {
            "parallel_sum_gbs": round(sum_gbs, 1),
            "gfma_per_s": round(fmas_per_s / 1e9, 1),
            "load_average_at_start": load_start,
            "load_average_at_end": load_end,
            "rows": rows,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
