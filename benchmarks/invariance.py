"""Invariance: the same greedy reply whatever the cache did, and what it costs.

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
reference's top-2 margin there. Then the cost against the code before the change
(``kvshelf.kv.schemes.ONE_REPRESENTATION = False``), side by side in one run: the
reference's cold prefill time and the decode ms/token of one agent.

    python benchmarks/invariance.py [--conversations 50] [--min-tokens 300] [--max-tokens 3000]
        [--generate 64] [--others 3]

The default is the issue's 50 conversations (about an hour here); a session runs a
reduced size (``--conversations 3 --max-tokens 1000``) and says so.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import write_json

from kvbench.common import documents
from kvshelf.kv import schemes
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.head import prefill_logits
from kvshelf.model.loader import LoadedModel, load
from kvshelf.runtime.scheduler import prefill_plan

REPLY = 16  # tokens generated in turn 1


def prefill(loaded: LoadedModel, cache: AgentCache, ids: list[int], chunk: int) -> np.ndarray:
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
    loaded: LoadedModel, caches: list[AgentCache], firsts: list[np.ndarray], steps: int
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
            tokens[b].append(int(mx.argmax(logits[b]).item()))
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


def conversation_paths(loaded: LoadedModel, prompt: list[int], others: list[list[int]], generate: int) -> dict:
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
    tokens, rows, _ = decode(loaded, [batch_base, *(m for m, _ in mates)], [ref_first, *(f for _, f in mates)], generate)
    results[f"batched with {len(others)}"] = (tokens[0], rows[0])
    reference = results["cold 256"]
    return {
        "tokens": len(conversation),
        "prefill_s": round(prefill_s, 3),
        "decode_ms_per_token": round(ms, 1),
        "paths": [compare(name, reference, got) for name, got in results.items() if name != "cold 256"],
    }


def cost(loaded: LoadedModel, prompt: list[int], generate: int) -> dict:
    """Cold prefill (chunk 256) and one agent's decode, with and without one representation."""
    out: dict[str, Any] = {}
    for rounds in range(2):  # alternate, twice: a drift in the machine hits both alike
        for mode in (True, False):
            schemes.ONE_REPRESENTATION = mode
            cache = AgentCache.empty(loaded.spec)
            t0 = time.perf_counter()
            first = prefill(loaded, cache, prompt, 256)
            p = time.perf_counter() - t0
            _, _, ms = decode(loaded, [cache], [first], generate)
            key = "one representation" if mode else "before (ONE_REPRESENTATION=False)"
            out.setdefault(key, {"prefill_s": [], "decode_ms_per_token": []})
            out[key]["prefill_s"].append(round(p, 3))
            out[key]["decode_ms_per_token"].append(round(ms, 1))
    schemes.ONE_REPRESENTATION = True
    for v in out.values():
        v["prefill_s_median"] = float(np.median(v["prefill_s"]))
        v["decode_ms_median"] = float(np.median(v["decode_ms_per_token"]))
    new, old = out["one representation"], out["before (ONE_REPRESENTATION=False)"]
    out["prefill_cost_pct"] = round(100 * (new["prefill_s_median"] / old["prefill_s_median"] - 1), 1)
    out["decode_tokens_per_s_cost_pct"] = round(100 * (1 - old["decode_ms_median"] / new["decode_ms_median"]), 1)
    out["tokens"] = len(prompt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--generate", type=int, default=64)
    ap.add_argument("--others", type=int, default=3)
    ap.add_argument("--model", default="embedded")
    args = ap.parse_args()
    loaded = load(args.model, progress=False)
    docs = documents(loaded.tokenizer, args.conversations + args.others, args.max_tokens, args.min_tokens)
    prompts = [loaded.tokenizer.encode_prompt(t) for t in docs.values()]
    rng = np.random.default_rng(0)
    lengths = np.linspace(args.min_tokens, args.max_tokens, args.conversations).astype(int)
    convs, others = prompts[: args.conversations], prompts[args.conversations :]
    rows = []
    t0 = time.perf_counter()
    for i, (ids, n) in enumerate(zip(convs, lengths)):
        mates = [o[: int(rng.integers(64, max(65, args.max_tokens // 2)))] for o in others]
        row = conversation_paths(loaded, ids[:n], mates, args.generate)
        rows.append(row)
        same = all(p["identical"] for p in row["paths"])
        print(f"conversation {i + 1}/{len(convs)}: {row['tokens']} tokens, every path identical: {same}", flush=True)
        for p in row["paths"]:
            print("   ", p, flush=True)
    costs = cost(loaded, convs[-1][: lengths[-1]], args.generate)
    print("cost:", costs, flush=True)
    deltas = [p["max_abs_dlogit"] for r in rows for p in r["paths"] if p["max_abs_dlogit"] is not None]
    summary = {
        "conversations": len(rows),
        "identical_share": sum(all(p["identical"] for p in r["paths"]) for r in rows) / max(1, len(rows)),
        "largest_abs_dlogit": max(deltas) if deltas else None,
        "divergences": [{"tokens": r["tokens"], **p} for r in rows for p in r["paths"] if not p["identical"]],
        "cost": costs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print("summary:", {k: v for k, v in summary.items() if k != "cost"}, flush=True)
    path = write_json("invariance", {"args": vars(args), "summary": summary, "conversations": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
