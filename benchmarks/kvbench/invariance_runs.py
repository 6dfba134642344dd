"""A resumable invariance run: one JSON file per conversation in a run directory, pooled.

A run directory (``benchmarks/results/invariance-50-<stamp>/``) holds, per conversation
``NN``, a part file per stage (``conv-NN.hot.json``...) while it is under way and
``conv-NN.json`` once every stage is in: the paths' results, the commit, the run's options
and the kernel probe (``invariance.kernel_probe``). What a stage hands to the next (the
conversation's ids, the reference's tokens and logits, turn 2's record) lies in
``work/conv-NN/`` until the conversation is done. A stage whose part file exists is not run
again, so a run can be stopped, continued and run in pieces (``--only``); ``aggregate``
pools whatever conversation files are there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbench import invariance as inv
from kvbench.machine import cpu_model
from kvshelf.model.few_rows import slice_rows

SCRIPT = Path(__file__).resolve().parents[1] / "invariance.py"


@dataclass(frozen=True)
class Options:
    """What makes a run: conversations of ``min_tokens..max_tokens``, ``generate`` greedy tokens per path."""

    conversations: int = 50
    min_tokens: int = 300
    max_tokens: int = 3000
    generate: int = 64


def commit() -> str:
    """The code's commit (``+changes`` if the tree differs from it); ``INVARIANCE_COMMIT``
    where the run goes from a frozen copy without git (``invariance_run.sh``)."""
    if os.environ.get("INVARIANCE_COMMIT"):
        return os.environ["INVARIANCE_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def conv_file(run_dir: Path, index: int, stage: str | None = None) -> Path:
    return run_dir / (f"conv-{index:02d}.json" if stage is None else f"conv-{index:02d}.{stage}.json")


def done(run_dir: Path, index: int, stage: str) -> bool:
    """Whether conversation ``index``'s ``stage`` is in (its part file, or the whole conversation's)."""
    return conv_file(run_dir, index).exists() or conv_file(run_dir, index, stage).exists()


def check_options(run_dir: Path, options: Options) -> None:
    """A run directory is for one set of options: continuing it with others is refused."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".gitignore").write_text("work/\n")  # the hand-over files (~70 MB a conversation) are not results
    path = run_dir / "options.json"
    if path.exists():
        had = json.loads(path.read_text())
        if had != asdict(options):
            raise SystemExit(f"{run_dir} was started with {had}, not {asdict(options)}")
    else:
        path.write_text(json.dumps(asdict(options)))


def run_stages(
    loaded: Any,
    run_dir: Path,
    index: int,
    stages: tuple[str, ...],
    options: Options,
    model: str = "embedded",
    log: Any = print,
) -> bool:
    """Run ``stages`` of conversation ``index`` (those not done yet) in this process; True
    once the conversation's file is written."""
    check_options(run_dir, options)
    if conv_file(run_dir, index).exists():
        return True
    g = inv.Greedy.of(loaded)
    probe = inv.kernel_probe(g)
    work = run_dir / "work" / f"conv-{index:02d}"
    work.mkdir(parents=True, exist_ok=True)
    tokens = inv.lengths(options.conversations, options.min_tokens, options.max_tokens)[index]
    for stage in stages:
        if conv_file(run_dir, index, stage).exists():
            continue
        t0 = time.perf_counter()
        ids = None
        if stage == "hot":
            ids = inv.prompt_ids(loaded.tokenizer, index, tokens, options.min_tokens, options.max_tokens)
        part = inv.run_stage(g, stage, work, options.generate, ids)
        part.update(
            stage=stage,
            pid=os.getpid(),
            wall_s=round(time.perf_counter() - t0, 1),
            kernel_probe=probe,
            cpu=cpu_model(),
            blis_slice_rows=slice_rows(),
            commit=commit(),
            model=model,
            load_average=list(os.getloadavg()),
        )
        conv_file(run_dir, index, stage).write_text(json.dumps(part, indent=1))
        same = all(p["identical"] for p in part["paths"])
        log(
            f"conversation {index:02d} {stage}: {part['wall_s']} s, identical: {same}; "
            + "; ".join(
                f"{p['path']} {'=' if p['identical'] else 'DIVERGES at ' + str(p['diverges_at'])}"
                f" (|dlogit| {p['max_abs_dlogit']})"
                for p in part["paths"]
            )
        )
    return merge(run_dir, index, options)


def run_in_new_process(run_dir: Path, index: int, stages: tuple[str, ...], options: Options, model: str) -> None:
    """Run ``stages`` of conversation ``index`` in a child process (the warm path's new process)."""
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--run-dir",
        str(run_dir),
        "--work",
        ",".join(f"{index}:{stage}" for stage in stages),
        "--model",
        model,
        "--conversations",
        str(options.conversations),
        "--min-tokens",
        str(options.min_tokens),
        "--max-tokens",
        str(options.max_tokens),
        "--generate",
        str(options.generate),
    ]
    subprocess.run(cmd, check=True)


