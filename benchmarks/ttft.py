"""Cold, warm (from disk) and hot (in RAM) time to first token: the TTFT section of
``kvshelf bench`` on its own (see ``kvbench.ttft`` for the method).

    python benchmarks/ttft.py [--sizes 1024 2048 4096 8192 16384] [--runs 2] [--model embedded]

Writes benchmarks/results/ttft-<time>/ (REPORT.md, results.json, ttft.png).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvbench.runner import run
from kvbench.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--runs", type=int, default=2, help="cold runs per size (fresh agents)")
    parser.add_argument("--repeats", type=int, default=3, help="warm and hot samples per agent")
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    settings = Settings(
        sections=("ttft",),
        ttft_sizes=tuple(args.sizes),
        ttft_cold_runs=args.runs,
        ttft_cold_runs_large=args.runs,
        ttft_repeats=args.repeats,
    )
    out = Path(__file__).parent / "results" / f"ttft-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


if __name__ == "__main__":
    main()
