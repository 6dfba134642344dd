"""Boundary checkpoints: what they save a long-lived agent, and what they cost it.

    python benchmarks/checkpoints.py crew [--cache-dir DIR]   # a CrewAI hierarchical crew, two runs
    python benchmarks/checkpoints.py bytes                     # checkpoint bytes at 4K and 16K tokens

``crew`` runs a hierarchical CrewAI crew (a manager that delegates to two agents, two
tasks) on the embedded Gemma 3 270M, in this process, then runs it again in a fresh
process on the same cache directory (a real restart). For the manager it prints each
task's first call: prompt tokens, cached tokens, and its system text's length in tokens
(the end of the system text with its tool descriptions, as ``kvshelf.runtime.boundaries``
finds it: the manager's first checkpoint): with checkpoints, task 2
(a new conversation with the same system prompt, after task 1's history passed the
512-token window) and the restarted run should reuse the whole system prompt.

``bytes`` measures the bytes the checkpoints add to one agent on the embedded model's
cache geometry at 4K and 16K tokens: real ``AgentCache`` layers filled with random K/V
(bytes do not depend on the values), checkpoints at the end of a 600-token system prompt
and at the end of the last complete turn, kept as a request keeps them (a last turn
shorter than the window needs none: the layers rewind there themselves); in RAM
(``checkpoint_bytes``) and in the record as encoded for disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

import kvshelf  # noqa: E402,F401  (OpenBLAS before MLX)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


# -- the crew ---------------------------------------------------------------------------------
def run_crew(cache_dir: str, max_tokens: int, model: str = "embedded") -> dict:
    """One kickoff of the hierarchical crew; the manager's calls per task."""
    from crewai import Agent, Crew, Process, Task

    from kvshelf.adapters.crewai import KVShelfLLM

    llm = KVShelfLLM(model=model, cache_dir=cache_dir, max_tokens=max_tokens)
    researcher = Agent(
        role="Researcher",
        goal="Find facts about KV caches.",
        backstory="A careful researcher.",
        llm=llm,
        max_iter=1,
        allow_delegation=False,
    )
    writer = Agent(
        role="Writer",
        goal="Write clear notes.",
        backstory="A technical writer.",
        llm=llm,
        max_iter=1,
        allow_delegation=False,
    )
    manager = Agent(
        role="Crew Manager",
        goal="Manage the team to complete each task with the best result.",
        backstory=(
            "You are a seasoned manager with a knack for getting the best out of your team. You are known "
            "for your ability to delegate work to the right people and to ask the right questions."
        ),
        llm=llm,
        allow_delegation=True,
        max_iter=3,
    )
    # Task 1 carries a long brief, as real tasks often do: the manager's history passes the
    # sliding window (512 tokens plus a slack block), so task 2 can reuse its system
    # prompt only through the checkpoint.
    brief = " ".join(
        f"Point {i}: the cache of agent {i} holds {i * 256} tokens and is restored from disk in {i} ms."
        for i in range(1, 31)
    )
    tasks = [
        Task(
            name="task-1",
            description=f"Read this brief, then list two facts about KV caches from it. Brief: {brief}",
            expected_output="Two facts.",
        ),
        Task(name="task-2", description="Write one sentence about prefix reuse.", expected_output="One sentence."),
    ]
    crew = Crew(
        agents=[researcher, writer],
        tasks=tasks,
        process=Process.hierarchical,
        manager_agent=manager,
        planning=False,
        memory=False,
        verbose=False,
    )
    crew.kickoff()
    manager_id = llm.agent_id_for(manager)
    engine = llm.backend.engine  # type: ignore[attr-defined]
    turns = [t for t in llm.turns if t["agent_id"] == manager_id]
    firsts: dict[str, dict[str, Any]] = {}
    for t in turns:
        firsts.setdefault(str(t["task"]), t)
    cache = engine._shelf.pool.get(manager_id)
    kept = getattr(cache, "checkpoints", None)  # None: a kvshelf without checkpoints (a before run)
    out = {
        "manager_id": manager_id,
        # the end of its system text (tool descriptions included), in tokens: its first checkpoint
        "system_tokens": kept[0].position if kept else None,
        "manager_calls": [{k: t[k] for k in ("task", "cache", "prompt_tokens", "cached_tokens")} for t in turns],
        "first_call_per_task": {
            k: {x: v[x] for x in ("cache", "prompt_tokens", "cached_tokens")} for k, v in firsts.items()
        },
        "record_tokens": len(cache.tokens) if cache is not None else None,
        "checkpoints": [c.position for c in kept] if kept is not None else None,
        "checkpoint_bytes": getattr(cache, "checkpoint_bytes", None),
    }
    engine.close()
    return out


