"""Batched decode and hidden disk I/O, on the embedded model.

1. Aggregate decode tokens/s for 1, 2, 4 and 8 agents served concurrently (one batch)
   against the same agents served one by one, in the same run. Each agent's prompt is
   prefilled beforehand, so both sides time the same decode work.
2. An agent restored from disk while 3 others decode: its TTFT against a restore with
   nobody else running, and the 3 agents' time per token with and without the restore
   going on (how much of the disk I/O the step loop hides).

    python benchmarks/concurrency.py [--agents 1 2 4 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import drop_from_page_cache, prompt_of_tokens, write_json

from kvshelf.runtime.engine import ChatResult, Engine


def messages(engine: Engine, i: int) -> list[dict]:
    doc = prompt_of_tokens(engine.loaded.tokenizer, 200, salt=f"Document {i}. ")
    return [{"role": "user", "content": f"{doc}\n\nRetell the text above in your own words, at length."}]


def timed_stream(engine: Engine, aid: str, msgs: list[dict], n: int, stamps: dict, results: dict) -> None:
    stamps[aid] = []
    for item in engine.stream(aid, msgs, max_tokens=n):
        stamps[aid].append(time.perf_counter())
        if isinstance(item, ChatResult):
            results[aid] = item


def run_threads(targets: list) -> None:
    threads = [threading.Thread(target=f, args=a) for f, a in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def throughput(engine: Engine, counts: list[int], tokens: int) -> list[dict]:
    rows = []
    for n in counts:
        agents = {f"tp{n}-{i}": messages(engine, i) for i in range(n)}
        for aid, msgs in agents.items():
            engine.prefill(aid, msgs)
        t = time.perf_counter()
        seq = [engine.chat(aid, msgs, max_tokens=tokens) for aid, msgs in agents.items()]
        seq_s = time.perf_counter() - t
        results: dict = {}
        t = time.perf_counter()
        run_threads(
            [
                (lambda a, m: results.__setitem__(a, engine.chat(a, m, max_tokens=tokens)), (a, m))
                for a, m in agents.items()
            ]
        )
        con_s = time.perf_counter() - t
        seq_tokens = sum(r.usage.completion_tokens for r in seq)
        con_tokens = sum(r.usage.completion_tokens for r in results.values())
        same = all(results[a].token_ids == r.token_ids for a, r in zip(agents, seq))
        row = {
            "agents": n,
            "sequential_tok_s": seq_tokens / seq_s,
            "concurrent_tok_s": con_tokens / con_s,
            "speedup": (con_tokens / con_s) / (seq_tokens / seq_s),
            "tokens": con_tokens,
            "identical_outputs": same,
        }
        print(
            f"{n} agents: one by one {row['sequential_tok_s']:.2f} tok/s, batched {row['concurrent_tok_s']:.2f} "
            f"tok/s ({row['speedup']:.2f}x), identical outputs: {same}",
            flush=True,
        )
        rows.append(row)
        for aid in agents:
            engine.forget(aid)
    return rows


def intervals(stamps: list[float], window: tuple[float, float] | None = None) -> list[float]:
    """The gaps between consecutive stamps; with a (start, end) window, only the gaps that overlap it."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if window is None:
        return gaps
    start, end = window
    return [b - a for a, b in zip(stamps, stamps[1:]) if b >= start and a <= end]


def hidden_io(engine: Engine, tokens: int) -> dict:
    decoders = {f"dec-{i}": messages(engine, 10 + i) for i in range(3)}
    for aid, msgs in decoders.items():
        engine.prefill(aid, msgs)
    late = messages(engine, 20)
    late_msgs = [*late, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on."}]
    engine.chat("late", late, max_tokens=2)
    engine.evict("late")

    def restore_alone() -> ChatResult:
        drop_from_page_cache(engine._shelf.store.path_for("late"))
        r = engine.chat("late", late_msgs, max_tokens=1)
        assert r.cache == "warm"
        engine.evict("late")
        return r

    alone = restore_alone()
    # baseline: 3 agents decoding, nobody restoring
    stamps: dict = {}
    results: dict = {}
    run_threads([(timed_stream, (engine, a, m, tokens, stamps, results)) for a, m in decoders.items()])
    base = [g for a in decoders for g in intervals(stamps[a])]
    for aid, msgs in decoders.items():
        engine.prefill(aid, msgs)
    # the same 3 decoding while "late" is restored from disk and answers
    drop_from_page_cache(engine._shelf.store.path_for("late"))
    stamps, results = {}, {}
    threads = [
        threading.Thread(target=timed_stream, args=(engine, a, m, tokens, stamps, results)) for a, m in decoders.items()
    ]
    for t in threads:
        t.start()
    while min((len(stamps.get(a, [])) for a in decoders), default=0) < 4:
        time.sleep(0.01)
    t_req = time.perf_counter()
    late_result = engine.chat("late", late_msgs, max_tokens=1)
    t_first = t_req + late_result.ttft_s
    for t in threads:
        t.join()
    during = [g for a in decoders for g in intervals(stamps[a], (t_req, t_first))]
    out: dict[str, Any] = {
        "restore_ttft_alone_s": alone.ttft_s,
        "restore_ttft_while_3_decode_s": late_result.ttft_s,
        "decode_step_s_without_restore": statistics.median(base),
        "decode_step_s_during_restore": statistics.median(during) if during else None,
        "record_bytes": engine._shelf.store.size_on_disk("late"),
    }
    print(
        f"restore TTFT alone {out['restore_ttft_alone_s'] * 1000:.0f} ms, while 3 decode "
        f"{out['restore_ttft_while_3_decode_s'] * 1000:.0f} ms; time per token of the 3: "
        f"{out['decode_step_s_without_restore'] * 1000:.0f} ms without, "
        f"{(out['decode_step_s_during_restore'] or 0) * 1000:.0f} ms during the restore",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        engine = Engine(model=args.model, cache_dir=tmp)
        engine.chat(None, [{"role": "user", "content": "warm up"}], max_tokens=2)
        result = {
            "benchmark": "concurrency",
            "model": args.model,
            "kv_scheme": engine.kv_scheme.name,
            "throughput": throughput(engine, args.agents, args.tokens),
            "hidden_io": hidden_io(engine, args.tokens * 2),
        }
        engine.close()
    path = write_json("concurrency", result)
    print("| agents | one by one tok/s | batched tok/s | speedup | identical outputs |")
    print("|---|---|---|---|---|")
    for r in result["throughput"]:
        print(
            f"| {r['agents']} | {r['sequential_tok_s']:.2f} | {r['concurrent_tok_s']:.2f} | "
            f"{r['speedup']:.2f}x | {r['identical_outputs']} |"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
