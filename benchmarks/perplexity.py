"""Perplexity of the model with each KV scheme against mlx-lm's own full-precision cache:
the quality section of ``kvshelf bench`` on its own (see ``kvbench.quality``).

    python benchmarks/perplexity.py [--quick] [--tokens 4096] [--schemes NAME ...] [--texts gpl3 pydoc]

Writes benchmarks/results/perplexity-<time>/ (REPORT.md, results.json, quality.png).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvbench.common import TEXTS
from kvbench.runner import run
from kvbench.settings import Settings
from kvshelf.kv.schemes import SCHEMES

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
    args = ap.parse_args()
    settings = Settings(
        sections=("quality",),
        ppl_tokens=1024 if args.quick else args.tokens,
        ppl_schemes=tuple(args.schemes),
        ppl_texts=tuple(args.texts),
    )
    out = Path(__file__).parent / "results" / f"perplexity-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


if __name__ == "__main__":
    main()
