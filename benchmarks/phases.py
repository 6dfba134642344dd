"""The 5-phase scenario four ways: cold (no cache at all), anonymous requests (RAM prefix
reuse), persistent caches, and persistent caches with a shared preamble and prefill ahead
(see ``kvbench.phases``).

    python benchmarks/phases.py [--quick] [--model embedded] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import write_json

from kvbench.phases import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter case file and replies")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        result = run(Path(out), args.quick, model=args.model, max_tokens=args.max_tokens)
    rows = result["table"]
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    print("speed-up in total wall time against cold:", result["speedup_vs_cold"])
    print("wrote", write_json("phases", {k: v for k, v in result.items() if k != "runs"} | {"runs": result["runs"]}))


if __name__ == "__main__":
    main()
