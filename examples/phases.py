"""Five phases, four agents, one case file: kvshelf's working memory across phases.

A detective, two suspects and a judge work through an inquiry (opening statements,
two interrogations, a confrontation, the verdict). The case file is prefilled once and
forked to all four agents (its blocks are stored once, in RAM and on disk); each agent's
cache carries over from phase to phase, so only new messages are prefilled; and the
next speaker's cache is extended in the background while the current one speaks.

Run it twice: the second run finds all four agents on disk and restores them (warm).

    python examples/phases.py [--max-tokens 24] [--cache-dir DIR] [--fresh]
"""

from __future__ import annotations

import argparse
import time

from kvbench.phases import MODES, Turn, play
from kvshelf.runtime.engine import Engine

NAMESPACE = "phases-example"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fresh", action="store_true", help="forget the example's agents first")
    args = parser.parse_args()

    engine = Engine(args.model, args.cache_dir)
    if args.fresh:
        for a in engine.agents():
            if a.agent_id.startswith(NAMESPACE + "-"):
                engine.forget(a.agent_id)
    print(
        "agents on disk from an earlier run:",
        [a.agent_id for a in engine.agents() if a.agent_id.startswith(NAMESPACE)],
    )
    phase = None

    def show(turn: Turn) -> None:
        nonlocal phase
        if turn.phase != phase:
            phase = turn.phase
            print(f"\n== {phase}")
        print(
            f"  {turn.agent:<9s} {turn.cache:<4s} cached {turn.cached_tokens:5d}/{turn.prompt_tokens:<5d} "
            f"TTFT {turn.ttft_s:6.2f}s  {turn.text[:70]!r}"
        )

    t0 = time.perf_counter()
    result = play(engine, MODES[2], max_tokens=args.max_tokens, namespace=NAMESPACE, on_turn=show)
    engine.flush()
    shared = {p.id: len(engine._shelf.shared.users(p.id)) for p in engine._shelf.shared.resident()}
    print(
        f"\nwall {time.perf_counter() - t0:.1f}s over {len(result['turns'])} turns; shared prefixes in RAM "
        f"(id: agents using it): {shared}"
    )
    for a in engine.agents():
        if a.agent_id.startswith(NAMESPACE):
            print(
                f"  {a.agent_id:<26s} {a.tokens:5d} tokens  "
                f"own RAM {a.ram_bytes / 1e6:5.2f} MB  disk {a.disk_bytes / 1e6:5.2f} MB"
            )
    engine.close()


if __name__ == "__main__":
    main()
