"""The invariance benchmark on a tiny model: every path of issue 21 (cold in 64/128/256
chunks and one call, hot across three turns with generated tokens, warm in a new
process, forked, evicted by the budget and reloaded, batched with 1, 3 and 7 others of
other lengths), one JSON file per conversation, resumed and pooled, and the bench
section built from the pooled run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from kvbench import invariance  # noqa: E402
from kvbench import invariance_runs as runs  # noqa: E402
from kvbench.context import BenchContext  # noqa: E402
from kvbench.settings import QUICK, with_overrides  # noqa: E402

PATHS = {
    "hot (3 turns)",
    "fork",
    "evicted and reloaded",
    "cold 64",
    "warm (new process)",
    "cold 128",
    "cold, one call",
}
BATCHES = {"batched with 1", "batched with 3", "batched with 7"}
GENERATE = 10


@pytest.fixture(scope="module")
def measured(tiny_dirs, tmp_path_factory):
    """Two conversations measured by the bench section (its warm stage in a child process)."""
    tmp = tmp_path_factory.mktemp("invariance")
    settings = with_overrides(
        QUICK,
        [
            "invariance_conversations=2",
            "invariance_min_tokens=300",
            "invariance_max_tokens=500",
            f"invariance_generate={GENERATE}",
        ],
    )
    ctx = BenchContext(settings, str(tiny_dirs["gemma3_text"]), tmp / "out", tmp / "work")
    try:
        result = invariance.run(ctx)
        loaded = ctx.get_engine().loaded
    finally:
        ctx.close()
    return result, tmp / "work" / "invariance", loaded, ctx.model


def test_every_path_of_every_conversation_is_in_its_file(measured):
    result, run_dir, _, _ = measured
    files = sorted(run_dir.glob("conv-*.json"))
    assert [f.name for f in files] == ["conv-00.json", "conv-01.json"]  # the stages' part files merged away
    assert not (run_dir / "work" / "conv-00").exists()
    for f in files:
        conv = json.loads(f.read_text())
        assert {p["path"] for p in conv["paths"]} == PATHS
        assert {b["path"] for b in conv["batches"]} == BATCHES
        assert len(conv["reference"]["tokens"]) == GENERATE
        assert conv["identical"] == all(p["identical"] for p in conv["paths"])
        assert len(conv["kernel_probe"]) == 64 and len(conv["first_logits_sha256"]) == 64
        # the hot path's turns: cut inside the prompt, each followed by a generated reply
        assert 0 < conv["turns"][0] < conv["turns"][1] < conv["tokens"]
        for b in conv["batches"]:
            size = int(b["path"].split()[-1]) + 1
            assert len(b["lengths"]) == size
            others = b["lengths"][len(b["rows"]) :]
            assert len(set(others)) == len(others) and conv["tokens"] not in others  # other lengths
        for p in conv["paths"]:
            assert p["max_abs_dlogit"] is not None and p["max_abs_dlogit"] >= 0
            if not p["identical"]:
                assert p["diverges_at"] >= 0 and p["reference_top2_margin"] >= 0 and "alone" in p
        # warm ran in another process than hot (which wrote the record it read)
        assert conv["stages"]["warm"]["pid"] != conv["stages"]["hot"]["pid"]
    convs = [json.loads(f.read_text()) for f in files]
    assert {c["tokens"] for c in convs} == {300 + 2 * invariance.REPLY, 500 + 2 * invariance.REPLY}  # prompt + replies


def test_the_section_pools_the_run(measured):
    result, run_dir, _, _ = measured
    summary = result["summary"]
    assert summary["conversations"] == 2 and summary["planned"] == 2
    assert {r["path"] for r in result["table"]} == PATHS | BATCHES
    assert 0.0 <= summary["identical_share"] <= 1.0
    assert (
        summary["identical_share"]
        == sum(json.loads(f.read_text())["identical"] for f in run_dir.glob("conv-*.json")) / 2
    )
    assert (
        summary["tokens"]["min"] == 300 + 2 * invariance.REPLY
        and summary["tokens"]["max"] == 500 + 2 * invariance.REPLY
    )
    assert len(summary["kernel_probes"]) == 1
    # which CPU ran those kernels (the bits are the CPU's: BLIS and OpenBLAS pick kernels by it)
    from kvbench.machine import cpu_model

    ((probe, machine),) = summary["machines"].items()
    assert probe in summary["kernel_probes"] and sorted(machine["conversations"]) == [0, 1]
    assert machine["cpus"] == [cpu_model()] and probe[:8] in result["description"]
    cost = summary["cost"]
    assert cost[invariance.CURRENT]["decode_ms_median"] > 0
    assert "prefill_cost_pct" in cost[invariance.ATTENTION_ONLY]
    headline = invariance.headline(result)
    assert headline is not None and headline.startswith("Invariance:")


def test_a_finished_run_is_reported_as_is(measured, tmp_path):
    _, run_dir, _, model = measured
    settings = with_overrides(QUICK, [f"invariance_results={run_dir}"])
    ctx = BenchContext(settings, model, tmp_path / "out", tmp_path / "work")
    result = invariance.run(ctx)
    assert ctx.engine is None  # nothing measured: no model loaded
    assert result["summary"]["conversations"] == 2 and {r["path"] for r in result["table"]} == PATHS | BATCHES
    chart = invariance.chart(result, tmp_path / "invariance.png")
    assert chart is not None and chart.stat().st_size > 0


def test_a_run_resumes_where_it_stopped(measured, tmp_path):
    _, run_dir, loaded, model = measured
    options = runs.Options(2, 300, 500, GENERATE)
    done = run_dir / "conv-00.json"
    before = done.read_text()
    assert runs.run_stages(loaded, run_dir, 0, invariance.STAGES, options, model)  # done: nothing rerun
    assert done.read_text() == before
    with pytest.raises(SystemExit, match="was started with"):
        runs.run_stages(loaded, run_dir, 0, ("hot",), runs.Options(3, 300, 500, GENERATE), model)
    # a conversation stopped after its first stage goes on from there, in pieces
    part = tmp_path / "run"
    assert not runs.run_stages(loaded, part, 1, ("hot",), options, model)
    hot = (part / "conv-01.hot.json").read_text()
    assert (part / "work" / "conv-01" / "conversation.json").exists()
    with pytest.raises(RuntimeError, match="another process"):
        runs.run_stages(loaded, part, 1, ("warm",), options, model)
    assert not runs.run_stages(loaded, part, 1, ("hot", "cold"), options, model)
    assert (part / "conv-01.hot.json").read_text() == hot  # not run again
    runs.run_in_new_process(part, 1, ("warm",), options, model)
    assert not (part / "conv-01.hot.json").exists()
    merged = json.loads((part / "conv-01.json").read_text())
    original = json.loads((run_dir / "conv-01.json").read_text())
    # the same conversation, measured again in pieces, is the same bit for bit
    assert merged["first_logits_sha256"] == original["first_logits_sha256"]
    assert merged["reference"]["tokens"] == original["reference"]["tokens"]
    assert [p["identical"] for p in merged["paths"]] == [p["identical"] for p in original["paths"]]
    pooled = runs.aggregate(part)
    assert pooled["conversations"] == 1 and pooled["done"] == [1]


def test_conversation_lengths_cover_the_range_in_any_prefix():
    lengths = invariance.lengths(50, 300, 3000)
    assert sorted(lengths) == np.linspace(300, 3000, 50).round().astype(int).tolist()
    assert lengths[0] == 300 and abs(lengths[1] - 1650) < 60
    for prefix in (4, 8, 16):
        part = sorted(lengths[:prefix])
        assert part[0] < 700 and part[-1] > 2300  # short and long from the start
    mates = invariance.mate_lengths(1000, 5)
    assert len(set(mates)) == 5 and 1000 not in mates and max(mates) < 1000


def test_a_divergence_is_reported_with_its_margin():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=32).astype(np.float32) for _ in range(4)]
    tokens = [int(r.argmax()) for r in rows]
    other_rows = [r.copy() for r in rows]
    other_rows[2][tokens[2]] -= 100.0
    other = tokens[:2] + [int(other_rows[2].argmax())] + tokens[3:]
    out = invariance.compare("x", (tokens, rows), (other, other_rows))
    assert not out["identical"] and out["diverges_at"] == 2
    assert out["reference_top2_margin"] == pytest.approx(invariance.margin(rows[2]), abs=1e-5)
    assert out["max_abs_dlogit"] == pytest.approx(100.0)
    same = invariance.compare("x", (tokens, rows), (tokens, rows))
    assert same["identical"] and same["max_abs_dlogit"] == 0.0


def test_the_run_is_packed_into_processes_that_keep_warm_apart_from_its_hot():
    import invariance as script  # benchmarks/invariance.py

    plan = invariance.lengths(50, 300, 3000)
    procs = script.processes(plan)
    items = [item for work in procs for item in work]
    assert items == [(i, stage) for i in range(50) for stage in invariance.STAGES]  # all, in order
    for work in procs:
        assert not any((i, "hot") in work and (i, "warm") in work for i, _ in work)
        estimate = script.LOAD_S + sum(script.STAGE_COST[s][0] + script.STAGE_COST[s][1] * plan[i] for i, s in work)
        assert len(work) == 1 or estimate <= script.PROCESS_BUDGET_S
    assert script.parse_work("0:warm,1:hot") == [(0, "warm"), (1, "hot")]
    with pytest.raises(SystemExit):
        script.parse_work("0:lukewarm")


def test_one_process_per_conversation_runs_every_stage_once_and_warm_in_a_later_process():
    import invariance as script  # benchmarks/invariance.py

    procs = script.processes_by_conversation(invariance.lengths(50, 300, 3000))
    items = [item for work in procs for item in work]
    assert sorted(items) == sorted((i, stage) for i in range(50) for stage in invariance.STAGES)
    assert len(procs) == 51 and procs[0] == [(0, "hot"), (0, "cold")] and procs[-1] == [(49, "warm")]
    for p, work in enumerate(procs):  # a conversation's warm comes one process after its hot
        assert not any((i, "hot") in work for i, stage in work if stage == "warm")
        assert all((i, "hot") in procs[p - 1] for i, stage in work if stage == "warm")


def test_non_finite_logits_are_reported_not_dropped():
    from kvbench import invariance_runs

    assert invariance_runs.worst([0.0, 0.5]) == 0.5
    assert np.isnan(invariance_runs.worst([0.0, float("nan"), 0.5]))  # max() would say 0.5
