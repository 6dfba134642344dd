"""Invariance: the same greedy reply whatever the cache did, and what it costs.

``benchmarks/invariance.py`` runs it alone; it is also the Invariance section of ``kvshelf bench``.

Each conversation (the embedded model's tokens of reference-manual prose, 300 to 3,000
tokens) goes through the paths a cache can take, the scheduler's own calls throughout
(``prefill_plan`` chunks through ``prefill_logits``, decode steps through the decode
working set, ``loaded.forward``), at temperature 0:

- "hot": turn 1 (the first 60% of the prompt), 16 generated tokens, then the rest of the
  prompt as the next turn (a cut back after the reply, then an extension from there);
  the conversation every other path runs is those tokens: turn 1, the reply, the rest;
- "cold 256" (the reference), "cold 128", "cold, one call": the conversation prefilled
  afresh in those chunk sizes;
- "warm": turn 1's state written as a record and read back, then extended;
- "fork": a fork of turn 1's state, extended;
- "batched": the reference's prefill, decoded together with ``--others`` other agents of
  other lengths.

For each path: the 64 greedy tokens against the reference's, the largest |Δlogit| over
the next-token logits and every step before a divergence, and each divergence with the
reference's top-2 margin there. Each conversation runs with the engine's default kernels and with the shape-invariant
ones (every projection through BLIS, ``kvshelf.model.attention``). Then the cost against
the current code, side by side in one run: the reference's cold prefill time and the
decode ms/token of one agent, for the invariant attention alone, BLIS alone and both.

    python benchmarks/invariance.py [--conversations 50] [--min-tokens 300] [--max-tokens 3000]
        [--generate 64] [--others 3]

The default is the issue's 50 conversations (about an hour here); a session runs a
reduced size (``--conversations 3 --max-tokens 1000``) and says so.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvbench.charts import bars
from kvbench.common import documents
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import prefill_logits
from kvshelf.runtime.scheduler import prefill_plan

TITLE = "Invariance: the same greedy reply whatever the cache did"

REPLY = 16  # tokens generated in turn 1


def prefill(loaded: Any, cache: AgentCache, ids: list[int], chunk: int) -> np.ndarray:
    """Feed ``ids[cache's reusable prefix:]`` as the scheduler does; the next-token logits."""
    keep = cache.reuse_prefix(ids)
    todo, out = ids[keep:], None
    plan = prefill_plan(len(todo), chunk)
    for i, n in enumerate(plan):
        part, todo = todo[:n], todo[n:]
        out = prefill_logits(loaded.forward, mx.array(part)[None], cache.layers, i == len(plan) - 1)
        cache.tokens.extend(part)
        mx.eval(cache.arrays(), *([out] if out is not None else []))
    assert out is not None
    return np.array(out.astype(mx.float32))


def decode(
    loaded: Any, caches: list[AgentCache], firsts: list[np.ndarray], steps: int
) -> tuple[list[list[int]], list[list[np.ndarray]], float]:
    """Greedy decode of every agent together; each one's tokens and logits rows (agent 0's
    rows only), and ms per step."""
    working = WorkingSets()
    tokens = [[int(f.argmax())] for f in firsts]
    rows: list[list[np.ndarray]] = [[firsts[0]]]
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        keys = list(range(len(caches)))
        layers = working.caches(keys, [c.layers for c in caches])
        x = mx.array([[t[-1]] for t in tokens])
        logits = loaded.forward(x, cache=layers)[:, -1]
        mx.eval(logits, [a for c in caches for a in c.arrays()], working.arrays())
        for b, c in enumerate(caches):
            c.tokens.append(tokens[b][-1])
            tokens[b].append(int(np.argmax(np.array(logits[b]))))
        rows[0].append(np.array(logits[0]))
    ms = (time.perf_counter() - t0) * 1e3 / max(1, steps - 1)
    return tokens, rows, ms


def margin(row: np.ndarray) -> float:
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


def compare(name: str, ref: tuple[list[int], list[np.ndarray]], got: tuple[list[int], list[np.ndarray]]) -> dict:
    (rt, rr), (gt, gr) = ref, got
    diverge = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
    upto = len(rt) if diverge is None else diverge + 1
    delta = max(float(np.abs(a - b).max()) for a, b in zip(rr[:upto], gr[:upto])) if gr else None
    out: dict[str, Any] = {"path": name, "identical": diverge is None, "max_abs_dlogit": delta}
    if diverge is not None:
        out["diverges_at"] = diverge
        out["reference_top2_margin"] = round(margin(rr[diverge]), 5)
    return out


def conversation_paths(loaded: Any, prompt: list[int], others: list[list[int]], generate: int) -> dict:
    spec, split = loaded.spec, int(len(prompt) * 0.6)
    turn1 = AgentCache.empty(spec)
    first = prefill(loaded, turn1, prompt[:split], 256)
    reply, _, _ = decode(loaded, [turn1], [first], REPLY)
    conversation = prompt[:split] + reply[0] + prompt[split:]
    saved = agent_record(turn1)
    forked = turn1.fork()

    results: dict[str, tuple[list[int], list[np.ndarray]]] = {}

    def run(name: str, cache: AgentCache, chunk: int = 256) -> None:
        logits = prefill(loaded, cache, conversation, chunk)
        tokens, rows, _ = decode(loaded, [cache], [logits], generate)
        results[name] = (tokens[0], rows[0])

    t0 = time.perf_counter()
    ref = AgentCache.empty(spec)
    ref_first = prefill(loaded, ref, conversation, 256)
    prefill_s = time.perf_counter() - t0
    batch_base = ref.fork()
    tokens, rows, ms = decode(loaded, [ref], [ref_first], generate)
    results["cold 256"] = (tokens[0], rows[0])
    run("cold 128", AgentCache.empty(spec), 128)
    run("cold, one call", AgentCache.empty(spec), len(conversation))
    run("hot", turn1)
    run("warm", agent_cache_from_record(spec, saved, None))
    run("fork", forked)
    mates = []
    for ids in others:
        mate = AgentCache.empty(spec)
        mates.append((mate, prefill(loaded, mate, ids, 256)))
    tokens, rows, _ = decode(
        loaded, [batch_base, *(m for m, _ in mates)], [ref_first, *(f for _, f in mates)], generate
    )
    results[f"batched with {len(others)}"] = (tokens[0], rows[0])
    reference = results["cold 256"]
    return {
        "tokens": len(conversation),
        "prefill_s": round(prefill_s, 3),
        "decode_ms_per_token": round(ms, 1),
        "paths": [compare(name, reference, got) for name, got in results.items() if name != "cold 256"],
    }


CURRENT = "current code (default kernels, MLX attention)"
BLIS_ONLY = "every row through BLIS, MLX attention"
ATTENTION_ONLY = "invariant attention, default projections"
INVARIANT = "shape-invariant (BLIS rows + invariant attention)"
# The kernel choices a conversation can run with: (every projection through BLIS, invariant attention)
KERNELS = {"default": (False, False), "blis": (True, False), "attention": (False, True), "invariant": (True, True)}


def with_kernels(loaded: Any, all_rows: bool, attention: bool = False) -> Any:
    """``loaded`` whose forward sends every projection's rows through BLIS (or not) and
    runs ``kvshelf.model.attention`` (or MLX's attention)."""
    twin = copy.copy(loaded)
    twin.forward = with_fast_linears(loaded.model, all_rows=all_rows, attention=attention)
    return twin


def cost(variants: dict[str, Any], prompt: list[int], generate: int) -> dict:
    """Cold prefill (chunk 256) and one agent's decode per variant (a model with its
    forward), alternated twice so that a drift in the machine hits all alike; the cost of
    each against the current code."""
    out: dict[str, Any] = {}
    for _ in range(2):
        for key, loaded in variants.items():
            cache = AgentCache.empty(loaded.spec)
            t0 = time.perf_counter()
            first = prefill(loaded, cache, prompt, 256)
            p = time.perf_counter() - t0
            _, _, ms = decode(loaded, [cache], [first], generate)
            out.setdefault(key, {"prefill_s": [], "decode_ms_per_token": []})
            out[key]["prefill_s"].append(round(p, 3))
            out[key]["decode_ms_per_token"].append(round(ms, 1))
    for v in out.values():
        v["prefill_s_median"] = float(np.median(v["prefill_s"]))
        v["decode_ms_median"] = float(np.median(v["decode_ms_per_token"]))
    old = out[CURRENT]
    for key, v in out.items():
        if key != CURRENT:
            v["prefill_cost_pct"] = round(100 * (v["prefill_s_median"] / old["prefill_s_median"] - 1), 1)
            v["decode_tokens_per_s_cost_pct"] = round(100 * (1 - old["decode_ms_median"] / v["decode_ms_median"]), 1)
    out["tokens"] = len(prompt)
    return out


def measure(
    loaded: Any,
    conversations: int,
    min_tokens: int,
    max_tokens: int,
    generate: int,
    others: int,
    log: Any = None,
    kernels: tuple[str, ...] = ("default", "invariant"),
    on_row: Any = None,
    prompts: list[list[int]] | None = None,
) -> dict:
    """Every conversation through every path with each choice of ``kernels`` (``KERNELS``:
    "default", the engine's; "blis": every projection's rows through BLIS; "attention":
    ``kvshelf.model.attention``; "invariant": both), then the cost of each against the
    current code; the summary and the rows (``conversations`` 0: the cost alone).
    ``prompts``: token ids to use instead of the reference-manual documents (a model
    without a tokenizer)."""
    forwards = {k: loaded if k == "default" else with_kernels(loaded, *KERNELS[k]) for k in kernels}
    for k in kernels:  # no BLIS here (or it failed its check): those kernels are not what they say
        if KERNELS[k][0] and not getattr(forwards[k].forward, "_all_rows", False):
            forwards.pop(k)
    kernels = tuple(forwards)
    if prompts is None:
        docs = documents(loaded.tokenizer, max(1, conversations) + others, max_tokens, min_tokens)
        prompts = [loaded.tokenizer.encode_prompt(t) for t in docs.values()]
    rng = np.random.default_rng(0)
    lengths = np.linspace(min_tokens, max_tokens, conversations).astype(int)
    convs, mates_from = prompts[:conversations], prompts[max(1, conversations) :]
    rows = []
    t0 = time.perf_counter()
    for i, (ids, n) in enumerate(zip(convs, lengths)):
        mates = [o[: int(rng.integers(64, max(65, max_tokens // 2)))] for o in mates_from]
        for kernel in kernels:
            row = {"kernels": kernel, **conversation_paths(forwards[kernel], ids[:n], mates, generate)}
            rows.append(row)
            if on_row is not None:  # a run cut short keeps what it measured
                on_row(rows)
            if log is not None:
                same = all(p["identical"] for p in row["paths"])
                log(f"conversation {i + 1}/{len(convs)} ({kernel} kernels): {row['tokens']} tokens, identical: {same}")
                for p in row["paths"]:
                    log(f"    {p}")
    variants = {
        CURRENT: loaded,
        ATTENTION_ONLY: forwards.get("attention") or with_kernels(loaded, False, True),
    }
    if "invariant" in forwards:
        variants[BLIS_ONLY] = forwards.get("blis") or with_kernels(loaded, True, False)
        variants[INVARIANT] = forwards["invariant"]
    # the longest conversation's tokens (with no conversation, the cost alone: ``max_tokens``)
    costs = cost(variants, convs[-1][: lengths[-1]] if convs else prompts[0][:max_tokens], generate)

    def of(kernel: str) -> dict:
        mine = [r for r in rows if r["kernels"] == kernel]
        deltas = [p["max_abs_dlogit"] for r in mine for p in r["paths"] if p["max_abs_dlogit"] is not None]
        return {
            "conversations": len(mine),
            "identical_share": sum(all(p["identical"] for p in r["paths"]) for r in mine) / max(1, len(mine)),
            "largest_abs_dlogit": max(deltas) if deltas else None,
            "divergences": [{"tokens": r["tokens"], **p} for r in mine for p in r["paths"] if not p["identical"]],
        }

    summary = {
        **of(kernels[0]),
        "by_kernels": {k: of(k) for k in kernels},
        "cost": costs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return {"summary": summary, "conversations": rows}


# -- the section of ``kvshelf bench`` ------------------------------------------------------
def run(ctx: Any) -> dict:
    s = ctx.settings
    loaded = ctx.get_engine().loaded
    out = measure(
        loaded, s.invariance_conversations, s.invariance_min_tokens, s.invariance_max_tokens, s.invariance_generate, 3
    )
    summary = out["summary"]
    table = []
    for kernel, part in summary["by_kernels"].items():
        mine_rows = [r for r in out["conversations"] if r["kernels"] == kernel]
        names = [p["path"] for p in mine_rows[0]["paths"]] if mine_rows else []
        for name in names:
            mine = [p for r in mine_rows for p in r["paths"] if p["path"] == name]
            table.append(
                {
                    "kernels": kernel,
                    "path": name,
                    "identical_share": round(sum(p["identical"] for p in mine) / len(mine), 3),
                    "max_abs_dlogit": round(max(p["max_abs_dlogit"] or 0.0 for p in mine), 5),
                    "divergences": [(p["diverges_at"], p["reference_top2_margin"]) for p in mine if not p["identical"]],
                }
            )
    c = summary["cost"]
    shares = ", ".join(f"{k} kernels {v['identical_share']:.0%}" for k, v in summary["by_kernels"].items())
    costs = "; ".join(
        f"{k}: prefill {v['prefill_cost_pct']:+.1f}%, decode tokens/s {v['decode_tokens_per_s_cost_pct']:+.1f}%"
        for k, v in c.items()
        if isinstance(v, dict) and "prefill_cost_pct" in v
    )
    return {
        "title": TITLE,
        "description": (
            f"{summary['conversations']} conversations of {s.invariance_min_tokens}-{s.invariance_max_tokens} tokens, "
            f"{s.invariance_generate} greedy tokens per path against a cold prefill in 256-token chunks. "
            f"Identical on every path: {shares}. Cost against the earlier reads: {costs}."
        ),
        "summary": summary,
        "table": table,
    }


def chart(result: dict, path: Path) -> Path | None:
    rows = result.get("table") or []
    if not rows:
        return None
    return bars(
        path,
        "Invariance: share of conversations with identical greedy tokens",
        "share",
        [f"{r['path']} ({r['kernels']})" for r in rows],
        {"identical share": [r["identical_share"] for r in rows]},
    )


def headline(result: dict) -> str | None:
    summary = result.get("summary")
    if not summary:
        return None
    shares = ", ".join(f"{v['identical_share']:.0%} ({k} kernels)" for k, v in summary["by_kernels"].items())
    return (
        f"Invariance: of {summary['conversations']} conversations, identical greedy tokens on every path: "
        f"{shares}; largest |dlogit| {summary['largest_abs_dlogit']:.3g} with the default kernels."
    )
