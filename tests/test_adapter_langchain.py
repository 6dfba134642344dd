"""``ChatKVShelf`` under real LangChain and LangGraph, offline, with ``$HOME`` in a temp dir.

The agent tests run the embedded Gemma 3 270M, in-process and against a ``kvshelf serve``
in a thread (the same engine behind both, so the agent names differ per mode); the
identity tests run a tiny random-weight model, since only the agent id of each reply
matters there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from kvshelf.adapters.backend import LocalBackend, shared_engine
from kvshelf.adapters.identity import agent_key, fallback_key
from kvshelf.adapters.langchain import ChatKVShelf
from kvshelf.runtime.engine import Engine
from kvshelf.serving.server import create_app
from tests.support.langchain_env import offline_langchain_env
from tests.support.servers import ServerThread
from tests.support.subprocesses import run_in_subprocess

SYSTEM = "You are a member of a small research team. Answer in one short sentence."
QUESTION = "What is a cache?"


offline_home = pytest.fixture(scope="module", autouse=True)(offline_langchain_env)


@pytest.fixture(scope="module")
def embedded(embedded_loaded, tmp_path_factory) -> Iterator[tuple[Engine, str]]:
    """An engine on the embedded model, and a ``kvshelf serve`` on that same engine."""
    engine = Engine(model=embedded_loaded, cache_dir=tmp_path_factory.mktemp("lc-agents"), progress=False)
    server = ServerThread(create_app(engine, close_engine=False))
    yield engine, server.url + "/v1"
    server.stop()
    engine.close()


@pytest.fixture(params=["local", "remote"])
def mode(request, embedded) -> tuple[str, dict[str, Any]]:
    engine, url = embedded
    return request.param, ({"engine": engine} if request.param == "local" else {"base_url": url})


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tmp_path_factory) -> Iterator[Engine]:
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path_factory.mktemp("lc-tiny"), progress=False)
    yield engine
    engine.close()


def ext(message: Any) -> dict:
    return message.response_metadata["kvshelf"]


def cached(message: Any) -> int:
    return message.usage_metadata["input_token_details"]["cache_read"]


def local_engine(llm: ChatKVShelf) -> Engine:
    """The in-process engine behind a model made without ``base_url``."""
    assert isinstance(llm.backend, LocalBackend)
    return llm.backend.engine


# -- agents: own caches, prefix reuse, streaming, tools, both modes -------------------------
def test_create_agent_agents_get_their_own_caches_and_reuse_them(mode):
    name, where = mode
    llm = ChatKVShelf(**where, max_tokens=6)
    alice = create_agent(llm, system_prompt=SYSTEM, name=f"alice-{name}")
    bob = create_agent(llm, system_prompt=SYSTEM, name=f"bob-{name}")

    first = alice.invoke({"messages": [HumanMessage(QUESTION)]})["messages"]
    reply = first[-1]
    assert ext(reply)["agent_id"] == f"alice-{name}" and ext(reply)["cache"] == "cold" and cached(reply) == 0
    assert reply.response_metadata["model_name"] and reply.usage_metadata["output_tokens"] >= 1

    # bob asks the very same thing: had he shared alice's cache, he would read from it
    other = bob.invoke({"messages": [HumanMessage(QUESTION)]})["messages"][-1]
    assert ext(other)["agent_id"] == f"bob-{name}" and ext(other)["cache"] == "cold" and cached(other) == 0

    second = alice.invoke({"messages": [*first, HumanMessage("Why does it help?")]})["messages"][-1]
    assert ext(second)["agent_id"] == f"alice-{name}" and ext(second)["cache"] == "hot"
    assert cached(second) >= reply.usage_metadata["input_tokens"] - 2  # all of turn 1 but a re-rendered tail
    assert second.usage_metadata["input_tokens"] > cached(second)


def test_streaming_through_a_langgraph_agent(mode):
    name, where = mode
    agent = create_agent(ChatKVShelf(**where, max_tokens=6), system_prompt=SYSTEM, name=f"streamer-{name}")
    chunks = [msg for msg, _meta in agent.stream({"messages": [HumanMessage(QUESTION)]}, stream_mode="messages")]
    assert len(chunks) >= 2
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert isinstance(full, AIMessageChunk)  # the model's tokens, summed
    assert full.usage_metadata is not None
    assert full.text and ext(full)["agent_id"] == f"streamer-{name}"  # identity from the graph's metadata
    assert full.usage_metadata["output_tokens"] >= 1 and full.response_metadata["finish_reason"] in ("stop", "length")
    # the model's own stream (and astream) carry the same fields
    llm = ChatKVShelf(**where, max_tokens=4, agent_id=f"streamer-{name}")
    parts = list(llm.stream([SystemMessage(SYSTEM), HumanMessage(QUESTION)]))
    assert parts[-1].chunk_position == "last" and ext(parts[-1])["cache"] == "hot" and cached(parts[-1]) > 0


@tool
def get_weather(city: str = "Paris") -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


def test_tool_call_round_trip(mode):
    name, where = mode
    llm = ChatKVShelf(**where, max_tokens=40, agent_id=f"forecaster-{name}")
    question = [SystemMessage("You are a weather assistant."), HumanMessage("What is the weather in Paris?")]
    # A 270M model rarely calls a tool on its own, so the call is forced by name. Its
    # arguments are not to be trusted (it tends to copy the schema), hence the default city.
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    assert call.response_metadata["finish_reason"] == "tool_calls" and call.usage_metadata is not None
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and call.tool_calls[0]["id"]
    result = get_weather.invoke(call.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]

    # the history with the call and its result goes back; the tools stay offered
    answer = llm.bind_tools([get_weather], max_tokens=6).invoke([*question, call, result])
    assert isinstance(answer, AIMessage) and ext(answer)["cache"] == "hot"
    assert cached(answer) > call.usage_metadata["input_tokens"] // 2


@pytest.mark.asyncio
async def test_async_invoke_and_stream(mode):
    name, where = mode
    llm = ChatKVShelf(**where, max_tokens=4, agent_id=f"async-{name}")
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    whole = await llm.ainvoke(messages)
    assert whole.text and ext(whole)["agent_id"] == f"async-{name}"
    parts = [chunk async for chunk in llm.astream(messages, config={"metadata": {"agent_id": f"async2-{name}"}})]
    assert parts[-1].chunk_position == "last" and ext(parts[-1])["agent_id"] == f"async-{name}"  # bound id wins


# -- identity: each step of the resolution order --------------------------------------------
MESSAGES = [SystemMessage("You are terse."), HumanMessage("Hi")]


def who(message: Any) -> str:
    return ext(message)["agent_id"]


def test_identity_bound_and_instance_ids_come_first(tiny):
    llm = ChatKVShelf(engine=tiny, max_tokens=1, agent_id="inst")
    meta: RunnableConfig = {"metadata": {"agent_id": "meta", "lc_agent_name": "named"}}
    assert who(llm.invoke(MESSAGES, config=meta)) == "inst"
    assert who(llm.bind(agent_id="bound").invoke(MESSAGES, config=meta)) == "bound"  # bound beats instance
    assert who(llm.invoke(MESSAGES, agent_id="kw")) == "kw"


def test_identity_from_run_metadata_in_invoke_and_stream(tiny):
    llm = ChatKVShelf(engine=tiny, max_tokens=1)
    both: RunnableConfig = {"metadata": {"lc_agent_name": "named", "agent_id": "meta"}}
    assert who(llm.invoke(MESSAGES, config=both)) == "meta.named"  # the name scoped under the id
    assert who(llm.invoke(MESSAGES, config={"metadata": {"lc_agent_name": "named"}})) == "named"
    assert who(llm.invoke(MESSAGES, config={"metadata": {"agent_id": "meta"}})) == "meta"
    assert who(list(llm.stream(MESSAGES, config=both))[-1]) == "meta.named"  # stream() gives _stream no run manager
    # the call's own metadata beats what surrounds it

    def inner(messages: list[BaseMessage]) -> AIMessage:
        return llm.invoke(messages, config={"metadata": {"agent_id": "inner"}})

    outer = RunnableLambda(inner)
    assert who(outer.invoke(MESSAGES, config={"metadata": {"agent_id": "outer"}})) == "inner"


def test_identity_from_the_ambient_config(tiny):
    llm = ChatKVShelf(engine=tiny, max_tokens=1)

    def direct(messages: list) -> BaseMessage:  # as a wrapper that calls the model's _generate would
        return llm._generate(messages).generations[0].message

    around = RunnableLambda(direct)
    assert who(around.invoke(MESSAGES, config={"metadata": {"lc_agent_name": "amb-name"}})) == "amb-name"
    both: RunnableConfig = {"metadata": {"lc_agent_name": "amb-name", "agent_id": "amb-id"}}
    assert who(around.invoke(MESSAGES, config=both)) == "amb-id.amb-name"


def test_identity_from_create_agent_names(tiny):
    llm = ChatKVShelf(engine=tiny, max_tokens=1)
    carol = create_agent(llm, system_prompt="You are terse.", name="carol")
    assert who(carol.invoke({"messages": [HumanMessage("Hi")]})["messages"][-1]) == "carol"
    picked = carol.invoke({"messages": [HumanMessage("Hi")]}, config={"metadata": {"agent_id": "user-42"}})
    assert who(picked["messages"][-1]) == "user-42.carol"  # the agent's name scoped under the caller's id
    analyst = create_agent(llm, name="Research Analyst")  # not a valid id: slug plus a hash
    reply = analyst.invoke({"messages": [HumanMessage("Hi")]})["messages"][-1]
    assert who(reply) == agent_key("Research Analyst") and who(reply).startswith("Research-Analyst-")


def test_identity_falls_back_to_the_system_text_and_tools(tiny):
    llm = ChatKVShelf(engine=tiny, max_tokens=1)
    first = who(llm.invoke(MESSAGES))
    assert first == fallback_key([{"role": "system", "content": "You are terse."}]) and first.startswith("anon-")
    assert who(llm.invoke([SystemMessage("You are terse."), HumanMessage("Other question")])) == first  # stable
    assert who(llm.invoke([SystemMessage("You are verbose."), HumanMessage("Hi")])) != first
    assert who(llm.bind_tools([get_weather]).invoke(MESSAGES)) not in (first, None)


@tool
def get_time(city: str = "Paris") -> str:
    """Get the local time in a city."""
    return f"It is noon in {city}."


def test_fallback_key_and_prompt_do_not_depend_on_the_order_of_the_tools(tiny):
    llm = ChatKVShelf(engine=tiny, max_tokens=1)
    one = llm.bind_tools([get_weather, get_time]).invoke(MESSAGES)
    other = llm.bind_tools([get_time, get_weather]).invoke(MESSAGES)
    assert who(one) == who(other) and who(one).startswith("anon-")
    # the same canonical prompt, too: the second call reads all of it but the last token from the cache
    assert other.usage_metadata is not None and one.usage_metadata is not None
    assert other.usage_metadata["input_tokens"] == one.usage_metadata["input_tokens"]
    assert cached(other) == other.usage_metadata["input_tokens"] - 1
    # a named agent's tools stay in the order given
    assert who(llm.bind_tools([get_time, get_weather]).invoke(MESSAGES, agent_id="ordered")) == "ordered"


def test_a_caller_wide_agent_id_is_scoped_per_agent_of_a_graph(tiny):
    """``metadata.agent_id`` given for a whole LangGraph run: each agent keeps a cache of its own."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    llm = ChatKVShelf(engine=tiny, max_tokens=2)
    graph = StateGraph(MessagesState)
    graph.add_node("researcher", create_agent(llm, system_prompt="You research.", name="researcher"))
    graph.add_node("writer", create_agent(llm, system_prompt="You write.", name="writer"))
    graph.add_edge(START, "researcher")
    graph.add_edge("researcher", "writer")
    graph.add_edge("writer", END)
    app = graph.compile()
    config: RunnableConfig = {"metadata": {"agent_id": "user-42"}}
    out = app.invoke({"messages": [HumanMessage("Write about caches.")]}, config=config)["messages"]
    replies = [m for m in out if isinstance(m, AIMessage)]
    assert [who(m) for m in replies] == ["user-42.researcher", "user-42.writer"]
    assert {"user-42.researcher", "user-42.writer"} <= {a.agent_id for a in tiny.agents()}
    # the next run with the same caller id: each agent reads its own cache, none evicts the other
    again = app.invoke({"messages": [HumanMessage("Write about caches.")]}, config=config)["messages"]
    assert [ext(m)["cache"] for m in again if isinstance(m, AIMessage)] == ["hot", "hot"]
    assert all(cached(m) > 0 for m in again if isinstance(m, AIMessage))


