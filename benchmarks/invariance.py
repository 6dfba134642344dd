"""Invariance: the same greedy reply whatever the cache did (issue 21), resumably.

What it measures is in ``kvbench.invariance`` (also the Invariance section of
``kvshelf bench``); the run directory and the pooling in ``kvbench.invariance_runs``.

    python benchmarks/invariance.py [--run-dir DIR] [--only I-J] [--stages hot,cold,warm]
        [--conversations 50] [--min-tokens 300] [--max-tokens 3000] [--generate 64] [--model embedded]
    python benchmarks/invariance.py --report DIR      # pool DIR's conversations: JSON, chart, section
    python benchmarks/invariance.py --plan [--by-conversation]  # the run's processes, one --work a line
    python benchmarks/invariance.py --run-dir DIR --work 0:warm,1:hot   # those stages, in one process
    python benchmarks/invariance.py --cost [--max-tokens 1200] [--generate 16]   # kernels' cost, one run
        (``--conversations 0`` says the same, as it did before the run was resumable)

Each conversation's stages not done yet run in this process, except "warm", which always
runs in a new one (a child process, when this one ran "hot"). ``benchmarks/invariance_run.sh``
runs the issue's 50 conversations one stage group per process under the shared test lock.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
from common import RESULTS, write_json

from kvbench import invariance as inv
from kvbench import invariance_runs as runs

# A process holds the shared test lock for at most ~5 minutes, and each one pays ~50 s to
# load the model and build its kernels: the run's stages are packed, in order, into
# processes of at most ``PROCESS_BUDGET_S`` estimated seconds (a conversation's "warm"
# never with its own "hot"). A stage's seconds here (2 cores shared with others' tests, load
# 2-7) as a fixed part (its decodes) plus one per token (its prefills), from conversations
# 0 (316 tokens) and 1 (1,694) of the first run: hot 106 and 167 s, cold 25 and 152, warm
# 107 and 183.
STAGE_COST = {"hot": (85.0, 0.05), "cold": (30.0, 0.07), "warm": (80.0, 0.065)}
LOAD_S = 50.0
PROCESS_BUDGET_S = 300.0

Work = list[tuple[int, str]]


def processes(plan: list[int], budget: float = PROCESS_BUDGET_S) -> list[Work]:
    """The run's (conversation, stage) items, in order, packed into processes."""
    out: list[Work] = []
    current: Work = []
    spent = LOAD_S
    for i, n in enumerate(plan):
        for stage in inv.STAGES:
            fixed, per_token = STAGE_COST[stage]
            estimate = fixed + per_token * n
            clash = stage == "warm" and (i, "hot") in current
            if current and (clash or spent + estimate > budget):
                out.append(current)
                current, spent = [], LOAD_S
            current.append((i, stage))
            spent += estimate
    return [*out, current] if current else out


def processes_by_conversation(plan: list[int]) -> list[Work]:
    """One process per conversation: the previous conversation's "warm" (so never in the
    process that ran its "hot"), then this one's "hot" and "cold". A process then pays one
    model load per conversation instead of up to three, for holding the test lock longer
    (3-13 minutes at load 2-5): for a machine nobody else needs to benchmark on."""
    out: list[Work] = []
    for i in range(len(plan)):
        out.append([*([(i - 1, "warm")] if i else []), (i, "hot"), (i, "cold")])
    return [*out, [(len(plan) - 1, "warm")]] if plan else out


def parse_work(spec: str) -> Work:
    """``"0:warm,1:hot"``: conversation 0's warm stage, then conversation 1's hot one."""
    items = []
    for item in spec.split(","):
        index, _, stage = item.partition(":")
        if stage not in inv.STAGES:
            raise SystemExit(f"--work: {item!r} is not CONVERSATION:STAGE with a stage of {inv.STAGES}")
        items.append((int(index), stage))
    return items


def indices(only: str | None, count: int) -> list[int]:
    if not only:
        return list(range(count))
    lo, _, hi = only.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def report(run_dir: Path) -> None:
    agg = runs.aggregate(run_dir)
    section = inv.section(agg)
    section["headline"] = inv.headline(section)
    path = write_json("invariance-50", {"section": section})
    (run_dir / "aggregate.json").write_text(json.dumps(section, indent=1))
    made = inv.chart(section, run_dir / "invariance.png")
    print(section["headline"])
    print(section["description"])
    for row in section["table"]:
        print(f"    {row}")
    print(f"wrote {path}, {run_dir / 'aggregate.json'}, {made}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--only", help="conversations I or I-J (0-based)")
    ap.add_argument("--stages", default=",".join(inv.STAGES))
    ap.add_argument("--work", help="CONVERSATION:STAGE,... to run in this process, in order (see --plan)")
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--generate", type=int, default=64)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--report", type=Path, metavar="DIR")
    ap.add_argument("--plan", action="store_true")
    ap.add_argument(
        "--by-conversation", action="store_true", help="with --plan: one process per conversation (see its function)"
    )
    ap.add_argument("--cost", action="store_true")
    args = ap.parse_args()
    if args.report is not None:
        return report(args.report)
    options = runs.Options(args.conversations, args.min_tokens, args.max_tokens, args.generate)
    plan = inv.lengths(options.conversations, options.min_tokens, options.max_tokens)
    if args.plan and options.conversations > 0:  # one process a line
        for items in processes_by_conversation(plan) if args.by_conversation else processes(plan):
            print(",".join(f"{i}:{stage}" for i, stage in items))
        return
    run_dir = args.run_dir or RESULTS / f"invariance-50-{time.strftime('%Y%m%d-%H%M%S')}"
    work = parse_work(args.work) if args.work else None
    if work is not None and all(runs.done(run_dir, i, stage) for i, stage in work):
        print(f"{args.work}: done already")
        return
    print(f"load average at start: {os.getloadavg()}", flush=True)
    from kvshelf.model.loader import load

    loaded = load(args.model, progress=False)
    if args.cost or args.conversations == 0:
        prompt = inv.prompt_ids(loaded.tokenizer, 0, args.max_tokens, args.min_tokens, args.max_tokens)
        out = inv.cost(inv.cost_variants(loaded), prompt, args.generate)
        print("cost:", out, flush=True)
        saved = write_json("invariance-cost", {"args": {k: str(v) for k, v in vars(args).items()}, "cost": out})
        print(f"wrote {saved}")
        return
    log = lambda line: print(line, flush=True)  # noqa: E731
    if work is not None:
        for i, stage in work:  # a warm after its own hot here is refused by ``warm_stage``
            runs.run_stages(loaded, run_dir, i, (stage,), options, args.model, log=log)
        print(f"run directory {run_dir}; load average at end: {os.getloadavg()}", flush=True)
        return
    stages = tuple(args.stages.split(","))
    here = tuple(s for s in stages if s != "warm")
    for i in indices(args.only, options.conversations):
        if here:
            runs.run_stages(loaded, run_dir, i, here, options, args.model, log=log)
        if "warm" in stages:
            if here:  # "warm in a new process": never the one that ran "hot"
                runs.run_in_new_process(run_dir, i, ("warm",), options, args.model)
            else:
                runs.run_stages(loaded, run_dir, i, ("warm",), options, args.model, log=log)
    print(f"run directory {run_dir}; load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
