"""Perplexity of the model with each KV scheme against mlx-lm's own full-precision cache:
the quality section of ``kvshelf bench`` on its own (see ``kvbench.quality``).

    python benchmarks/perplexity.py [--quick] [--tokens 4096] [--schemes NAME ...] [--texts gpl3 pydoc]
    python benchmarks/perplexity.py --kernels [--tokens 2048] [--schemes q4-g64-kivi-rotv]

Writes benchmarks/results/perplexity-<time>/ (REPORT.md, results.json, quality.png).
``--kernels``: instead, each scheme with the engine's default kernels and with the
shape-invariant ones (``KVSHELF_SHAPE_INVARIANT``: each row of every projection its own sgemv, the
invariant attention of ``kvshelf.model.attention``) against mlx-lm's fp32 cache, side by
side; writes ``results/perplexity-kernels-<time>.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
from common import write_json

from kvbench.common import TEXTS
from kvbench.quality import run_text
from kvbench.runner import run
from kvbench.settings import Settings
from kvshelf.kv.schemes import SCHEMES
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.loader import load

DEFAULT_SCHEMES = [
    "q4-g64-per-token-v1",
    "q4-g64-rot",
    "q4-g64-kivi-rotv",
    "q4-g64-kivi-rotv-sink4",
    "q4-g64-kivi",
    "q4-g64-rot-sink4",
    "q4-g32-rot",
    "q4-g32",
    "q4-g64-sink4",
    "q8-g64",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1024 tokens per text (smoke test)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    ap.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES, choices=list(SCHEMES))
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--kernels", action="store_true", help="default against shape-invariant kernels")
    args = ap.parse_args()
    if args.kernels:
        kernels(args.model, 1024 if args.quick else args.tokens, args.texts, args.schemes)
        return
    settings = Settings(
        sections=("quality",),
        ppl_tokens=1024 if args.quick else args.tokens,
        ppl_schemes=tuple(args.schemes),
        ppl_texts=tuple(args.texts),
    )
    out = Path(__file__).parent / "results" / f"perplexity-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


def kernels(model: str, tokens: int, texts: list[str], schemes: list[str]) -> None:
    """Perplexity per scheme with the default and the shape-invariant kernels, and mlx-lm's
    fp32 cache (the reference), over BOS + ``tokens`` tokens of each text."""
    print(f"load average at start: {os.getloadavg()}", flush=True)
    loaded = load(model, progress=False)
    invariant = copy.copy(loaded)
    invariant.model = with_fast_linears(loaded.model, all_rows=True, attention=True)  # type: ignore[assignment]
    rows = []
    for text in texts:
        tok = loaded.tokenizer.encode(TEXTS[text]())
        ids = ([loaded.tokenizer.bos_id] if loaded.tokenizer.bos_id is not None else []) + tok[:tokens]
        ref = run_text(loaded, ids, None)["ppl"]
        rows.append({"text": text, "kv": "fp32 (mlx-lm cache)", "kernels": "default", "ppl": ref})
        for name in schemes:
            for kind, which in (("default", loaded), ("shape-invariant", invariant)):
                ppl = run_text(which, ids, SCHEMES[name])["ppl"]
                rows.append({"text": text, "kv": name, "kernels": kind, "ppl": ppl, "delta_pct": 100 * (ppl / ref - 1)})
                print(f"  {text} {name} {kind}: {ppl:.3f} ({100 * (ppl / ref - 1):+.2f}% against fp32 {ref:.3f})")
    load_end = os.getloadavg()
    path = write_json("perplexity-kernels", {"tokens": tokens, "rows": rows, "load_end": load_end})
    print(f"wrote {path}; load average at end: {load_end}")


if __name__ == "__main__":
    main()
