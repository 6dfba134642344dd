"""kvshelf as AutoGen's model client, with the real autogen-core / autogen-agentchat, offline.

Tiny random-weight models serve the tests where the text does not matter (identity,
cache reuse, streaming, cancellation, config); the embedded Gemma 3 270M serves the
ones that need a model that can follow a format (a tool call round trip, JSON output).
Both modes run: the engine in this process, and ``kvshelf serve`` over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import ChatAgent, Team
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_core import EVENT_LOGGER_NAME, CancellationToken, FunctionCall, Image
from autogen_core.models import (
    AssistantMessage,
    ChatCompletionClient,
    CreateResult,
    FunctionExecutionResult,
    FunctionExecutionResultMessage,
    LLMMessage,
    SystemMessage,
    UserMessage,
    validate_model_info,
)
from autogen_core.tools import FunctionTool
from pydantic import BaseModel, Field

from kvshelf.adapters.autogen import KVShelfChatCompletionClient, TurnStats, runtime_agent_name, to_openai_messages
from kvshelf.runtime.engine import Engine
from kvshelf.serving.server import create_app
from tests.support.servers import ServerThread
from tests.support.tiny import make_tiny_model_dir

SYSTEM = SystemMessage(content="You are a terse assistant.")


def ask(text: str, system: SystemMessage = SYSTEM) -> list:
    return [system, UserMessage(content=text, source="user")]


def last(client: KVShelfChatCompletionClient) -> TurnStats:
    """The client's last turn, which a test that has just made a call knows is there."""
    turn = client.last_turn
    assert turn is not None
    return turn


def sent(client: KVShelfChatCompletionClient, agent_id: str) -> dict[str, Any]:
    """The last request made for ``agent_id``, which a test that has just made one knows is there."""
    conv = client.conversation(agent_id)
    assert conv is not None
    return conv


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    """AutoGen and its dependencies must not write into the real home directory."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tmp_path_factory) -> Iterator[dict]:
    """A tiny engine, served in-process and over HTTP; and an EOS-less one for cancelling."""
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path_factory.mktemp("autogen-tiny"), progress=False)
    endless_dir = make_tiny_model_dir(tmp_path_factory.mktemp("endless") / "m", "llama", eos=False)
    endless = Engine(endless_dir, tmp_path_factory.mktemp("autogen-endless"), progress=False)
    server = ServerThread(create_app(engine, close_engine=False))
    yield {"engine": engine, "url": server.url + "/v1", "endless": endless}
    server.stop()
    engine.close()
    endless.close()


def make_client(tiny: dict, mode: str, **kwargs) -> KVShelfChatCompletionClient:
    """A client for ``mode``; the agent prefix keeps the two modes' agents apart on the one engine."""
    kwargs = {"max_tokens": 6, "agent_prefix": f"{mode}-", **kwargs}
    if mode == "remote":
        return KVShelfChatCompletionClient(base_url=tiny["url"], **kwargs)
    return KVShelfChatCompletionClient(engine=tiny["engine"], **kwargs)


MODES = pytest.mark.parametrize("mode", ["local", "remote"])


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, embedded_loaded) -> Iterator[KVShelfChatCompletionClient]:
    engine = Engine(embedded_loaded, tmp_path_factory.mktemp("autogen-embedded"), progress=False)
    yield KVShelfChatCompletionClient(engine=engine, max_tokens=48)
    engine.close()


