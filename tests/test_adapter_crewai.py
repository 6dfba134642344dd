"""KVShelfLLM under the real CrewAI (1.15), offline, in process and against a server.

Crews run on a tiny random-weight model, whose text is noise but whose caches are
real: what is checked is routing (one cache per CrewAI agent, keyed by ``agent.key``),
prefix reuse, events, streaming and stop words. Tool calls and ``response_model`` need
a model that writes JSON, so they run on the embedded Gemma 3 270M, with the call
forced by ``tool_choice`` and the JSON shown by example.

CrewAI writes under $HOME when imported, and phones home unless told not to: the
module fixture points HOME at a temp dir and turns telemetry and tracing off first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvshelf.runtime.engine import Engine
from kvshelf.serving.server import create_app
from tests.support.servers import ServerThread

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def cw(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """CrewAI imported offline, with HOME in a temp dir (restored after the module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("crewai-home")))
        mp.setenv("CREWAI_DISABLE_TELEMETRY", "true")
        mp.setenv("OTEL_SDK_DISABLED", "true")
        mp.setenv("CREWAI_TRACING_ENABLED", "false")
        mp.delenv("OPENAI_API_KEY", raising=False)
        from crewai import Agent, Crew, Process, Task
        from crewai.events.event_bus import crewai_event_bus
        from crewai.events.types import llm_events, tool_usage_events
        from crewai.llms.base_llm import call_stop_override

        from kvshelf.adapters.crewai import KVShelfLLM

        yield SimpleNamespace(
            Agent=Agent,
            Crew=Crew,
            Process=Process,
            Task=Task,
            bus=crewai_event_bus,
            llm_events=llm_events,
            tool_events=tool_usage_events,
            call_stop_override=call_stop_override,
            KVShelfLLM=KVShelfLLM,
        )


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A tiny model's engine, and a real kvshelf server over the same engine."""
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path_factory.mktemp("crewai-cache"), progress=False)
    server = ServerThread(create_app(engine, close_engine=False))
    yield SimpleNamespace(engine=engine, url=server.url, model=str(tiny_dirs["gemma3_text"]))
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def embedded(embedded_loaded, tmp_path_factory) -> Iterator[Engine]:
    engine = Engine(embedded_loaded, tmp_path_factory.mktemp("crewai-embedded-cache"), progress=False)
    yield engine
    engine.close()


def make_llm(cw, tiny, mode: str, **kwargs):
    if mode == "remote":
        return cw.KVShelfLLM(base_url=tiny.url, **{"max_tokens": 8, **kwargs})
    return cw.KVShelfLLM(model=tiny.model, engine=tiny.engine, **{"max_tokens": 8, **kwargs})


class Events:
    """CrewAI events of the given types, collected while the context is open."""

    def __init__(self, cw, *types) -> None:
        self.cw, self.types = cw, types
        self.seen: list[object] = []

    def __enter__(self) -> Events:
        self.scope = self.cw.bus.scoped_handlers()
        self.scope.__enter__()
        for t in self.types:
            self.cw.bus.register_handler(t, lambda source, event: self.seen.append(event))
        return self

    def __exit__(self, *exc) -> None:
        self.cw.bus.flush()
        self.scope.__exit__(*exc)

    def of(self, t) -> list:
        self.cw.bus.flush()
        return [e for e in self.seen if isinstance(e, t)]


