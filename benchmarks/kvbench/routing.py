"""Routing: expert agents, each primed with its own document, answer a stream of questions.

Each of ``routing_experts`` agents holds one reference-manual topic (``routing_doc_tokens``
tokens at most) as its system prompt. A question asks to quote, word for word, a passage
whose first 8 words it gives (a cue found in one document only), and the reply is opened
with those 8 words, so what the model adds is its continuation of the passage. A
lexical router picks the expert (idf-weighted word overlap between the question and
each document), then:

- priming: the first question to each expert is cold (its document is prefilled);
- the stream: ``routing_questions`` more, with locality (half repeat one of the last two experts),
  to a second engine whose RAM budget holds ``routing_resident_experts`` experts, so
  some are hot (in RAM) and others warm (restored from disk; every record is dropped
  from the OS page cache before each question);
- control: each stream question is also put to a wrong expert, whose document does
  not hold the passage.

An answer "comes from the right document" when its word trigrams (those not already in
the question) are found more often in the routed expert's document than in any other.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from pathlib import Path

from kvbench.charts import bars
from kvbench.common import documents, drop_from_page_cache, median_range
from kvbench.context import BenchContext

TITLE = "Routing: expert agents answering a stream of questions"
CUE_WORDS, CHECK_WORDS = 8, 6
SYSTEM = "Document:\n"


def words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9_]+", text.lower())]


def trigrams(ws: list[str]) -> set[tuple[str, ...]]:
    return {tuple(ws[i : i + 3]) for i in range(len(ws) - 2)}


def make_questions(docs: dict[str, str], count: int, rng: random.Random) -> list[dict]:
    """One cue per question, unique to its document; the first ``len(docs)`` prime each expert."""
    names = list(docs)
    normalized = {n: " ".join(words(d)) for n, d in docs.items()}
    raw_words = {n: docs[n].split() for n in names}
    order = list(range(len(names)))
    while len(order) < count:
        recent = order[-2:]
        order.append(rng.choice(recent) if rng.random() < 0.5 else rng.randrange(len(names)))
    questions = []
    for k, e in enumerate(order[:count]):
        ws = raw_words[names[e]]
        for _ in range(200):
            i = rng.randrange(0, max(1, len(ws) - CUE_WORDS - CHECK_WORDS))
            cue = " ".join(ws[i : i + CUE_WORDS])
            key = " ".join(words(cue))
            if len(words(cue)) >= 5 and sum(key in t for t in normalized.values()) == 1:
                break
        questions.append(
            {
                "expert": e,
                "cue": cue,
                "expected": words(" ".join(ws[i + CUE_WORDS : i + CUE_WORDS + CHECK_WORDS])),
                "text": f'Quote, word for word, the passage of the document that begins "{cue}".',
            }
        )
    return questions


class Router:
    """idf-weighted word overlap between a question and each document."""

    def __init__(self, docs: list[str]):
        self.vocab = [set(words(d)) for d in docs]
        df = Counter(w for v in self.vocab for w in v)
        self.idf = {w: math.log(len(docs) / c) for w, c in df.items()}

    def route(self, question: str) -> int:
        qs = set(words(question))
        scores = [sum(self.idf.get(w, 0.0) for w in qs & v) for v in self.vocab]
        return max(range(len(scores)), key=scores.__getitem__)


def judge(answer: str, question: str, docs: list[str], right: int, expected: list[str]) -> dict:
    grams = trigrams(words(answer)) - trigrams(words(question))
    hits = [len(grams & trigrams(words(d))) for d in docs]
    best = max(hits) if hits else 0
    from_right = best > 0 and hits[right] == best and hits.count(best) == 1
    got = words(answer)[:3]
    return {"from_right_doc": from_right, "continues_exactly": got == expected[:3], "doc_hits": hits}


def ttft_row(label: str, results: list[dict]) -> dict:
    if not results:
        return {"requests": label, "count": 0}
    t = median_range([r["ttft_s"] for r in results])
    return {
        "requests": label,
        "count": len(results),
        "ttft_s": t["median"],
        "ttft_min_max": f"{t['min']:.3f}–{t['max']:.3f}",
        "from_right_doc_pct": 100 * sum(r["from_right_doc"] for r in results) / len(results),
        "continues_exactly_pct": 100 * sum(r["continues_exactly"] for r in results) / len(results),
    }


def run(ctx: BenchContext) -> dict:
    from kvshelf.runtime.engine import Engine

    s = ctx.settings
    first = ctx.get_engine()
    rng = random.Random(s.seed)
    docs_by_name = documents(first.loaded.tokenizer, s.routing_experts, s.routing_doc_tokens)
    names, docs = list(docs_by_name), list(docs_by_name.values())
    questions = make_questions(docs_by_name, len(docs) + s.routing_questions, rng)
    router = Router(docs)
    ids = [f"expert-{i}" for i in range(len(docs))]

    def ask(engine, e: int, q: dict) -> dict:
        # the reply is opened with the cue (an open assistant turn), so the model's own words
        # are the passage's continuation, if it finds it in the document it holds
        msgs = [
            {"role": "system", "content": SYSTEM + docs[e]},
            {"role": "user", "content": q["text"]},
            {"role": "assistant", "content": q["cue"], "prefix": True},
        ]
        r = engine.chat(ids[e], msgs, max_tokens=s.routing_max_tokens)
        return {
            "expert": e,
            "right": q["expert"],
            "cache": r.cache,
            "ttft_s": r.ttft_s,
            "answer": r.text,
            "prompt_tokens": r.usage.prompt_tokens,
            **judge(r.text, q["text"], docs, q["expert"], q["expected"]),
        }

    routed = [router.route(q["cue"]) for q in questions]
    results = [ask(first, routed[k], q) for k, q in enumerate(questions[: len(docs)])]  # priming: cold
    first.flush()
    sizes = [a.ram_bytes for a in first.agents() if a.agent_id in ids]
    for aid in ids:
        first.evict(aid)
    budget = int(s.routing_resident_experts * sum(sizes) / max(1, len(sizes)))
    control = []
    with Engine(model=first.loaded, cache_dir=ctx.cache_dir, budget=budget, progress=False) as engine:
        for k, q in enumerate(questions[len(docs) :], start=len(docs)):
            for aid in ids:
                drop_from_page_cache(engine._shelf.store.path_for(aid))
            results.append(ask(engine, routed[k], q))
            wrong = (q["expert"] + 1 + k % (len(docs) - 1)) % len(docs)
            control.append(ask(engine, wrong, q))
    by_kind = {kind: [r for r in results if r["cache"] == kind] for kind in ("cold", "warm", "hot")}
    rows = [
        ttft_row("cold (priming)", by_kind["cold"]),
        ttft_row("warm (from disk)", by_kind["warm"]),
        ttft_row("hot (in RAM)", by_kind["hot"]),
        ttft_row("all routed", results),
        ttft_row("control: wrong expert", control),
    ]
    router_acc = sum(r == q["expert"] for r, q in zip(routed, questions)) / len(questions)
    print(
        f"  routing: router accuracy {router_acc:.0%}, "
        + ", ".join(f"{r['requests']} {r.get('from_right_doc_pct', 0):.0f}%" for r in rows),
        flush=True,
    )
    return {
        "title": TITLE,
        "table": rows,
        "router_accuracy": router_acc,
        "budget_bytes": budget,
        "documents": names,
        "expert_ram_bytes": sizes,
        "answers": results,
        "control_answers": control,
        "description": (
            f"{len(docs)} experts, each primed with one Python reference-manual topic "
            f"({', '.join(names)}; at most {s.routing_doc_tokens} tokens each). {len(questions)} questions, the "
            f"first {len(docs)} priming each expert (cold); "
            f"the other {s.routing_questions} go to an engine whose budget holds "
            f"{s.routing_resident_experts} experts ({budget / 1e6:.1f} MB), with every record dropped from the "
            "page cache before each question. Each question gives 8 words found in one document only and asks "
            "for the passage word for word; the reply is opened with those 8 words (an open assistant turn) and "
            f"{s.routing_max_tokens} tokens are generated. The lexical router sent "
            f"{router_acc:.0%} of questions to the right expert. 'From the right doc': the answer's new word "
            "trigrams match the right document more than any other; 'continues exactly': its first 3 words are "
            "the passage's next 3. Control: the same stream questions put to a wrong expert."
        ),
    }


def chart(result: dict, path: Path) -> Path | None:
    rows = [r for r in result["table"] if r.get("count")]
    if not rows:
        return None
    return bars(
        path,
        "Routing: TTFT by where the expert's cache was",
        "median TTFT (s, log)",
        [r["requests"] for r in rows],
        {"TTFT": [r["ttft_s"] for r in rows]},
        logy=True,
    )


def headline(result: dict) -> str | None:
    rows = {r["requests"]: r for r in result["table"] if r.get("count")}
    if "all routed" not in rows:
        return None
    routed, control = rows["all routed"], rows.get("control: wrong expert", {})
    ttft = ", ".join(
        f"{k.split(' ')[0]} {rows[k]['ttft_s']:.2f} s"
        for k in ("cold (priming)", "warm (from disk)", "hot (in RAM)")
        if k in rows
    )
    return (
        f"Routing: {routed['from_right_doc_pct']:.0f}% of routed answers come from the right document "
        f"(control, wrong expert: {control.get('from_right_doc_pct', 0):.0f}%); median TTFT {ttft}."
    )
