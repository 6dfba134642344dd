"""Non-Gemma chat templates: rendered by transformers' own renderer (``{% break %}``,
``strftime_now``, ``tools=``), with a fixed date, and mlx-lm's tool parser where it knows
the template's format; loaded from a tiny random-weight model's own tokenizer config."""

from __future__ import annotations

import datetime
import json
from typing import Any

import httpx

from kvshelf.model.template import (
    FIXED_DATE,
    ChatMLTemplate,
    GemmaTemplate,
    JinjaTemplate,
    infer_tool_parser,
    native_tool_parser,
)
from kvshelf.runtime.engine import Engine
from kvshelf.runtime.results import ChatResult, Usage
from kvshelf.serving.completions import ReplyShaper, prepare
from kvshelf.serving.openai_api import ChatCompletionRequest
from kvshelf.serving.server import create_app
from kvshelf.structured.plan import plan_output
from tests.support.servers import ServerThread
from tests.support.tiny import make_tiny_model_dir

# A template in the style of Llama 3 and Qwen: today's date and the tools in the system turn,
# calls written as <tool_call>{json}</tool_call>, a loop that stops early with {% break %}.
DATED_TOOLS = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
<|system|>Today is {{ date_string }}.
{%- if tools %} You may call:{% for t in tools %} {{ t.function.name | tojson }}{% endfor %}.{% endif %}</s>
{%- for m in messages %}
{%- if m.role == "system" %}{% continue %}{% endif %}
<|{{ m.role }}|>{{ m.content }}
{%- if m.tool_calls %}{% for tool_call in m.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>{"name": {{ tool_call.name | tojson }}, "arguments": {{ tool_call.arguments | tojson }}}</tool_call>
{%- endfor %}{% endif %}</s>
{%- endfor %}
{%- for m in messages %}{% if m.role == "system" %}<|note|>{{ m.content }}</s>{% break %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

MISTRAL_LIKE = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{# [TOOL_CALLS] #}"

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_tide", "description": "High tide", "parameters": {"type": "object"}},
    }
]


def test_transformers_renderer_handles_break_continue_tools_and_a_fixed_date():
    template = JinjaTemplate(DATED_TOOLS, bos_token="<s>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tide?"}]
    text = template.render(msgs, tools=TOOLS)
    assert text.startswith('<|system|>Today is 01 Jan 2026. You may call: "get_tide".</s>')  # BOS left out
    assert FIXED_DATE.strftime("%d %b %Y") in text and datetime.date.today().strftime("%d %b %Y") not in text
    assert text.count("<|note|>Be brief.</s>") == 1  # {% break %} stopped the loop after the first system message
    assert "<|system|>Be brief." not in text  # {% continue %} skipped it in the turns
    assert text.endswith("<|assistant|>") and template.renders_tools
    assert "You may call" not in template.render(msgs)  # no tools, no tool text
    later = JinjaTemplate(DATED_TOOLS, bos_token="<s>", date=datetime.date(2030, 5, 6))
    assert "Today is 06 May 2030." in later.render(msgs)


def test_earlier_tool_calls_render_with_dict_arguments_and_turns_stay_byte_stable():
    template = JinjaTemplate(DATED_TOOLS)
    call = {"id": "c1", "type": "function", "function": {"name": "get_tide", "arguments": '{"port": "Dover"}'}}
    turn1: list[dict[str, Any]] = [{"role": "user", "content": "Tide at Dover?"}]
    turn2: list[dict[str, Any]] = [
        *turn1,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "6am"},
    ]
    text = template.render(turn2, tools=TOOLS)
    assert '<tool_call>{"name": "get_tide", "arguments": {"port": "Dover"}}</tool_call>' in text
    # a conversation rendered again with more turns starts with what it was (prefix reuse)
    head = template.render(turn1, add_generation_prompt=False, tools=TOOLS)
    assert text.startswith(head)


def test_mlx_lm_tool_parsers_are_found_from_the_template_and_read_its_calls():
    parser = infer_tool_parser(DATED_TOOLS, {})
    assert parser is not None and parser.name == "json_tools"
    reply = 'Let me check. <tool_call>{"name": "get_tide", "arguments": {"port": "Dover"}}</tool_call>'
    assert parser.calls(reply, TOOLS) == [{"name": "get_tide", "arguments": {"port": "Dover"}}]
    mistral = infer_tool_parser(MISTRAL_LIKE, {})
    assert mistral is not None and mistral.name == "mistral"
    assert infer_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}", {}) is None
    assert infer_tool_parser("plain", {}, name="json_tools") is not None  # the tokenizer config's choice wins


def test_a_tiny_model_with_its_own_template_loads_it_and_reuses_its_prefix(tmp_path):
    model = make_tiny_model_dir(tmp_path / "m", "llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": DATED_TOOLS}))
    engine = Engine(model=model, cache_dir=tmp_path / "c")
    template = engine.loaded.template
    assert isinstance(template, JinjaTemplate) and template.tool_parser is not None
    assert template.tool_parser.name == "json_tools"
    msgs = [{"role": "system", "content": "Be brief. " * 10}, {"role": "user", "content": "Tide?"}]
    r1 = engine.chat("keeper", msgs, max_tokens=6)
    follow_up = [*msgs, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "Why?"}]
    r2 = engine.chat("keeper", follow_up, max_tokens=6)  # (was the default 2048: a random model runs on)
    assert r2.cache == "hot" and r2.usage.cached_tokens > len("Today is 01 Jan 2026.")


