"""Where one batch-1 decode step's time goes: a profile of its pieces, each timed alone.

For each model (the embedded Gemma 3 270M and a random-weight llama of SmolLM2-135M's
shape) at one context length, medians of a few repeats:

- the whole step as the scheduler runs it (decode working set, every batch-1 projection
  through sgemv), and with only the output projection through sgemv;
- the body alone (the layers and the final norm; MLX's matmuls, and sgemv's), the body
  over mlx-lm's own fp32 KV cache, and the body over an empty context
  (one cached token: what the layers cost without attention's reads);
- the working set's update and fetch alone, and attention alone over what it fetched;
- un-rotating each layer's new value row (what the working set does per step) against
  un-rotating each layer's attention output instead (issue 14's "once per head");
- every layer's linear projections (q/k/v/o, gate/up/down), one row each, as MLX's
  matmul runs them (``cblas_sgemm`` with one row) and as ``cblas_sgemv`` runs them on
  the same weights, summed over the layers;
- the floor of the layers' weights and the head's weights at the bandwidth measured now.

    python benchmarks/decode_profile.py [--models embedded,llama30] [--context 1024]

Run it through the exclusive benchmark lock; a figure taken under other load is noise.
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
from decode import build_model
from mlx_lm.models.cache import make_prompt_cache

from kvbench.decode_steps import FLOOR_METHOD, bandwidth, fill, weight_bytes
from kvshelf.kv import working_set
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import buffer_view, with_fast_head
from kvshelf.model.sgemv import system_sgemv
from kvshelf.model.spec import ModelCacheSpec


def layer_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for layer in model.model.layers for _, m in layer.named_modules() if isinstance(m, nn.Linear)]


def profile(name: str, context: int, repeats: int) -> dict[str, Any]:
    model = build_model(name)
    bw = bandwidth(model)
    gbs = bw["gbs"]
    spec = ModelCacheSpec.from_model(model)
    head_only = with_fast_head(model)
    fast = with_fast_linears(model)
    linears = layer_linears(model)
    layer_bytes = sum(m.weight.nbytes for m in linears)
    out: dict[str, Any] = {"model": name, "context": context, "layers": len(model.model.layers)}
    out["bandwidth"] = bw
    out["floor_ms"] = round(weight_bytes(model) / gbs / 1e6, 1)
    out["layer_linears_floor_ms"] = round(layer_bytes / gbs / 1e6, 1)

    cache = AgentCache.empty(spec, SCHEMES[DEFAULT_SCHEME])
    fill(cache.layers, spec, context, seed=3)
    ws = WorkingSets()
    x = mx.array([[1]])

    def step(forward: Any) -> Callable[[], None]:
        def run() -> None:
            caches = ws.caches([0], [cache.layers])
            y = forward(x, cache=caches)
            mx.eval(y, cache.arrays(), ws.arrays())

        return run

    out["step_ms"] = round(median_ms(step(fast), repeats), 1)
    # The working set's pipelining (kvshelf.kv.working_set.PIPELINE) off and on again, each
    # twice, alternating, so drift in the machine's load touches both alike.
    pipelined: dict[bool, list[float]] = {False: [], True: []}
    default = working_set.PIPELINE
    for on in (False, True, False, True):
        working_set.PIPELINE = on
        pipelined[on].append(median_ms(step(fast), repeats))
    working_set.PIPELINE = default
    out["step_no_pipeline_ms"] = round(statistics.median(pipelined[False]), 1)
    out["step_pipeline_ms"] = round(statistics.median(pipelined[True]), 1)
    out["step_head_gemv_only_ms"] = round(median_ms(step(head_only), repeats), 1)
    out["body_ms"] = round(median_ms(step(model.model), repeats), 1)
    # The Python side of the body: building its graph (every layer's MLX calls, the working
    # set's upkeep), timed apart from MLX evaluating it.
    built: list[float] = []

    def body_built() -> None:
        t = time.perf_counter()
        y = model.model(x, cache=ws.caches([0], [cache.layers]))
        built.append((time.perf_counter() - t) * 1e3)
        mx.eval(y, cache.arrays(), ws.arrays())

    median_ms(body_built, repeats)
    out["body_graph_build_ms"] = round(statistics.median(built[2:]), 1)
    out["body_gemv_ms"] = round(median_ms(step(getattr(fast, "body", model.model)), repeats), 1)
    empty = make_prompt_cache(model)
    fill(empty, spec, 1, seed=4)

    def body_empty() -> None:  # the context grows by one token a call: stays near empty
        mx.eval(model.model(x, cache=empty))

    out["body_empty_context_ms"] = round(median_ms(body_empty, repeats), 1)

    peer = make_prompt_cache(model)
    fill(peer, spec, context, seed=5)

    def body_peer() -> None:
        mx.eval(model.model(x, cache=peer))

    out["body_mlx_lm_fp32_kv_ms"] = round(median_ms(body_peer, repeats), 1)

    layers = ws.caches([0], [cache.layers])
    kvs = [
        (mx.random.normal((1, s.kv_heads, 1, s.k_head_dim)), mx.random.normal((1, s.kv_heads, 1, s.v_head_dim)))
        for s in spec.layers
    ]
    mx.eval(kvs)
    heads = model.model.layers[0].self_attn.n_heads if hasattr(model.model.layers[0], "self_attn") else 1
    fetched: list[Any] = []

    def cache_path() -> None:
        fetched.clear()
        for c, (k, v) in zip(ws.caches([0], [cache.layers]), kvs):
            fetched.append(c.update_and_fetch(k, v))
        mx.eval(fetched, cache.arrays(), ws.arrays())

    out["cache_update_and_fetch_ms"] = round(median_ms(cache_path, repeats), 1)
    built.clear()

    def cache_built() -> None:
        t = time.perf_counter()
        got = [c.update_and_fetch(k, v) for c, (k, v) in zip(ws.caches([0], [cache.layers]), kvs)]
        built.append((time.perf_counter() - t) * 1e3)
        mx.eval(got, cache.arrays(), ws.arrays())

    median_ms(cache_built, repeats)
    out["cache_update_graph_build_ms"] = round(statistics.median(built[2:]), 1)
    masks_built: list[float] = []

    def masks() -> None:
        t = time.perf_counter()
        got = [c.make_mask(1) for c in ws.caches([0], [cache.layers])]
        masks_built.append((time.perf_counter() - t) * 1e3)
        mx.eval([m for m in got if isinstance(m, mx.array)])

    out["masks_ms"] = round(median_ms(masks, repeats), 2)
    queries = [mx.random.normal((1, heads, 1, k.shape[-1])) for k, _ in fetched]
    mx.eval(queries)

    def attention() -> None:
        outs = [
            mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=None) for q, (k, v) in zip(queries, fetched)
        ]
        mx.eval(outs)

    out["sdpa_ms"] = round(median_ms(attention, repeats), 1)

    # Issue 14's "undo the value rotation once per head, not per row": with the working
    # set a step un-rotates one new value row per layer (kv_heads x head_dim); moving the
    # inverse rotation to the attention output would un-rotate n_heads rows instead.
    new_rows = [mx.random.normal((1, s.kv_heads, 1, s.v_head_dim)) for s in spec.layers]
    outputs = [mx.random.normal((1, heads, 1, s.v_head_dim)) for s in spec.layers]
    mx.eval(new_rows, outputs)
    out["unrotate_new_value_rows_ms"] = round(
        median_ms(lambda: mx.eval([mx.hadamard_transform(r) for r in new_rows]), repeats), 2
    )
    out["unrotate_attention_outputs_ms"] = round(
        median_ms(lambda: mx.eval([mx.hadamard_transform(r) for r in outputs]), repeats), 2
    )
    del layers

    # What mx.compile of the non-attention parts gains: every layer's MLP on one row,
    # in one graph, as the model runs it and compiled (checked bit-identical first).
    mlps = [layer.mlp for layer in model.model.layers]
    compiled = [mx.compile(mlp) for mlp in mlps]
    hidden = mx.random.normal((1, 1, model.model.layers[0].mlp.down_proj.weight.shape[0]))
    mx.eval(hidden)
    out["mlp_compiled_bit_identical"] = all(mx.array_equal(f(hidden), m(hidden)).item() for f, m in zip(compiled, mlps))
    out["mlps_ms"] = round(median_ms(lambda: mx.eval([m(hidden) for m in mlps]), repeats), 1)
    out["mlps_compiled_ms"] = round(median_ms(lambda: mx.eval([f(hidden) for f in compiled]), repeats), 1)

    rows = [mx.random.normal((1, 1, m.weight.shape[1])) for m in linears]
    mx.eval(rows)

    def mlx_linears() -> None:
        for m, r in zip(linears, rows):
            mx.eval(m(r))

    def mlx_linears_one_graph() -> None:
        mx.eval([m(r) for m, r in zip(linears, rows)])

    sgemv = system_sgemv()
    out["linears_mlx_ms"] = round(median_ms(mlx_linears, repeats), 1)
    out["linears_mlx_one_eval_ms"] = round(median_ms(mlx_linears_one_graph, repeats), 1)
    if sgemv is not None:
        views = [buffer_view(m.weight) for m in linears]
        vecs = [np.asarray(r).reshape(-1) for r in rows]

        def blas_linears() -> None:
            for w, v in zip(views, vecs):
                sgemv(w, v)

        out["linears_sgemv_ms"] = round(median_ms(blas_linears, repeats), 1)
    shown = {k: v for k, v in out.items() if k not in ("model", "context", "bandwidth")}
    print(f"{name} at {context}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,llama30")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    rows = [profile(name, args.context, args.repeats) for name in args.models.split(",")]
    loads = {"load_average_at_start": load_start, "load_average_at_end": list(os.getloadavg())}
    print(loads)
    print(f"wrote {write_json('decode-profile', {'floor_method': FLOOR_METHOD, **loads, 'rows': rows})}")


if __name__ == "__main__":
    main()