@pytest.mark.parametrize("mode", ["local", "remote"])
def test_a_crew_gives_each_agent_its_own_cache_and_reuses_it(cw, tiny, mode):
    llm = make_llm(cw, tiny, mode)
    specs = {
        name: dict(role=f"{name} ({mode})", goal=f"Help with {{topic}} as the {name}.", backstory=f"A {name}.")
        for name in ("Planner", "Critic")
    }
    agents = {name: cw.Agent(**spec, llm=llm, max_iter=1, verbose=False) for name, spec in specs.items()}
    order = ["Planner", "Critic", "Planner", "Critic"]
    tasks = [
        cw.Task(description=f"Step {i}: work on {{topic}}.", expected_output="A line.", agent=agents[who])
        for i, who in enumerate(order)
    ]
    crew = cw.Crew(agents=list(agents.values()), tasks=tasks, process=cw.Process.sequential, verbose=False)
    E = cw.llm_events
    with Events(cw, E.LLMCallStartedEvent, E.LLMCallCompletedEvent, E.LLMCallFailedEvent) as events:
        crew.kickoff(inputs={"topic": "caches"})

    turns = llm.turns
    assert len(turns) == 4
    ids = {name: llm.agent_id_for(agent) for name, agent in agents.items()}
    assert [t["agent_id"] for t in turns] == [ids[who] for who in order]
    assert ids["Planner"] != ids["Critic"] and all(i.startswith("crewai-") for i in ids.values())
    assert all(agents[n].key in ids[n] for n in agents)  # keyed by CrewAI's stable agent.key
    # the id is stable: a new Agent with the same role, goal and backstory (a new run) maps to it
    assert llm.agent_id_for(cw.Agent(**specs["Planner"], llm=llm)) == ids["Planner"]
    assert [t["cache"] for t in turns[:2]] == ["cold", "cold"] and turns[0]["cached_tokens"] == 0
    for turn in turns[2:]:  # each agent's second task reuses its own prefix (at least its system text)
        assert turn["cache"] == "hot" and 0 < turn["cached_tokens"] < turn["prompt_tokens"]
    known = {a.agent_id for a in tiny.engine.agents()}
    assert set(ids.values()) <= known

    # events: one started and one completed per call, paired by call id, none failed
    started, completed = events.of(E.LLMCallStartedEvent), events.of(E.LLMCallCompletedEvent)
    assert len(started) == len(completed) == 4 and not events.of(E.LLMCallFailedEvent)
    assert {e.call_id for e in started} == {e.call_id for e in completed}
    assert all("\nObservation:" in (e.stop_sequences or []) for e in started)  # ReAct's stop word reached us
    usage = llm.get_token_usage_summary()
    assert usage.successful_requests == 4 and usage.cached_prompt_tokens == sum(t["cached_tokens"] for t in turns)
    assert usage.prompt_tokens == sum(t["prompt_tokens"] for t in turns) and usage.completion_tokens > 0


@pytest.mark.parametrize("mode", ["local", "remote"])
def test_streaming_emits_chunk_events_and_matches_plain_calls(cw, tiny, mode):
    plain = make_llm(cw, tiny, mode, agent_id=f"stream-{mode}")
    streaming = make_llm(cw, tiny, mode, agent_id=f"stream-{mode}", stream=True)
    whole = plain.call(MESSAGES)
    assert isinstance(whole, str) and whole
    E = cw.llm_events
    with Events(cw, E.LLMStreamChunkEvent, E.LLMCallCompletedEvent) as events:
        streamed = streaming.call(MESSAGES)
        astreamed = asyncio.run(streaming.acall(MESSAGES))
    assert streamed == astreamed == whole
    chunks = events.of(E.LLMStreamChunkEvent)
    assert "".join(e.chunk for e in chunks) == whole * 2  # two streamed calls, every piece announced
    assert len(events.of(E.LLMCallCompletedEvent)) == 2
    assert asyncio.run(plain.acall(MESSAGES)) == whole
    assert [t["cache"] for t in streaming.turns] == ["hot", "hot"] and streaming.turns[0]["cached_tokens"] > 0
    assert streaming.turns[0]["agent_id"] == f"stream-{mode}"


