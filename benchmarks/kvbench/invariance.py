"""Invariance: the same greedy reply whatever the cache did, and what it costs.

``benchmarks/invariance.py`` runs it (resumably, one conversation's stage per process);
it is also the Invariance section of ``kvshelf bench``.

Each conversation (reference-manual prose, 300 to 3,000 tokens) goes through every path a
cache can take, with the scheduler's own calls (``prefill_plan`` chunks through
``prefill_logits``, decode steps through the decode working set) and the forward the
engine runs at temperature 0 (``LoadedModel.greedy_forward``). Its 64 greedy tokens and
next-token logits on each path are compared with the reference's: a cold prefill in
256-token chunks, decoded alone.

The paths, in three stages (``STAGES``) that may each run in their own process:

- "hot": the agent's three turns. Turn 1 (the first half of the prompt) and turn 2 (up to
  85%) each get an ``REPLY``-token greedy reply, and the conversation every path runs is
  turn 1, its reply, turn 2, its reply, turn 3. Turn 2's state, as the agent leaves it, is
  saved as a record on disk (for "warm"), forked ("fork"), and handed to a ``Shelf`` with a
  byte budget that the next agent's return overflows, so the shelf's own budget eviction
  spills it and its restore reads it back ("evicted and reloaded"). Then the reference.
  Decoded together: hot, fork, evicted and one other agent ("batched with 3").
- "cold": cold in 64-token chunks, decoded with one other agent ("batched with 1").
- "warm": in a new process (checked: not the one that wrote the record), turn 2's record
  read back from disk and extended by turn 3; cold in 128-token chunks; cold in one call.
  Decoded together with five other agents ("batched with 7").

So every path is decoded in a batch, and a path whose tokens equal the lone reference's
proves both its own path and the batch's invariance at once; a path that diverges is
decoded again alone, so that the divergence is attributed (both are reported). The other
agents of a batch have other lengths than the conversation and than each other: forks of
the batch's own state cut back to other lengths (``reuse_prefix``, as a fork with another
prompt is), each with its own next-token logits, decoded with the rest.

For each path: the 64 greedy tokens against the reference's, the largest |Δlogit| over
the next-token logits and every step up to a divergence, and each divergence with the
reference's top-2 margin there. ``kvbench.invariance_runs`` keeps one JSON file per
conversation and pools them; ``cost`` times the kernel choices against the current code.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvbench.charts import bars
from kvbench.common import documents
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import prefill_logits
from kvshelf.runtime.scheduler import prefill_plan
from kvshelf.runtime.shelf import Shelf
from kvshelf.storage.agent_id import AgentId

TITLE = "Invariance: the same greedy reply whatever the cache did"

REPLY = 8  # greedy tokens of each of the hot path's first two replies
CUTS = (0.5, 0.85)  # where the prompt is cut into the hot path's three turns
STAGES = ("hot", "cold", "warm")
WARM_AGENT = AgentId("turn-2")


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
    loaded: Any, caches: list[AgentCache], firsts: list[np.ndarray], steps: int, keep: tuple[int, ...] = (0,)
) -> tuple[list[list[int]], list[list[np.ndarray]], float]:
    """Greedy decode of every agent together: each one's tokens, the logits rows of the
    agents in ``keep`` (in that order), and ms per step."""
    working = WorkingSets()
    tokens = [[int(f.argmax())] for f in firsts]
    rows: list[list[np.ndarray]] = [[firsts[b]] for b in keep]
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
        for r, b in enumerate(keep):
            rows[r].append(np.array(logits[b]))
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


# -- one conversation's paths --------------------------------------------------------------
@dataclass
class Greedy:
    """What a path runs: the engine's temperature-0 forward over the loaded model."""

    spec: Any
    forward: Any
    fingerprint: str

    @classmethod
    def of(cls, loaded: Any) -> Greedy:
        return cls(loaded.spec, loaded.greedy_forward, loaded.fingerprint)


def kernel_probe(g: Greedy) -> str:
    """sha256 of the next-token logits of a fixed 40-token prompt: the same in every
    process of a run, or the kernels changed under it (results can only be pooled while
    it is the same)."""
    cache = AgentCache.empty(g.spec)
    return hashlib.sha256(prefill(g, cache, [(7 * i + 3) % 97 + 2 for i in range(40)], 256).tobytes()).hexdigest()


def lengths(count: int, lo: int, hi: int) -> list[int]:
    """Conversation lengths spread evenly over ``lo..hi``, in van der Corput order (the
    shortest, the middle, a quarter, three quarters...): any prefix of a run covers the
    whole range."""
    even = np.linspace(lo, hi, count).round().astype(int).tolist() if count > 1 else [lo]

    def vdc(k: int) -> float:
        out, base = 0.0, 0.5
        while k:
            out, k, base = out + base * (k & 1), k >> 1, base / 2
        return out

    order = sorted(range(count), key=vdc)
    out = [0] * count
    for rank, k in enumerate(order):
        out[k] = even[rank]
    return out


