"""How many agents stay resident under one byte budget: fp16 KV against kvshelf's Q4.

Measured, not computed: a ``BlockPool`` with the budget is filled with real caches, one
agent at a time, evicting least recently used agents when it goes over, exactly as the
engine does; the count is how many it holds at the first eviction.

- Q4: one agent per context size is prefilled once by the engine (the TTFT section's
  agents are reused) and every further agent is a real copy of its blocks, read back
  from its record on disk (``Engine.load_record``): its own arrays, not a reference.
- fp16: mlx-lm's own caches (``KVCache`` for global layers, ``RotatingKVCache`` with the
  model's window for sliding ones), as ``mlx_lm`` keeps them for this model, filled
  with fp16 arrays of the same shapes for the same number of tokens.

MLX's active memory is read with the pool full, as a check that the bytes are real.
"""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvbench.charts import bars
from kvbench.common import prompt_of_tokens
from kvbench.context import BenchContext
from kvshelf.runtime.pool import BlockPool

TITLE = "Capacity: agents resident under one byte budget, fp16 KV vs Q4"


class FP16Agent:
    """One agent's fp16 KV as mlx-lm holds it; ``nbytes`` is what the pool counts."""

    shared = None  # no shared prefix blocks: the pool counts this agent's own bytes only

    def __init__(self, spec, tokens: int, seed: int):
        key = mx.random.key(seed)
        self.tokens = range(tokens)  # the positions it holds, which the pool's listing counts
        self.layers = []
        for layer in spec.layers:
            cache = KVCache() if layer.window is None else RotatingKVCache(max_size=layer.window)
            n = tokens if layer.window is None else min(tokens, layer.window)
            # prefill all but the last token in one call, then one decode step, as generation leaves it
            for count in (n - 1, 1):
                k = mx.random.normal((1, layer.kv_heads, count, layer.k_head_dim), key=key).astype(mx.float16)
                v = mx.random.normal((1, layer.kv_heads, count, layer.v_head_dim), key=key).astype(mx.float16)
                cache.update_and_fetch(k, v)
            mx.eval(cache.state)
            self.layers.append(cache)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


def fill(budget: int, make, limit: int) -> dict:
    """Put agents into a budgeted pool until the first eviction; report what stayed."""
    gc.collect()
    base = mx.get_active_memory()
    pool = BlockPool(budget)
    made, evicted, peak_resident_mem = 0, False, 0
    while made < limit and not evicted:
        pool.put(f"agent-{made}", make(made))
        made += 1
        victims = pool.over_budget_victims()
        for v in victims:
            pool.pop(v)
        evicted = bool(victims)
        if not evicted:
            peak_resident_mem = mx.get_active_memory() - base
    resident = len(list(pool))
    out = {
        "resident": resident,
        "made": made,
        "hit_limit": not evicted,
        "pool_bytes": pool.resident_bytes,
        "bytes_per_agent": pool.resident_bytes / max(1, resident),
        "mlx_active_bytes_full": mx.get_active_memory() - base,
        "mlx_active_bytes_before_eviction": peak_resident_mem,
    }
    del pool
    gc.collect()
    return out


def q4_source(ctx: BenchContext, n: int) -> str:
    """An agent with a record of about ``n`` prompt tokens (the TTFT section's, or a new one)."""
    engine = ctx.get_engine()
    aid = ctx.records.get(n)
    if aid is None or not engine._shelf.store.path_for(aid).exists():
        aid = f"capacity-{n}"
        engine.prefill(
            aid, [{"role": "user", "content": prompt_of_tokens(engine.loaded.tokenizer, n, salt="Capacity. ")}]
        )
        engine.flush()
        ctx.records[n] = aid
    return aid


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    engine = ctx.get_engine()
    rows = []
    for n in s.capacity_sizes:
        if n >= engine.loaded.context_length:
            continue
        aid = q4_source(ctx, n)
        engine.flush()
        tokens = engine._shelf.store.token_count(aid)

        def q4_copy(i: int):
            cache = engine._shelf.load(aid)
            if cache is None:
                raise RuntimeError(f"record of {aid} could not be read back")
            return cache

        q4 = fill(s.capacity_budget, q4_copy, s.capacity_max_agents)
        fp16 = fill(
            s.capacity_budget, lambda i: FP16Agent(engine.loaded.spec, tokens, s.seed + i), s.capacity_max_agents
        )
        rows.append(
            {
                "context_tokens": tokens,
                "budget_mb": s.capacity_budget / 1e6,
                "fp16_agents": fp16["resident"],
                "q4_agents": q4["resident"],
                "q4_over_fp16": q4["resident"] / max(1, fp16["resident"]),
                "fp16_per_agent_mb": fp16["bytes_per_agent"] / 1e6,
                "q4_per_agent_mb": q4["bytes_per_agent"] / 1e6,
                "fp16_mlx_active_mb": fp16["mlx_active_bytes_before_eviction"] / 1e6,
                "q4_mlx_active_mb": q4["mlx_active_bytes_before_eviction"] / 1e6,
                "raw": {"q4": q4, "fp16": fp16, "kv_scheme": engine.kv_scheme.name},
            }
        )
        print(f"  capacity {tokens} tokens: fp16 {fp16['resident']} agents, Q4 {q4['resident']} agents", flush=True)
    return {
        "title": TITLE,
        "table": rows,
        "description": (
            f"Budget {s.capacity_budget / 1e6:.0f} MB. A BlockPool with that budget is filled one agent at a time "
            "(least recently used evicted when over, as in the engine); the figure is how many agents it holds at the "
            f"first eviction. Q4 ({engine.kv_scheme.name}): real copies of an agent the engine prefilled, read back "
            "from its record. fp16: mlx-lm's own KVCache / RotatingKVCache (window kept as mlx-lm keeps it) "
            "filled with fp16 "
            "arrays of the same shapes. 'MLX active MB' is MLX's allocator reading with the pool full (before the "
            "evicting insert): the bytes are real, not computed. Context tokens include the TTFT section's follow-ups."
        ),
    }


def chart(result: dict, path: Path) -> Path | None:
    rows = result["table"]
    if not rows:
        return None
    cats = [f"{r['context_tokens']} tokens" for r in rows]
    return bars(
        path,
        f"Agents resident in {rows[0]['budget_mb']:.0f} MB",
        "agents",
        cats,
        {"fp16 KV (mlx-lm caches)": [r["fp16_agents"] for r in rows], "kvshelf Q4": [r["q4_agents"] for r in rows]},
    )


def headline(result: dict) -> str | None:
    rows = result["table"]
    if not rows:
        return None
    return (
        "Capacity in {:.0f} MB: ".format(rows[0]["budget_mb"])
        + "; ".join(
            f"{r['context_tokens']} tokens: {r['q4_agents']} agents with Q4 vs {r['fp16_agents']} with fp16 "
            f"({r['q4_over_fp16']:.1f}x)"
            for r in rows
        )
        + "."
    )
