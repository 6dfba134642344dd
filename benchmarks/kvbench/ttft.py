"""Time to first token: cold (prefill), warm (restored from disk) and hot (in RAM).

For each prompt size, ``ttft_cold_runs`` fresh agents (``ttft_cold_runs_large`` above 4K
tokens; distinct prompts) are each:
1. cold: asked with nothing cached, so the whole prompt is prefilled;
2. warm, ``ttft_repeats`` times: evicted from RAM once the record is on disk, the
   record dropped from the OS page cache (so the read really hits the disk), then
   asked a short follow-up: restore + prefill of the ~20 new tokens;
3. hot, ``ttft_repeats`` times: asked another follow-up while still in RAM.

Cold runs are the expensive part (minutes at 16K on a CPU), so warm and hot get more
samples per agent. The last agent of each size is reused by the capacity section.
"""

from __future__ import annotations

from pathlib import Path

from kvbench.charts import lines
from kvbench.common import drop_from_page_cache, follow_up, median_range, prompt_of_tokens
from kvbench.context import BenchContext

TITLE = "Time to first token: cold, warm (from disk), hot (in RAM)"
QUESTIONS = (
    "Summarise the text above in one short sentence.",
    "Name the single most important point in it.",
    "Which section of it matters most?",
    "Give it a title.",
)


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    engine = ctx.get_engine()
    rows = []
    for n in s.ttft_sizes:
        if n >= engine.loaded.context_length:
            rows.append({"tokens": n, "skipped": f"over the model's context ({engine.loaded.context_length})"})
            continue
        cold, warm, hot, record_bytes, tokens_held = [], [], [], [], []
        runs = s.ttft_cold_runs if n <= 4096 else s.ttft_cold_runs_large
        for r in range(runs):
            aid = f"ttft-{n}-{r}"  # the work directory is new for every bench run: no stale agent
            msgs = [{"role": "user", "content": prompt_of_tokens(engine.loaded.tokenizer, n, salt=f"Run {r}. ")}]
            res = engine.chat(aid, msgs, max_tokens=4)
            assert res.cache == "cold", res.cache
            cold.append(res.ttft_s)
            for i in range(s.ttft_repeats):
                msgs = follow_up(msgs, res.text, QUESTIONS[i % len(QUESTIONS)])
                engine.flush()
                engine.evict(aid)
                drop_from_page_cache(engine._shelf.store.path_for(aid))
                res = engine.chat(aid, msgs, max_tokens=4)
                if res.cache != "warm":
                    raise RuntimeError(f"expected a restore from disk, got {res.cache}")
                warm.append(res.ttft_s)
            for i in range(s.ttft_repeats):
                msgs = follow_up(msgs, res.text, QUESTIONS[(i + 1) % len(QUESTIONS)])
                res = engine.chat(aid, msgs, max_tokens=4)
                if res.cache != "hot":
                    raise RuntimeError(f"expected a hot cache, got {res.cache}")
                hot.append(res.ttft_s)
            engine.flush()
            record_bytes.append(engine._shelf.store.size_on_disk(aid))
            tokens_held.append(res.usage.prompt_tokens + res.usage.completion_tokens)
            ctx.records[n] = aid
            print(
                f"  ttft {n:6d} run {r}: cold {cold[-1]:.2f} s, warm {warm[-1]:.3f} s, hot {hot[-1]:.3f} s", flush=True
            )
        c, w, h = median_range(cold), median_range(warm), median_range(hot)
        rows.append(
            {
                "tokens": n,
                "cold_s": c["median"],
                "cold_min_max": f"{c['min']:.2f}–{c['max']:.2f}",
                "warm_s": w["median"],
                "warm_min_max": f"{w['min']:.3f}–{w['max']:.3f}",
                "hot_s": h["median"],
                "hot_min_max": f"{h['min']:.3f}–{h['max']:.3f}",
                "cold_over_warm": c["median"] / w["median"],
                "q4_record_mb": record_bytes[-1] / 1e6,
                "cold_runs": len(cold),
                "warm_hot_samples": len(warm),
                "raw": {"cold": c, "warm": w, "hot": h, "tokens_held": tokens_held},
            }
        )
    return {
        "title": TITLE,
        "kv_scheme": engine.kv_scheme.name,
        "model": engine.loaded.name,
        "table": rows,
        "description": (
            f"Model {engine.loaded.name}, KV scheme {engine.kv_scheme.name}. Cold: the whole prompt is prefilled. "
            "Warm: the agent is evicted from RAM and its record dropped from the OS page cache, then a "
            "~20-token follow-up is asked (restore from disk + prefill of the new tokens). Hot: another "
            "follow-up while the agent is in RAM. Medians with min–max over the runs shown; every request "
            "generates 4 tokens."
        ),
    }


def chart(result: dict, path: Path) -> Path | None:
    rows = [r for r in result["table"] if "cold_s" in r]
    if not rows:
        return None
    xs = [r["tokens"] for r in rows]
    series = {}
    for key, label in (("cold", "cold (prefill)"), ("warm", "warm (from disk)"), ("hot", "hot (in RAM)")):
        raw = [r["raw"][key] for r in rows]
        series[label] = ([x["median"] for x in raw], [x["min"] for x in raw], [x["max"] for x in raw])
    return lines(path, "Time to first token", "prompt tokens", "seconds (log)", xs, series, logx=True, logy=True)


def headline(result: dict) -> str | None:
    rows = [r for r in result["table"] if "cold_s" in r]
    if not rows:
        return None
    r = rows[-1]
    return (
        f"TTFT at {r['tokens']} tokens: cold {r['cold_s']:.1f} s, warm (from disk) {r['warm_s']:.2f} s, "
        f"hot {r['hot_s']:.2f} s (cold / warm = {r['cold_over_warm']:.0f}x)."
    )