# -- tools in the model's own format ----------------------------------------------------
CALL = '<tool_call>{"name": "get_tide", "arguments": {"port": "Dover"}}</tool_call>'


def _tiny_with_template(tmp_path, template: str = DATED_TOOLS):
    model = make_tiny_model_dir(tmp_path / "m", "llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return model


def test_gemma_and_chatml_keep_kvshelfs_format_and_a_template_with_tools_gets_its_own():
    assert native_tool_parser(GemmaTemplate()) is None and native_tool_parser(ChatMLTemplate()) is None
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    no_tools = JinjaTemplate(plain, tool_parser=infer_tool_parser(DATED_TOOLS, {}))
    assert native_tool_parser(no_tools) is None  # the template cannot show tools: kvshelf describes them
    parser = native_tool_parser(JinjaTemplate(DATED_TOOLS, tool_parser=infer_tool_parser(DATED_TOOLS, {})))
    assert parser is not None and parser.name == "json_tools"


def test_under_auto_the_templates_own_tools_text_replaces_kvshelfs_and_its_parser_reads_the_calls():
    parser = infer_tool_parser(DATED_TOOLS, {})
    plan = plan_output(TOOLS, "auto", native=parser)
    assert plan.template_tools == TOOLS and plan.system_text == "" and plan.grammar is None and plan.opening == ""
    content, calls = plan.parse(f"Let me check. {CALL}")
    assert content == "Let me check. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_tide", {"port": "Dover"})
    ]
    assert calls[0].id.startswith("call_")
    # a call of a function not offered, or one that does not parse, stays content
    other = CALL.replace("get_tide", "launch")
    assert plan.parse(other) == (other, [])
    assert plan.parse("<tool_call>{oops</tool_call>") == ("<tool_call>{oops</tool_call>", [])
    # a forced call keeps kvshelf's format, where the grammar guarantees it
    forced = plan_output(TOOLS, "required", native=parser)
    assert forced.template_tools is None and forced.grammar is not None and "<tool_call>" in forced.system_text


def test_a_streamed_reply_shows_its_content_and_holds_back_its_native_calls():
    parser = infer_tool_parser(DATED_TOOLS, {})
    assert parser is not None
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Tide?"}], "tools": TOOLS}
    )
    turn = prepare(req, "keeper", native=parser)
    assert turn.options["tools"] == TOOLS and "You can call" not in json.dumps(turn.messages)
    shaper = ReplyShaper(turn)
    reply = f"Checking <tool_call>{CALL[len('<tool_call>') :]}"
    shown = "".join(shaper.feed(reply[i : i + 3]) for i in range(0, len(reply), 3))
    assert shown == "Checking "  # nothing of the call, not even the start of its tag
    result = ChatResult(reply, "stop", Usage(10, 0, 20), 0.1)
    tail, calls, finish = shaper.finish(result)
    assert tail == "" and finish == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_tide", {"port": "Dover"})]
    stream = parser.stream(TOOLS)
    assert stream.feed("a <tool") == "a " and stream.feed("box> b") == "<toolbox> b"  # a false start is released


def test_mistrals_format_without_a_closing_tag_is_read_to_the_end():
    mistral = infer_tool_parser(MISTRAL_LIKE, {})
    assert mistral is not None
    text = 'Sure.[TOOL_CALLS]get_tide[ARGS]{"port": "Dover"}'
    assert mistral.split(text, TOOLS) == ("Sure.", [{"name": "get_tide", "arguments": {"port": "Dover"}}])


def test_a_tiny_model_is_shown_its_tools_by_its_own_template_and_reuses_that_prefix(tmp_path):
    engine = Engine(model=_tiny_with_template(tmp_path), cache_dir=tmp_path / "c")
    msgs = [{"role": "system", "content": "Be brief. " * 10}, {"role": "user", "content": "Tide?"}]
    r1 = engine.chat("keeper", msgs, max_tokens=6, tools=TOOLS)
    template = engine.loaded.template
    shown = engine.loaded.tokenizer.encode_prompt(template.render(msgs, tools=TOOLS))
    assert r1.usage.prompt_tokens == len(shown)  # the template's own tool text, and no kvshelf tool text
    r2 = engine.chat(
        "keeper",
        [*msgs, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "Why?"}],
        max_tokens=4,
        tools=TOOLS,
    )
    # every turn up to the note (which this template writes after the turns) is reused, tool text included
    head = template.render(msgs, add_generation_prompt=False, tools=TOOLS).partition("<|note|>")[0]
    assert head.endswith("Tide?</s>") and 'You may call: "get_tide"' in head
    assert r2.cache == "hot" and r2.usage.cached_tokens >= len(engine.loaded.tokenizer.encode_prompt(head)) - 1
    # over HTTP: /v1/tokenize counts the same prompt as the engine ran
    server = ServerThread(create_app(engine, close_engine=False))
    try:
        body = {"model": "m", "messages": msgs, "tools": TOOLS}
        counted = httpx.post(f"{server.url}/v1/tokenize", json=body, timeout=30).json()["prompt_tokens"]
        assert counted == len(shown)
        # an append with tools prefills what the agent's next chat with them renders
        appended = httpx.post(f"{server.url}/v1/agents/planner/append", json=body, timeout=60).json()
        assert appended["prompt_tokens"] == len(shown)
        chat = httpx.post(
            f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 2}, headers={"X-Agent-Id": "planner"}
        ).json()
        assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shown) - 2
    finally:
        server.stop()
        engine.close()