def test_unnamed_agents_with_one_system_prompt_share_a_cache_and_stay_correct(tiny):
    """Documented: two unnamed agents with the same system text and tools share one
    ``anon-`` cache. Each evicts the other's history, but every answer is what a fresh
    computation gives."""
    llm = ChatKVShelf(engine=tiny, max_tokens=4)
    first, second = create_agent(llm, system_prompt="You are terse."), create_agent(llm, system_prompt="You are terse.")
    questions = ["What is a cache?", "Name a colour.", "What is a cache? Say more."]
    for agent, question in zip((first, second, first), questions):
        reply = agent.invoke({"messages": [HumanMessage(question)]})["messages"][-1]
        assert who(reply) == fallback_key([{"role": "system", "content": "You are terse."}])
        fresh = tiny.chat(
            None, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}], max_tokens=4
        )
        assert reply.text == fresh.text


SUPERVISOR = """
import json
import kvshelf
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langgraph_supervisor import create_supervisor
from kvshelf.adapters.langchain import ChatKVShelf
from kvshelf.runtime.engine import Engine

engine = Engine({model!r}, {cache!r}, progress=False)
llm = ChatKVShelf(engine=engine, max_tokens=1)
names = ["researcher", "writer", "critic", "planner", "coder"]
agents = [create_agent(llm, system_prompt=f"You are the {{n}}.", name=n) for n in names]
app = create_supervisor(agents, model=llm, prompt="You manage a team.").compile()
reply = app.invoke({{"messages": [HumanMessage("Write a report.")]}})["messages"][-1]
meta, usage = reply.response_metadata["kvshelf"], reply.usage_metadata
engine.close()
print(json.dumps({{"agent_id": meta["agent_id"], "cache": meta["cache"], "prompt": usage["input_tokens"],
    "cached": usage["input_token_details"]["cache_read"], "set_order": list(set(names))}}))
"""