DOCUMENTS = 40  # reference-manual topics of 300+ tokens (the embedded tokenizer's manual has 44)


def prompt_ids(tokenizer: Any, index: int, tokens: int, lo: int, hi: int) -> list[int]:
    """Conversation ``index``'s prompt: reference-manual topics from the ``index``-th on
    (of ``DOCUMENTS``), joined until it has ``tokens`` tokens. Past the last topic, a
    conversation starts halfway through its first topic, so that no two share a start."""
    docs = list(documents(tokenizer, DOCUMENTS, hi, lo).values())
    first = docs[index % len(docs)]
    if index >= len(docs):
        lines = first.splitlines()
        first = "\n".join(lines[len(lines) // 2 :])
    text, k = first, index + 1
    ids = tokenizer.encode_prompt(text)
    while len(ids) < tokens:
        text, k = f"{text}\n\n{docs[k % len(docs)]}", k + 1
        ids = tokenizer.encode_prompt(text)
    return ids[:tokens]


def mate_lengths(n: int, k: int) -> list[int]:
    """``k`` lengths other than ``n`` and each other, spread below it."""
    return sorted({max(2, round(n * (j + 1) / (k + 1)) - 3 * j) for j in range(k)})


def batch(
    g: Greedy,
    paths: dict[str, AgentCache],
    firsts: dict[str, np.ndarray],
    conversation: list[int],
    others: int,
    reference: tuple[list[int], list[np.ndarray]],
    generate: int,
) -> tuple[list[dict], dict]:
    """Decode ``paths`` together with ``others`` other agents (forks of the first path's
    state cut back to other lengths); each path compared with the reference, and any
    that diverges decoded again alone (``alone``)."""
    names = list(paths)
    source = paths[names[0]]
    mates = []
    for length in mate_lengths(len(conversation), others - len(names) + 1):
        mate = source.fork()
        mates.append((mate, prefill(g, mate, conversation[:length], 256)))
    spare = {name: paths[name].fork() for name in names}  # to decode alone if it diverges
    caches = [*paths.values(), *(m for m, _ in mates)]
    tokens, rows, ms = decode(
        g, caches, [*firsts.values(), *(f for _, f in mates)], generate, keep=tuple(range(len(names)))
    )
    out = []
    for i, name in enumerate(names):
        row = {**compare(name, reference, (tokens[i], rows[i])), "batched_with": len(caches) - 1}
        if not row["identical"]:
            alone_tokens, alone_rows, _ = decode(g, [spare[name]], [firsts[name]], generate)
            row["alone"] = compare(name, reference, (alone_tokens[0], alone_rows[0]))
        out.append(row)
    info = {
        "path": f"batched with {len(caches) - 1}",
        "rows": names,
        "lengths": [len(c.tokens) - (generate - 1) for c in caches],
        "decode_ms_per_step": round(ms, 1),
    }
    return out, info


def hot_stage(g: Greedy, ids: list[int], work: Path, generate: int) -> dict:
    """The hot path's three turns (which make the conversation), turn 2's record, fork and
    budget eviction, the reference; hot, fork and evicted decoded in a batch of 4."""
    spec = g.spec
    a, b = (int(len(ids) * c) for c in CUTS)
    hot = AgentCache.empty(spec)
    first = prefill(g, hot, ids[:a], 256)
    r1 = decode(g, [hot], [first], REPLY)[0][0]
    turn2 = ids[:a] + r1 + ids[a:b]
    first = prefill(g, hot, turn2, 256)
    r2 = decode(g, [hot], [first], REPLY)[0][0]
    conversation = turn2 + r2 + ids[b:]
    # Turn 2's state as the agent leaves it: on disk for "warm" (read in another process)
    store = Shelf(work / "store", g.fingerprint, spec, hot.scheme)
    try:
        if not store.save_behind(WARM_AGENT, hot).result():
            raise RuntimeError("could not save turn 2's record")
    finally:
        store.close()
    forked, evicted = hot.fork(), evict_and_reload(g, hot, work / "evict")
    (work / "conversation.json").write_text(
        json.dumps({"ids": conversation, "turns": [a, len(turn2) + REPLY], "writer_pid": os.getpid()})
    )

    t0 = time.perf_counter()
    ref = AgentCache.empty(spec)
    ref_first = prefill(g, ref, conversation, 256)
    prefill_s = time.perf_counter() - t0
    tokens, rows, ms = decode(g, [ref], [ref_first], generate)
    reference = (tokens[0], rows[0])
    np.save(work / "reference.npy", np.stack(rows[0]))
    (work / "reference.json").write_text(json.dumps(tokens[0]))

    paths = {"hot (3 turns)": hot, "fork": forked, "evicted and reloaded": evicted}
    firsts = {name: prefill(g, cache, conversation, 256) for name, cache in paths.items()}
    rows_out, info = batch(g, paths, firsts, conversation, 3, reference, generate)
    return {
        "tokens": len(conversation),
        "turns": [a, len(turn2) + REPLY],
        "reference": {
            "first_logits_sha256": hashlib.sha256(ref_first.tobytes()).hexdigest(),
            "prefill_s": round(prefill_s, 3),
            "decode_ms_per_token": round(ms, 1),
            "tokens": tokens[0],
        },
        "paths": rows_out,
        "batches": [info],
    }


def evict_and_reload(g: Greedy, state: AgentCache, where: Path) -> AgentCache:
    """``state`` as an agent the shelf spilled under its byte budget and restored: given
    back, then another agent's return overflows the budget (room for one of the two), the
    shelf saves and drops the older one, and the engine's restore reads its record back."""
    shelf = Shelf(where, g.fingerprint, g.spec, state.scheme, budget=state.nbytes + state.nbytes // 2)
    try:
        agent, other = AgentId("evicted"), AgentId("next")
        for aid in (agent, other):
            shelf.lend(aid)
            shelf.give_back(aid, state.fork())
        if agent in shelf.pool or other not in shelf.pool:
            raise RuntimeError("the budget did not evict the older agent")
        if shelf.lend(agent) is not None:
            raise RuntimeError("an evicted agent is still resident")
        cache, source = shelf.restored(agent, shelf.restore(agent).result())
        if source != "warm":
            raise RuntimeError(f"the evicted agent came back {source}, not from its record")
        return cache
    finally:
        shelf.close()


def load_reference(work: Path) -> tuple[list[int], tuple[list[int], list[np.ndarray]], dict]:
    meta = json.loads((work / "conversation.json").read_text())
    rows = np.load(work / "reference.npy")
    return meta["ids"], (json.loads((work / "reference.json").read_text()), list(rows)), meta


def cold_stage(g: Greedy, work: Path, generate: int) -> dict:
    """Cold in 64-token chunks, decoded with one other agent."""
    conversation, reference, _ = load_reference(work)
    cold = AgentCache.empty(g.spec)
    first = prefill(g, cold, conversation, 64)
    rows, info = batch(g, {"cold 64": cold}, {"cold 64": first}, conversation, 1, reference, generate)
    return {"paths": rows, "batches": [info]}


def warm_stage(g: Greedy, work: Path, generate: int) -> dict:
    """In a new process: turn 2's record read back and extended; cold in 128-token chunks
    and in one call; the three decoded with five other agents."""
    conversation, reference, meta = load_reference(work)
    if meta["writer_pid"] == os.getpid():
        raise RuntimeError("the warm path must read the record in another process than the one that wrote it")
    store = Shelf(work / "store", g.fingerprint, g.spec, AgentCache.empty(g.spec).scheme)
    try:
        warm = store.load(WARM_AGENT)
    finally:
        store.close()
    if warm is None:
        raise RuntimeError("turn 2's record is missing or unusable")
    paths = {
        "warm (new process)": warm,
        "cold 128": AgentCache.empty(g.spec),
        "cold, one call": AgentCache.empty(g.spec),
    }
    chunks = {"warm (new process)": 256, "cold 128": 128, "cold, one call": len(conversation)}
    firsts = {name: prefill(g, cache, conversation, chunks[name]) for name, cache in paths.items()}
    rows, info = batch(g, paths, firsts, conversation, 7, reference, generate)
    return {"paths": rows, "batches": [info]}


STAGE_RUNNERS = {"cold": cold_stage, "warm": warm_stage}


def run_stage(g: Greedy, stage: str, work: Path, generate: int, ids: list[int] | None = None) -> dict:
    """One stage of one conversation (``STAGES``); "hot" needs the prompt, the others read
    what "hot" left in ``work``."""
    if stage == "hot":
        assert ids is not None
        return hot_stage(g, ids, work, generate)
    return STAGE_RUNNERS[stage](g, work, generate)


# -- the cost of each kernel choice --------------------------------------------------------
CURRENT = "current code (default kernels, MLX attention)"
ROWS_ONLY = "every row its own sgemv, MLX attention"
ATTENTION_ONLY = "invariant attention, default projections"
INVARIANT = "shape-invariant (rows through sgemv + invariant attention)"
# The kernel choices a conversation can run with: (every projection's rows invariant, invariant
# attention). "blis" keeps its name from run directories written when those rows went through
# BLIS's product; since 2026-12-02 each row is its own sgemv (kvshelf.model.sgemv.each_row).
KERNELS = {"default": (False, False), "blis": (True, False), "attention": (False, True), "invariant": (True, True)}


def with_kernels(loaded: Any, all_rows: bool, attention: bool = False) -> Any:
    """``loaded`` whose forward sends every projection's rows through their own sgemv (or not) and
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


# -- the section of ``kvshelf bench`` ------------------------------------------------------
def run(ctx: Any) -> dict:
    """The aggregate of a finished run directory (``invariance_results``), else a small run
    of ``invariance_conversations`` measured now (its warm stage in a new process), with the
    cost of each kernel choice against the current code."""
    from kvbench import invariance_runs as runs

    s = ctx.settings
    if getattr(s, "invariance_results", ""):
        return section(runs.aggregate(Path(s.invariance_results)))
    loaded = ctx.get_engine().loaded
    run_dir = ctx.work_dir / "invariance"
    options = runs.Options(
        s.invariance_conversations, s.invariance_min_tokens, s.invariance_max_tokens, s.invariance_generate
    )
    for i in range(s.invariance_conversations):
        runs.run_stages(loaded, run_dir, i, ("hot", "cold"), options, model=ctx.model)
        runs.run_in_new_process(run_dir, i, ("warm",), options, model=ctx.model)
    result = section(runs.aggregate(run_dir))
    prompt = prompt_ids(
        loaded.tokenizer,
        0,
        s.invariance_max_tokens,
        s.invariance_min_tokens,
        s.invariance_max_tokens,
    )
    result["summary"]["cost"] = cost(cost_variants(loaded), prompt, s.invariance_generate)
    c = result["summary"]["cost"]
    costs = "; ".join(
        f"{k}: prefill {v['prefill_cost_pct']:+.1f}%, decode tokens/s {v['decode_tokens_per_s_cost_pct']:+.1f}%"
        for k, v in c.items()
        if isinstance(v, dict) and "prefill_cost_pct" in v
    )
    result["description"] += f" Cost against the current code ({c['tokens']} tokens): {costs}."
    return result


def cost_variants(loaded: Any) -> dict[str, Any]:
    """The current code, the invariant attention alone, and (where the invariant rows passed
    their check) those rows alone and both: what ``cost`` times."""
    variants = {CURRENT: loaded, ATTENTION_ONLY: with_kernels(loaded, False, True)}
    both = with_kernels(loaded, True, True)
    if getattr(both.forward, "_all_rows", False):
        variants[ROWS_ONLY] = with_kernels(loaded, True, False)
        variants[INVARIANT] = both
    return variants


def section(agg: dict) -> dict:
    """The bench report's section from an aggregate (``invariance_runs.aggregate``)."""
    table = [
        {
            "path": name,
            "conversations": p["conversations"],
            "identical_share": round(p["identical"] / max(1, p["conversations"]), 3),
            "max_abs_dlogit": p["max_abs_dlogit"],
            "divergences": p["divergences"],
        }
        for name, p in agg["per_path"].items()
    ]
    t = agg["tokens"]
    description = (
        f"{agg['conversations']} conversations of {t['min']}-{t['max']} tokens (median {t['median']}) through every "
        f"path, {agg['generate']} greedy tokens each with `greedy_forward`, against a cold prefill in 256-token "
        f"chunks decoded alone. Identical on every path: {agg['identical']} of {agg['conversations']} "
        f"({agg['identical_share']:.0%}); largest |dlogit| {agg['largest_abs_dlogit']}; "
        f"{len(agg['divergences'])} divergences."
    )
    machines = agg.get("machines") or {}
    if machines:
        description += (
            " Each conversation ran all its paths with one set of kernels (kernel probe): "
            + "; ".join(
                f"{probe[:8]} on {', '.join(m['cpus'])}, {len(m['conversations'])} conversations"
                for probe, m in machines.items()
            )
            + "."
        )
    return {"title": TITLE, "description": description, "summary": agg, "table": table}


def chart(result: dict, path: Path) -> Path | None:
    rows = result.get("table") or []
    if not rows:
        return None
    return bars(
        path,
        "Invariance: share of conversations with identical greedy tokens, per path",
        "share",
        [r["path"] for r in rows],
        {"identical share": [r["identical_share"] for r in rows]},
    )


def headline(result: dict) -> str | None:
    summary = result.get("summary")
    if not summary:
        return None
    return (
        f"Invariance: of {summary['conversations']} conversations, {summary['identical_share']:.0%} give identical "
        f"greedy tokens on every path; largest |dlogit| {summary['largest_abs_dlogit']}."
    )
