"""Structured output on its own: the structured section of ``kvshelf bench`` (see
``kvbench.structured`` for the method).

    python benchmarks/structured.py [--schemas 20] [--model embedded]

``--schemas N`` is the size flag: N tool schemas and N JSON schemas, their sizes spread
over 1..20 fields (20: every size, the full run, about 25 minutes on 2 cores; 4: sizes
1, 7, 14, 20, about 6 minutes). For each, the share
of replies that parse and validate, constrained vs unconstrained, and ms/token with and
without the mask, side by side in one run; plus the mask's own cost per token (computed
beside the step, applied on it) against the step. Writes
benchmarks/results/structured-<time>/ (REPORT.md, results.json, structured.png).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from kvbench.runner import run
from kvbench.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=20, help="tool and JSON schemas each, sizes spread over 1..20")
    parser.add_argument("--max-tokens", type=int, default=64, help="per reply, plus --tokens-per-field per field")
    parser.add_argument("--tokens-per-field", type=int, default=32)
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    settings = Settings(
        sections=("structured",),
        structured_schemas=args.schemas,
        structured_max_tokens=args.max_tokens,
        structured_tokens_per_field=args.tokens_per_field,
    )
    out = Path(__file__).parent / "results" / f"structured-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


if __name__ == "__main__":
    main()
