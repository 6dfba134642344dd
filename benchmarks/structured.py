"""Structured output on its own: the structured section of ``kvshelf bench`` (see
``kvbench.structured`` for the method).

    python benchmarks/structured.py [--schemas 20] [--max-tokens 160] [--model embedded]

For N tool schemas and N JSON schemas of increasing complexity (1..N fields), the share
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
    parser.add_argument("--schemas", type=int, default=20, help="tool schemas and JSON schemas, each (1..N fields)")
    parser.add_argument("--max-tokens", type=int, default=160, help="per reply")
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    settings = Settings(
        sections=("structured",), structured_schemas=args.schemas, structured_max_tokens=args.max_tokens
    )
    out = Path(__file__).parent / "results" / f"structured-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


if __name__ == "__main__":
    main()
