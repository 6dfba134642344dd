"""What ``ChatKVShelf`` itself controls around tools, structured output and JSON mode.

``langchain-tests``' standard suite (tests/test_langchain_standard.py) judges the model's
answers; these tests judge kvshelf's part, on a tiny random-weight model whose replies
are noise, so every outcome is fixed by kvshelf's code, not by a model's skill:

* the tool schema (name, description, parameters) reaches the prompt the model reads,
  and ``tool_choice="none"`` leaves it out;
* the reply parser maps a model's ``<tool_call>`` text to LangChain ``tool_calls`` (the
  text is fed to the server's own reply shaping, next to a real engine result);
* structured output shows the schema and, on a reply that is not the schema's JSON,
  raises ``OutputParserException`` (or, with ``include_raw=True``, returns the raw
  message and the error), as ``with_structured_output`` documents; a dict schema
  (TypedDict, JSON schema) is not validated, so its result is only ever a dict;
* JSON mode opens the reply with ``{`` and returns the raw text when it is not JSON.

The prompt is read back from the agent's cache: the tiny tokenizer is one byte per
token, so the cached ids decode to exactly the text the model saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TypedDict

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableSequence
from langchain_core.tools import tool
from pydantic import BaseModel

from kvshelf.adapters.langchain import ChatKVShelf, _chat_result
from kvshelf.runtime.engine import Engine
from kvshelf.runtime.params import GenerationParams
from kvshelf.serving.completions import completion, prepare
from kvshelf.serving.openai_api import ChatCompletionRequest
from tests.support.langchain_env import offline_langchain_env
from tests.support.tiny import byte_tokenizer

offline_home = pytest.fixture(scope="module", autouse=True)(offline_langchain_env)

QUESTION = [HumanMessage("What is the weather in Paris?")]


@tool
def get_weather(city: str) -> str:
    """Look up today's weather forecast for a city."""
    return f"Sunny in {city}."


class City(BaseModel):
    """A capital city and its country."""

    city: str
    country: str


class CityDict(TypedDict):
    """A capital city and its country."""

    city: str
    country: str


@pytest.fixture(scope="module")
def engine(tiny_dirs, tmp_path_factory) -> Iterator[Engine]:
    eng = Engine(tiny_dirs["gemma3_text"], tmp_path_factory.mktemp("lc-contract"), progress=False)
    yield eng
    eng.close()


def seen_by(engine: Engine, agent_id: str) -> str:
    """The text of the agent's cache: its prompt, then its reply."""
    cache = engine._shelf.pool.get(agent_id)
    assert cache is not None, f"{agent_id} has no cache"
    return byte_tokenizer().decode(list(cache.tokens))


def test_the_tool_schema_reaches_the_prompt(engine):
    llm = ChatKVShelf(engine=engine, max_tokens=2)
    llm.bind_tools([get_weather]).invoke(QUESTION, agent_id="tools-auto")
    prompt = seen_by(engine, "tools-auto")
    assert "What is the weather in Paris?" in prompt
    assert "get_weather" in prompt and "Look up today's weather forecast for a city." in prompt
    assert '"city"' in prompt and '"string"' in prompt  # the parameters' JSON schema
    assert "<tool_call>" in prompt  # how to call: the format the reply parser reads

    llm.bind_tools([get_weather], tool_choice="none").invoke(QUESTION, agent_id="tools-none")
    assert "get_weather" not in seen_by(engine, "tools-none")


def test_a_forced_tool_opens_the_reply_with_its_call(engine):
    llm = ChatKVShelf(engine=engine, max_tokens=2)
    llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION, agent_id="tools-forced")
    prompt = seen_by(engine, "tools-forced")
    opening = prompt[prompt.rindex("<tool_call>") :]
    assert opening.startswith('<tool_call>{"name": "get_weather"')


def lc_message(engine: Engine, model_text: str, **request: Any) -> AIMessage:
    """``model_text`` as the model's reply, through the server's reply shaping and
    ``ChatKVShelf``'s conversion, next to a real engine result (usage, cache, agent)."""
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], **request}
    )
    turn = prepare(req, "parser", GenerationParams(max_tokens=8))
    result = engine.chat("parser", turn.messages, max_tokens=1)
    body = completion([model_text, result], turn, "tiny")
    message = _chat_result(body).generations[0].message
    assert isinstance(message, AIMessage)
    return message


