"""REPORT.md, results.json and the charts: each section's table next to its chart.

Tables are rendered from the rows the sections return (nested values such as ``raw``
stay in the JSON only), so the report prints exactly what was measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UNITS = (("_pct", " %"), ("_s", " s"), ("_mb", " MB"), ("_ms", " ms"))


def header(key: str) -> str:
    """``cold_s`` -> ``cold s``; a key with spaces is already a display name (``mlx_lm.server ttft_s``)."""
    readable = (lambda k: k) if " " in key else (lambda k: k.replace("_", " "))
    for suffix, unit in UNITS:
        if key.endswith(suffix):
            return readable(key[: -len(suffix)]) + unit
    return readable(key)


def cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        a = abs(value)
        return (
            f"{value:.0f}" if a >= 100 else f"{value:.1f}" if a >= 10 else f"{value:.2f}" if a >= 1 else f"{value:.3f}"
        )
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    columns: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in columns and not isinstance(v, (dict, list, tuple)):
                columns.append(k)
    if not columns:
        return ""
    lines = ["| " + " | ".join(header(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def machine_table(machine: dict) -> str:
    return "\n".join(["| | |", "|---|---|", *(f"| {k.replace('_', ' ')} | {cell(v)} |" for k, v in machine.items())])


def write(out_dir: Path, meta: dict, machine: dict, sections: dict[str, dict], charts: dict[str, list[Path]]) -> Path:
    """Write REPORT.md and results.json into ``out_dir``; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(
        json.dumps({"meta": meta, "machine": machine, "sections": sections}, indent=2, default=str)
    )
    md = [
        f"# kvshelf bench ({meta['mode']}) — {meta['date']}",
        "",
        f"Model: {meta['model']}. Run took {meta['elapsed_s'] / 60:.1f} min. Mode `{meta['mode']}`: {meta['mode_doc']}",
        "",
    ]
    lines = [f"- {r['headline']}" for r in sections.values() if r.get("headline")]
    lines += [f"- {r.get('title', n)}: **failed** (see below)" for n, r in sections.items() if "error" in r]
    lines += [f"- {n}: **not reached** in this run" for n in meta.get("not_reached", [])]
    if lines:
        md += ["## Summary", "", *lines, ""]
    md += ["## Machine", "", machine_table(machine), ""]
    settings = {k: v for k, v in meta.get("settings", {}).items() if k not in ("mode", "notes", "peer_vllm_mlx")}
    changed = meta.get("overridden") or []
    if changed:
        md += [
            "Overridden for this run (against the mode's defaults): "
            + ", ".join(f"`{k}`" for k in changed if k in settings)
            + ".",
            "",
        ]
    md += [
        "Settings: "
        + "; ".join(
            f"`{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}`" for k, v in settings.items()
        ),
        "",
    ]
    for name, result in sections.items():
        md += [f"## {result.get('title', name)}", ""]
        if result.get("description"):
            md += [result["description"], ""]
        if "error" in result:
            md += [f"**This section failed:** `{result['error']}`", ""]
        if result.get("load_average") is not None:
            md += [
                f"Load average (1, 5, 15 min) after this section: {result['load_average']}; "
                f"section took {result.get('elapsed_s', 0):.0f} s.",
                "",
            ]
        table = markdown_table(result.get("table") or [])
        if table:
            md += [table, ""]
        for chart in charts.get(name, []):
            md += [f"![{name}]({chart.name})", ""]
        for title, rows in (result.get("extra_tables") or {}).items():
            md += [f"### {title}", "", markdown_table(rows), ""]
        if name == "peer" and result.get("vllm_mlx"):
            md += [f"**vllm-mlx:** {result['vllm_mlx']}", ""]
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(md))
    return path
