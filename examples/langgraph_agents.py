"""Two LangGraph agents (``langchain.agents.create_agent``) on kvshelf, each with its own KV cache.

``researcher`` looks facts up with a tool, ``writer`` turns them into a newsletter line.
Both use one ``ChatKVShelf``; each is known to kvshelf by its ``name`` (LangChain passes
it as ``lc_agent_name``), so each keeps its own cache, in RAM and on disk.

    python examples/langgraph_agents.py            # embedded model, in-process (offline)
    python examples/langgraph_agents.py            # again: the agents come back "warm"
    python examples/langgraph_agents.py --fresh    # start over
    python examples/langgraph_agents.py --base-url http://127.0.0.1:8000/v1   # a `kvshelf serve`

Every model call prints its agent, where its cache came from (cold: computed; hot: in
RAM; warm: restored from disk), how many prompt tokens were read from the cache, and the
time to first token. The conversation is kept in a small JSON file, so a second run
continues it and its first turns are served from the caches the first run left on disk.
Replies are short and greedy (temperature 0); the embedded model is a 270M model, so
expect cached tokens and TTFT to be the interesting part, not the prose. The researcher's
first call each turn is made to call the tool (``tool_choice``), since a model this
small rarely calls one on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, cast

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelCallLimitMiddleware, ModelRequest, wrap_model_call
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    HumanMessage,
    ToolMessage,
    messages_from_dict,
    messages_to_dict,
)
from langchain_core.tools import tool

import kvshelf  # noqa: F401  (OpenBLAS before MLX)
from kvshelf.adapters.backend import LocalBackend, RemoteBackend
from kvshelf.adapters.langchain import ChatKVShelf
from kvshelf.paths import kvshelf_home

BRIEFING = (
    "You work for Northwind Outfitters, a small company that makes waterproof hiking gear. "
    "The team is preparing the spring newsletter. Products: the Ridge jacket (3-layer shell, "
    "410 g), the Tarn trousers (2.5-layer, 290 g) and the Cairn pack (28 litres, roll top). "
    "Tone: plain, friendly, no hype. Keep every answer to one or two short sentences."
)
FACTS = {
    "ridge": "The Ridge jacket weighs 410 g and keeps out 20,000 mm of water.",
    "tarn": "The Tarn trousers weigh 290 g and pack into their own pocket.",
    "cairn": "The Cairn pack holds 28 litres and has a roll-top closure.",
}
TOPICS = ["the Ridge jacket", "the Tarn trousers", "the Cairn pack", "the Ridge jacket again"]


@tool
def lookup_product(product: str = "") -> str:
    """Look up the facts about one of our products (ridge, tarn or cairn)."""
    key = next((k for k in FACTS if k in str(product).lower()), None)
    return FACTS[key] if key else " ".join(FACTS.values())  # a small model may not name one: all of them


@wrap_model_call
def call_the_tool_first(request: ModelRequest, handler: Any) -> Any:
    """Force a tool call when the last message is the user's question (not a tool result)."""
    if request.tools and not isinstance(request.messages[-1], ToolMessage):
        request = request.override(tool_choice="any")
    return handler(request)


