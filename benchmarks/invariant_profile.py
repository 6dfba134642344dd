"""Where the shape-invariant kernels spend their time: a ~1K-token prefill and decode steps at 1K.

``LoadedModel.greedy_forward`` sends every row of every projection through its own sgemv
(``kvshelf.model.sgemv.each_row``; until 2026-12-02 BLIS's product, ``kvshelf.model.few_rows``)
and every attention through ``kvshelf.model.attention``. Each product hands MLX's array to
numpy, so MLX evaluates the graph up to it: the wall time of a forward splits into the
products themselves (by projection; the head's is not clocked) and the MLX work between two calls (by the
projection that waits on it: before ``o_proj`` that is RoPE, the cache update and
attention; before ``q_proj`` the norms and residuals; before ``down_proj`` the MLP's
activation; before the head the last norm). Printed beside the default kernels, the
attention-only and projections-only forwards, for the embedded Gemma 3 and the 30-layer llama.

    python benchmarks/invariant_profile.py [--models embedded,llama30] [--tokens 1010] [--steps 8]

Run it through kv-bench; it writes ``results/invariant-profile-*.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import write_json
from decode import build_model

from kvbench.invariance import decode, prefill
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.model.attention import invariant_attention_body
from kvshelf.model.gemv import gemv_body, with_fast_linears
from kvshelf.model.head import ProjectedModel, with_fast_head
from kvshelf.model.sgemv import each_row, system_sgemv
from kvshelf.model.spec import ModelCacheSpec


@dataclass
class Bare:
    model: Any
    spec: ModelCacheSpec
    forward: Any


class Clock:
    """The shape-invariant product (``each_row``) that books its own time and the time since
    the previous call returned."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        sgemv = system_sgemv()
        assert sgemv is not None
        self.gemm = partial(each_row, sgemv)
        self.product: dict[str, float] = defaultdict(float)
        self.before: dict[str, float] = defaultdict(float)
        self.calls = 0
        self.last: float | None = None

    def reset(self) -> None:
        self.product.clear()
        self.before.clear()
        self.calls = 0
        self.last = None

    def __call__(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        name = self.names.get(weight.ctypes.data, "head")
        if self.last is not None:
            self.before[name] += t0 - self.last
        y = self.gemm(x, weight)
        t1 = time.perf_counter()
        self.product[name] += t1 - t0
        self.calls += 1
        self.last = t1
        return y


def weight_names(model: Any) -> dict[int, str]:
    out = {}
    for name, m in model.named_modules():
        if "weight" in m and isinstance(m["weight"], mx.array) and m["weight"].ndim == 2:
            out[np.asarray(m["weight"]).ctypes.data] = name.split(".")[-1]
    return out


def clocked_forward(model: Any, clock: Clock) -> ProjectedModel:
    """``with_fast_linears(model, all_rows=True, attention=True)`` with ``clock`` as its gemm."""
    fast = with_fast_head(model)
    sgemv = system_sgemv()
    assert isinstance(fast, ProjectedModel) and sgemv is not None
    body = invariant_attention_body(gemv_body(model.model, sgemv, clock, all_rows=True, plans=False))
    return ProjectedModel(model, fast._project, fast._head, sgemv, body=body, all_rows=True)


def prompt_for(name: str, model: Any, tokens: int) -> list[int]:
    vocab = model.args.vocab_size
    return np.random.default_rng(1).integers(0, vocab, tokens).tolist()


def profile(name: str, tokens: int, steps: int, only: list[str] | None = None) -> dict:
    model = build_model(name)
    spec = ModelCacheSpec.from_model(model)
    prompt = prompt_for(name, model, tokens)
    variants = {
        "default": with_fast_linears(model),
        "attention only": with_fast_linears(model, all_rows=False, attention=True),
        "projections only": with_fast_linears(model, all_rows=True, attention=False),
        "invariant": with_fast_linears(model, all_rows=True, attention=True),
        "invariant (sgemv rows)": with_fast_linears(model, all_rows=True, attention=True, plans=False),
    }
    clock = Clock(weight_names(model))
    variants["invariant, clocked"] = clocked_forward(model, clock)
    if only:
        variants = {k: v for k, v in variants.items() if k in only}
    out: dict[str, Any] = {}
    for _ in range(2):
        for key, forward in variants.items():
            bare = Bare(model, spec, forward)
            cache = AgentCache.empty(spec)
            clock.reset()
            t0 = time.perf_counter()
            first = prefill(bare, cache, prompt, 256)
            p = time.perf_counter() - t0
            pre = (dict(clock.product), dict(clock.before), clock.calls)
            clock.reset()
            _, _, ms = decode(bare, [cache], [first], steps + 1)
            dec = (dict(clock.product), dict(clock.before), clock.calls)
            row = out.setdefault(key, {"prefill_s": [], "decode_ms": []})
            row["prefill_s"].append(round(p, 3))
            row["decode_ms"].append(round(ms, 1))
            if key.endswith("clocked"):
                row["prefill_product_ms"] = {k: round(v * 1e3, 1) for k, v in pre[0].items()}
                row["prefill_mlx_before_ms"] = {k: round(v * 1e3, 1) for k, v in pre[1].items()}
                row["prefill_product_calls"] = pre[2]
                row["decode_product_ms_per_step"] = {k: round(v * 1e3 / steps, 2) for k, v in dec[0].items()}
                row["decode_mlx_before_ms_per_step"] = {k: round(v * 1e3 / steps, 2) for k, v in dec[1].items()}
                row["decode_product_calls_per_step"] = dec[2] / steps
    for key, row in out.items():
        print(f"{name} {key}: prefill {row['prefill_s']} s, decode {row['decode_ms']} ms/step")
        pieces: tuple[str, ...] = ("prefill_product_ms", "prefill_mlx_before_ms")
        pieces += ("decode_product_ms_per_step", "decode_mlx_before_ms_per_step")
        for k in pieces:
            if k in row:
                print(f"   {k}: {row[k]} (sum {sum(row[k].values()):.1f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", default="embedded,llama30")
    ap.add_argument("--tokens", type=int, default=1010)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variants", default="", help="a comma-separated subset of the forwards (default: all)")
    args = ap.parse_args()
    start = list(os.getloadavg())
    print(f"load average at start: {start}", flush=True)
    only = [v for v in args.variants.split(",") if v]
    result = {m: profile(m, args.tokens, args.steps, only) for m in args.models.split(",")}
    end = list(os.getloadavg())
    path = write_json(
        "invariant-profile", {"args": vars(args), "load_average_at_start": start, "load_average_at_end": end, **result}
    )
    print(f"wrote {path}; load average at end: {end}")


if __name__ == "__main__":
    main()
