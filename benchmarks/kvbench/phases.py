"""The 5-phase interrogation scenario, timed cold (no cache at all), on anonymous requests
(RAM prefix reuse), with persistent caches, and with persistent caches plus a shared
preamble and prefill ahead.

The scenario itself (case file, roles, phases, ``play``) belongs to the example that
shows it to users, examples/phases.py; this module loads that file by path (examples
are scripts, not a package) and only adds ``run``: every mode in one process, and
the table for ``kvshelf bench`` (benchmarks/phases.py writes it as JSON).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "phases.py"


def _load_scenario() -> ModuleType:
    """examples/phases.py as a module (registered first, as its dataclasses need)."""
    name = "kvshelf_example_phases"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the phases scenario from {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


scenario = _load_scenario()
MODES = scenario.MODES
CASE_FILE = scenario.CASE_FILE
PHASES = scenario.PHASES
Turn = scenario.Turn
play = scenario.play


def run(out_dir: Path, quick: bool, model: str = "embedded", max_tokens: int | None = None) -> dict[str, Any]:
    """Every mode in one process, each on a fresh cache directory; the table has
    one row per phase with each mode's mean TTFT, then a total row of wall times."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    case_file = CASE_FILE.split("\n\nPhysical evidence.")[0] if quick else CASE_FILE
    max_tokens = max_tokens or (12 if quick else 24)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvshelf-phases-") as scratch:
        for mode in MODES:
            engine = scenario.engine_for(mode, model, Path(scratch) / mode.replace("+", "-"), progress=False)
            try:
                engine.chat(None, [{"role": "user", "content": "warm up"}], max_tokens=2)
                runs[mode] = play(engine, mode, case_file=case_file, max_tokens=max_tokens)
            finally:
                engine.close()
    table = []
    for i, (phase, _, _) in enumerate(PHASES):
        row: dict[str, Any] = {"phase": phase}
        for mode in MODES:
            row[f"{mode} ttft s"] = round(runs[mode]["phases"][i]["mean_ttft_s"], 3)
        for mode in MODES:
            row[f"{mode} wall s"] = round(runs[mode]["phases"][i]["wall_s"], 2)
        table.append(row)
    total: dict[str, Any] = {"phase": "total"}
    for mode in MODES:
        total[f"{mode} ttft s"] = round(sum(t["ttft_s"] for t in runs[mode]["turns"]) / len(runs[mode]["turns"]), 3)
    for mode in MODES:
        total[f"{mode} wall s"] = round(runs[mode]["wall_s"], 2)
    table.append(total)
    cold = runs["cold"]["wall_s"]
    result = {
        "title": "Phases: the 5-phase interrogation scenario",
        "description": (
            f"4 agents, 5 phases, {sum(len(p[2]) for p in PHASES)} turns of up to {max_tokens} tokens on {model}; "
            "the same scenario cold (no cache at all), on anonymous requests (RAM prefix reuse across requests "
            "that name no agent), with persistent per-agent caches, and with persistent caches plus the case "
            "file prefilled once and forked, and listeners prefilled ahead. TTFT is the mean per turn."
        ),
        "table": table,
        "speedup_vs_cold": {mode: round(cold / runs[mode]["wall_s"], 2) for mode in MODES},
        "runs": runs,
    }
    (out_dir / "phases.json").write_text(json.dumps(result, indent=2))
    return result
