"""Invariance: the same greedy reply whatever the cache did, and what it costs.

What it measures is in ``kvbench.invariance`` (also the Invariance section of
``kvshelf bench``).

    python benchmarks/invariance.py [--conversations 50] [--min-tokens 300] [--max-tokens 3000]
        [--generate 64] [--others 3] [--model embedded] [--kernels default,blis]

The default is the issue's 50 conversations of 300 to 3,000 tokens (about an hour here);
a session runs a reduced size (e.g. ``--conversations 3 --max-tokens 1200``) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
from common import RESULTS, write_json

from kvbench.invariance import measure
from kvshelf.model.loader import load


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--generate", type=int, default=64)
    ap.add_argument("--others", type=int, default=3)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--kernels", default="default,blis", help="default: the engine's; blis: every row through BLIS")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    loaded = load(args.model, progress=False)
    partial = RESULTS / f"invariance-partial-{time.strftime('%Y%m%d-%H%M%S')}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)

    def keep(rows: list) -> None:
        partial.write_text(json.dumps({"args": vars(args), "conversations": rows}, indent=2))

    out = measure(
        loaded,
        args.conversations,
        args.min_tokens,
        args.max_tokens,
        args.generate,
        args.others,
        log=lambda line: print(line, flush=True),
        kernels=tuple(args.kernels.split(",")),
        on_row=keep,
    )
    summary = out["summary"]
    print("cost:", summary["cost"], flush=True)
    print("summary:", {k: v for k, v in summary.items() if k != "cost"}, flush=True)
    path = write_json("invariance", {"args": vars(args), **out})
    partial.unlink(missing_ok=True)
    print(f"wrote {path}; load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
