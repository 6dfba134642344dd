"""The structured section of ``kvshelf bench`` end to end on a tiny model: the table, not the figures.

A random-weight model writes noise unconstrained, so the section must show what the mask
does: every constrained JSON reply valid, no unconstrained one, and the mask's cost
measured for every reply. Timings are printed and written, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_structured_section_compares_constrained_and_free_replies(tiny_dirs, tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--model", str(tiny_dirs["llama"]), "--out", str(out)]
    cmd += ["--sections", "structured", "--set", "structured_fields=1,2,3", "--set", "structured_max_tokens=400"]
    cmd += ["--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stderr[-4000:]
    section = json.loads((out / "results.json").read_text())["sections"]["structured"]
    assert "error" not in section, section.get("error")
    rows = section["rows"]
    assert [(r["kind"], r["fields"]) for r in rows] == [("tool", k) for k in (1, 2, 3)] + [
        ("json", k) for k in (1, 2, 3)
    ]
    assert all(r["constrained_valid"] for r in rows)  # 400 tokens are enough for every reply of 1-3 fields
    assert not any(r["free_valid"] for r in rows)  # a random model's unconstrained reply never validates
    assert all(r["mask_apply_ms"] is not None and r["mask_compute_ms"] is not None for r in rows)
    summary = {r["schemas"]: r for r in section["summary"]}
    assert summary["all (6)"]["valid_constrained"] == 1.0 and summary["all (6)"]["valid_free"] == 0.0
    report = (out / "REPORT.md").read_text()
    assert f"## {section['title']}" in report and "### Summary" in report and "structured.png" in report