def test_the_reply_parser_maps_tool_call_text_to_langchain_tool_calls(engine):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    msg = lc_message(engine, text, tools=tools)
    assert msg.content == "Let me check."
    assert [(c["name"], c["args"], c["type"]) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}, "tool_call")
    ]
    assert msg.tool_calls[0]["id"] and not msg.invalid_tool_calls
    assert msg.response_metadata["finish_reason"] == "tool_calls"

    two = text + ' <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    assert [c["args"] for c in lc_message(engine, two, tools=tools).tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    # a call of a tool that was not offered, or broken JSON, is not a call: it stays text
    for bad in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "get_weather"'):
        msg = lc_message(engine, bad, tools=tools)
        assert msg.tool_calls == [] and msg.content == bad
        assert msg.response_metadata["finish_reason"] != "tool_calls"


def test_structured_output_shows_the_schema_and_raises_on_a_reply_that_is_not_it(engine):
    llm = ChatKVShelf(engine=engine, max_tokens=6, agent_id="structured")
    with pytest.raises(OutputParserException):
        llm.with_structured_output(City).invoke(QUESTION)
    prompt = seen_by(engine, "structured")
    assert '"city"' in prompt and '"country"' in prompt  # the schema was shown to the model

    raw = llm.with_structured_output(City, include_raw=True).invoke(QUESTION)
    assert isinstance(raw, dict) and set(raw) == {"raw", "parsed", "parsing_error"}
    assert (
        isinstance(raw["raw"], AIMessage) and isinstance(raw["raw"].content, str) and raw["raw"].content.startswith("{")
    )
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException)


@pytest.mark.parametrize("schema", [CityDict, City.model_json_schema()], ids=["typeddict", "json"])
def test_structured_output_with_a_dict_schema_shows_it_and_returns_a_dict(engine, schema):
    """Dict schemas are not validated: LangChain's JSON parser repairs a partial object and
    checks no keys, so any reply that opens an object comes back as a dict (never text)."""
    llm = ChatKVShelf(engine=engine, max_tokens=6, agent_id="structured-dict")
    raw = llm.with_structured_output(schema, include_raw=True).invoke(QUESTION)
    prompt = seen_by(engine, "structured-dict")
    assert '"city"' in prompt and '"country"' in prompt
    assert isinstance(raw, dict)
    assert raw["raw"].content.startswith("{") and isinstance(raw["parsed"], dict) and raw["parsing_error"] is None


def test_structured_output_validates_a_reply_that_is_the_schema(engine):
    """The parsing half on its own: the same runnable's parser on a reply that fits."""
    reply = AIMessage('{"city": "Paris", "country": "France"}')
    chain = ChatKVShelf(engine=engine).with_structured_output(City)
    assert isinstance(chain, RunnableSequence)  # the model, then its parser
    assert chain.last.invoke(reply) == City(city="Paris", country="France")
    with pytest.raises(OutputParserException):  # valid JSON, wrong keys: pydantic validation fails
        chain.last.invoke(AIMessage('{"name": "cat"}'))


def test_json_mode_returns_the_raw_text_when_max_tokens_cuts_the_reply(engine):
    """Constrained, a JSON reply can only fail by being cut short: it is returned as generated."""
    long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "Long", "schema": long_text}}
    llm = ChatKVShelf(engine=engine, max_tokens=6, agent_id="json-mode")
    msg = llm.bind(response_format=fmt).invoke(QUESTION)
    assert msg.content == '{"text"'  # "{" opens it; the grammar forces the key, one byte per token of this tokenizer
    with pytest.raises(json.JSONDecodeError):
        json.loads(msg.content)  # cut short: returned as generated, not repaired
    assert msg.response_metadata["finish_reason"] == "length" and msg.usage_metadata is not None
    assert msg.usage_metadata["output_tokens"] == 6

    with pytest.raises(OutputParserException):  # json_mode with a pydantic class validates it
        llm.with_structured_output(City, method="json_mode").invoke(QUESTION)
