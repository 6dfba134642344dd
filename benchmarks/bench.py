"""``kvshelf bench``: every section of the benchmark, one report with a chart per table.

    python benchmarks/bench.py [--quick|--full] [--model embedded] [--sections ttft,peer] [--set NAME=VALUE]

``kvshelf bench`` runs this script from a source checkout; the benchmark code
(``kvbench``) and its dependencies (matplotlib, the peer servers) stay out of the
installed runtime package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kvshelf  # noqa: F401  (OpenBLAS before mlx)


def main(argv: list[str] | None = None) -> int:
    bench = argparse.ArgumentParser(
        prog="kvshelf bench",
        description="measure TTFT, capacity, quality, routing and the peer; write a report (needs kvshelf[bench])",
    )
    mode = bench.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes (< 15 min on 2 cores)")
    mode.add_argument("--full", action="store_true", help="adds 32K prompts, more schemes and rounds (hours)")
    bench.add_argument("--model", default="embedded", help="'embedded', an mlx-lm model dir, or a HF repo id")
    bench.add_argument("--out", type=Path, default=None, help="report directory (default: benchmarks/results/<date>)")
    bench.add_argument(
        "--sections",
        default=None,
        help="comma-separated subset of: ttft,capacity,quality,decode,routing,phases,peer,store,structured",
    )
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one setting (see kvbench.settings), e.g. ttft_sizes=1024,2048",
    )
    bench.add_argument("--work-dir", type=Path, default=None, help="scratch directory, kept (default: a temp dir)")

    args = bench.parse_args(argv)
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    try:
        from kvbench.runner import run as run_bench
        from kvbench.settings import MODES, with_overrides
    except ImportError as exc:
        print(f"kvshelf bench needs the bench extra: pip install 'kvshelf[bench]' ({exc})", file=sys.stderr)
        return 2
    import time

    settings = MODES["quick" if args.quick else "full" if args.full else "default"]
    overrides = list(args.set) + ([f"sections={args.sections}"] if args.sections else [])
    try:
        settings = with_overrides(settings, overrides)
    except ValueError as exc:
        print(f"kvshelf bench: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("benchmarks") / "results" / time.strftime("%Y-%m-%d-%H%M")
    report = run_bench(settings, args.model, out, args.work_dir)
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
