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

from kvshelf.runtime.engine import ChatResult, Engine

TOPIC = """\
Briefing for the Millbrook town council, spring session.

The old railway station on Station Road closed to passengers ten years ago, when the
branch line was cut back to Ashford Junction. The building is a two-storey Victorian
brick hall with a slate roof, a glazed canopy over the former platform, a booking hall
of about 300 square metres, two waiting rooms, a parcels office and a goods shed of
roughly 500 square metres behind it. The council bought the site from the railway five
years ago for a nominal sum, on condition that it is put to public benefit within
seven years, or it reverts.

Condition: a survey last autumn found the roof sound but the canopy's cast-iron columns
corroded at their bases. Repairing the canopy is estimated at 180,000 pounds. The
booking hall needs rewiring, heating and accessible toilets before any public use,
estimated at 420,000 pounds. The goods shed is structurally sound but has no insulation.

Four proposals are on the table.
1. A public library and study space in the booking hall, with the goods shed as a
   community events room. Running cost about 95,000 pounds a year; the county would
   fund half for the first five years if the old library on Mill Lane is sold.
2. A covered food market, six days a week, with stalls in the booking hall and goods
   shed. A market operator has offered a 15-year lease at 40,000 pounds a year, but wants
   40 parking spaces, which would take the old coal yard.
3. A bicycle workshop and repair cafe run by a charity, with bike storage for commuters
   who ride to the bus interchange. Small rent, 12 jobs, volunteer-run evenings.
4. Demolition and 36 homes, 12 of them affordable. A developer would pay 1.1 million
   pounds for the site, but the heritage society has applied for listed status, which
   would block demolition if granted.

Traffic: Station Road already carries 6,000 vehicles a day and the primary school is
200 metres away. Footfall on Station Road's shops has fallen by a third since the
station closed. The town has 2,100 residents aged 16 to 25 and no youth centre.
"""

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
            engine.flush()  # saves are written behind; wait so the disk column is current
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
    medians = {k: sorted(v)[len(v) // 2] for k, v in ttfts.items() if v}
    summary = {"wall_s": wall, "requests": counts, "median_ttft_s": medians}
    print(f"total wall time {wall:.1f} s; requests by cache source: {counts}")
    print("median ttft: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in medians.items()))
    return summary


def _new_state() -> dict:
    return {
        "turn": 0,
        "histories": {a: [{"role": "system", "content": p}] for a, p in AGENTS.items()},
        "unheard": {a: [TOPIC] for a in AGENTS},
    }


AGENTS_NAMES = {"planner": "Ada", "historian": "Ben", "shopkeeper": "Cleo", "student": "Dev"}
