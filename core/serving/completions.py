"""One chat completion: from an OpenAI request to an engine turn, and back to OpenAI bodies.

``prepare`` resolves the agent, and has ``kvshelf.structured.plan`` render tools and
JSON mode into the messages and choose the grammar that constrains the reply (so a
forced call or a JSON reply always parses and matches its schema), and picks the
engine's options. ``ReplyShaper`` turns the engine's text into
content and tool calls, the same way for a streamed and a whole reply, so the two
always agree.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvshelf.errors import InvalidAgentId
from kvshelf.model.template import ToolParser
from kvshelf.runtime.engine import ChatResult, Engine
from kvshelf.runtime.params import GenerationParams
from kvshelf.serving.errors_http import bad_request, error_body, error_response
from kvshelf.serving.openai_api import (
    ChatCompletionRequest,
    NamedToolChoice,
    chunk_body,
    completion_body,
    completion_id,
    usage_body,
)
from kvshelf.storage.agent_id import AgentId
from kvshelf.structured import json_mode, tools
from kvshelf.structured.plan import call_fields, plan_output

log = logging.getLogger(__name__)


def model_id(engine: Engine) -> str:
    """The model name clients see: the engine's model, made safe for a URL or a header."""
    return re.sub(r"[^A-Za-z0-9._:/-]+", "-", engine.loaded.name).strip("-") or "kvshelf"


@dataclass
class Turn:
    agent_id: AgentId | None  # validated where it entered (header, body, path or adapter)
    messages: list[dict[str, Any]]
    opening: str  # what the model's turn starts with (forced call, JSON object)
    tool_names: list[str]  # parse tool calls out of the reply when non-empty
    json_mode: bool
    parallel_tool_calls: bool
    options: dict[str, Any]  # Engine.stream keyword arguments
    constrained: bool = False  # a grammar shapes the reply: a call cut by max_tokens is dropped, not repaired
    native: ToolParser | None = None  # calls in the model's own format (its template shows the tools)


def _agent_id(req: ChatCompletionRequest, header: str | None) -> AgentId | None:
    """The agent a request names: the ``X-Agent-Id`` header, else the body's
    ``prompt_cache_key`` (OpenAI's own field for "requests that share a cache", which
    OpenAI clients can send without extra headers), else its ``user``; validated here,
    once. An ``AgentId`` (an adapter's, already valid) is passed through unchecked.
    None: an anonymous request (served from RAM only, see ``kvshelf.runtime.anonymous``)."""
    sources = ((header, "X-Agent-Id"), (req.prompt_cache_key, "prompt_cache_key"), (req.user, "user"))
    value, param = next(((v, p) for v, p in sources if v is not None), (None, ""))
    if value is None:
        return None
    try:
        return AgentId(value)
    except InvalidAgentId as exc:
        raise bad_request(
            f"{exc}. The X-Agent-Id header (else the body's 'prompt_cache_key', else its 'user') "
            "names the agent whose cache is used.",
            param,
            "invalid_agent_id",
        ) from None


DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")
"""kvshelf's repetition penalty (``GenerationParams``' fields of the same names, llama.cpp's names)."""


