"""The Decode section of ``kvshelf bench`` on a tiny model: a row per context, path and
batch size, with the floor measured in the same run and a chart."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from kvbench import decode_section  # noqa: E402
from kvbench.context import BenchContext  # noqa: E402
from kvbench.settings import QUICK, with_overrides  # noqa: E402


def test_decode_section_measures_each_batch_against_the_floor(tiny_dirs, tmp_path):
    settings = with_overrides(
        QUICK, ["decode_contexts=300,600", "decode_batches=1,3", "decode_steps=2", "decode_stream_mb=64"]
    )
    ctx = BenchContext(settings, str(tiny_dirs["gemma3_text"]), tmp_path / "out", tmp_path / "work")
    try:
        result = decode_section.run(ctx)
    finally:
        ctx.close()
    bw = result["bandwidth"]
    # The floor's bandwidth: a streamed buffer by numpy and MLX, and the weights' own bytes
    # through sgemv, numpy and the step's own one-row product on every core, each with its
    # spread; the floor uses the highest best pass.
    assert {"stream_numpy_sum", "stream_mlx_sum", "weights_numpy_sum", "weights_skinny_row"} <= set(bw["readings"])
    assert bw["gbs"] == max(r["best_gbs"] for r in bw["readings"].values()) > 0
    assert all(r["best_gbs"] >= r["median_gbs"] >= r["worst_gbs"] for r in bw["readings"].values())
    assert "interleaved" in bw["method"] and bw["stream_mb"] == 64
    rows = result["table"]
    got = {(r["context"], r["path"].split()[0], r["batch"]) for r in rows}
    assert got == {(c, p, b) for c in (300, 600) for p, b in (("mlx-lm", 1), ("kvshelf", 1), ("kvshelf", 3))}
    for r in rows:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and r["x_floor"] > 0
    kv = [r for r in rows if r["path"].startswith("kvshelf")]
    assert all(r["working_set_mb"] > 0 for r in kv)
    headline = decode_section.headline(result)
    assert headline is not None and headline.startswith("Decode at 300 tokens")
    chart = decode_section.chart(result, tmp_path / "decode.png")
    assert chart is not None and chart.stat().st_size > 0
