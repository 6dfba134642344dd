"""JSON mode and forced calls end where the reply is complete, instead of running to max_tokens."""

from __future__ import annotations

from kvshelf.runtime.engine import Engine
from kvshelf.structured.json_mode import end_of_object


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


def test_unconstrained_a_forced_tool_call_and_json_mode_end_where_their_object_closes():
    """``constrained=False`` (the benchmark's comparison) keeps the older cut: no grammar,
    the reply ends where the call's or the JSON object's brackets close."""
    from kvshelf.structured.plan import plan_output

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    named = plan_output([tool], forced, constrained=False)
    reply = ' {"city": "Paris"}}</tool_call> and more'
    assert named.grammar is None and named.until()(reply) == reply.index("}}") + 2  # type: ignore[misc]
    required = plan_output([tool], "required", constrained=False)
    reply = 'get_weather", "arguments": {}} more'
    assert required.until()(reply) == reply.index("}}") + 2  # type: ignore[misc]
    assert plan_output([tool], "auto", constrained=False).until() is None  # auto: may call several
    as_json = plan_output(response_format={"type": "json_object"}, constrained=False)
    assert as_json.until()('"a": 1} done') == len('"a": 1}')  # type: ignore[misc]


def test_the_server_constrains_forced_calls_and_json_with_a_grammar_instead_of_a_cut():
    from kvshelf.runtime.params import GenerationParams
    from kvshelf.serving.completions import prepare
    from kvshelf.serving.openai_api import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    base = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]}
    for extra in (
        {"tool_choice": "required"},
        {},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ):
        turn = prepare(ChatCompletionRequest.model_validate({**base, **extra}), None, GenerationParams(max_tokens=64))
        assert turn.options["grammar"].description == "tool_calls"
        # no cut where the object closes: only a call repeated word for word ends the reply early
        call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        until = turn.options["until"]  # fed the reply as it grows, as the scheduler does
        assert until(call.removeprefix(turn.opening)) == -1
        assert until((call + "\n" + call).removeprefix(turn.opening)) == len(call) - len(turn.opening)
    as_json = prepare(
        ChatCompletionRequest.model_validate(
            {"messages": base["messages"], "response_format": {"type": "json_object"}}
        ),
        None,
    )
    assert "until" not in as_json.options and as_json.options["grammar"].opening == "{"
    plain = prepare(ChatCompletionRequest.model_validate({"messages": base["messages"]}), None)
    assert "grammar" not in plain.options and "until" not in plain.options
