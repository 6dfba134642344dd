"""Constrained decoding on random-weight models: whatever the model would write, the reply validates.

A random-weight model is the hardest client of a grammar: left alone it writes noise, so
every reply here that parses and validates does so because of the token mask. Schemas keep
their strings and numbers bounded, so a reply ends well within ``max_tokens``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import jsonschema
import numpy as np
import pytest

from kvshelf.errors import ApiError, InvalidSchema
from kvshelf.runtime.engine import Engine
from kvshelf.structured.grammar import closed, json_grammar, tool_call_grammar

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]},
    {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "city": SHORT},
        "required": ["unit", "city"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"],
            },
        },
        "required": ["tags", "owner"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": SCHEMAS[2],
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": SCHEMAS[1]}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: arguments must be {}
]
ASK = [{"role": "user", "content": "Please answer."}]


@pytest.fixture(scope="module")
def engine(tiny_dirs, tmp_path_factory):
    eng = Engine(tiny_dirs["llama"], tmp_path_factory.mktemp("constrained"), progress=False)
    yield eng
    eng.close()


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": False}}


def _validate_call(call: Any, allowed: list[str]) -> None:
    assert call.name in allowed
    schema = next(t["function"].get("parameters") for t in TOOLS if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), closed(schema or {"type": "object", "properties": {}}))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_json_schema_reply_always_validates(engine, index, seed):
    schema = SCHEMAS[index]
    r = engine.chat(None, ASK, response_format=_fmt(schema), temperature=1.0, seed=seed, max_tokens=200)
    assert r.finish_reason == "stop"  # the grammar ended the reply, not max_tokens
    jsonschema.validate(json.loads(r.text), closed(schema))


def test_json_object_is_one_object_and_the_reply_ends_where_it_closes(engine):
    r = engine.chat(None, ASK, response_format={"type": "json_object"}, max_tokens=300)
    assert r.finish_reason == "stop" and isinstance(json.loads(r.text), dict)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_required_gives_calls_of_offered_tools_whose_arguments_validate(engine, seed):
    r = engine.chat(None, ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
    assert r.finish_reason == "tool_calls" and r.tool_calls
    for call in r.tool_calls:
        _validate_call(call, ["get_weather", "add", "ping"])


@pytest.mark.parametrize("name", ["get_weather", "add", "ping"])
def test_a_named_tool_choice_gives_exactly_one_call_of_that_tool(engine, name):
    choice = {"type": "function", "function": {"name": name}}
    r = engine.chat(
        None, ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=4, max_tokens=300
    )
    assert [c.name for c in r.tool_calls] == [name]
    _validate_call(r.tool_calls[0], [name])
    if name == "ping":
        assert json.loads(r.tool_calls[0].arguments) == {}  # no schema keys copied in


def test_without_parallel_calls_the_grammar_ends_after_one_call(engine):
    r = engine.chat(None, ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300)
    assert len(r.tool_calls) == 1 and r.usage.completion_tokens < 300
    assert r.text == ""  # nothing but the call


@pytest.mark.parametrize("seed", range(6))
def test_auto_is_text_that_never_opens_a_call_or_text_then_valid_calls(engine, seed):
    r = engine.chat(None, ASK, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=60)
    if r.tool_calls:
        for call in r.tool_calls:
            _validate_call(call, ["get_weather", "add", "ping"])
    elif r.finish_reason == "stop":
        assert "<tool_call>" not in r.text


def test_auto_call_once_opened_is_constrained():
    """The grammar itself: under "auto", text may not go on after ``<tool_call>`` as anything but a call."""
    import llguidance

    from kvshelf.model.loader import TextTokenizer
    from kvshelf.structured.constraint import Vocabulary
    from tests.support.tiny import byte_tokenizer

    vocab = Vocabulary(TextTokenizer(byte_tokenizer(), None, frozenset({0})))
    grammar = tool_call_grammar(TOOLS, "auto")
    ids = vocab.encode('Sure. <tool_call>{"value": 3}')
    matcher = llguidance.LLMatcher(vocab.llg, grammar.source, log_level=0)
    accepted = matcher.try_consume_tokens(ids)
    assert vocab._tokenizer.decode(ids[:accepted]) == 'Sure. <tool_call>{"'  # "value" is refused
    text = vocab.encode("Plain text, with <b>tags</b>.")
    assert llguidance.LLMatcher(vocab.llg, grammar.source, log_level=0).try_consume_tokens(text) == len(text)


def test_constrained_and_free_requests_share_one_decode_batch(engine):
    """A free request decoded beside a constrained one produces what it produces alone."""
    free_msgs = [{"role": "user", "content": "Say anything at all."}]
    alone = engine.chat(None, free_msgs, max_tokens=40)
    before = engine.stats["max_batch"]
    results: dict[str, Any] = {}
    start = threading.Barrier(2)

    def run(key: str, **kw: Any) -> None:
        start.wait()
        results[key] = engine.chat(None, free_msgs if key == "free" else ASK, **kw)

    threads = [
        threading.Thread(target=run, args=("free",), kwargs={"max_tokens": 40}),
        threading.Thread(target=run, args=("json",), kwargs={"response_format": _fmt(SCHEMAS[3]), "max_tokens": 300}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(engine.stats["max_batch"], before) >= 2
    assert results["free"].token_ids == alone.token_ids
    jsonschema.validate(json.loads(results["json"].text), closed(SCHEMAS[3]))


def test_a_grammar_not_enforced_only_ends_the_reply_where_it_breaks(engine):
    """A validator (``enforced=False``) masks nothing: the reply is the free reply's own
    tokens, up to and including the first one its grammar refuses, and ends there."""
    import dataclasses

    import llguidance

    from kvshelf.structured.plan import plan_output

    plan = plan_output(response_format=_fmt(SCHEMAS[3]))
    assert plan.grammar is not None
    messages = plan.messages(ASK)
    free = engine.chat(None, messages, max_tokens=60)
    validator = dataclasses.replace(plan.grammar, enforced=False)
    checked = engine.chat(None, messages, max_tokens=60, grammar=validator)
    matcher = llguidance.LLMatcher(engine.vocabulary.llg, validator.source, log_level=0)
    matcher.consume_tokens(engine.vocabulary.encode(plan.opening))
    kept = matcher.try_consume_tokens(free.token_ids)
    assert kept < len(free.token_ids)  # a random model's free reply leaves the schema
    assert checked.token_ids == free.token_ids[: kept + 1]
    assert checked.finish_reason == "stop"


def test_a_constrained_turn_leaves_the_cache_exact_and_restores_warm(tiny_dirs, tmp_path):
    """The mask only picks tokens: the agent's cache after a constrained turn is the cache of
    those tokens, and restoring it from disk continues exactly as computing it fresh.

    At the engines' default prefill chunk, as users run them: greedy turns and prefills run
    the shape-invariant kernels (tests/test_invariance.py), so a cache built over two turns
    and a decode equals one prefilled at once, bit for bit (``prefill_chunk=1`` on both, one
    forward per token, cost this test ~20-45 s for the same comparison)."""
    warm = Engine(tiny_dirs["llama"], tmp_path / "a", progress=False)
    fresh = Engine(tiny_dirs["llama"], tmp_path / "b", progress=False)
    first = warm.chat("ann", ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300)
    call = first.tool_calls[0]
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": "done"},
        {"role": "user", "content": "And now?"},
    ]
    from kvshelf.structured.plan import plan_output

    rendered = plan_output(TOOLS, "auto").messages(history)  # what the next turn's prompt holds
    assert warm.flush() == [] and warm.evict("ann")
    second = warm.chat("ann", history, tools=TOOLS, tool_choice="auto", max_tokens=4)
    assert second.cache == "warm" and second.usage.cached_tokens > first.usage.prompt_tokens
    assert np.array_equal(warm.prefill("ann", rendered), fresh.prefill("ann", rendered))
    warm.close()
    fresh.close()


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "object", "if": {"type": "object"}, "then": {}}, '"if"'),
        ({"type": "objectx"}, "objectx"),
        ({"type": "string", "format": "bogus"}, "bogus"),
        ({"type": "string", "pattern": "(?=a)"}, "look-around"),
    ],
)
def test_a_schema_the_grammar_cannot_enforce_is_refused_naming_the_keyword(engine, schema, keyword):
    with pytest.raises(InvalidSchema) as err:
        engine.chat(None, ASK, response_format=_fmt(schema))
    assert keyword in str(err.value) and err.value.param == "response_format.json_schema.schema"
    assert err.value.status == 400
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(InvalidSchema) as err:
        engine.chat(None, ASK, tools=[TOOLS[0], *bad_tool], tool_choice="auto")
    assert keyword in str(err.value) and err.value.param == "tools[1].function.parameters"


def test_tool_choice_needs_its_tools(engine):
    with pytest.raises(ApiError, match="requires 'tools'"):
        engine.chat(None, ASK, tools=[], tool_choice="required")
    with pytest.raises(ApiError, match="not in 'tools'"):
        engine.chat(None, ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_schemas_are_closed_where_they_leave_other_keys_open():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"const": {"properties": 1}}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["properties"]["properties"]["a"] == {"const": {"properties": 1}}  # data, untouched
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert json_grammar({"type": "array"}).opening == "" and json_grammar(None).opening == "{"
    bounded = closed({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}})["properties"]["n"]
    assert bounded == {"type": "integer", "minimum": 1, "maximum": 2**53 - 1}  # no endless digits


def test_an_integer_without_bounds_cannot_run_on_forever():
    import llguidance

    from kvshelf.model.loader import TextTokenizer
    from kvshelf.structured.constraint import Vocabulary
    from tests.support.tiny import byte_tokenizer

    vocab = Vocabulary(TextTokenizer(byte_tokenizer(), None, frozenset({0})))
    grammar = json_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    digits = vocab.encode('{"n": ' + "1" * 30)
    accepted = llguidance.LLMatcher(vocab.llg, grammar.source, log_level=0).try_consume_tokens(digits)
    assert accepted == len('{"n": ') + 16  # 1111111111111111 < 2**53 - 1 < 11111111111111111


def test_engines_on_one_tokenizer_share_one_built_vocabulary(tiny_dirs, tmp_path):
    """llguidance's vocabulary (3-9 s to build for Gemma 3) is built once per tokenizer and
    stop ids in a process, not once per engine, and goes when its tokenizer goes."""
    import gc
    import weakref

    from kvshelf.model.loader import TextTokenizer, load
    from kvshelf.structured import constraint
    from tests.support.tiny import byte_tokenizer

    loaded = load(tiny_dirs["llama"], progress=False)
    first, second = (Engine(loaded, tmp_path / name, progress=False) for name in ("a", "b"))
    try:
        assert first.vocabulary.llg is second.vocabulary.llg
        other_stops = TextTokenizer(loaded.tokenizer.tokenizer, None, frozenset({1}))
        assert constraint.Vocabulary(other_stops).llg is not first.vocabulary.llg  # its own end tokens
        r = second.chat(None, ASK, response_format=_fmt(SCHEMAS[1]), max_tokens=200)
        jsonschema.validate(json.loads(r.text), closed(SCHEMAS[1]))  # the shared one still constrains
    finally:
        first.close()
        second.close()
    tokenizer = byte_tokenizer()
    assert constraint.Vocabulary(TextTokenizer(tokenizer, None, frozenset({0}))).llg.vocab_size > 0
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None  # the cache kept no strong reference to it


def _byte_matcher(schema: dict[str, Any]) -> tuple[Any, Any]:
    import llguidance

    from kvshelf.model.loader import TextTokenizer
    from kvshelf.structured.constraint import Vocabulary
    from tests.support.tiny import byte_tokenizer

    vocab = Vocabulary(TextTokenizer(byte_tokenizer(), None, frozenset({0})))
    return vocab, llguidance.LLMatcher(vocab.llg, json_grammar(schema).source, log_level=0)


@pytest.mark.parametrize(
    "text, kept",
    [
        ('{"x": ' + "3" * 30, '{"x": ' + "3" * 16),  # 3333333333333333 < 2**53 - 1 < 33333333333333333
        ('{"x": 3.' + "0" * 30, '{"x": 3.' + "0" * 10),  # ten digits after the point, no more
        ('{"x": 1e' + "9" * 30, '{"x": 1'),  # no exponent: bounded numbers are plain decimals
    ],
)
def test_a_number_without_bounds_cannot_run_on_forever(text, kept):
    """The embedded model wrote ``"lon": 3000000...`` until max_tokens: a number's digits are bounded too."""
    vocab, matcher = _byte_matcher({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    ids = vocab.encode(text)
    assert vocab._tokenizer.decode(ids[: matcher.try_consume_tokens(ids)]) == kept


def test_a_bounded_number_still_validates_against_the_declared_schema():
    """The grammar narrows a schema, never widens it: what it admits is valid as declared."""
    schema = {"type": "object", "properties": {"r": {"type": ["number", "null"], "maximum": 1}}, "required": ["r"]}
    out = closed(schema)["properties"]["r"]
    assert out == {"type": ["number", "null"], "maximum": 1, "minimum": -(2**53 - 1), "multipleOf": 1e-10}
    cases = [('{"r": -0.25}', True), ('{"r": null}', True), ('{"r": 0.12345678901}', False), ('{"r": 2}', False)]
    for text, ok in cases:
        vocab, matcher = _byte_matcher(schema)
        ids = vocab.encode(text)
        assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) is ok, text
        if ok:
            jsonschema.validate(json.loads(text), schema)


def test_a_call_repeated_word_for_word_ends_the_reply():
    """Allowed parallel calls, the embedded model writes its one call again until max_tokens:
    the reply ends before the first exact repeat, and a different call still goes on."""
    from kvshelf.structured.tools import end_of_repeat

    opening = '<tool_call>{"name": "'
    a = 'f", "arguments": {"x": 1}}</tool_call>'
    b = '\n<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>'
    until = end_of_repeat(opening)
    assert until(a) == -1 and until(a + b) == -1
    assert until(a + b + b[:-3]) == -1  # the repeat is not complete yet
    assert until(a + b + b) == len(a + b)  # cut before the newline that opens the repeat
    assert end_of_repeat(opening)(a + "\n" + opening + a) == len(a)


def test_max_tokens_cuts_a_constrained_reply_with_finish_reason_length(engine):
    """``max_tokens`` is a hard cap, as OpenAI's: a constrained reply that does not fit ends
    with finish_reason "length", as the text generated, and a cut call is never returned as
    a call (its arguments could lack required fields)."""
    long_text = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    r = engine.chat(None, ASK, response_format=_fmt(long_text), max_tokens=8)
    assert r.finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.text.startswith('{"s": "') and not _parses(r.text)
    tool = [{"type": "function", "function": {"name": "note", "parameters": long_text}}]
    r = engine.chat(None, ASK, tools=tool, tool_choice="required", max_tokens=8)
    assert r.finish_reason == "length" and r.tool_calls == []
    assert r.text.startswith('<tool_call>{"name": "note"')


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


# -- over HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(engine):
    import httpx

    from kvshelf.serving.server import create_app
    from tests.support.servers import ServerThread

    server = ServerThread(create_app(engine, close_engine=False))
    with httpx.Client(base_url=server.url + "/v1", timeout=120) as client:
        yield client
    server.stop()


def test_the_server_answers_a_schema_it_cannot_enforce_with_a_400_naming_the_keyword(http):
    bad = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {}}
    r = http.post("/chat/completions", json={"messages": ASK, "response_format": _fmt(bad)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and err["code"] == "invalid_json_schema"
    assert '"if"' in err["message"] and '"then"' in err["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "bogus"}}}
    r = http.post("/chat/completions", json={"messages": ASK, "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"
    assert "bogus" in r.json()["error"]["message"]


def _post(http: Any, body: dict[str, Any], stream: bool) -> tuple[str, list[dict[str, Any]], str]:
    """(content, tool calls, finish_reason) of one completion, streamed (SSE) or whole."""
    if not stream:
        r = http.post("/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        message = choice["message"]
        return message["content"] or "", message.get("tool_calls") or [], choice["finish_reason"]
    content, finish = "", ""
    calls: list[dict[str, Any]] = []
    with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_constrains_forced_calls_and_json_replies(http, stream):
    body: dict[str, Any] = {"messages": ASK, "max_tokens": 300, "temperature": 1.0, "seed": 5}
    _, calls, finish = _post(http, {**body, "tools": TOOLS, "tool_choice": "required"}, stream)
    assert finish == "tool_calls" and calls
    for call in calls:
        fn = call["function"]
        schema = next(t["function"].get("parameters") for t in TOOLS if t["function"]["name"] == fn["name"])
        jsonschema.validate(json.loads(fn["arguments"]), closed(schema or {"type": "object"}))
    text, _, finish = _post(http, {**body, "response_format": _fmt(SCHEMAS[3])}, stream)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), closed(SCHEMAS[3]))