def crew_main(args: argparse.Namespace) -> None:
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvshelf-crew-")
    start = loadavg()
    first = run_crew(cache_dir, args.max_tokens, args.model)
    code = f"import json, sys; sys.argv=['x']; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    code += f"import checkpoints as c; print(json.dumps(c.run_crew({cache_dir!r}, {args.max_tokens}, {args.model!r})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {"run_1_in_ram": first, "run_2_after_restart": second, "loadavg_start": start, "loadavg_end": loadavg()}
    print(json.dumps(result, indent=2))
    print("wrote", write_json("checkpoints-crew", result))


# -- the bytes ---------------------------------------------------------------------------------
def bytes_main(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from kvshelf.kv.agent_cache import AgentCache
    from kvshelf.kv.record import agent_record
    from kvshelf.model.loader import load
    from kvshelf.storage.codec import encode

    spec = load("embedded", progress=False).spec
    rows: list[dict[str, Any]] = []
    scenarios = {"short last turn": 200, "last turn longer than the window": 1500}
    for total, (scenario, last_turn) in [(t, s) for t in (4096, 16384) for s in scenarios.items()]:
        boundaries = {600, total - last_turn}  # the end of the system text, of the last complete turn
        cache = AgentCache.empty(spec)
        mx.random.seed(0)
        at = 0
        stops = sorted(boundaries | set(range(256, total, 256)) | {total})
        for end in stops:
            n = end - at
            for c, layer in zip(cache.layers, spec.layers):
                c.append(
                    mx.random.normal((1, layer.kv_heads, n, layer.k_head_dim)),
                    mx.random.normal((1, layer.kv_heads, n, layer.v_head_dim)),
                )
            cache.tokens.extend([1] * n)
            mx.eval(cache.arrays())
            at = end
            if end in boundaries:
                cache.checkpoint()
        cache.prune_checkpoints()  # as at the end of the request
        record = agent_record(cache)
        with_ck = sum(len(p) for p in encode(record, "agent", "fingerprint"))
        bare = agent_record(cache)
        bare.meta.pop("checkpoints", None)
        bare.tensors = {k: v for k, v in bare.tensors.items() if not k.startswith("c")}
        without = sum(len(p) for p in encode(bare, "agent", "fingerprint"))
        rows.append(
            {
                "tokens": total,
                "scenario": scenario,
                "checkpoints": [c.position for c in cache.checkpoints],
                "ram_layers_bytes": sum(c.nbytes for c in cache.layers),
                "ram_checkpoint_bytes": cache.checkpoint_bytes,
                "per_checkpoint_bytes": [c.nbytes for c in cache.checkpoints],
                "record_bytes_without": without,
                "record_bytes_with": with_ck,
            }
        )
    for r in rows:
        print(
            f"{r['tokens']:>6} tokens, {r['scenario']}: checkpoints at {r['checkpoints']}: "
            f"+{r['ram_checkpoint_bytes'] / 1e6:.2f} MB in RAM (layers {r['ram_layers_bytes'] / 1e6:.2f} MB), "
            f"record {r['record_bytes_without'] / 1e6:.2f} -> {r['record_bytes_with'] / 1e6:.2f} MB"
        )
    print("wrote", write_json("checkpoints-bytes", {"rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    crew = sub.add_parser("crew")
    crew.add_argument("--cache-dir")
    crew.add_argument("--max-tokens", type=int, default=48)
    crew.add_argument("--model", default="embedded")
    sub.add_parser("bytes")
    args = parser.parse_args()
    crew_main(args) if args.what == "crew" else bytes_main(args)


if __name__ == "__main__":
    main()