def prepare(
    req: ChatCompletionRequest,
    header_agent: str | None,
    defaults: GenerationParams | None = None,
    native: ToolParser | None = None,
) -> Turn:
    """Resolve identity, render tools and JSON mode into the messages, pick engine options.

    A sampling field the request leaves out takes its value from ``defaults``
    (``GenerationParams()`` unless given), the same for the server and the adapters.
    ``native``: the model's own tool-call format (``Engine.native_tools``), whose
    template then shows the tools (see ``kvshelf.structured.plan``)."""
    defaults = defaults or GenerationParams()
    agent_id = _agent_id(req, header_agent)
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    plan = plan_output(
        [t.model_dump(exclude_none=True) for t in req.tools or []],
        choice,
        req.parallel_tool_calls,
        req.response_format.model_dump(exclude_none=True) if req.response_format else None,
        native=native,
    )
    messages = plan.messages([m.model_dump(exclude_none=True) for m in req.messages])
    options: dict[str, Any] = {
        "max_tokens": req.max_completion_tokens or req.max_tokens or defaults.max_tokens,
        "temperature": defaults.temperature if req.temperature is None else req.temperature,
        "top_p": defaults.top_p if req.top_p is None else req.top_p,
        "stop": req.stop,
        "seed": req.seed,
    }
    dry: dict[str, Any] = {}
    for name in DRY_FIELDS:
        if (value := getattr(req, name)) is not None:
            dry[name] = tuple(value) if isinstance(value, list) else value
    if req.logit_bias or req.frequency_penalty or req.presence_penalty or dry:  # see kvshelf.runtime.sampling
        options["params"] = replace(
            defaults,
            logit_bias=tuple((int(t), b) for t, b in (req.logit_bias or {}).items()),
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            **dry,
        )
    if (until := plan.until()) is not None:
        options["until"] = until
    if plan.grammar is not None:
        options["grammar"] = plan.grammar
    if plan.template_tools is not None:
        options["tools"] = plan.template_tools
    return Turn(
        agent_id,
        messages,
        plan.opening,
        plan.tool_names,
        plan.json_mode,
        req.parallel_tool_calls,
        options,
        constrained=plan.grammar is not None,
        native=plan.native,
    )


class ReplyShaper:
    """Turns the engine's text chunks into what the client sees: content and tool calls."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.native = turn.native.stream(turn.options.get("tools")) if turn.native and turn.tool_names else None
        self.calls_parser = (
            tools.ToolCallStream(turn.tool_names, repair=not turn.constrained)
            if turn.tool_names and self.native is None
            else None
        )
        self.cutter = json_mode.JsonObjectCutter() if turn.json_mode and not turn.tool_names else None
        self.content = ""

    def feed(self, chunk: str) -> str:
        """The content that may be shown now."""
        if self.cutter:
            chunk = self.cutter.feed(chunk)
        if self.calls_parser:
            chunk = self.calls_parser.feed(chunk)
        elif self.native:
            chunk = self.native.feed(chunk)
        self.content += chunk
        return chunk

    def finish(self, result: ChatResult) -> tuple[str, list[tools.ToolCall], str]:
        """(content not shown yet, tool calls, finish_reason)."""
        tail, calls = self.calls_parser.finish() if self.calls_parser else ("", [])
        if self.native:
            tail, found = self.native.finish()
            calls = [tools.ToolCall(*call_fields(c), tools.new_call_id()) for c in found]
        if not self.turn.parallel_tool_calls:
            calls = calls[:1]
        self.content += tail
        if self.turn.tool_names and self.turn.opening and not calls:
            log.warning("tool_choice asked for a call, but the model produced no valid one; returning text")
        if self.cutter and not json_mode.is_valid_json(self.content):
            log.warning("response_format asked for JSON, but the reply is not valid JSON (%s)", result.finish_reason)
        return tail, calls, "tool_calls" if calls else result.finish_reason


def log_turn(result: ChatResult) -> None:
    """One INFO line per answered turn: which agent, where its cache came from, how much of
    the prompt it covered. What a user of a framework's own OpenAI client reads to see that
    turn two was warm; it holds counts and the agent id, never prompt text."""
    u, t = result.usage, result.timeline
    log.info(
        "turn done: agent=%s cache=%s cached=%d/%d completion=%d ttft=%.3fs%s",
        result.agent_id or "-",
        result.cache,
        u.cached_tokens,
        u.prompt_tokens,
        u.completion_tokens,
        result.ttft_s,
        ""
        if t is None
        else f" (cache ready at {t.cache_ready_s:.3f}s; before its first token: {t.others_prefill_calls} "
        f"prefill calls of others, {t.decode_steps} decode steps)",
    )


def extension(result: ChatResult) -> dict[str, Any]:
    """kvshelf's own fields, beside OpenAI's: which agent, where its cache came from, where
    its time to first token went (``Timeline``: a restore, or a queue behind other agents'
    work), and (from a durable engine, as ``kvshelf serve`` runs) whether the turn is on disk."""
    extra: dict[str, Any] = {"agent_id": result.agent_id, "cache": result.cache, "ttft_s": round(result.ttft_s, 4)}
    if result.timeline is not None:
        extra["timeline"] = asdict(result.timeline)
    return extra if result.saved is None else {**extra, "saved": result.saved}


def usage(result: ChatResult) -> dict:
    u = result.usage
    return usage_body(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def completion(items: list[str | ChatResult], turn: Turn, model: str) -> dict:
    """The body of a non-streamed completion from the engine's items (chunks, then the result)."""
    result = items[-1]
    assert isinstance(result, ChatResult)
    log_turn(result)
    shaper = ReplyShaper(turn)
    for chunk in [turn.opening, *items[:-1]]:
        shaper.feed(chunk)  # type: ignore[arg-type]
    _, calls, finish = shaper.finish(result)
    message: dict[str, Any] = {"role": "assistant", "content": shaper.content, "refusal": None}
    if calls:
        message["content"] = shaper.content.strip() or None
        message["tool_calls"] = [c.to_openai() for c in calls]
    return completion_body(completion_id(), model, message, finish, usage(result), extension(result))