# -- identity and cache reuse -------------------------------------------------------------------
@MODES
@pytest.mark.asyncio
async def test_distinct_agents_get_distinct_caches_and_a_second_turn_reuses_the_prefix(tiny, mode):
    client = make_client(tiny, mode)
    alice, bob = client.for_agent("alice"), client.for_agent("bob")
    messages = ask("Hello there.")
    first = await alice.create(messages)
    assert isinstance(first.content, str) and first.finish_reason in ("stop", "length")
    a1 = last(alice)
    assert a1.agent_id == f"{mode}-alice" and a1.cache == "cold" and a1.cached_tokens == 0

    await bob.create(messages)  # same prompt, another agent: its own, empty cache
    b1 = last(bob)
    assert b1.agent_id == f"{mode}-bob" and b1.cache == "cold" and b1.cached_tokens == 0

    messages += [
        AssistantMessage(content=first.content, source="alice"),
        UserMessage(content="And then?", source="user"),
    ]
    await alice.create(messages)
    a2 = last(alice)
    assert a2.cache == "hot" and a2.cached_tokens >= a1.prompt_tokens
    # usage: each view counts its own calls, the client they came from counts them all
    assert alice.total_usage().prompt_tokens == a1.prompt_tokens + a2.prompt_tokens
    assert client.total_usage().prompt_tokens == alice.total_usage().prompt_tokens + bob.total_usage().prompt_tokens
    assert client.actual_usage() == client.total_usage() and len(client.turns) == 3
    # everything alice has seen, as sent, with her last reply
    conv = sent(client, f"{mode}-alice")
    assert conv["messages"][-1]["role"] == "assistant" and conv["messages"][-2]["content"] == "And then?"
    await client.close()


@MODES
@pytest.mark.asyncio
async def test_team_members_are_keyed_by_name_across_team_instances(tiny, mode):
    """Inside a RoundRobinGroupChat the runtime's AgentId names the caller; the per-team
    uuid is dropped, so a new team (as in the next run of a program) finds the caches."""
    client = make_client(tiny, mode, agent_prefix=f"{mode}-team-")

    def team() -> RoundRobinGroupChat:
        agents: list[ChatAgent | Team] = [
            AssistantAgent(n, model_client=client, system_message=f"You are {n}.") for n in ("ann", "ben")
        ]
        return RoundRobinGroupChat(agents, max_turns=4)

    await team().run(task="Plan a picnic.")
    ids = [t.agent_id for t in client.turns]
    assert ids == [f"{mode}-team-ann", f"{mode}-team-ben"] * 2
    assert [t.cache for t in client.turns] == ["cold", "cold", "hot", "hot"]
    assert all(t.cached_tokens > 0 for t in client.turns[2:])

    await team().run(task="Plan a picnic.")  # a new team: new uuid, same agents
    again = client.turns[4:]
    assert [t.agent_id for t in again[:2]] == [f"{mode}-team-ann", f"{mode}-team-ben"]
    assert all(t.cached_tokens > 0 for t in again[:2])  # system + task reused from their caches
    await client.close()


def alice_team(client: KVShelfChatCompletionClient, system: str) -> RoundRobinGroupChat:
    return RoundRobinGroupChat([AssistantAgent("alice", model_client=client, system_message=system)], max_turns=1)


def same_name_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "share the kvshelf cache" in str(w.message)]


@pytest.mark.asyncio
async def test_same_name_agents_of_two_teams_get_one_warning_naming_agent_prefix(tiny):
    client = make_client(tiny, "local", agent_prefix="clash-")
    sales, support = alice_team(client, "You sell bikes."), alice_team(client, "You fix bikes.")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        await sales.run(task="Hello.")
        assert same_name_warnings(record) == []
        await support.run(task="Hello.")  # another alice, another system text: the same id
        await sales.run(task="Again.")
        await support.run(task="Again.")
    assert [t.agent_id for t in client.turns] == ["clash-alice"] * 4  # before: one cache for both
    (message,) = same_name_warnings(record)  # once, however often they clash
    assert "'clash-alice'" in message and "agent_prefix" in message and "for_agent" in message

    # the remedy it names: a client per team with its own prefix keeps them apart, silently
    a, b = make_client(tiny, "local", agent_prefix="sales."), make_client(tiny, "local", agent_prefix="support.")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for team in (alice_team(a, "You sell bikes."), alice_team(b, "You fix bikes.")):
            await team.run(task="Hello.")
    assert same_name_warnings(record) == []
    assert [t.agent_id for t in (*a.turns, *b.turns)] == ["sales.alice", "support.alice"]


@pytest.mark.asyncio
async def test_two_live_teams_with_the_same_agents_warn_and_a_new_team_per_task_does_not(tiny):
    client = make_client(tiny, "local", agent_prefix="loop-")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for task in ("One.", "Two.", "Three."):  # a new team per task: the same agent, run after run
            await alice_team(client, "You sell bikes.").run(task=task)
        assert same_name_warnings(record) == []
        first, second = alice_team(client, "You sell bikes."), alice_team(client, "You sell bikes.")
        await first.run(task="One.")
        await second.run(task="Two.")
        assert same_name_warnings(record) == []  # could still be a replacement
        await first.run(task="Three.")  # the first team is back: both are alive
    (message,) = same_name_warnings(record)
    assert "two teams at once" in message and "'loop-alice'" in message


@pytest.mark.asyncio
async def test_a_call_outside_any_runtime_is_keyed_by_its_system_text(tiny):
    client = make_client(tiny, "local")
    await client.create(ask("Hi."))
    await client.create(ask("Hello?"))
    await client.create(ask("Hi.", SystemMessage(content="You are someone else.")))
    first, second, other = (t.agent_id for t in client.turns)
    assert first == second and first.startswith("local-anon-") and other != first
    assert client.turns[1].cached_tokens > 0


@MODES
@pytest.mark.asyncio
async def test_a_call_without_tools_keeps_the_agents_tool_text_and_so_its_cache(tiny, mode):
    """AssistantAgent's reflection after a tool call sends no tools (tool_choice="none");
    the agent's system text must not change, or its whole history would be recomputed."""
    client = make_client(tiny, mode)
    agent = client.for_agent("reflector")
    tool = FunctionTool(get_weather, description="The current weather in a city.")
    messages = ask("Weather in Oslo?")
    first = await agent.create(messages, tools=[tool])
    messages += [
        AssistantMessage(content=first.content, thought=first.thought, source="reflector"),
        UserMessage(content="Sum up.", source="user"),
    ]
    second = await agent.create(messages, tool_choice="none")
    assert isinstance(second.content, str) and last(agent).cached_tokens >= first.usage.prompt_tokens
    conv = sent(client, f"{mode}-reflector")
    assert "get_weather" in conv["messages"][0]["content"] and "tools" not in conv
    await client.close()


def test_runtime_agent_names():
    team = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
    assert runtime_agent_name(f"alice_{team}", team) == "alice"
    assert runtime_agent_name(f"my_agent_{team}", team) == "my_agent"
    assert runtime_agent_name("writer", "default") == "writer"
    assert runtime_agent_name("writer", "session-7") == "writer:session-7"


def test_group_chat_history_renders_the_same_bytes_turn_after_turn():
    turn1: list[LLMMessage] = [SYSTEM, UserMessage(content="Plan a picnic.", source="user")]
    turn2: list[LLMMessage] = turn1 + [
        AssistantMessage(content="Saturday, by the lake.", source="alice"),
        UserMessage(content="Rain is likely.", source="bob"),
        UserMessage(content=["Bring", "umbrellas."], source="carol"),
    ]
    turn3: list[LLMMessage] = turn2 + [
        AssistantMessage(content="Then Sunday.", source="alice"),
        SystemMessage(content="Be brief."),
    ]
    r1, r2, r3 = (to_openai_messages(t) for t in (turn1, turn2, turn3))
    assert r2[: len(r1)] == r1 and r3[: len(r2)] == r2
    assert r2[-1] == {"role": "user", "content": "bob: Rain is likely.\n\ncarol: Bring\numbrellas."}
    assert r3[-1] == {"role": "user", "content": "system: Be brief."}  # a late system message stays in place
    assert [m["role"] for m in r3] == ["system", "user", "assistant", "user", "assistant", "user"]


# -- streaming and cancellation -----------------------------------------------------------------
@MODES
@pytest.mark.asyncio
async def test_stream_yields_text_then_exactly_one_result(tiny, mode, caplog):
    client = make_client(tiny, mode, max_tokens=8)
    with caplog.at_level(logging.INFO, logger=EVENT_LOGGER_NAME):
        whole = await client.for_agent("streamer").create(ask("Count."))
        items = [item async for item in client.for_agent("streamer2").create_stream(ask("Count."))]
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == EVENT_LOGGER_NAME]
    assert [e["type"] for e in events] == ["LLMCall", "LLMStreamStart", "LLMStreamEnd"]
    *chunks, result = items
    texts = [c for c in chunks if isinstance(c, str)]
    assert isinstance(result, CreateResult) and texts == chunks
    assert "".join(texts) == result.content == whole.content  # greedy by default: same reply
    assert result.usage == whole.usage and last(client).agent_id == f"{mode}-streamer2"
    await client.close()


@MODES
@pytest.mark.asyncio
async def test_cancelling_a_stream_stops_the_engine_request(tiny, mode):
    endless = tiny["endless"]
    if mode == "remote":
        server = ServerThread(create_app(endless, close_engine=False))
        client = KVShelfChatCompletionClient(base_url=server.url, agent_id="runner", max_tokens=3000)
    else:
        client = KVShelfChatCompletionClient(engine=endless, agent_id="runner", max_tokens=3000)
    before = endless.stats["decoded_tokens"]
    token = CancellationToken()
    stream = client.create_stream(ask("Go on forever."), cancellation_token=token)
    assert isinstance(await anext(stream), str)
    token.cancel()
    with pytest.raises(asyncio.CancelledError):
        async for _ in stream:
            pass
    # the same agent is served next: had the cancelled request run on, it would hold the
    # agent (one request per agent at a time) until all 3000 tokens were decoded
    after = await client.create(ask("Go on forever."), extra_create_args={"max_tokens": 2})
    assert after.finish_reason == "length" and last(client).cached_tokens > 0
    assert endless.stats["decoded_tokens"] - before < 3000
    await client.close()
    if mode == "remote":
        server.stop()


@pytest.mark.asyncio
async def test_cancelling_create_cancels_the_engine_request(tiny):
    endless = tiny["endless"]
    client = KVShelfChatCompletionClient(engine=endless, agent_id="creator", max_tokens=3000)
    before = endless.stats["decoded_tokens"]
    token = CancellationToken()
    task = asyncio.create_task(client.create(ask("Go on forever."), cancellation_token=token))
    while endless.stats["decoded_tokens"] == before:  # wait until it is generating
        await asyncio.sleep(0.01)
    token.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = await client.create(ask("Go on forever."), extra_create_args={"max_tokens": 2})
    assert after.finish_reason == "length"
    assert endless.stats["decoded_tokens"] - before < 3000


# -- tools and JSON (the embedded model) ----------------------------------------------------------
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 21 C in {city}."


@pytest.mark.embedded
@pytest.mark.asyncio
async def test_tool_call_round_trip(embedded):
    tool = FunctionTool(get_weather, description="The current weather in a city.")
    agent = embedded.for_agent("forecaster")
    messages = ask("What is the weather in Paris? Use the tool.")
    called = await agent.create(messages, tools=[tool], tool_choice=tool, extra_create_args={"max_tokens": 200})
    assert called.finish_reason == "function_calls"
    (call,) = called.content
    assert isinstance(call, FunctionCall) and call.name == "get_weather" and call.id
    args = json.loads(call.arguments)
    assert isinstance(args, dict)
    output = await tool.run_json(args, CancellationToken()) if "city" in args else get_weather("Paris")
    messages += [
        AssistantMessage(content=called.content, thought=called.thought, source="forecaster"),
        FunctionExecutionResultMessage(
            content=[FunctionExecutionResult(content=output, name=call.name, call_id=call.id)]
        ),
    ]
    answer = await agent.create(messages, tools=[tool], extra_create_args={"max_tokens": 12})
    assert isinstance(answer.content, str) and answer.content.strip() and answer.finish_reason in ("stop", "length")
    assert last(agent).cached_tokens >= called.usage.prompt_tokens  # the call stayed in the cache


class Pet(BaseModel):
    name: str
    species: str


@MODES
@pytest.mark.parametrize("json_output", [True, Pet])
@pytest.mark.asyncio
async def test_json_output_asks_for_a_json_object(tiny, mode, json_output):
    client = make_client(tiny, mode)
    kind = "json_object" if json_output is True else "json_schema"
    result = await client.for_agent(f"json-{kind}").create(ask("A pet, as JSON."), json_output=json_output)
    assert isinstance(result.content, str) and result.content.startswith("{")  # the reply is opened as an object
    response_format = sent(client, f"{mode}-json-{kind}")["response_format"]
    assert response_format["type"] == kind and (
        json_output is True or response_format["json_schema"]["schema"] == Pet.model_json_schema()
    )
    await client.close()


