"""A store of 100,000 agents costs no more per turn than a store of ten (issue 22).

Side by side in one run, with 0, 1,000, 10,000 and 100,000 other agents' files in the
store: a save, a load and a whole durable turn on a tiny model; one agent's metadata;
a page of the listing (from the store's index, and from record headers read lazily);
and chats overlapping a full listing against chats that are not. What is measured and
how: ``benchmarks/kvbench/store_scale.py`` (also the ``store`` section of ``kvshelf bench``).

    /work/bin/kv-bench python benchmarks/store_scale.py [--sizes 0 1000 10000 100000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import write_json

from kvbench.store_scale import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 1000, 10000, 100000])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvshelf-store-scale-", dir=Path.home()) as work:
        result = measure(args.sizes, args.repeats, Path(work))
    for row in result["table"]:
        print(json.dumps(row))
    print(json.dumps(result["overlap"] | {"raw": None}))
    print(write_json("store_scale", result))


if __name__ == "__main__":
    main()