class ChunkBuilder:
    """The chunk bodies of a streamed completion, built one engine item at a time.

    Shared by the HTTP server (which sends them as SSE) and the in-process adapters
    (which consume them directly), so a streamed reply looks the same in both.
    """

    def __init__(self, turn: Turn, model: str, include_usage: bool) -> None:
        self.turn, self.model, self.include_usage = turn, model, include_usage
        self.cid, self.shaper = completion_id(), ReplyShaper(turn)

    def _chunk(self, delta: dict | None, finish: str | None = None, **more: Any) -> dict:
        extra = {"usage": None} if self.include_usage else {}
        return chunk_body(self.cid, self.model, delta, finish, **{**extra, **more})

    def start(self) -> list[dict]:
        out = [self._chunk({"role": "assistant", "content": ""})]
        if self.turn.opening and (shown := self.shaper.feed(self.turn.opening)):
            out.append(self._chunk({"content": shown}))
        return out

    def feed(self, item: str | ChatResult) -> list[dict]:
        """Chunks for one engine item (a text piece, or the final result)."""
        if not isinstance(item, ChatResult):
            shown = self.shaper.feed(item)
            return [self._chunk({"content": shown})] if shown else []
        out = []
        log_turn(item)
        tail, calls, finish = self.shaper.finish(item)
        if tail and (tail.strip() or not calls):
            out.append(self._chunk({"content": tail}))
        if calls:
            out.append(self._chunk({"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}))
        out.append(self._chunk({}, finish, kvshelf=extension(item)))
        if self.include_usage:
            out.append(chunk_body(self.cid, self.model, None, usage=usage(item)))
        return out


async def events(
    stream: AsyncIterator[str | ChatResult], first: str | ChatResult, turn: Turn, model: str, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body of a streamed completion, from its first engine item on, ending in [DONE]."""
    builder = ChunkBuilder(turn, model, include_usage)
    for body in builder.start():
        yield sse(body)
    item = first
    try:
        while True:
            for body in builder.feed(item):
                yield sse(body)
            if isinstance(item, ChatResult):
                break
            item = await anext(stream)
    except StopAsyncIteration:
        yield sse(error_body("Generation was stopped (the server is shutting down).", "server_error"))
    except Exception as exc:  # headers are sent: the error goes in the stream
        yield sse(error_response(exc)[1])
    yield sse("[DONE]")
