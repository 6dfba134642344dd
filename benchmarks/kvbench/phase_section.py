"""The 5-phase multi-agent scenario, run by ``kvbench.phases`` (issue 7).

That module owns the scenario; this one only calls ``phases.run(out_dir, quick, model,
max_tokens)`` and adapts its result to the report. Without it the section says so
instead of failing the whole bench.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from kvbench.charts import bars
from kvbench.context import BenchContext

TITLE = "Phases: the 5-phase multi-agent scenario"


def run(ctx: BenchContext) -> dict:
    try:
        phases = importlib.import_module("kvbench.phases")
    except ModuleNotFoundError as exc:
        if exc.name != "kvbench.phases":
            raise
        return {
            "title": TITLE,
            "table": [],
            "pending": True,
            "description": "Not run: kvbench.phases (the scenario, issue 7) is not in this build yet.",
        }
    ctx.close()  # the scenario loads its own engine; give its memory back first
    result = dict(
        phases.run(
            ctx.out_dir / "phases",
            ctx.settings.mode == "quick",
            model=ctx.model,
            max_tokens=ctx.settings.phases_max_tokens or None,
        )
    )
    result.pop("runs", None)  # every turn of every mode: kept in phases/phases.json, not in the report's JSON
    result.setdefault("title", TITLE)
    result.setdefault("table", [])
    result.setdefault("description", (phases.__doc__ or "").strip().split("\n\n")[0])
    return result


def chart(result: dict, path: Path) -> Path | None:
    """Mean TTFT per phase, one bar per mode (the TTFT columns of the scenario's table)."""
    rows = result.get("table") or []
    if not rows:
        return None
    label_key = next((k for k, v in rows[0].items() if isinstance(v, str)), None)
    numeric = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    columns = [k for k in numeric if "ttft" in k.lower()] or numeric[:4]
    if not columns:
        return None
    cats = [str(r.get(label_key, i)) if label_key else str(i) for i, r in enumerate(rows)]
    return bars(
        path,
        "Phases: mean TTFT per turn",
        "seconds (log)",
        cats,
        {k.replace(" ttft s", ""): [float(r.get(k) or 0) for r in rows] for k in columns},
        logy=True,
    )


def headline(result: dict) -> str | None:
    speedup = result.get("speedup_vs_cold")
    if not speedup:
        return None
    return "Phases: wall time against cold, " + ", ".join(f"{m} {v:.2f}x" for m, v in speedup.items()) + "."
