"""Tool calls and JSON mode without a model: crafted model text through the parsers,
and the prompt additions checked for the byte stability that prefix reuse needs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvshelf.model.template import ChatMLTemplate, GemmaTemplate
from kvshelf.structured.json_mode import JsonObjectCutter, instruction, is_valid_json
from kvshelf.structured.tools import (
    ToolCallStream,
    complete_json_prefix,
    end_of_call,
    name_tool_results,
    opening,
    parse_tool_calls,
    tools_text,
    with_system_text,
)

NAMES = ["get_weather", "add"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


def calls_of(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just an answer.", "Just an answer.", []),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
            "",
            [("get_weather", {"city": "Paris"})],
        ),
        # arguments as a JSON string, as OpenAI itself sends them; a second call; text before
        (
            'Let me see.\n<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\nDone.',
            "Let me see.\n",
            [("add", {"a": 1}), ("get_weather", {})],
        ),
        # an invalid block before a valid one stays content
        (
            '<tool_call>{"name": "nope"}</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "nope"}</tool_call>',
            [("add", {})],
        ),
        # no closing tag at the very end (the turn ended), junk after the object inside the tag
        ('<tool_call>{"name": "add", "arguments": {"a": 2}}', "", [("add", {"a": 2})]),
        ('<tool_call>{"name": "add", "arguments": {"a": 2}}}</tool_call>', "", [("add", {"a": 2})]),
        # lenient: bare and fenced JSON, "parameters", a list of calls
        ('{"name": "add", "parameters": {"a": 3}}', "", [("add", {"a": 3})]),
        (
            '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```',
            "",
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            '[{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {}}]',
            "",
            [("add", {}), ("get_weather", {})],
        ),
    ],
)
def test_parses_calls(text, content, calls):
    assert calls_of(text) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered function
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": </tool_call>',  # broken JSON
        '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
        '{"city": "Paris"}',  # JSON, but not a call
        '[{"name": "add", "arguments": {}}, {"oops": 1}]',  # one bad item spoils a bare list
    ],
)
def test_invalid_calls_stay_content(text):
    assert calls_of(text) == (text, [])


def test_an_exact_repeat_of_a_call_is_dropped():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    _, calls = parse_tool_calls(f"{call}\n{call}\n{call}", NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1}')]


def test_call_ids_are_unique_and_arguments_are_json_strings():
    one, two = ({"name": "add", "arguments": {"a": a}} for a in (1, 2))
    text = f"<tool_call>{json.dumps(one)}</tool_call>\n<tool_call>{json.dumps(two)}</tool_call>"
    _, calls = parse_tool_calls(text, NAMES)
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].to_openai(0) == {
        "index": 0,
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }


@pytest.mark.parametrize(
    "text",
    [
        "Plain text, no calls at all, with a < sign and <b>tags</b>.",
        'Checking.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        '  {"name": "get_weather", "arguments": {"city": "Rome"}}',
        "<tool_cal is not a tag",
        '{"not": "a call"} and more',
        "`code` is shown",
    ],
)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_parser_agrees_with_whole_text_parser(text, step):
    stream = ToolCallStream(NAMES)
    shown = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    assert "<tool_call" not in shown  # a tag is never shown as content
    tail, calls = stream.finish()
    content, expected = parse_tool_calls(text, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
    assert shown + tail == (content if expected else text)


def test_stream_parser_releases_a_false_tag_start():
    stream = ToolCallStream(NAMES)
    assert stream.feed("a <tool") == "a "
    assert stream.feed("box> b") == "<toolbox> b"


def test_tools_text_and_forced_openings():
    text = tools_text(TOOLS)
    assert '{"name": "get_weather", "description": "Weather in a city"' in text and "<tool_call>" in text
    assert opening("auto") == opening("none") == ""
    assert opening("required") == '<tool_call>{"name": "'
    assert opening({"type": "function", "function": {"name": "add"}}) == '<tool_call>{"name": "add", "arguments":'


@pytest.mark.parametrize("template", [GemmaTemplate(), ChatMLTemplate()], ids=["gemma", "chatml"])
def test_tool_conversation_renders_byte_stable(template):
    """Each turn's prompt (tools in the system text, forced opening) starts the next one."""
    extra = tools_text(TOOLS)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}],
        [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        [{"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks"}],
    ]
    history: list[dict[str, Any]] = []
    prompts: list[str] = []
    for i, new in enumerate(turns):
        history += new
        msgs = with_system_text(name_tool_results(history), extra)
        if i == 0:  # a forced call on the first turn opens the model's turn
            msgs.append(
                {"role": "assistant", "content": opening({"function": {"name": "get_weather"}}), "prefix": True}
            )
        prompts.append(template.render(msgs))
    assert prompts[0].endswith('<tool_call>{"name": "get_weather", "arguments":')
    assert prompts[1].startswith(prompts[0])  # the completed call continues the opened turn
    assert prompts[2].startswith(prompts[1])
    assert '<tool_response name="get_weather">' in prompts[1] or "<|im_start|>tool" in prompts[1]
    assert prompts[0].count(extra) == 1


def test_with_system_text_merges_into_the_first_system_message():
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "hi"},
    ]
    assert with_system_text(msgs, "TOOLS")[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
    assert with_system_text(msgs[1:], "TOOLS") == [{"role": "system", "content": "TOOLS"}, msgs[1]]
    assert with_system_text(msgs, "") == msgs


def test_name_tool_results_from_earlier_calls():
    msgs: list[dict[str, Any]] = [
        {"role": "assistant", "tool_calls": [{"id": "c9", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "3"},
        {"role": "tool", "tool_call_id": "zz", "content": "?"},
    ]
    out = name_tool_results(msgs)
    assert out[1]["name"] == "add" and "name" not in out[2]


@pytest.mark.parametrize(
    "chunks, shown",
    [
        (["{", '"a": "}{"', ", ", '"b": [1, {"c": 2}]}', " trailing words"], '{"a": "}{", "b": [1, {"c": 2}]}'),
        (["{", '"s": "quote \\" }"}', "}}"], '{"s": "quote \\" }"}'),
        (["{", '"open": 1'], '{"open": 1'),  # cut short: returned as generated
    ],
)
def test_json_cutter(chunks, shown):
    cutter = JsonObjectCutter()
    assert "".join(cutter.feed(c) for c in chunks) == shown


def test_json_instruction_and_validation():
    assert "JSON" in instruction({"type": "json_object"})
    assert '"required": ["x"]' in instruction({"type": "json_schema", "json_schema": {"schema": {"required": ["x"]}}})
    assert is_valid_json('{"a": 1}') and not is_valid_json('{"a": 1')


# -- a request made ready for the engine ------------------------------------------------------
def prepared(header: str | None = None, **body):
    from kvshelf.runtime.params import GenerationParams
    from kvshelf.serving.completions import prepare
    from kvshelf.serving.openai_api import ChatCompletionRequest

    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return prepare(ChatCompletionRequest.model_validate(body), header, GenerationParams(max_tokens=99))


def test_prepare_resolves_identity_and_options():
    assert prepared().agent_id is None
    assert prepared(user="bob").agent_id == "bob"
    assert prepared("alice", user="bob").agent_id == "alice"  # the header wins
    turn = prepared(max_tokens=5, max_completion_tokens=7, temperature=0, stop="x")
    assert turn.options == {"max_tokens": 7, "temperature": 0, "top_p": 1.0, "stop": "x", "seed": None}
    # left out: the given defaults; the temperature is GenerationParams' greedy 0, not OpenAI's 1
    assert prepared().options["max_tokens"] == 99 and prepared().options["temperature"] == 0.0


@pytest.mark.parametrize(
    "choice, opened, rendered",
    [
        (None, "", True),
        ("auto", "", True),
        ("none", "", False),
        ("required", '<tool_call>{"name": "', True),
        ({"type": "function", "function": {"name": "add"}}, '<tool_call>{"name": "add", "arguments":', True),
    ],
)
def test_prepare_tool_choice(choice, opened, rendered):
    turn = prepared(tools=TOOLS, **({"tool_choice": choice} if choice else {}))
    assert turn.opening == opened and bool(turn.tool_names) == rendered
    assert (turn.messages[0]["role"] == "system" and "<tool_call>" in turn.messages[0]["content"]) == rendered
    last = turn.messages[-1]
    assert (last == {"role": "assistant", "content": opened, "prefix": True}) == bool(opened)


def test_prepare_json_mode_and_tool_results():
    turn = prepared(response_format={"type": "json_object"})
    assert turn.json_mode and turn.opening == "{" and "JSON" in turn.messages[0]["content"]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    turn = prepared(
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ],
    )
    assert turn.messages[-1]["name"] == "add"


def test_jinja_templates_open_the_assistant_turn_too():
    from kvshelf.model.template import JinjaTemplate

    source = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    template, msgs = JinjaTemplate(source), [{"role": "user", "content": "hi"}]
    opened = template.render([*msgs, {"role": "assistant", "content": "{", "prefix": True}])
    assert opened == template.render(msgs) + "{"
    assert template.render([*msgs, {"role": "assistant", "content": '{"a": 1}'}], False).startswith(opened)


def test_a_call_cut_short_inside_its_tag_is_completed_only_by_closing_brackets():
    assert complete_json_prefix('{"name": "f", "arguments": {"a": [1, 2') == '{"name": "f", "arguments": {"a": [1, 2]}}'
    assert complete_json_prefix('{"a": 1,') == '{"a": 1}'
    for broken in ('{"a": "unterminated', '{"a": }', '{"a": 1}}', "[1, 2", '{"a": tru', "plain text", ""):
        assert complete_json_prefix(broken) is None, broken
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Paris"', ["f"])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"city": "Paris"})]
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Par', ["f"])
    assert calls == [] and content.startswith("<tool_call>")  # cut inside a string: not a call
    # the reply ended inside the closing tag (the model wrote "</tool_call" and ended its turn)
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call', ["f"])
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"a": 1}]


def test_a_forced_call_ends_where_its_object_closes_or_at_the_closing_tag():
    opening = '<tool_call>{"name": "f", "arguments":'
    until = end_of_call(opening)
    reply = ' {"a": 1}} trailing'
    assert until(reply) == reply.index("}}") + 2
    until = end_of_call(opening)
    reply = ' {"a": 1</tool_call> more'
    assert until(reply) == reply.index("</tool_call>")
    assert end_of_call(opening)(' {"a": 1') == -1
