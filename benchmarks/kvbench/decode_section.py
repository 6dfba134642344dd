"""Decode: ms per token at batch 1, 4 and 8 against the memory-bandwidth floor.

On the bench's own model, side by side in one run: kvshelf's decode step as the
scheduler runs it (the default KV scheme through the decode working set, the batch-1
output projection through sgemv, a row per agent), mlx-lm's own step with its fp32
KV cache at batch 1 (what ``mlx_lm.generate`` runs), and the floor: the model's weight
bytes over the memory bandwidth measured now. Caches hold random K/V of the context's
length (timing does not depend on the values). ``benchmarks/decode.py`` measures more
(plain Q4, batch 2, a second model, the per-step path).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from mlx_lm.models.cache import make_prompt_cache

from kvbench.charts import bars
from kvbench.context import BenchContext
from kvbench.decode_steps import bandwidth, fill, step_ms, weight_bytes
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES

TITLE = "Decode: ms per token against the memory-bandwidth floor"


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    loaded = ctx.get_engine().loaded
    model, fast, spec = loaded.model, loaded.forward, loaded.spec
    bw = bandwidth(model, megabytes=s.decode_stream_mb)
    floor_ms = weight_bytes(model) / bw["gbs"] / 1e6
    rows: list[dict] = []

    def row(context: int, path: str, batch: int, times: list[float], working_mb: float | None = None) -> None:
        ms = statistics.median(times)
        one = next((r for r in rows if r["context"] == context and r["path"] == path and r["batch"] == 1), None)
        rows.append(
            {
                "context": context,
                "path": path,
                "batch": batch,
                "ms_per_step": round(ms, 1),
                "tokens_per_s": round(batch * 1e3 / ms, 2),
                "x_floor": round(ms / floor_ms, 2),
                "x_batch_1_tokens_per_s": round(batch * one["ms_per_step"] / ms, 2) if one else 1.0,
                "working_set_mb": working_mb,
                "floor_ms": round(floor_ms, 3),  # a tiny model on a fast machine: well under 0.1 ms
            }
        )

    for context in s.decode_contexts:
        peer = make_prompt_cache(model)
        fill(peer, spec, context, seed=1)
        times, _ = step_ms(model, [peer], s.decode_steps, s.decode_warmup, peer=True)
        row(context, "mlx-lm fp32 KV", 1, times)
        del peer
        agents = []
        for b in range(max(s.decode_batches)):
            cache = AgentCache.empty(spec, SCHEMES[DEFAULT_SCHEME])
            fill(cache.layers, spec, context, seed=10 + b)
            agents.append(cache.layers)
        for batch in sorted(s.decode_batches):
            members = [[c.clone() for c in layers] for layers in agents[:batch]]
            times, held = step_ms(fast, members, s.decode_steps, s.decode_warmup, working=True)
            row(context, f"kvshelf {DEFAULT_SCHEME}", batch, times, round(held / 1e6 / batch, 1))
        del agents
    return {
        "title": TITLE,
        "description": (__doc__ or "").strip().split("\n\n")[1].replace("\n", " "),
        "bandwidth": bw,
        "table": rows,
    }


def chart(result: dict, path: Path) -> Path | None:
    rows = result.get("table") or []
    if not rows:
        return None
    labels = [f"{r['context'] // 1024}K, batch {r['batch']}" for r in rows if r["path"].startswith("kvshelf")]
    kv = [r for r in rows if r["path"].startswith("kvshelf")]
    peer = {r["context"]: r["ms_per_step"] for r in rows if not r["path"].startswith("kvshelf")}
    return bars(
        path,
        "Decode: ms per step (one token per agent)",
        "ms per step",
        labels,
        {
            "kvshelf": [r["ms_per_step"] for r in kv],
            "mlx-lm fp32 KV, batch 1": [peer.get(r["context"], 0.0) if r["batch"] == 1 else 0.0 for r in kv],
            "floor (weights / bandwidth)": [r["floor_ms"] for r in kv],
        },
    )


def headline(result: dict) -> str | None:
    rows = result.get("table") or []
    ones = [r for r in rows if r["path"].startswith("kvshelf") and r["batch"] == 1]
    if not ones:
        return None
    first = ones[0]
    peer = next((r for r in rows if r["context"] == first["context"] and r["path"] == "mlx-lm fp32 KV"), None)
    widest = max((r for r in rows if r["path"].startswith("kvshelf")), key=lambda r: r["batch"])
    text = f"Decode at {first['context']} tokens: {first['ms_per_step']:.0f} ms/token at batch 1"
    text += f" ({first['x_floor']:.2f}x the floor"
    if peer:
        text += f"; mlx-lm fp32 KV {peer['ms_per_step']:.0f} ms"
    return text + f"), batch {widest['batch']} {widest['x_batch_1_tokens_per_s']:.2f}x batch 1's tokens/s."
