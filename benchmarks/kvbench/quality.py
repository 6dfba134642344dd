"""Perplexity with each KV scheme against mlx-lm's own full-precision cache.

For each text: BOS + N tokens go through the model in 256-token chunks, as the engine
prefills, with every layer's cache coded by the scheme under test; a chunk's own tokens
are already seen through the scheme (they are written to the cache before attention
reads it). The reference is ``make_prompt_cache``: K/V in the model's compute dtype
(fp32 on the CPU, so at least as good as fp16 KV). Also: bytes per cached token
relative to fp16, and decode ms/token at the end of the text.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from kvbench.charts import bars
from kvbench.common import TEXTS
from kvbench.context import BenchContext
from kvshelf.kv.schemes import SCHEMES, KVScheme
from kvshelf.model.spec import BLOCK_TOKENS

TITLE = "Quality: perplexity per KV scheme"
REFERENCE = "full precision (mlx-lm cache)"
DECODE_STEPS = 6


def cache_arrays(cache: list) -> list[mx.array]:
    out: list[mx.array] = []
    for c in cache:
        for name in ("keys", "values", "k_tail", "sink_k", "sink_v"):
            x = getattr(c, name, None)
            out.extend(x if isinstance(x, tuple) else [x] if isinstance(x, mx.array) else [])
    return out


def run_text(loaded, ids: list[int], scheme: KVScheme | None) -> dict:
    """Negative log-likelihood of ``ids[1:]`` given the prefix, plus decode timing."""
    model = loaded.model
    cache = make_prompt_cache(model) if scheme is None else [scheme.make(layer) for layer in loaded.spec.layers]
    nll = mx.array(0.0)
    inputs = ids[:-1]
    for i in range(0, len(inputs), BLOCK_TOKENS):
        x = mx.array(inputs[i : i + BLOCK_TOKENS])[None]
        targets = mx.array(ids[i + 1 : i + 1 + BLOCK_TOKENS])
        logits = model(x, cache=cache)[0].astype(mx.float32)
        token_logit = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        nll = nll + (mx.logsumexp(logits, axis=-1) - token_logit).sum()
        mx.eval(nll, cache_arrays(cache))
    step_s = []
    token = mx.array([[ids[-1]]])
    for _ in range(DECODE_STEPS):
        t = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)[None]
        mx.eval(token, cache_arrays(cache))
        step_s.append(time.perf_counter() - t)
    n = len(inputs)
    return {
        "tokens": n,
        "nll": nll.item(),
        "ppl": float(mx.exp(nll / n)),
        "decode_ms": 1000 * statistics.median(step_s[1:] or step_s),
    }


def bytes_ratio(loaded, scheme: KVScheme | None, tokens: int) -> float:
    """Bytes per cached token (fp16 extras such as a KIVI tail amortized over ``tokens``) / fp16."""
    layers = loaded.spec.layers
    fp16 = sum(layer.bytes_per_token(None) for layer in layers)
    if scheme is None:
        return sum(layer.bytes_per_token(None, scale_bytes=4) for layer in layers) / fp16
    return sum(scheme.bytes_per_token(layer, tokens) for layer in layers) / fp16


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    loaded = ctx.get_engine().loaded
    ids = {}
    for t in s.ppl_texts:
        tok = loaded.tokenizer.encode(TEXTS[t]())
        n = min(s.ppl_tokens, len(tok))
        bos = [loaded.tokenizer.bos_id] if loaded.tokenizer.bos_id is not None else []
        ids[t] = bos + tok[:n]
    params = tree_flatten(loaded.model.parameters())
    assert isinstance(params, list)  # (name, array) pairs: a dict comes back only for a dict destination
    compute_dtype = str(params[0][1].dtype).replace("mlx.core.", "")
    rows: list[dict] = []
    for name in [REFERENCE, *s.ppl_schemes]:
        scheme = None if name == REFERENCE else SCHEMES[name]
        row: dict = {
            "kv_scheme": name if scheme else f"{name}, {compute_dtype}",
            "x_fp16_bytes": bytes_ratio(loaded, scheme, s.ppl_tokens),
        }
        decode = []
        for t in s.ppl_texts:
            r = run_text(loaded, ids[t], scheme)
            ref = rows[0][f"ppl_{t}"] if rows else r["ppl"]
            row[f"ppl_{t}"] = r["ppl"]
            row[f"delta_{t}_pct"] = 100 * (r["ppl"] / ref - 1)
            decode.append(r["decode_ms"])
        row["decode_ms_per_token"] = statistics.mean(decode)
        rows.append(row)
        print(f"  quality {name}: " + ", ".join(f"{t} {row[f'ppl_{t}']:.3f}" for t in s.ppl_texts), flush=True)
    return {
        "title": TITLE,
        "table": rows,
        "description": (
            f"Perplexity over BOS + {s.ppl_tokens} tokens of each text ({', '.join(s.ppl_texts)}), every layer's cache "
            f"coded by the scheme, 256-token chunks as the engine prefills. Reference: mlx-lm's cache in the model's "
            f"compute dtype ({compute_dtype}). x fp16 bytes: bytes per cached token against fp16 K/V, fp16 extras "
            f"amortized over {s.ppl_tokens} tokens. "
            "Decode: one step at the end of the text, vocabulary projection included."
        ),
    }


def chart(result: dict, path: Path) -> Path | None:
    rows = result["table"]
    texts = [k[len("delta_") : -len("_pct")] for k in rows[0] if k.startswith("delta_")] if rows else []
    if not rows:
        return None
    return bars(
        path,
        "Perplexity increase over the full-precision cache",
        "Δ perplexity (%)",
        [r["kv_scheme"].split(",")[0] for r in rows],
        {t: [r[f"delta_{t}_pct"] for r in rows] for t in texts},
    )


def headline(result: dict) -> str | None:
    from kvshelf.kv.schemes import DEFAULT_SCHEME

    rows = [r for r in result["table"] if r["kv_scheme"] == DEFAULT_SCHEME]
    if not rows:
        return None
    r = rows[0]
    deltas = " / ".join(
        f"{v:+.1f}% ({k[len('delta_') : -len('_pct')]})" for k, v in r.items() if k.startswith("delta_")
    )
    return (
        f"Quality: the default scheme {DEFAULT_SCHEME} costs {deltas} perplexity "
        f"at {r['x_fp16_bytes']:.3f}x the bytes of fp16 KV."
    )