@pytest.mark.parametrize("mode", ["local", "remote"])
def test_stop_words_end_the_reply_before_them(cw, tiny, mode):
    llm = make_llm(cw, tiny, mode, max_tokens=16)
    whole = llm.call(MESSAGES)
    stop = next(whole[i : i + 3] for i in range(4, len(whole) - 3) if whole[i : i + 3].strip())
    cut = whole[: whole.index(stop)]
    with cw.call_stop_override(llm, [stop]):  # how CrewAI's executor applies "\nObservation:"
        assert llm.call(MESSAGES).strip() == cut.strip()
    assert stop not in cut and llm.turns[-1]["finish_reason"] == "stop"


def test_agentless_calls_use_a_stable_fallback_or_the_agent_with_that_system_text(cw, tiny):
    llm = make_llm(cw, tiny, "local")
    anon = llm.agent_id_for(None, MESSAGES)
    assert anon.startswith("crewai-anon-") and anon == make_llm(cw, tiny, "local").agent_id_for(None, MESSAGES)
    agent = cw.Agent(role="Solo", goal="Be solo.", backstory="Alone.", llm=llm)
    system = [{"role": "system", "content": "Solo persona."}]
    own = llm.agent_id_for(agent, system)
    # CrewAI's forced final answer carries no agent but the agent's own system text
    assert llm.agent_id_for(None, system + [{"role": "user", "content": "Now answer."}]) == own
    assert llm.agent_id_for(None, [{"role": "system", "content": "Other."}]) != own


