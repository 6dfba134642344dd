"""The Invariance section of ``kvshelf bench`` on a tiny model: every path of every
conversation compared with the cold reference, the cost of each kernel choice measured
against the current code, a chart."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from kvbench import invariance  # noqa: E402
from kvbench.context import BenchContext  # noqa: E402
from kvbench.settings import QUICK, with_overrides  # noqa: E402

PATHS = {"cold 128", "cold, one call", "hot", "warm", "fork", "batched with 3"}


def test_invariance_section_compares_every_path(tiny_dirs, tmp_path):
    settings = with_overrides(
        QUICK,
        [
            "invariance_conversations=2",
            "invariance_min_tokens=300",
            "invariance_max_tokens=600",
            "invariance_generate=12",
        ],
    )
    ctx = BenchContext(settings, str(tiny_dirs["gemma3_text"]), tmp_path / "out", tmp_path / "work")
    try:
        result = invariance.run(ctx)
    finally:
        ctx.close()
    assert {r["path"] for r in result["table"]} == PATHS
    kernels = {r["kernels"] for r in result["table"]}
    assert "default" in kernels and kernels <= {"default", "invariant"}
    summary = result["summary"]
    assert summary["conversations"] == 2 and 0.0 <= summary["identical_share"] <= 1.0
    for conv in result["summary"]["divergences"]:
        assert conv["diverges_at"] >= 0 and conv["reference_top2_margin"] >= 0
    cost = summary["cost"]
    assert (
        cost[invariance.ATTENTION_ONLY]["prefill_s_median"] > 0
        and "prefill_cost_pct" in cost[invariance.ATTENTION_ONLY]
    )
    assert cost[invariance.CURRENT]["decode_ms_median"] > 0
    if "invariant" in kernels:  # BLIS is installed: both shape-invariant choices are timed too
        assert "decode_tokens_per_s_cost_pct" in cost[invariance.INVARIANT] and invariance.BLIS_ONLY in cost
    headline = invariance.headline(result)
    assert headline is not None and headline.startswith("Invariance:")
    chart = invariance.chart(result, tmp_path / "invariance.png")
    assert chart is not None and chart.stat().st_size > 0
