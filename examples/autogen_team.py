"""Three AutoGen agents in a RoundRobinGroupChat, each with its own persistent KV cache.

    python examples/autogen_team.py             # embedded model, in this process, offline
    python examples/autogen_team.py             # again: the team continues, agents come back warm
    python examples/autogen_team.py --fresh     # start the conversation over
    python examples/autogen_team.py --base-url http://127.0.0.1:8000/v1   # a running kvshelf serve

All three agents share one ``KVShelfChatCompletionClient``; kvshelf tells them apart by
the AutoGen runtime's agent id (``planner_<team uuid>`` -> ``planner``), so each has its
own cache. For each turn the script prints where the agent's cache came from (``cold``:
computed, ``hot``: in RAM, ``warm``: restored from disk), how many prompt tokens were
reused, and the time to first token. The team's state (AutoGen's ``save_state``) is kept
between runs, so the second run continues the same conversation: every agent's first
turn is ``warm``, with its whole history reused instead of recomputed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import httpx
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import ChatAgent, Team
from autogen_agentchat.messages import TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat

import kvshelf  # noqa: F401  (before MLX, for OpenBLAS)
from kvshelf.adapters.autogen import KVShelfChatCompletionClient
from kvshelf.adapters.backend import shared_engine
from kvshelf.paths import kvshelf_home

PREFIX = "autogen-team-"
AGENTS = {
    "planner": "You are the planner of a small town council team. Propose one concrete next step, in two sentences.",
    "critic": (
        "You are the critic of a small town council team. Name the main risk of the last proposal, in two sentences."
    ),
    "writer": "You are the writer of a small town council team. Sum up what was agreed so far, in two sentences.",
}
BRIEFING = """\
Council briefing. The town of Millbrook (pop. 8,400) must decide what to do with the
old railway depot on Station Road, closed since 2009. The building is structurally sound
but needs a new roof (estimated 310,000) and accessibility work (about 120,000). Three
proposals are on the table. First, a covered market with 24 stalls, run by the council,
open four days a week; local farmers and craft sellers have asked for one for years.
Second, a library annex and study space with free wifi, run with the county library
service, which would pay the staff but not the building work. Third, a sale to a
private developer for about 1.1 million, who would convert it into 18 flats, six of
them affordable. The depot sits next to the bus station and a car park with 60 spaces.
Residents in the last survey ranked "things for young people to do" and "keeping the
high street alive" as their top two concerns. The council's reserve is 900,000 and it
must keep at least 400,000 untouched. A regional heritage grant of up to 250,000 is
open until March for projects that keep historic buildings in public use.
"""
QUESTIONS = [
    "Which proposal should the council back, and what is the first step?",
    "How do we pay for it without breaking the reserve rule?",
    "What do we tell residents at next month's meeting?",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running kvshelf serve (default: embedded, in-process)")
    parser.add_argument("--api-key", default=os.environ.get("KVSHELF_API_KEY"))
    parser.add_argument("--model", default="embedded", help="in-process model (default: embedded Gemma 3 270M)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per run (each agent speaks once a round)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument(
        "--state",
        type=Path,
        default=kvshelf_home() / "examples" / "autogen_team.json",
        help="where the team's conversation is kept between runs",
    )
    parser.add_argument("--fresh", action="store_true", help="forget the saved conversation and start over")
    return parser.parse_args()


def forget_agents(args: argparse.Namespace) -> None:
    """Erase the agents' caches (RAM and disk), so that the first run starts cold."""
    ids = [PREFIX + name for name in AGENTS]
    if args.base_url:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        root = args.base_url.rstrip("/").removesuffix("/v1")
        for aid in ids:
            httpx.delete(f"{root}/v1/agents/{aid}", headers=headers)  # 404 if it never spoke
    else:
        engine = shared_engine(args.model)
        known = {a.agent_id for a in engine.agents()}
        for aid in ids:
            if aid in known:
                engine.forget(aid)


async def main() -> None:
    args = parse_args()
    # agent_prefix keeps these agents apart from others with the same names (kvshelf demo's planner)
    client = KVShelfChatCompletionClient(
        args.model, base_url=args.base_url, api_key=args.api_key, max_tokens=args.max_tokens, agent_prefix=PREFIX
    )
    agents: list[ChatAgent | Team] = [
        AssistantAgent(name, model_client=client, system_message=system) for name, system in AGENTS.items()
    ]
    team = RoundRobinGroupChat(agents, max_turns=args.rounds * len(agents))

    if args.fresh:
        forget_agents(args)
    saved = None if args.fresh or not args.state.exists() else json.loads(args.state.read_text())
    run = 1 if saved is None else saved["run"] + 1
    if saved is None:
        task = f"{BRIEFING}\n{QUESTIONS[0]}"
    else:
        await team.load_state(saved["team"])
        task = QUESTIONS[(run - 1) % len(QUESTIONS)]
    mode = args.base_url or f"in-process, model {args.model}"
    print(f"== run {run} ({mode}): {task.splitlines()[-1]}\n")
    print(f"{'agent':<8} {'cache':<5} {'cached/prompt':>14} {'TTFT':>8}  reply")

    async for message in team.run_stream(task=task):
        if not isinstance(message, TextMessage) or message.source == "user":
            continue
        turn = client.last_turn  # the team runs one agent at a time: this agent's call
        assert turn is not None and turn.agent_id == PREFIX + message.source
        reply = " ".join(message.content.split())
        print(
            f"{message.source:<8} {turn.cache:<5} {turn.cached_tokens:>6}/{turn.prompt_tokens:<7} "
            f"{turn.ttft_s:>7.2f}s  {reply[:70]!r}"
        )

    args.state.parent.mkdir(parents=True, exist_ok=True)
    args.state.write_text(json.dumps({"run": run, "team": await team.save_state()}))
    usage = client.total_usage()
    print(
        f"\nusage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens; "
        f"{sum(t.cached_tokens for t in client.turns)} prompt tokens came from the agents' caches."
    )
    print("Run again to continue: each agent's first turn comes back warm, restored from disk.")
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