def test_langgraph_supervisor_keeps_one_id_across_processes(tiny_dirs, tmp_path):
    """The supervisor names no agent and offers handoff tools in ``set`` order, which
    follows ``PYTHONHASHSEED``: it still gets one id, and a second process reads its cache."""
    code = SUPERVISOR.format(model=str(tiny_dirs["gemma3_text"]), cache=str(tmp_path))
    # two processes are enough: seeds 1 and 2 order the five names differently (asserted)
    runs = [run_in_subprocess(code, env={"PYTHONHASHSEED": str(seed)}) for seed in (1, 2)]
    assert len({tuple(r["set_order"]) for r in runs}) == len(runs)  # the tools really came in another order
    assert len({r["agent_id"] for r in runs}) == 1 and runs[0]["agent_id"].startswith("anon-")
    assert runs[0]["cache"] == "cold"
    for later in runs[1:]:
        assert later["cache"] == "warm" and later["cached"] == later["prompt"] - 1
    assert len(list(tmp_path.rglob("anon-*.safetensors"))) == 1  # no orphan records


# -- the default in-process engine and a restart ----------------------------------------------
def test_default_mode_shares_one_engine_and_restores_from_disk(tiny_dirs, tmp_path):
    model = str(tiny_dirs["llama"])
    llm = ChatKVShelf(model=model, cache_dir=str(tmp_path), max_tokens=3, agent_id="dora")
    assert local_engine(ChatKVShelf(model=model, cache_dir=str(tmp_path))) is local_engine(llm)
    assert local_engine(llm) is shared_engine(model, tmp_path)
    first = llm.invoke(MESSAGES)
    assert ext(first)["cache"] == "cold"
    local_engine(llm).close()  # saves flushed; the next backend is a new engine on the same directory

    again = ChatKVShelf(model=model, cache_dir=str(tmp_path), max_tokens=3, agent_id="dora")
    assert local_engine(again) is not local_engine(llm)
    second = again.invoke([*MESSAGES, first, HumanMessage("And?")])
    assert ext(second)["cache"] == "warm" and cached(second) > 0
    local_engine(again).close()