def test_response_model_returns_the_validated_object_or_text(cw, tiny, embedded):
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        country: str

    llm = cw.KVShelfLLM(engine=embedded, max_tokens=32)
    shown = [  # the JSON is shown by example: a 270M model copies a pattern, not a schema
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": '{"city": "Rome", "country": "Italy"}'},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    E = cw.llm_events
    with Events(cw, E.LLMCallCompletedEvent) as events:
        city = llm.call(shown, response_model=City)
    assert city == City(city="Paris", country="France")
    assert json.loads(events.of(E.LLMCallCompletedEvent)[0].response) == city.model_dump()
    # a reply that is not valid JSON comes back as text (CrewAI's converter repairs or retries)
    noise = make_llm(cw, tiny, "local").call(MESSAGES, response_model=City)
    assert isinstance(noise, str)


@pytest.mark.parametrize("mode", ["local", "remote"])
def test_response_model_is_enforced_on_any_model(cw, tiny, mode):
    """Constrained decoding: a random-weight model's reply still validates as the response_model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: str = Field(max_length=8)
        kind: Literal["capital", "port", "village"]

    place = make_llm(cw, tiny, mode, max_tokens=200).call(MESSAGES, response_model=Place)
    assert isinstance(place, Place)


def test_tool_calls_round_trip_directly_and_through_an_agent(cw, embedded):
    from crewai.tools import BaseTool

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_secret_word",
                "description": "Return the secret word.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    forced = {"type": "function", "function": {"name": "get_secret_word"}}
    llm = cw.KVShelfLLM(engine=embedded, max_tokens=24, tool_choice=forced)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the secret word?"},
    ]

    # 1. No available_functions: the OpenAI-style calls come back for the executor to run.
    calls = llm.call(messages, tools=tools)
    assert isinstance(calls, list) and calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"]["name"] == "get_secret_word"
    assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
    assert llm.turns[-1]["finish_reason"] == "tool_calls"

    # 2. The result goes back as a tool message, and the same agent continues from its cache.
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "name": "get_secret_word", "content": "kvshelf"},
    ]
    plain = cw.KVShelfLLM(engine=embedded, max_tokens=8)  # tool_choice "auto": the model decides
    assert plain.call(follow, tools=tools)  # text, or another call: either way the turn went through
    assert plain.turns[-1]["agent_id"] == llm.turns[-1]["agent_id"] and plain.turns[-1]["cached_tokens"] > 0

    # 3. With available_functions the call is executed here, as CrewAI's own LLMs do.
    ran: list[int] = []

    def get_secret_word(**_: object) -> str:
        ran.append(1)
        return "kvshelf"

    T = cw.tool_events
    with Events(cw, T.ToolUsageFinishedEvent) as events:
        out = llm.call(messages, tools=tools, available_functions={"get_secret_word": get_secret_word})
    assert out == "kvshelf" and ran == [1] and events.of(T.ToolUsageFinishedEvent)[0].tool_name == "get_secret_word"
    assert llm.turns[-1]["cached_tokens"] > 0  # same prompt again: served from the cache

    # 4. Through an Agent and a Task: CrewAI's executor runs the tool the model called.
    class SecretWord(BaseTool):
        name: str = "get_secret_word"
        description: str = "Return the secret word."
        result_as_answer: bool = True

        def _run(self, **_: object) -> str:
            ran.append(2)
            return "kvshelf"

    agent = cw.Agent(
        role="Keeper",
        goal="Find the secret word.",
        backstory="You use tools.",
        tools=[SecretWord()],
        llm=llm,
        max_iter=2,
        verbose=False,
    )
    task = cw.Task(description="What is the secret word?", expected_output="The word.", agent=agent)
    result = cw.Crew(agents=[agent], tasks=[task], verbose=False).kickoff()
    assert result.raw == "kvshelf" and ran == [1, 2]
    assert llm.turns[-1]["agent_id"] == llm.agent_id_for(agent) and llm.turns[-1]["finish_reason"] == "tool_calls"


def test_context_window_and_token_count_come_from_the_model(cw, tiny):
    for mode in ("local", "remote"):
        llm = make_llm(cw, tiny, mode)
        assert llm.supports_function_calling() and llm.supports_stop_words()
        assert llm.get_context_window_size() == int(tiny.engine.loaded.context_length * 0.85)
        llm.call(MESSAGES)
        assert llm.get_input_tokens_count(MESSAGES) == llm.turns[-1]["prompt_tokens"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.mark.parametrize("mode", ["local", "remote"])
def test_a_streamed_tool_call_parses_and_runs(cw, tiny, mode):
    """``stream=True`` with a forced call (constrained): the tool-call chunk events carry the
    call, and ``call``/``acall`` return calls whose arguments parse, or run the function.

    The random model writes call after call until ``max_tokens`` (about 60 tokens each, the
    forced opening included); 150 leaves room for two whole calls and a cut third, which is
    dropped: parallel calls in one stream, at half the decoding of 300."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    llm = make_llm(cw, tiny, mode, stream=True, max_tokens=150, tool_choice=forced, agent_id=f"stream-call-{mode}")
    E = cw.llm_events
    with Events(cw, E.LLMStreamChunkEvent) as events:
        calls = llm.call(MESSAGES, tools=[WEATHER_TOOL])
        again = asyncio.run(llm.acall(MESSAGES, tools=[WEATHER_TOOL]))
    for got in (calls, again):
        assert isinstance(got, list) and len(got) >= 2 and got[0]["id"]
        assert {c["function"]["name"] for c in got} == {"get_weather"}
        for c in got:
            args = json.loads(c["function"]["arguments"])
            assert (
                set(args) == {"city", "unit"} and len(args["city"]) <= 8 and args["unit"] in ("celsius", "fahrenheit")
            )
    announced = [e for e in events.of(E.LLMStreamChunkEvent) if e.tool_call is not None]
    assert [json.loads(e.chunk) for e in announced] == [json.loads(c["function"]["arguments"]) for c in calls + again]
    assert all("<tool_call>" not in e.chunk for e in events.of(E.LLMStreamChunkEvent))
    ran: list[dict] = []

    def get_weather(**kw: object) -> str:
        ran.append(kw)
        return "sunny"

    out = llm.call(MESSAGES, tools=[WEATHER_TOOL], available_functions={"get_weather": get_weather})
    assert out == "sunny" and ran and set(ran[0]) == {"city", "unit"}
