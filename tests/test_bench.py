"""``kvshelf bench --quick`` end to end on a tiny model: the report and charts, not the figures.

The bench runs as a user runs it (the CLI in its own process), on a random-weight
llama directory with tiny sizes. Every section but the phases scenario is included
(that one plays 4 modes x 5 phases, minutes even on a tiny model); the peer comparison
really starts ``kvshelf serve`` and ``mlx_lm.server`` twice each.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg

TINY = [
    "ttft_sizes=64",
    "ttft_repeats=2",
    "capacity_sizes=64,128",
    "capacity_budget=2000000",
    "ppl_tokens=256",
    "ppl_schemes=q4-g64-kivi-rotv",
    "routing_experts=4",
    "routing_doc_tokens=200",
    "routing_questions=3",
    "routing_max_tokens=6",
    "peer_agents=2",
    "peer_doc_tokens=120",
    "peer_max_tokens=3",
    "store_sizes=0,40",
    "store_repeats=3",
]
SECTIONS = ("ttft", "capacity", "quality", "routing", "peer", "store")


def test_bench_quick_writes_a_report_with_charts(tiny_dirs, tmp_path):
    out = tmp_path / "report"
    cmd = [
        sys.executable,
        "-m",
        "kvshelf.cli",
        "bench",
        "--quick",
        "--model",
        str(tiny_dirs["llama"]),
        "--out",
        str(out),
        "--work-dir",
        str(tmp_path / "work"),
    ]
    for pair in TINY:
        cmd += ["--set", pair]
    cmd += ["--sections", ",".join(SECTIONS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    data = json.loads((out / "results.json").read_text())
    for key in ("cpu", "memory_gb", "mlx_backend", "blas"):
        assert data["machine"][key], key
    sections = data["sections"]
    for name in SECTIONS:
        assert "error" not in sections[name], (name, sections[name].get("error"))
        assert sections[name]["table"], name
    assert set(sections) == set(SECTIONS)
    assert len(sections["peer"]["per_request"]) == 2 * 3  # 2 agents: priming round, one before, one after restart

    report = (out / "REPORT.md").read_text()
    assert "## Machine" in report
    for name in SECTIONS:
        assert f"## {sections[name]['title']}" in report
    charts = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert {Path(c).stem for c in charts} >= {*SECTIONS, "peer-requests"}
    for c in charts:
        image = mpimg.imread(out / c)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # every markdown table is rectangular: each row has as many cells as its header
    for block in re.findall(r"((?:^\|.*\|\n)+)", report + "\n", flags=re.M):
        rows = block.strip().splitlines()
        widths = {len(re.findall(r"(?<!\\)\|", r)) for r in rows}
        assert len(widths) == 1, rows[:3]
