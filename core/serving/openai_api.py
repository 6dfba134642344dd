"""The OpenAI chat-completions wire format: request schemas, response and error bodies.

Requests are validated here so that a wrong type, an empty ``messages``, an unknown
role or an out-of-range number becomes a 400 with an OpenAI-style error object that
names the offending parameter, never a crash. Every sampling field OpenAI defines is
honoured (``logit_bias``, ``frequency_penalty``, ``presence_penalty``, ``top_p`` 0 as
greedy, ``parallel_tool_calls``, and kvshelf's own ``dry_*`` repetition penalty with
llama.cpp's names) or refused with a 400 (``n`` > 1, ``logprobs``,
``top_logprobs``); fields that change nothing about the reply (``metadata``, ``store``,
``service_tier``, ...) and fields kvshelf does not know are accepted and ignored (the
README lists them), so that clients and frameworks work unchanged.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvshelf.errors import ApiError
from kvshelf.model.template import message_text
from kvshelf.serving.errors_http import bad_request

Role = Literal["system", "developer", "user", "assistant", "tool"]


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """An assistant's earlier call, as the client sends it back in the history."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        message_text({"content": value})  # raises ValueError with a readable message
        return value

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs 'content' (only an assistant's tool calls may go without)")
        return self


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. ``model`` is accepted but any name is served by the one model."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)  # 0: greedy, as OpenAI takes it
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # DRY, kvshelf's (and llama.cpp's) penalty on repeating the context: kvshelf.runtime.repetition
    dry_multiplier: float | None = Field(default=None, ge=0, le=100)
    dry_base: float | None = Field(default=None, ge=1, le=10)
    dry_allowed_length: int | None = Field(default=None, ge=1)
    dry_penalty_last_n: int | None = Field(default=None, ge=-1)
    dry_sequence_breakers: list[str] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's own cache key: kvshelf takes it as the agent id
    n: int = 1
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(value):
            raise ValueError("each of dry_sequence_breakers must be a non-empty string")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("kvshelf returns one choice per request; send n=1 (or leave it out)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported by kvshelf; leave them out")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top_logprobs needs logprobs, which kvshelf does not return; leave it out")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit() or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias maps token ids (as strings of digits) to a bias between -100 and 100; "
                    f"got {token[:20]!r}: {bias}"
                )
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of up to 16 non-empty strings")
        return value


class ForkRequest(BaseModel):
    """``POST /v1/agents/{id}/fork``: the agent to create from this one."""

    model_config = ConfigDict(extra="forbid")

    new_agent: str


class AppendRequest(ChatCompletionRequest):
    """``POST /v1/agents/{id}/append``: the agent's conversation so far, prefilled
    without generating; ``background`` queues it as prefill ahead."""

    background: bool = False


# -- errors ------------------------------------------------------------------------------
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def param_path(loc: Sequence[Any]) -> str | None:
    """pydantic's ``("body", "messages", 0, "role")`` as OpenAI's ``messages[0].role``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _FIELD.match(str(part)) or part in _TYPE_TAGS:
            continue  # union branch tags ("str", "literal[...]", "NamedToolChoice") mean nothing to a person
        else:
            out += f".{part}" if out else str(part)
    return out or None


_CODES = {
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
    "extra_forbidden": "unknown_parameter",
}


def invalid_request(errors: Sequence[Any]) -> ApiError:
    """The first of pydantic's errors (a body FastAPI or the in-process backend refused)
    as a 400 that names the offending parameter."""
    err: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = str(err.get("type", ""))
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. Send a JSON object "
            f"(Content-Type: application/json). Parser said: {err.get('ctx', {}).get('error', err.get('msg'))}",
            code="invalid_json",
        )
    param = param_path(err.get("loc", ()))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return bad_request(
            f"The request body must be a JSON object, sent as Content-Type: application/json ({msg})",
            code="invalid_type",
        )
    code = _CODES.get(kind) or ("invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code=code)


# -- responses ---------------------------------------------------------------------------
def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage_body(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(cid: str, model: str, message: dict, finish_reason: str, usage: dict, extra: dict) -> dict:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
        "kvshelf": extra,
    }


def chunk_body(cid: str, model: str, delta: dict | None, finish_reason: str | None = None, **extra: Any) -> dict:
    """One SSE chunk; ``delta=None`` gives the empty ``choices`` of the final usage chunk."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }
