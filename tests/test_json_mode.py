"""JSON mode ends generation where the object closes, instead of running to max_tokens."""

from __future__ import annotations

from kvshelf.runtime.engine import Engine
from kvshelf.serving.json_mode import end_of_object


def test_end_of_object_follows_strings_escapes_and_nesting_token_by_token():
    reply = ' "a": {"b": "}\\" ]"}, "c": [1, {"d": 2}]} and then some chatter'
    until = end_of_object()
    ends = [until(reply[:n]) for n in range(1, len(reply) + 1)]
    close = reply.index("} and") + 1
    assert all(e == -1 for e in ends[: close - 1]) and set(ends[close - 1 :]) == {close}
    assert end_of_object()('"x": 1') == -1


def test_until_ends_a_reply_early_with_finish_reason_stop(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["llama"], tmp_path, progress=False)
    messages = [{"role": "user", "content": "Say something."}]
    free = engine.chat("a", messages, max_tokens=12)
    cut = engine.chat("b", messages, max_tokens=12, until=lambda text: 3 if len(text) >= 3 else -1)
    assert cut.finish_reason == "stop" and cut.text == free.text[:3]
    assert len(cut.token_ids) < len(free.token_ids)
    engine.close()


def test_a_forced_tool_call_and_json_mode_end_where_their_object_closes():
    from kvshelf.runtime.params import GenerationParams
    from kvshelf.serving.completions import prepare
    from kvshelf.serving.openai_api import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    base = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    named = prepare(
        ChatCompletionRequest.model_validate({**base, "tool_choice": forced}), None, GenerationParams(max_tokens=64)
    )
    reply = ' {"city": "Paris"}}</tool_call> and more'
    assert named.options["until"](reply) == reply.index("}}") + 2
    required = prepare(
        ChatCompletionRequest.model_validate({**base, "tool_choice": "required"}), None, GenerationParams(max_tokens=64)
    )
    reply = 'get_weather", "arguments": {}} more'
    assert required.options["until"](reply) == reply.index("}}") + 2
    assert (
        "until"
        not in prepare(ChatCompletionRequest.model_validate(base), None, GenerationParams(max_tokens=64)).options
    )  # auto: may call several
    as_json = prepare(
        ChatCompletionRequest.model_validate(
            {"messages": base["messages"], "response_format": {"type": "json_object"}}
        ),
        None,
        GenerationParams(max_tokens=64),
    )
    assert as_json.options["until"]('"a": 1} done') == len('"a": 1}')