def merge(run_dir: Path, index: int, options: Options) -> bool:
    """Write ``conv-NN.json`` from its stages' part files once all are in; drop the work files."""
    parts = {s: conv_file(run_dir, index, s) for s in inv.STAGES}
    if not all(p.exists() for p in parts.values()):
        return False
    data = {s: json.loads(p.read_text()) for s, p in parts.items()}
    probes = {d["kernel_probe"] for d in data.values()}
    if len(probes) != 1:
        raise RuntimeError(f"conversation {index}: its stages ran different kernels ({sorted(probes)}); rerun them")
    hot = data["hot"]
    paths = [p for d in data.values() for p in d["paths"]]
    batches = []
    for d in data.values():
        for b in d["batches"]:
            rows = [p for p in d["paths"] if p["path"] in b["rows"]]
            entry = {
                "path": b["path"],
                "identical": all(p["identical"] for p in rows),
                "max_abs_dlogit": max(p["max_abs_dlogit"] for p in rows),
                "rows": b["rows"],
                "lengths": b["lengths"],
            }
            diverged = [p for p in rows if not p["identical"]]
            if diverged:
                entry["diverges_at"] = min(p["diverges_at"] for p in diverged)
                entry["reference_top2_margin"] = diverged[0]["reference_top2_margin"]
            batches.append(entry)
    out = {
        "conversation": index,
        "tokens": hot["tokens"],
        "turns": hot["turns"],
        "identical": all(p["identical"] for p in paths),
        "kernel_probe": probes.pop(),
        "first_logits_sha256": hot["reference"]["first_logits_sha256"],
        "options": asdict(options),
        "commits": sorted({d["commit"] for d in data.values()}),
        "cpus": sorted({d.get("cpu", "unrecorded") for d in data.values()}),
        "model": hot["model"],
        "wall_s": round(sum(d["wall_s"] for d in data.values()), 1),
        "stages": {s: {k: d[k] for k in ("pid", "wall_s", "load_average", "batches")} for s, d in data.items()},
        "reference": hot["reference"],
        "paths": paths,
        "batches": batches,
    }
    conv_file(run_dir, index).write_text(json.dumps(out, indent=1))
    for p in parts.values():
        p.unlink()
    shutil.rmtree(run_dir / "work" / f"conv-{index:02d}", ignore_errors=True)
    return True


def _finite(x: float | None) -> bool:
    return x is None or bool(np.isfinite(x))


def worst(deltas: list[float]) -> float:
    """The largest |dlogit|, NaN if any is (non-finite logits: ``max`` alone would drop it)."""
    return float("nan") if not all(_finite(d) for d in deltas) else max(deltas)


def aggregate(run_dir: Path) -> dict:
    """Every finished conversation of ``run_dir`` pooled: the share identical on every path,
    the largest |dlogit|, every divergence with its margin, per-path counts, the tokens."""
    convs = sorted(
        (json.loads(p.read_text()) for p in run_dir.glob("conv-[0-9][0-9].json")), key=lambda c: c["conversation"]
    )
    probes: dict[str, int] = {}
    machines: dict[str, dict] = {}  # by kernel probe: the CPUs and conversations that ran those kernels
    for c in convs:
        probes[c["kernel_probe"]] = probes.get(c["kernel_probe"], 0) + 1
        seen = machines.setdefault(c["kernel_probe"], {"cpus": set(), "conversations": []})
        seen["cpus"].update(c.get("cpus", ["unrecorded"]))
        seen["conversations"].append(c["conversation"])
    per_path: dict[str, dict] = {}
    divergences = []
    for c in convs:
        for p in [*c["paths"], *c["batches"]]:
            row = per_path.setdefault(
                p["path"], {"conversations": 0, "identical": 0, "max_abs_dlogit": 0.0, "divergences": []}
            )
            row["conversations"] += 1
            row["identical"] += bool(p["identical"])
            row["max_abs_dlogit"] = worst([row["max_abs_dlogit"], p["max_abs_dlogit"] or 0.0])
            if not p["identical"]:
                row["divergences"].append([c["conversation"], p["diverges_at"], p["reference_top2_margin"]])
        for p in c["paths"]:
            if not p["identical"]:
                divergences.append({"conversation": c["conversation"], "tokens": c["tokens"], **p})
    tokens = [c["tokens"] for c in convs]
    walls = [c["wall_s"] for c in convs]
    deltas = [p["max_abs_dlogit"] for c in convs for p in c["paths"] if p["max_abs_dlogit"] is not None]
    options = convs[0]["options"] if convs else {}
    identical = sum(c["identical"] for c in convs)
    return {
        "run_dir": str(run_dir),
        "conversations": len(convs),
        "planned": options.get("conversations"),
        "generate": options.get("generate"),
        "identical": identical,
        "identical_share": identical / max(1, len(convs)),
        "largest_abs_dlogit": worst(deltas) if deltas else None,
        "non_finite": [
            [c["conversation"], p["path"]] for c in convs for p in c["paths"] if not _finite(p["max_abs_dlogit"])
        ],
        "divergences": divergences,
        "per_path": per_path,
        "tokens": {
            "min": min(tokens, default=0),
            "max": max(tokens, default=0),
            "median": int(np.median(tokens)) if tokens else 0,
            "histogram": np.histogram(tokens, bins=[0, 600, 1200, 1800, 2400, 3100])[0].tolist() if tokens else [],
            "histogram_edges": [0, 600, 1200, 1800, 2400, 3100],
        },
        "wall_s": {"median": float(np.median(walls)) if walls else None, "total": round(sum(walls), 1)},
        "kernel_probes": probes,
        "machines": {k: {"cpus": sorted(v["cpus"]), "conversations": v["conversations"]} for k, v in machines.items()},
        "commits": sorted({x for c in convs for x in c["commits"]}),
        "options": options,
        "done": [c["conversation"] for c in convs],
    }
