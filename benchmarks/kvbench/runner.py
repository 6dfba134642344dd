"""``kvshelf bench``: run the sections in one process, then write the report.

A section that fails is recorded with its error and the rest still run, so one broken
measurement never hides the others. Sections run in the order of ``settings.sections``,
and the report is rewritten after each one, so a run cut short still reports what it
measured and names what it did not reach. The scenario and the peer comparison start
their own engines or servers; the in-process engine is closed before them (and
reloaded if a later section needs it).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

from kvbench import (
    capacity,
    cluster,
    decode_section,
    invariance,
    machine,
    peer,
    phase_section,
    quality,
    report,
    routing,
    store_scale,
    structured,
    ttft,
)
from kvbench.context import BenchContext
from kvbench.settings import MODES, Settings

MODULES = {
    "ttft": ttft,
    "capacity": capacity,
    "quality": quality,
    "decode": decode_section,
    "invariance": invariance,
    "routing": routing,
    "phases": phase_section,
    "peer": peer,
    "store": store_scale,
    "structured": structured,
    "cluster": cluster,
}
MODE_DOCS = {
    "quick": "a smoke run (< 15 min on 2 cores): TTFT at 1K–4K, capacity at 1K–4K, perplexity over 1K tokens, "
    "~512-token documents for routing and the peer comparison.",
    "default": "TTFT at 1K–16K, capacity at 4K/8K/16K, perplexity over 4K tokens, ~1.5K-token documents "
    "(about an hour on 2 cores).",
    "full": "the default plus 32K prompts, more KV schemes, more routing questions and more peer rounds "
    "(hours on 2 cores).",
}


def overridden(settings: Settings) -> list[str]:
    base = MODES.get(settings.mode)
    return [] if base is None else [k for k, v in vars(settings).items() if getattr(base, k) != v]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: servers are stopped, the scratch directory removed


def run(settings: Settings, model: str, out_dir: Path, work_dir: Path | None = None) -> Path:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.perf_counter()
    desc = machine.describe()
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kvshelf-bench-", dir=Path.home()))
    ctx = BenchContext(settings, model, out_dir, work)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    charts: dict[str, list[Path]] = {}
    try:
        for name in settings.sections:  # in the order given: a run cut short keeps what came first
            module = MODULES[name]
            print(f"[bench] {name} ...", flush=True)
            t = time.perf_counter()
            try:
                result = module.run(ctx)
            except Exception as exc:  # noqa: BLE001  (a failed section is reported, the rest go on)
                traceback.print_exc()
                result = {
                    "title": getattr(module, "TITLE", name),
                    "table": [],
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                }
            result["elapsed_s"] = time.perf_counter() - t
            try:
                result["headline"] = module.headline(result) if "error" not in result else None
            except Exception as exc:  # noqa: BLE001
                result["headline"] = None
                print(f"[bench] {name}: no headline ({type(exc).__name__}: {exc})", flush=True)
            result["load_average"] = machine.load_average()
            results[name] = result
            try:
                made = module.chart(result, out_dir / f"{name}.png") if result.get("table") else None
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                result.setdefault("error", f"chart failed: {type(exc).__name__}: {exc}")
                made = None
            charts[name] = [p for p in (made if isinstance(made, list) else [made]) if p]
            meta = {
                "mode": settings.mode,
                "mode_doc": MODE_DOCS.get(settings.mode, ""),
                "model": model,
                "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                "elapsed_s": time.perf_counter() - started,
                "settings": {k: v for k, v in vars(settings).items()},
                "not_reached": [n for n in settings.sections if n not in results],
                "overridden": overridden(settings),
            }
            report.write(out_dir, meta, desc, results, charts)  # after every section: a partial run still reports
            print(f"[bench] {name} done in {result['elapsed_s']:.0f} s", flush=True)
    finally:
        ctx.close()
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return out_dir / "REPORT.md"