class BoundedPet(BaseModel):
    """A pet whose JSON a random-weight model can finish: bounded strings, a closed choice."""

    name: str = Field(max_length=8)
    species: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


@MODES
@pytest.mark.asyncio
async def test_json_output_with_a_model_class_is_enforced_on_any_model(tiny, mode):
    """Constrained decoding: even a random-weight model's reply is a valid BoundedPet."""
    client = make_client(tiny, mode, max_tokens=200)
    result = await client.for_agent("json-enforced").create(ask("A pet, as JSON."), json_output=BoundedPet)
    assert isinstance(result.content, str) and result.finish_reason == "stop"
    BoundedPet.model_validate_json(result.content)
    await client.close()


@pytest.mark.embedded
@pytest.mark.asyncio
async def test_structured_output_is_a_valid_pet(embedded):
    """The schema is enforced: the 270M model's reply is a Pet, with the keys it was asked for."""
    result = await embedded.for_agent("json-pet").create(
        ask("Describe a pet cat called Tom as a JSON object with the keys name and species."),
        json_output=Pet,
        extra_create_args={"max_tokens": 80},
    )
    pet = Pet.model_validate_json(result.content)
    assert pet.name and pet.species


# -- the rest of the ChatCompletionClient ---------------------------------------------------------
@MODES
@pytest.mark.asyncio
async def test_counts_tokens_as_the_model_sees_them(tiny, mode):
    client = make_client(tiny, mode)
    tool = FunctionTool(get_weather, description="The current weather in a city.")
    messages = ask("Weather?")
    n = client.count_tokens(messages, tools=[tool])
    result = await client.for_agent("counter").create(messages, tools=[tool], tool_choice="none")
    assert client.count_tokens(messages) == result.usage.prompt_tokens < n  # tools add their description
    assert client.remaining_tokens(messages) == tiny["engine"].loaded.context_length - result.usage.prompt_tokens
    await client.close()


def test_model_info_and_capabilities(tiny):
    client = make_client(tiny, "local")
    validate_model_info(client.model_info)
    info = client.model_info
    assert (info["vision"], info["function_calling"], info["json_output"], info["structured_output"]) == (
        False,
        True,
        True,
        True,
    )
    assert client.capabilities == {"vision": False, "function_calling": True, "json_output": True}


@pytest.mark.asyncio
async def test_images_and_unknown_arguments_are_refused_clearly(tiny):
    client = make_client(tiny, "local")
    image = Image.from_base64(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    )
    with pytest.raises(ValueError, match="vision"):
        await client.create([UserMessage(content=["What is this?", image], source="user")])
    with pytest.raises(ValueError, match="extra_create_args"):
        await client.create(ask("Hi."), extra_create_args={"frequency_penalty": 1})


def test_dump_and_load_component(tiny):
    client = KVShelfChatCompletionClient(
        base_url="http://127.0.0.1:9/v1", api_key="sekret", agent_id="alice", temperature=0.5, max_tokens=99, seed=3
    )
    dumped = client.dump_component()
    assert dumped.provider == "kvshelf.adapters.autogen.KVShelfChatCompletionClient"
    loaded = ChatCompletionClient.load_component(dumped)
    assert isinstance(loaded, KVShelfChatCompletionClient) and loaded.agent_id == "alice"
    assert loaded._to_config() == client._to_config()
    api_key = loaded._to_config().api_key
    assert api_key is not None and api_key.get_secret_value() == "sekret"
    assert "sekret" not in dumped.model_dump_json()  # a key never lands in a JSON config
    assert client.for_agent("bob").dump_component().config["agent_id"] == "bob"

    # a whole agent, with this client inside, round-trips through AutoGen's own config
    local = make_client(tiny, "local", max_tokens=5)
    agent = AssistantAgent("ann", model_client=local, system_message="You are Ann.")
    again = AssistantAgent.load_component(agent.dump_component())
    assert again._model_client.dump_component() == local.dump_component()


def test_predict_context_extends_the_listeners_history_with_what_it_has_not_heard():
    from kvshelf.adapters.autogen import _Heard, predict_context

    ben = _Heard(
        "ben", [SystemMessage(content="You are ben."), UserMessage(content="Plan.", source="user")], "I agree.", {}
    )
    ann_saw: list[LLMMessage] = [
        SystemMessage(content="You are ann."),
        UserMessage(content="Plan.", source="user"),
        AssistantMessage(content="Let us go.", source="ann"),
        UserMessage(content="I agree.", source="ben"),
        UserMessage(content="Bring food.", source="cy"),
    ]
    predicted = predict_context(ben, "ann", ann_saw, "Agreed, at noon.")
    assert predicted == [
        *ben.messages,
        AssistantMessage(content="I agree.", source="ben"),
        UserMessage(content="Bring food.", source="cy"),
        UserMessage(content="Agreed, at noon.", source="ann"),
    ]
    stranger = _Heard("dora", [SystemMessage(content="You are dora.")], "Hello.", {})
    assert predict_context(stranger, "ann", ann_saw, "Agreed.") is None  # not in this group's history


@MODES
@pytest.mark.asyncio
async def test_group_chat_prefill_ahead_gives_the_same_replies_with_more_of_each_prompt_cached(tiny, mode):
    engine = tiny["engine"]

    async def play(ahead: bool) -> tuple[list[str], list]:
        client = make_client(tiny, mode, agent_prefix=f"{mode}-ahead{int(ahead)}-", prefill_ahead=ahead, max_tokens=5)
        agents: list[ChatAgent | Team] = [
            AssistantAgent(n, model_client=client, system_message=f"You are {n}, planning a trip.")
            for n in ("ann", "ben", "cy")
        ]
        result = await RoundRobinGroupChat(agents, max_turns=9).run(task="Where shall we go?")
        await client.close()
        return [m.to_text() for m in result.messages], client.turns

    plain_texts, plain_turns = await play(False)
    before = engine.stats["background_calls"]
    ahead_texts, ahead_turns = await play(True)
    assert engine.stats["background_calls"] > before
    assert ahead_texts == plain_texts
    # from the second round on, what others said before the last speaker was prefilled ahead
    for plain, ahead in zip(plain_turns[3:], ahead_turns[3:]):
        assert ahead.prompt_tokens == plain.prompt_tokens and ahead.cached_tokens > plain.cached_tokens


# -- streaming with tools -------------------------------------------------------------------------
def bounded_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return f"Sunny in {city}, in {unit}."


@MODES
@pytest.mark.asyncio
@pytest.mark.parametrize("choice", ["required", "named"])
async def test_create_stream_with_tools_ends_in_calls_that_parse(tiny, mode, choice):
    """A streamed forced call (constrained): no call text leaks out as content, and the one
    ``CreateResult`` holds FunctionCalls whose arguments are JSON of the tool's schema."""
    weather = FunctionTool(bounded_weather, description="The current weather in a city.")
    ping = FunctionTool(lambda: "pong", name="ping", description="Check that the service is up.")
    client = make_client(tiny, mode, max_tokens=300)
    items = [
        item
        async for item in client.for_agent(f"stream-tools-{choice}").create_stream(
            ask("Weather in Paris?"),
            tools=[weather, ping],
            tool_choice=weather if choice == "named" else "required",
            extra_create_args={"parallel_tool_calls": False},
        )
    ]
    result = items[-1]
    assert isinstance(result, CreateResult) and all(isinstance(i, str) for i in items[:-1])
    assert "<tool_call>" not in "".join(str(i) for i in items[:-1])  # the call is held back, never streamed
    assert result.finish_reason == "function_calls" and isinstance(result.content, list) and len(result.content) == 1
    call = result.content[0]
    assert isinstance(call, FunctionCall) and call.id
    assert call.name == "bounded_weather" or (choice == "required" and call.name == "ping")
    args = json.loads(call.arguments)
    if call.name == "ping":
        assert args == {}
    else:
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert await weather.run_json(args, CancellationToken())  # the tool runs on them
    await client.close()
