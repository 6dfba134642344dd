"""``kvshelf demo``: four agents with their own system prompts hold a round-table.

Every turn prints where each agent's cache came from (cold: computed from nothing;
warm: restored from disk; hot: still in RAM), its time to first token, how many
prompt tokens were reused, and the bytes the agent holds in RAM and on disk.

The conversation itself (what a framework would keep in its own memory) is saved
next to the caches, so running the demo again continues it: every agent's first
turn is then restored from disk instead of recomputed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .engine import ChatResult, Engine

TOPIC = (
    "The town of Millbrook must decide what to do with an old railway station that has "
    "been empty for ten years. Options on the table: a public library, a food market, "
    "a bicycle workshop, or demolition to make room for housing."
)

AGENTS = {
    "planner": "You are Ada, the town planner. You care about budgets, zoning and traffic. "
    "Answer in two short sentences.",
    "historian": "You are Ben, the local historian. You care about heritage and the station's "
    "Victorian brickwork. Answer in two short sentences.",
    "shopkeeper": "You are Cleo, who runs the bakery on Station Road. You care about foot "
    "traffic and small businesses. Answer in two short sentences.",
    "student": "You are Dev, a student who cycles everywhere. You care about young people and "
    "cheap places to meet. Answer in two short sentences.",
}


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:6.2f} MB"


def _row(agent: str, turn: int, r: ChatResult, ram: int, disk: int) -> str:
    return (
        f"turn {turn:2d}  {agent:<10s} {r.cache:<4s}  ttft {r.ttft_s * 1000:8.1f} ms  "
        f"cached {r.usage.cached_tokens:5d}/{r.usage.prompt_tokens:<5d} "
        f"ram {_fmt_bytes(ram)}  disk {_fmt_bytes(disk)}"
    )


def run_demo(
    model: str = "embedded",
    cache_dir: Path | None = None,
    turns: int = 3,
    max_tokens: int = 40,
    budget: str | None = None,
    fresh: bool = False,
) -> dict:
    """Run the round-table; returns a summary (also printed)."""
    engine = Engine(model=model, cache_dir=cache_dir, budget=budget)
    state_file = engine.cache_dir / "demo-state.json"
    if fresh:
        for agent in AGENTS:
            engine.forget(f"demo-{agent}")
        state_file.unlink(missing_ok=True)
    state = json.loads(state_file.read_text()) if state_file.exists() else _new_state()
    histories, unheard = state["histories"], state["unheard"]
    first_turn = state["turn"] + 1
    print(f"kvshelf demo: {len(AGENTS)} agents on {engine.loaded.name}; caches in {engine.cache_dir}")
    if first_turn > 1:
        print(f"continuing the conversation at round {first_turn}: every agent's cache should come back warm from disk")
    t0 = time.perf_counter()
    counts = {"hot": 0, "warm": 0, "cold": 0}
    ttfts: dict[str, list[float]] = {"hot": [], "warm": [], "cold": []}
    for turn in range(first_turn, first_turn + turns):
        for agent in AGENTS:
            # Like a framework's agent memory: the agent hears what others said since its
            # last turn, as one user message, and its own replies stay assistant messages.
            heard = unheard[agent] + [f"Round {turn}: what do you say now?"]
            histories[agent].append({"role": "user", "content": "\n".join(heard)})
            result = engine.chat(f"demo-{agent}", histories[agent], max_tokens=max_tokens)
            histories[agent].append({"role": "assistant", "content": result.text})
            unheard[agent] = []
            for other in AGENTS:
                if other != agent:
                    unheard[other].append(f"{AGENTS_NAMES[agent]} said: {result.text.strip()}")
            info = next(a for a in engine.agents() if a.agent_id == f"demo-{agent}")
            print(_row(agent, turn, result, info.ram_bytes, info.disk_bytes))
            counts[result.cache] += 1
            ttfts[result.cache].append(result.ttft_s)
        state["turn"] = turn
        state_file.write_text(json.dumps(state, indent=1))
    engine.close()
    wall = time.perf_counter() - t0
    summary = {
        "wall_s": wall,
        "requests": counts,
        "median_ttft_s": {k: sorted(v)[len(v) // 2] for k, v in ttfts.items() if v},
    }
    print(f"total wall time {wall:.1f} s; requests by cache source: {counts}")
    print("median ttft: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in summary["median_ttft_s"].items()))
    return summary


def _new_state() -> dict:
    return {
        "turn": 0,
        "histories": {a: [{"role": "system", "content": p}] for a, p in AGENTS.items()},
        "unheard": {a: [f"Topic: {TOPIC}"] for a in AGENTS},
    }


AGENTS_NAMES = {"planner": "Ada", "historian": "Ben", "shopkeeper": "Cleo", "student": "Dev"}