def report(agent: str, turn: int, new: list) -> None:
    for msg in new:
        if isinstance(msg, ToolMessage):
            print(f"    {agent:>10}  tool -> {msg.content!r}")
        elif isinstance(msg, AIMessage) and "kvshelf" not in msg.response_metadata:
            print(f"    {agent:>10}  ({msg.text})")  # a middleware's message, e.g. the call limit
        elif isinstance(msg, AIMessage):
            kv, usage = msg.response_metadata.get("kvshelf", {}), msg.usage_metadata
            read = ((usage.get("input_token_details") if usage else None) or {}).get("cache_read", 0)
            prompt = usage.get("input_tokens", 0) if usage else 0
            said = (
                f"calls {msg.tool_calls[0]['name']}({json.dumps(msg.tool_calls[0]['args'])})"
                if msg.tool_calls
                else repr(msg.text.strip()[:70])
            )
            print(
                f"  t{turn} {agent:>10}  {kv.get('cache', '?'):>4}  cached {read:4d}/{prompt:<4d}"
                f"  ttft {kv.get('ttft_s', 0):6.2f}s  {said}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running `kvshelf serve` (default: the embedded model in-process)")
    parser.add_argument("--api-key", default=os.environ.get("KVSHELF_API_KEY"))
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--cache-dir", help="in-process agents' caches (default: kvshelf's own)")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--state",
        type=Path,
        help="where the conversation is kept between runs "
        "(default: langgraph_agents.json in --cache-dir, else in kvshelf's home)",
    )
    parser.add_argument("--fresh", action="store_true", help="forget both agents and start over")
    args = parser.parse_args()
    args.state = args.state or Path(args.cache_dir or kvshelf_home() / "examples") / "langgraph_agents.json"

    def chat_model(max_tokens: int) -> ChatKVShelf:  # every instance shares one engine (or server)
        return ChatKVShelf(
            model=args.model,
            base_url=args.base_url,
            api_key=args.api_key,
            cache_dir=args.cache_dir,
            max_tokens=max_tokens,
        )

    llm = chat_model(args.max_tokens)
    researcher_middleware: list[AgentMiddleware[Any, Any, Any]] = [
        call_the_tool_first,
        ModelCallLimitMiddleware(run_limit=2),
    ]
    agents = {  # the researcher's replies are longer: a whole tool call must fit
        "researcher": create_agent(
            chat_model(2 * args.max_tokens),
            tools=[lookup_product],
            system_prompt=BRIEFING + " You research facts.",
            middleware=researcher_middleware,
            name="researcher",
        ),
        "writer": create_agent(llm, system_prompt=BRIEFING + " You write the newsletter.", name="writer"),
    }
    if args.fresh:
        forget(llm, list(agents))
        args.state.unlink(missing_ok=True)
    state: dict[str, Any] = json.loads(args.state.read_text()) if args.state.exists() else {"turn": 0, "histories": {}}
    # messages_from_dict builds the concrete message classes (AnyMessage), typed as their base class
    histories = {name: cast(list[AnyMessage], messages_from_dict(state["histories"].get(name, []))) for name in agents}
    print(
        f"{'continuing' if state['turn'] else 'starting'} on {llm.backend.model_name} "
        f"({'remote ' + args.base_url if args.base_url else 'in-process'}); state in {args.state}"
    )

    started = time.monotonic()
    for _ in range(args.turns):
        turn = state["turn"] = state["turn"] + 1
        topic = TOPICS[(turn - 1) % len(TOPICS)]
        print(f"\n== turn {turn}: {topic}")
        asks = {"researcher": f"What should the newsletter say about {topic}?"}
        for name, agent in agents.items():
            if name == "writer":
                found = histories["researcher"][-1].text.strip() or topic
                asks["writer"] = f"Write one newsletter line about {topic}. The researcher says: {found}"
            before = len(histories[name]) + 1
            histories[name] = agent.invoke({"messages": [*histories[name], HumanMessage(asks[name])]})["messages"]
            report(name, turn, histories[name][before:])
    print(f"\n{args.turns} turns in {time.monotonic() - started:.1f}s")

    args.state.parent.mkdir(parents=True, exist_ok=True)
    state["histories"] = {name: messages_to_dict(h) for name, h in histories.items()}
    args.state.write_text(json.dumps(state))


def forget(llm: ChatKVShelf, names: list[str]) -> None:
    backend = llm.backend
    for name in names:
        if isinstance(backend, LocalBackend):
            backend.engine.forget(name)
        elif isinstance(backend, RemoteBackend):
            backend._client.delete(f"/v1/agents/{name}")  # 404 when it does not exist: fine


if __name__ == "__main__":
    main()
