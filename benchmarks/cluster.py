"""Many machines, one shelf (issue 20): nodes behind HAProxy over one shared store.

Side by side in one run, on the embedded model by default: one node on one core
against two behind HAProxy (tokens/s), affinity routing against round robin over the
shared store (cached share, median TTFT), and a node killed mid-run (time to the moved
agent's answer, its TTFT against cold, turns lost, 5xx). What is measured and how:
``benchmarks/kvbench/cluster.py`` (also the ``cluster`` section of ``kvshelf bench``).

    /work/bin/kv-bench python benchmarks/cluster.py [--size small|default|full] [--model embedded]
        [--parts scaling,routing,failover]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from common import write_json

from kvbench.cluster import PARTS, SIZES, chart, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default", help="how many turns and agents")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {','.join(PARTS)} to run")
    args = parser.parse_args()
    start = list(os.getloadavg())
    print("load average at start:", start, flush=True)
    with tempfile.TemporaryDirectory(prefix="kvshelf-cluster-", dir=Path.home()) as work:
        result = measure(args.model, Path(work), args.size, tuple(args.parts.split(",")))
    result["load_average_start"] = start
    result["load_average_end"] = list(os.getloadavg())
    for row in result["table"]:
        print(json.dumps(row))
    print("load average at end:", result["load_average_end"])
    path = write_json("cluster", result)
    print(path, chart(result, path.with_suffix(".png")))


if __name__ == "__main__":
    main()
