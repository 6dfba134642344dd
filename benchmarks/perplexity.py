"""Perplexity of the embedded model with each KV scheme, against mlx-lm's own fp cache.

For each text: BOS + N tokens (4096; ``--quick``: 1024) go through the model in
256-token chunks, as the engine prefills, with every layer's cache coded by the
scheme under test. The chunk's own tokens are already seen through the scheme (they
are written to the cache before attention reads it). Each chunk's logits give the
log-likelihood of every next token. The reference is ``make_prompt_cache`` (fp32 K/V:
the model runs in fp32, so this is at least as good as fp16 KV).

Also measured, per scheme: bytes per cached token (the per-token storage formula for
every layer, sliding ones included, averaged over layers; plus the same after N
tokens with fp16 extras such as a KIVI tail or sinks amortized), prefill tokens/s
(model body only: the vocabulary projection for perplexity is timed apart) and decode
ms/token at the end of the text (a full step, vocabulary projection included).

    python benchmarks/perplexity.py [--quick] [--schemes NAME ...] [--texts gpl3 pydoc]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import RESULTS, TEXTS, machine, write_json

import mlx.core as mx
from kvshelf.kvschemes import SCHEMES, KVScheme
from kvshelf.model import load
from kvshelf.spec import BLOCK_TOKENS
from mlx_lm.models.cache import make_prompt_cache

REFERENCE = "fp32 (mlx-lm)"
# Most informative first: a run writes its results after every scheme.
DEFAULT_SCHEMES = [
    "q4-g64-per-token-v1", "q4-g64-rot", "q4-g64-kivi-rotv", "q4-g64-kivi-rotv-sink4", "q4-g64-kivi",
    "q4-g64-rot-sink4", "q4-g32-rot", "q4-g32", "q4-g64-sink4", "q8-g64",
]


def cache_arrays(cache: list) -> list[mx.array]:
    out = []
    for c in cache:
        for name in ("keys", "values", "k_tail", "sink_k", "sink_v"):
            x = getattr(c, name, None)
            out.extend(x if isinstance(x, tuple) else [x] if isinstance(x, mx.array) else [])
    return out


def run_text(m, ids: list[int], scheme: KVScheme | None, decode_steps: int) -> dict:
    """Negative log-likelihood of ``ids[1:]`` given the prefix, plus prefill/decode timing."""
    model = m.model
    cache = make_prompt_cache(model) if scheme is None else [scheme.make(layer) for layer in m.spec.layers]
    nll, body_s = mx.array(0.0), 0.0
    inputs = ids[:-1]
    for i in range(0, len(inputs), BLOCK_TOKENS):
        x = mx.array(inputs[i : i + BLOCK_TOKENS])[None]
        targets = mx.array(ids[i + 1 : i + 1 + BLOCK_TOKENS])
        t = time.perf_counter()
        h = model.model(x, cache)
        mx.eval(h, cache_arrays(cache))
        body_s += time.perf_counter() - t
        logits = model.model.embed_tokens.as_linear(h)[0]
        token_logit = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        nll = nll + (mx.logsumexp(logits, axis=-1) - token_logit).sum()
        mx.eval(nll)
    n = len(inputs)
    step_s = []
    token = mx.array([[ids[-1]]])
    for _ in range(decode_steps):
        t = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)[None]
        mx.eval(token, cache_arrays(cache))
        step_s.append(time.perf_counter() - t)
    return {
        "tokens": n,
        "nll": nll.item(),
        "ppl": float(mx.exp(nll / n).item()),
        "prefill_tok_s": n / body_s,
        "decode_ms": 1000 * statistics.median(step_s[1:] or step_s),
        "nbytes": sum(getattr(c, "nbytes", 0) for c in cache),
    }


def bytes_per_token(m, scheme: KVScheme | None, tokens: int | None) -> float:
    layers = m.spec.layers
    if scheme is None:
        return sum(layer.bytes_per_token(None) for layer in layers) / len(layers)
    return sum(scheme.bytes_per_token(layer, tokens) for layer in layers) / len(layers)


def markdown(rows: list[dict], texts: list[str]) -> str:
    head = ["KV scheme", "B/token/layer", "x fp16", f"x fp16 @N"]
    for t in texts:
        head += [f"ppl {t}", f"Δ {t}"]
    head += ["prefill tok/s", "decode ms/tok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["scheme"], f"{r['bytes_per_token']:.1f}", f"{r['x_fp16']:.3f}", f"{r['x_fp16_at_n']:.3f}"]
        for t in texts:
            cells += [f"{r[t]['ppl']:.3f}", f"{r[t]['delta_pct']:+.2f}%"]
        cells += [f"{r['prefill_tok_s']:.0f}", f"{r['decode_ms']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1024 tokens per text (smoke test)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    ap.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES, choices=list(SCHEMES))
    ap.add_argument("--decode-steps", type=int, default=6)
    args = ap.parse_args()
    n = 1024 if args.quick else args.tokens

    m = load("embedded", progress=False)
    fp16_per_token = bytes_per_token(m, None, None)
    ids = {}
    for t in args.texts:
        tok = m.tokenizer.encode(TEXTS[t]())
        if len(tok) < n:
            raise SystemExit(f"text {t} has only {len(tok)} tokens, need {n}")
        ids[t] = [m.tokenizer.bos_id] + tok[:n]

    rows: list[dict] = []
    path = None
    for name in [REFERENCE, *args.schemes]:
        scheme = None if name == REFERENCE else SCHEMES[name]
        row = {"scheme": name, "bytes_per_token": bytes_per_token(m, scheme, None)}
        row["x_fp16"] = row["bytes_per_token"] / fp16_per_token
        row["x_fp16_at_n"] = bytes_per_token(m, scheme, n + 1) / fp16_per_token
        for t in args.texts:
            row[t] = run_text(m, ids[t], scheme, args.decode_steps)
            ref = rows[0][t]["ppl"] if rows else row[t]["ppl"]
            row[t]["delta_pct"] = 100 * (row[t]["ppl"] / ref - 1)
        row["prefill_tok_s"] = statistics.mean(row[t]["prefill_tok_s"] for t in args.texts)
        row["decode_ms"] = statistics.mean(row[t]["decode_ms"] for t in args.texts)
        rows.append(row)
        print(markdown([row], args.texts).splitlines()[-1], flush=True)
        table = markdown(rows, args.texts)
        data = {"tokens": n, "texts": args.texts, "reference": REFERENCE, "rows": rows}
        if path is None:
            path = write_json("perplexity", data)
        else:  # the same file, rewritten with every new row
            path.write_text(json.dumps({"machine": machine(), **data}, indent=2))
        path.with_suffix(".md").write_text(f"Perplexity over BOS + {n} tokens, every layer coded.\n\n{table}\n")

    print(f"\n{table}\n\nwrote {path} and {path.with_suffix('.md').relative_to(RESULTS.parent)}")


if __name__ == "__main__":
    main()
