"""kvshelf as a CrewAI model: ``KVShelfLLM``, a ``crewai.BaseLLM``.

```python
from crewai import Agent
from kvshelf.adapters.crewai import KVShelfLLM

llm = KVShelfLLM()                                   # the embedded model, in this process
llm = KVShelfLLM(base_url="http://127.0.0.1:8000")   # or a running `kvshelf serve`
Agent(role="Researcher", goal="...", backstory="...", llm=llm)
```

One instance can serve every agent of a crew: each call is routed to the calling
agent's own persistent KV cache.

**Identity** (the kvshelf agent id of a call), first that applies:

1. ``KVShelfLLM(agent_id="...")``: every call of this instance uses that id.
2. The calling agent (``from_agent``): ``crewai-<role slug>-<from_agent.key>``, where
   ``key`` is CrewAI's md5 of the agent's role, goal and backstory (as written, before
   interpolation). It is the same in every run, so a restarted crew finds its agents'
   caches on disk; an agent whose role, goal or backstory changes starts a new cache.
   (``from_agent.id`` is a fresh uuid each run and is not used.)
3. Calls that carry no agent (CrewAI's forced final answer, context summaries, output
   conversion), keyed by their system text: if an agent already called this instance
   with the same system text, that agent's id (the forced final answer continues its
   conversation, so its cache is reused); otherwise ``crewai-anon-<hash of the system
   text>``, so calls with the same persona share a cache, stably across runs.

**Defaults.** ``temperature`` is 0 (greedy, reproducible) unless given; ``max_tokens``
is ``GenerationParams``' default (2048, in process or remote) unless given. Stop words (ReAct's ``\\nObservation:``)
are sent to the engine, which stops there; the reply never contains them.

**Results** follow CrewAI's native OpenAI LLM: text; or, when the model calls tools,
the OpenAI-style list ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
for the executor to run; or, when ``available_functions`` is given, the first call is
executed here and its result returned. With ``response_model`` the model is asked for
JSON with that schema and the validated pydantic object is returned; a reply that does
not validate is returned as text with a warning, for CrewAI's converter to repair.

Every call emits CrewAI's call started/completed (or failed) events inside
``llm_call_context()``, stream chunk events when ``stream=True``, and counts token
usage (cached prompt tokens included). ``llm.turns`` lists each call's agent id, cache
state (cold/warm/hot), TTFT and token counts.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from crewai.events.types.llm_events import LLMCallType
from crewai.hooks.dispatch import HookAborted
from crewai.llms.base_llm import BaseLLM, LLMCallBlockedError, llm_call_context
from crewai.utilities.exceptions.context_window_exceeding_exception import LLMContextLengthExceededError
from crewai.utilities.types import LLMMessage
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from kvshelf.adapters.backend import Backend, BackendError, connect, merge_chunks
from kvshelf.adapters.identity import agent_key, fallback_key
from kvshelf.runtime.params import GenerationParams
from kvshelf.storage.agent_id import AgentId

logger = logging.getLogger(__name__)

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
_SLUG = re.compile(r"[^A-Za-z0-9]+")
_CONTEXT_USAGE_RATIO = 0.85  # CrewAI's share of the window it lets a prompt fill
_connect_lock = threading.Lock()  # module-level: a lock in the model would break deep copies
_DEFAULTS = GenerationParams()  # the engine's and the server's defaults, so local and remote agree


class KVShelfLLM(BaseLLM):
    """A CrewAI LLM over kvshelf: every agent gets its own persistent Q4 KV cache.

    ``model`` is a kvshelf model (``"embedded"``, an mlx-lm directory or a Hugging Face
    repo id) in process; with ``base_url`` it is only the name sent to the server.
    """

    llm_type: str = "kvshelf"
    model: str = "embedded"
    provider: str = "kvshelf"
    temperature: float | None = _DEFAULTS.temperature
    cache_dir: str | None = None
    budget: int | str | None = None
    agent_id: str | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: type[BaseModel] | dict[str, Any] | None = None
    engine: Any = Field(default=None, exclude=True, repr=False)

    _backend: Backend | None = PrivateAttr(default=None)
    _turns: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _by_system: dict[AgentId, AgentId] = PrivateAttr(default_factory=dict)  # system-text key -> agent id

    @model_validator(mode="before")
    @classmethod
    def _kvshelf_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            data.setdefault("model", "embedded")
            data.setdefault("provider", "kvshelf")
            if data.get("temperature") is None:
                data["temperature"] = _DEFAULTS.temperature
            if data.get("cache_dir") is not None:
                data["cache_dir"] = str(data["cache_dir"])
        return data

    # -- backend and identity ------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The in-process engine or the remote server, connected on first use."""
        if self._backend is None:
            with _connect_lock:
                if self._backend is None:
                    self._backend = connect(
                        self.model,
                        base_url=self.base_url,
                        api_key=self.api_key,
                        cache_dir=self.cache_dir,
                        budget=self.budget,
                        engine=self.engine,
                    )
        return self._backend

    def agent_id_for(self, from_agent: Any = None, messages: Sequence[Mapping[str, Any]] | None = None) -> AgentId:
        """The kvshelf agent id a call from ``from_agent`` with ``messages`` uses."""
        if self.agent_id:
            return agent_key(self.agent_id)
        messages = messages or []
        system = fallback_key(messages, prefix="crewai-anon-")
        has_system = any(m.get("role") in ("system", "developer") and m.get("content") for m in messages)
        key = getattr(from_agent, "key", None) if from_agent is not None else None
        if not key:
            return self._by_system.get(system, system) if has_system else system
        role = getattr(from_agent, "_original_role", None) or getattr(from_agent, "role", "") or ""
        slug = _SLUG.sub("-", str(role)).strip("-")[:40]
        agent = agent_key(f"{slug}-{key}" if slug else str(key), prefix="crewai-")
        if has_system:
            self._by_system[system] = agent
        return agent

    @property
    def turns(self) -> list[dict[str, Any]]:
        """One record per model call: agent_id, role, task, cache, ttft_s and token counts."""
        return list(self._turns)

    # -- CrewAI's capability queries ---------------------------------------------------
    def supports_function_calling(self) -> bool:
        return True

    def supports_stop_words(self) -> bool:
        return True

    def get_context_window_size(self) -> int:
        return int(self.backend.context_length * _CONTEXT_USAGE_RATIO)

    def get_input_tokens_count(self, messages: Any, tools: Any = None, response_model: Any = None) -> int:
        """Exact prompt tokens, tools and JSON schema rendered as the model will see them."""
        try:
            return self.backend.count_tokens(self._body(self._format_messages(messages), tools, response_model, False))
        except Exception:
            return super().get_input_tokens_count(messages, tools, response_model)

    # -- calls ---------------------------------------------------------------------------
    def _begin(
        self,
        messages: str | list[Any],
        tools: list[dict[str, Any]] | None,
        callbacks: list[Any] | None,
        available_functions: dict[str, Any] | None,
        from_task: Any,
        from_agent: Any,
        response_model: type[BaseModel] | None,
    ) -> tuple[list[LLMMessage], AgentId, dict[str, Any], bool]:
        """What ``call`` and ``acall`` do before the request: the started event, the
        before-call hooks, the agent and the body (messages, agent id, body, streaming)."""
        self._emit_call_started_event(
            messages=messages,
            tools=tools,
            callbacks=callbacks,
            available_functions=available_functions,
            from_task=from_task,
            from_agent=from_agent,
        )
        formatted = self._format_messages(messages)
        self._invoke_before_llm_call_hooks(formatted, from_agent)
        agent = self.agent_id_for(from_agent, formatted)
        streaming = bool(self._effective_stream())
        return formatted, agent, self._body(formatted, tools, response_model, streaming), streaming

    def call(
        self,
        messages: str | list[Any],
        tools: list[dict[str, Any]] | None = None,
        callbacks: list[Any] | None = None,
        available_functions: dict[str, Any] | None = None,
        from_task: Any = None,
        from_agent: Any = None,
        response_model: type[BaseModel] | None = None,
    ) -> str | Any:
        with llm_call_context():
            try:
                formatted, agent, body, streaming = self._begin(
                    messages, tools, callbacks, available_functions, from_task, from_agent, response_model
                )
                if streaming:
                    chunks = [self._on_chunk(c, from_task, from_agent) for c in self.backend.stream(agent, body)]
                    reply = _merged(chunks)
                else:
                    reply = _reply(self.backend.complete(agent, body))
                return self._finish(reply, agent, formatted, available_functions, from_task, from_agent, response_model)
            except (HookAborted, LLMCallBlockedError) as exc:
                self._emit_call_denied_event(exc, from_task, from_agent)
                raise
            except Exception as exc:
                raise self._failed(exc, from_task, from_agent) from exc

    async def acall(
        self,
        messages: str | list[Any],
        tools: list[dict[str, Any]] | None = None,
        callbacks: list[Any] | None = None,
        available_functions: dict[str, Any] | None = None,
        from_task: Any = None,
        from_agent: Any = None,
        response_model: type[BaseModel] | None = None,
    ) -> str | Any:
        with llm_call_context():
            try:
                formatted, agent, body, streaming = self._begin(
                    messages, tools, callbacks, available_functions, from_task, from_agent, response_model
                )
                if streaming:
                    stream: AsyncIterator[dict] = self.backend.astream(agent, body)
                    chunks = [self._on_chunk(c, from_task, from_agent) async for c in stream]
                    reply = _merged(chunks)
                else:
                    reply = _reply(await self.backend.acomplete(agent, body))
                return self._finish(reply, agent, formatted, available_functions, from_task, from_agent, response_model)
            except (HookAborted, LLMCallBlockedError) as exc:
                self._emit_call_denied_event(exc, from_task, from_agent)
                raise
            except Exception as exc:
                raise self._failed(exc, from_task, from_agent) from exc

    # -- request and reply -----------------------------------------------------------------
    def _body(
        self,
        messages: list[Any],
        tools: list[dict[str, Any]] | None,
        response_model: type[BaseModel] | None,
        streaming: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {**self.additional_params, "model": self.model, "messages": _openai_messages(messages)}
        for name in ("temperature", "top_p", "seed"):
            if (value := getattr(self, name)) is not None:
                body[name] = value
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        if stops := [s for s in self.stop_sequences if s]:
            body["stop"] = stops[:16]
        if tools:
            body["tools"] = [_openai_tool(t) for t in tools]
            body["tool_choice"] = self.tool_choice or "auto"
        schema = response_model or self.response_format
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            from crewai.utilities.pydantic_schema_utils import generate_model_description

            body["response_format"] = dict(generate_model_description(schema))
        elif isinstance(schema, dict):
            body["response_format"] = schema
        if streaming:
            body["stream_options"] = {"include_usage": True}
        return body

    def _on_chunk(self, chunk: dict, from_task: Any, from_agent: Any) -> dict:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                self._emit_stream_chunk_event(
                    chunk=text, from_task=from_task, from_agent=from_agent, response_id=chunk.get("id")
                )
            for call in delta.get("tool_calls") or []:
                self._emit_stream_chunk_event(
                    chunk=(call.get("function") or {}).get("arguments") or "",
                    from_task=from_task,
                    from_agent=from_agent,
                    tool_call=call,
                    call_type=LLMCallType.TOOL_CALL,
                    response_id=chunk.get("id"),
                )
        return chunk

    def _finish(
        self,
        reply: dict,
        agent: AgentId,
        messages: list[Any],
        available_functions: dict[str, Any] | None,
        from_task: Any,
        from_agent: Any,
        response_model: type[BaseModel] | None,
    ) -> Any:
        usage = reply.get("usage") or None
        if usage:
            self._track_token_usage_internal(usage)
        self._record(agent, from_agent, from_task, reply)
        done = dict(
            from_task=from_task,
            from_agent=from_agent,
            messages=messages,
            usage=usage,
            finish_reason=reply.get("finish_reason"),
            response_id=reply.get("id"),
        )
        calls = reply["message"].get("tool_calls") or []
        if calls and not available_functions:
            self._emit_call_completed_event(response=calls, call_type=LLMCallType.TOOL_CALL, **done)
            return calls
        for call in calls:  # available_functions given: run the call here, as CrewAI's own LLMs do
            function = call.get("function") or {}
            try:
                args = json.loads(function.get("arguments") or "{}")
            except json.JSONDecodeError:
                logger.error("kvshelf: tool call %r has arguments that are not JSON", function.get("name"))
                continue
            result = self._handle_tool_execution(
                function_name=function.get("name", ""),
                function_args=args if isinstance(args, dict) else {},
                available_functions=available_functions or {},
                from_task=from_task,
                from_agent=from_agent,
            )
            if result is not None:
                return result
        content = reply["message"].get("content") or ""
        schema = response_model or self.response_format
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            try:
                parsed = self._validate_structured_output(content, schema)
            except ValueError as exc:
                logger.warning("kvshelf: reply is not a valid %s, returned as text: %s", schema.__name__, exc)
            else:
                assert isinstance(parsed, BaseModel)  # a schema was given, so it parsed into one
                self._emit_call_completed_event(
                    response=parsed.model_dump_json(), call_type=LLMCallType.LLM_CALL, **done
                )
                return parsed
        content = self._apply_stop_words(content)
        self._emit_call_completed_event(response=content, call_type=LLMCallType.LLM_CALL, **done)
        return self._invoke_after_llm_call_hooks(messages, content, from_agent)

    def _record(self, agent: AgentId, from_agent: Any, from_task: Any, reply: dict) -> None:
        usage, ext = reply.get("usage") or {}, reply.get("kvshelf") or {}
        self._turns.append(
            {
                "agent_id": agent,
                "role": getattr(from_agent, "role", None),
                "task": getattr(from_task, "name", None) or getattr(from_task, "description", None),
                "cache": ext.get("cache"),
                "ttft_s": ext.get("ttft_s"),
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                "completion_tokens": usage.get("completion_tokens", 0),
                "finish_reason": reply.get("finish_reason"),
            }
        )

    def _failed(self, exc: Exception, from_task: Any, from_agent: Any) -> Exception:
        message = f"kvshelf call failed: {exc}"
        logger.error(message)
        self._emit_call_failed_event(error=message, from_task=from_task, from_agent=from_agent)
        if isinstance(exc, BackendError) and exc.code == "context_length_exceeded":
            return LLMContextLengthExceededError(str(exc))  # lets CrewAI summarise and retry
        return exc

    def close(self) -> None:
        """Close a remote connection (an in-process engine is shared, and outlives this LLM)."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None


# -- helpers -------------------------------------------------------------------------------
def _reply(body: dict) -> dict:
    """A completion body in ``merge_chunks``' shape."""
    choice = body["choices"][0]
    return {
        "message": choice["message"],
        "finish_reason": choice.get("finish_reason"),
        "usage": body.get("usage"),
        "kvshelf": body.get("kvshelf"),
        "id": body.get("id"),
    }


def _merged(chunks: list[dict]) -> dict:
    return {**merge_chunks(chunks), "id": next((c["id"] for c in chunks if c.get("id")), None)}


def _openai_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """CrewAI's messages as plain OpenAI ones (CrewAI adds its own keys, e.g. cache marks)."""
    out = []
    for message in messages:
        m = {k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None}
        if "content" not in m and not m.get("tool_calls"):
            m["content"] = ""
        out.append(m)
    return out


def _openai_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A CrewAI tool schema (OpenAI-style or flat) as an OpenAI tool."""
    from crewai.llms.providers.utils.common import safe_tool_conversion

    name, description, parameters = safe_tool_conversion(dict(tool), "kvshelf")
    function: dict[str, Any] = {"name": name, "description": description or ""}
    if parameters:
        function["parameters"] = dict(parameters)
    return {"type": "function", "function": function}


__all__ = ["KVShelfLLM"]
