"""Structured output on its own: the structured section of ``kvshelf bench`` (see
``kvbench.structured`` for the method).

    python benchmarks/structured.py [--schemas 20] [--model embedded]

``--schemas N`` is the size flag: N tool schemas and N JSON schemas, their sizes spread
over 1..20 fields (20: every size, the full run, most of an hour on 2 cores; 4: sizes
1, 7, 14, 20, about 11 minutes at 150 ms/token, so a session splits it: ``--kinds tool``
then ``--kinds json``, or ``--fields 14,20`` for the sizes still to run). Unconstrained
replies take most of the time: they rarely close and run to their token budget. For each, the share
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
    parser.add_argument("--kinds", default="tool,json", help="tool, json or both (a run split in two)")
    parser.add_argument("--modes", default="free,constrained", help="free, constrained or both (a run split in two)")
    parser.add_argument("--fields", default="", help="schema sizes to run, e.g. 14,20 (overrides --schemas)")
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    settings = Settings(
        sections=("structured",),
        structured_schemas=args.schemas,
        structured_max_tokens=args.max_tokens,
        structured_tokens_per_field=args.tokens_per_field,
        structured_kinds=tuple(k for k in args.kinds.split(",") if k),
        structured_modes=tuple(m for m in args.modes.split(",") if m),
        structured_fields=tuple(int(k) for k in args.fields.split(",") if k),
    )
    out = Path(__file__).parent / "results" / f"structured-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


if __name__ == "__main__":
    main()