class Reading(BaseModel):
    """What a random-weight model can finish: bounded strings, a closed choice."""

    city: str = Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_is_enforced_on_any_model(tiny, method):
    """Constrained decoding: even a random-weight model's reply parses into the schema."""
    llm = ChatKVShelf(engine=tiny, max_tokens=200, agent_id=f"structured-{method}")
    reading = llm.with_structured_output(Reading, method=method).invoke("Weather in Paris?")
    assert isinstance(reading, Reading)


def test_bind_tools_forced_calls_have_arguments_that_validate(tiny):
    @tool
    def get_weather(city: Annotated[str, Field(max_length=8)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Weather in a city."""
        return "sunny"

    @tool
    def ping() -> str:
        """Check that the service is up."""
        return "pong"

    llm = ChatKVShelf(engine=tiny, max_tokens=200, agent_id="forced-tools")
    for choice, name in (("get_weather", "get_weather"), ("ping", "ping")):
        msg = llm.bind_tools([get_weather, ping], tool_choice=choice, parallel_tool_calls=False).invoke("Go.")
        assert [c["name"] for c in msg.tool_calls] == [name]
        args = msg.tool_calls[0]["args"]
        if name == "ping":
            assert args == {}
        else:
            assert (
                set(args) == {"city", "unit"} and len(args["city"]) <= 8 and args["unit"] in ("celsius", "fahrenheit")
            )
    msg = llm.bind_tools([get_weather, ping], tool_choice="any").invoke("Go.")
    assert msg.tool_calls and all(c["name"] in ("get_weather", "ping") for c in msg.tool_calls)


# -- streaming with tools: constrained calls, as OpenAI tool-call deltas ---------------------
@pytest.fixture(scope="module")
def tiny_url(tiny) -> Iterator[str]:
    server = ServerThread(create_app(tiny, close_engine=False))
    yield server.url + "/v1"
    server.stop()


@tool
def bounded_weather(city: Annotated[str, Field(max_length=8)], unit: Literal["celsius", "fahrenheit"]) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


@tool
def ping() -> str:
    """Check that the service is up."""
    return "pong"


def _merged(chunks: list[Any]) -> AIMessageChunk:
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return full


def _assert_calls_parse(full: AIMessageChunk, names: set[str]) -> None:
    assert full.tool_calls and not full.invalid_tool_calls
    assert full.response_metadata["finish_reason"] == "tool_calls" and "<tool_call>" not in full.text
    for call in full.tool_calls:
        assert call["name"] in names and call["id"]
        if call["name"] == "ping":
            assert call["args"] == {}
        else:
            assert set(call["args"]) == {"city", "unit"} and bounded_weather.invoke(call["args"])


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
@pytest.mark.parametrize("choice", ["any", "bounded_weather"])
@pytest.mark.asyncio
async def test_stream_and_astream_with_bound_tools_end_in_calls_that_parse(tiny, tiny_url, remote, choice):
    """``bind_tools`` then ``stream``/``astream``: the chunks add up to a message whose tool
    calls parse (LangChain merges the tool-call chunks by index and parses their args)."""
    where: dict[str, Any] = {"base_url": tiny_url} if remote else {"engine": tiny}
    llm = ChatKVShelf(**where, max_tokens=300, agent_id=f"stream-tools-{choice}")
    bound = llm.bind_tools([bounded_weather, ping], tool_choice=choice)
    names = {"bounded_weather", "ping"} if choice == "any" else {"bounded_weather"}
    _assert_calls_parse(_merged(list(bound.stream("Weather in Paris?"))), names)
    _assert_calls_parse(_merged([c async for c in bound.astream("Weather in Paris?")]), names)
