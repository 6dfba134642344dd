"""Where a batched decode step's time goes: its pieces at batch 1, 4 and 8, each timed alone.

Issue 14 asks a batch of 8 agents to decode at >= 5x the tokens/s of one agent: the
weights are read once per step whatever the batch, and 8 rows of compute are a few
GFLOP, so a batch-8 step should cost little more than a batch-1 step. This profile
(the batch companion of ``decode_profile.py``, which covers batch 1 alone) times, per
batch size and medians of a few repeats:

- the whole step as the scheduler runs it (decode working set kept across steps, the
  engine's projections), with BLIS for a batch's rows and without (``KVSHELF_NO_BLIS``);
- the body alone, and the time Python spends building its graph before MLX evaluates it;
- the working set's update and fetch for every layer (append into the Q4 blocks, the
  batch's new rows coded once, the buffer write) and the two masks a step builds;
- attention over what the working set fetched, with those masks;
- every layer's projections with B rows, through MLX's matmul and through BLIS;
- the output projection with B rows through MLX, BLIS (and sgemv at batch 1);
- choosing the next tokens as the scheduler does (one argmax and sync per member)
  against one argmax over the batch.

    python benchmarks/decode_batch_profile.py [--models embedded] [--context 1024] [--batches 1,4,8]

Run it through the exclusive benchmark lock, with few repeats: every repeat is a step.
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
import mlx.nn as nn
import numpy as np
from common import median_ms, write_json
from decode import build_model, engine_forward

from kvbench.decode_steps import bandwidth, cache_arrays, describe_bandwidth, fill
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model import few_rows
from kvshelf.model.head import ProjectedModel, buffer_view
from kvshelf.model.sgemv import system_sgemv
from kvshelf.model.spec import ModelCacheSpec


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """One warm-up call, then the median in ms to 0.1 ms (the profile's rows)."""
    return round(median_ms(fn, repeats, warmup=1), 1)


def profile(name: str, context: int, batches: list[int], repeats: int) -> list[dict[str, Any]]:
    model = build_model(name)
    spec = ModelCacheSpec.from_model(model)
    forwards = {"blis": engine_forward(model, True), "mlx": engine_forward(model, False)}
    linears = [m for layer in model.model.layers for _, m in layer.named_modules() if isinstance(m, nn.Linear)]
    gemm = few_rows.system_gemm()
    sgemv = system_sgemv()
    head = forwards["mlx"]
    agents = []
    for b in range(max(batches)):
        cache = AgentCache.empty(spec, SCHEMES[DEFAULT_SCHEME])
        fill(cache.layers, spec, context, seed=20 + b)
        agents.append(cache)
    rows = []
    for batch in batches:
        members = [[c.clone() for c in a.layers] for a in agents[:batch]]
        ws = WorkingSets()
        keys = list(range(batch))
        x = mx.array([[1]] * batch)
        out: dict[str, Any] = {"model": name, "context": context, "batch": batch}

        def state(members: list[list[Any]] = members) -> list[mx.array]:
            return [a for layers in members for c in layers for a in cache_arrays(c)]

        def step(forward: Any) -> Callable[[], None]:
            def run() -> None:
                logits = forward(x, cache=ws.caches(keys, members))[:, -1]
                mx.eval(mx.argmax(logits, axis=-1), state(), ws.arrays())

            return run

        for kind, forward in forwards.items():
            out[f"step_{kind}_ms"] = timed(step(forward), repeats)
            body = getattr(forward, "body", model.model)
            out[f"body_{kind}_ms"] = timed(step(lambda x, cache: body(x, cache)[:, :, :8]), repeats)

        built: list[float] = []

        def body_lazy() -> None:  # MLX's own body: nothing evaluates until the end
            t = time.perf_counter()
            h = model.model(x, cache=ws.caches(keys, members))
            built.append((time.perf_counter() - t) * 1e3)
            mx.eval(h, state(), ws.arrays())

        out["body_lazy_ms"] = timed(body_lazy, repeats)
        out["body_graph_build_ms"] = round(statistics.median(built[1:]), 1)

        caches = ws.caches(keys, members)
        kvs = [
            (
                mx.random.normal((batch, s.kv_heads, 1, s.k_head_dim)),
                mx.random.normal((batch, s.kv_heads, 1, s.v_head_dim)),
            )
            for s in spec.layers
        ]
        mx.eval(kvs)
        fetched: list[Any] = []
        masks: list[Any] = []
        window = spec.layers[0].window

        def cache_path() -> None:
            fetched.clear()
            masks.clear()
            cs = ws.caches(keys, members)
            masks.extend([cs[0].make_mask(1, window_size=window), cs[-1].make_mask(1)])
            for c, (k, v) in zip(cs, kvs):
                fetched.append(c.update_and_fetch(k, v))
            mx.eval(fetched, masks, state(), ws.arrays())

        out["working_set_update_fetch_and_masks_ms"] = timed(cache_path, repeats)

        def masks_only() -> None:
            cs = ws.caches(keys, members)
            mx.eval([cs[0].make_mask(1, window_size=window), cs[-1].make_mask(1)])

        out["masks_ms"] = timed(masks_only, repeats)
        heads = getattr(model.model.layers[0].self_attn, "n_heads", 1)
        queries = [mx.random.normal((batch, heads, 1, k.shape[-1])) for k, _ in fetched]
        mx.eval(queries)

        def attention() -> None:
            outs = []
            for s, q, (k, v) in zip(spec.layers, queries, fetched):
                mask = masks[0] if s.window is not None else masks[1]
                if isinstance(mask, mx.array) and mask.shape[-1] != k.shape[2]:
                    mask = None
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask))
            mx.eval(outs)

        out["attention_ms"] = timed(attention, repeats)
        del caches

        inputs = [mx.random.normal((batch, 1, m.weight.shape[1])) for m in linears]
        mx.eval(inputs)
        out["linears_mlx_ms"] = timed(lambda: mx.eval([m(r) for m, r in zip(linears, inputs)]), repeats)
        if gemm is not None:
            views = [buffer_view(m.weight) for m in linears]
            rows_np = [np.asarray(r).reshape(batch, -1) for r in inputs]
            out["linears_blis_ms"] = timed(lambda: [gemm(r, w) for r, w in zip(rows_np, views)], repeats)
        hidden = mx.random.normal((batch, 1, spec_hidden(model)))
        mx.eval(hidden)
        if isinstance(head, ProjectedModel):
            out["head_mlx_ms"] = timed(lambda: mx.eval(head._project(hidden)), repeats)
            weight = head.weight_view()
            h_np = np.asarray(hidden).reshape(batch, -1)
            if gemm is not None:
                out["head_blis_ms"] = timed(lambda: gemm(h_np, weight), repeats)
            if batch == 1 and sgemv is not None:
                out["head_sgemv_ms"] = timed(lambda: sgemv(weight, h_np[0]), repeats)
            logits = head._project(hidden)[:, -1]
            mx.eval(logits)
            out["choose_per_member_ms"] = timed(
                lambda: [int(mx.argmax(logits[b], axis=-1)) for b in range(batch)], repeats
            )
            out["choose_batched_ms"] = timed(lambda: mx.argmax(logits, axis=-1).tolist(), repeats)
        pieces = ", ".join(f"{k} {v}" for k, v in out.items() if k.endswith("ms"))
        print(f"{name} at {context}, batch {batch}: {pieces}")
        rows.append(out)
    return rows


def spec_hidden(model: nn.Module) -> int:
    return int(model.model.embed_tokens.weight.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    bw = bandwidth()
    print(f"load {load_start}; {describe_bandwidth(bw)}")
    rows = [
        r
        for name in args.models.split(",")
        for r in profile(name, args.context, [int(b) for b in args.batches.split(",")], args.repeats)
    ]
    result = {"bandwidth": bw, "load_average_at_start": load_start, "load_average_at_end": list(os.getloadavg())}
    print(f"load at end {result['load_average_at_end']}")
    print(f"wrote {write_json('decode-batch-profile', {**result, 'rows': rows})}")


if __name__ == "__main__":
    main()
