"""Which ops give a row other bits when other rows come with it (issue 21, the diagnosis).

A token's K/V and logits must not depend on how many rows were computed with it (a
1-token decode step against the same token inside a 256-token prefill chunk), else a
4-bit bin edge turns the last bits into a different token. This takes real hidden rows of
the embedded model (the embeddings of a document, then layer 0's output) and runs each op
of a sliding and a global layer on 256 rows at once and on one row alone: the norms, the
q/k/v/o projections, the per-head norms, RoPE (the row alone at its own offset), attention
through a kvshelf cache (a 256-token call against 255 tokens then 1) and the MLP, the head;
once with the engine's default kernels, once with the shape-invariant ones
(``KVSHELF_SHAPE_INVARIANT``: each row of every projection its own sgemv, ``kvshelf.model.attention``).

    python benchmarks/row_probe.py [--model embedded] [--rows 256]

Prints one line per op and writes ``results/row-probe-*.json``. Not a timing.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import write_json

from kvbench.common import documents
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load


def compare(whole: mx.array, alone: mx.array) -> dict:
    a, b = np.array(whole.astype(mx.float32)), np.array(alone.astype(mx.float32))
    return {"bit_identical": bool(np.array_equal(a, b)), "max_abs_delta": float(np.abs(a - b).max())}


def row_ops(body: Any, layer_index: int, spec: Any, x: mx.array, rows: list[int]) -> dict[str, dict]:
    """Each op of layer ``layer_index`` on all of ``x`` (1, n, dim) against row r alone."""
    layer = body.layers[layer_index]
    attn = layer.self_attn
    a = getattr(attn, "attention", attn)  # an InvariantAttention wraps the module
    n = x.shape[1]
    out: dict[str, dict] = {}

    def rowwise(name: str, f: Any, inp: mx.array) -> mx.array:
        whole = f(inp)
        alone = mx.concatenate([f(inp[:, r : r + 1]) for r in rows], axis=1)
        out[name] = compare(whole[:, rows], alone)
        return whole

    h = rowwise("input_layernorm", layer.input_layernorm, x)
    q = rowwise("q_proj", a.q_proj, h)
    rowwise("k_proj", a.k_proj, h)
    rowwise("v_proj", a.v_proj, h)
    rowwise("o_proj", a.o_proj, q)
    heads = q.reshape(1, n, a.n_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(a, "q_norm"):
        whole = a.q_norm(heads)
        alone = mx.concatenate([a.q_norm(heads[:, :, r : r + 1]) for r in rows], axis=2)
        out["q_norm (per head)"] = compare(whole[:, :, rows], alone)
    whole = a.rope(heads, offset=0)
    alone = mx.concatenate([a.rope(heads[:, :, r : r + 1], offset=r) for r in rows], axis=2)
    out["rope (row alone at its offset)"] = compare(whole[:, :, rows], alone)
    # Attention through the cache: all n tokens in one call, against n-1 then the last alone.
    one = AgentCache.empty(spec).layers[layer_index]
    whole = attn(h, one.make_mask(n), one)[:, -1]
    two = AgentCache.empty(spec).layers[layer_index]
    attn(h[:, :-1], two.make_mask(n - 1), two)
    alone = attn(h[:, -1:], two.make_mask(1), two)[:, 0]
    out["attention (n-token call vs n-1 then 1)"] = compare(whole, alone)
    r = attn(h, AgentCache.empty(spec).layers[layer_index].make_mask(n), AgentCache.empty(spec).layers[layer_index])
    post = rowwise("post_attention_layernorm", layer.post_attention_layernorm, r)
    pre = rowwise("pre_feedforward_layernorm", layer.pre_feedforward_layernorm, x + post)
    g = rowwise("mlp.gate_proj", layer.mlp.gate_proj, pre)
    rowwise("mlp.down_proj", layer.mlp.down_proj, g)
    rowwise("mlp (whole)", layer.mlp, pre)
    return out


def probe(loaded: Any, all_rows: bool, attention: bool, x: mx.array, rows: list[int]) -> dict[str, dict]:
    fast = with_fast_linears(loaded.model, all_rows=all_rows, attention=attention)
    body = fast.body if isinstance(fast, ProjectedModel) else loaded.model.model
    pattern = getattr(loaded.model.args, "sliding_window_pattern", 1)
    found: dict[str, dict] = {}
    for index in sorted({0, pattern - 1}):
        kind = "sliding" if loaded.spec.layers[index].window else "global"
        for op, v in row_ops(body, index, loaded.spec, x, rows).items():
            found[f"layer {index} ({kind}): {op}"] = v
    if isinstance(fast, ProjectedModel):
        hidden = loaded.model.model.norm(x) if hasattr(loaded.model.model, "norm") else x
        whole = fast.project(hidden)
        alone = mx.concatenate([fast.project(hidden[:, r : r + 1]) for r in rows], axis=1)
        found["head (output projection)"] = compare(whole[:, rows], alone)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    loaded = load(args.model, progress=False)
    text = next(iter(documents(loaded.tokenizer, 1, 2 * args.rows, args.rows).values()))
    ids = loaded.tokenizer.encode_prompt(text)[: args.rows]
    inner = loaded.model.model
    x = inner.embed_tokens(mx.array(ids)[None])
    if hasattr(inner.args, "hidden_size") and "gemma" in type(inner).__module__:
        x = x * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(x.dtype)
    rows = [0, args.rows // 3, args.rows - 1]
    results = {}
    for name, all_rows, attention in (("default", False, False), ("shape-invariant", True, True)):
        results[name] = probe(loaded, all_rows, attention, x, rows)
        for op, v in results[name].items():
            print(f"{name:16s} {op:60s} identical={v['bit_identical']!s:5s} max|d|={v['max_abs_delta']:.3g}")
    load_end = os.getloadavg()
    print(f"load average at end: {load_end}", flush=True)
    write_json(
        "row-probe",
        {"model": args.model, "rows": args.rows, "probed_rows": rows, "results": results, "load_end": load_end},
    )


if __name__ == "__main__":
    main()
