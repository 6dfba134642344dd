"""LangChain chat model on kvshelf: ``ChatKVShelf``, a ``BaseChatModel`` whose every agent
keeps its own persistent KV cache.

    from kvshelf.adapters.langchain import ChatKVShelf
    from langchain.agents import create_agent

    llm = ChatKVShelf()                                  # embedded model, in-process
    alice = create_agent(llm, tools=[...], name="alice")   # alice's turns reuse alice's cache
    bob = create_agent(llm, name="bob")                    # bob gets a cache of his own

Install with ``pip install "kvshelf[langchain]"``. The adapter is thin: it turns LangChain
messages into an OpenAI chat request and hands it to ``kvshelf.adapters.backend`` (the
shared in-process engine, or a ``kvshelf serve`` at ``base_url``), which renders tools and
JSON mode into the prompt and parses tool calls out of the reply.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal, TypeGuard

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.messages.utils import convert_to_openai_messages
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
    make_invalid_tool_call,
    parse_tool_call,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import RunnableConfig, ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import TypeBaseModel, is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from kvshelf.adapters.backend import Backend, connect
from kvshelf.adapters.identity import agent_key, fallback_key, scoped_key, sorted_tools
from kvshelf.runtime.params import GenerationParams
from kvshelf.storage.agent_id import AgentId

# Per-call keyword arguments (``invoke(..., **kw)``, ``bind(**kw)``) sent in the request body.
_BODY_KWARGS = (
    "temperature",
    "max_tokens",
    "seed",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
)
_METADATA_KEYS = ("agent_id", "lc_agent_name")
# ``stream()``/``astream()`` call ``_stream`` without a run manager: they hand the identity
# keys of the call's config metadata down in this keyword argument instead.
_RUN_METADATA = "kvshelf_run_metadata"
_DEFAULTS = GenerationParams()  # the engine's and the server's defaults, so local and remote agree


class ChatKVShelf(BaseChatModel):
    """A LangChain chat model served by kvshelf, with one persistent Q4 KV cache per agent.

    **Modes.** In-process by default: ``model`` ("embedded", an mlx-lm model dir or HF repo
    id) is loaded once per process and ``(model, cache_dir)``, and shared by every
    ``ChatKVShelf`` (and every other kvshelf adapter) in it, so all agents are batched
    together. With ``base_url`` it talks to a running ``kvshelf serve`` instead
    (``api_key``, or ``$KVSHELF_API_KEY``), so several processes share one engine and
    its caches; ``model`` and ``cache_dir`` are then the server's business.

    **Which agent's cache a call uses**, first match wins:

    1. a bound or instance id: ``model.bind(agent_id="alice")`` (or ``invoke(...,
       agent_id=...)``), else the ``agent_id`` field;
    2. the run's metadata: the ``agent_id`` and ``lc_agent_name`` (which
       ``langchain.agents.create_agent(..., name="alice")`` sets) of the metadata
       LangChain passes to this call (``run_manager.metadata``, from
       ``config={"metadata": {...}}``), else of the ambient runnable config
       (``ensure_config()["metadata"]``, which a ``.stream()`` call or a LangGraph node
       sees). With both, the name is scoped under the id: ``invoke(..., {"metadata":
       {"agent_id": "user-42"}})`` on a graph gives its ``researcher`` agent the id
       ``user-42.researcher`` and its ``writer`` ``user-42.writer``, so a caller-wide id
       never merges a graph's agents into one cache. With one of them, that one;
    3. a stable fallback, ``anon-<hash of the system text and the tools>``, the same in
       every process: the tools are sorted by name, for the key and for the prompt, so an
       order that changes from run to run (``langgraph-supervisor`` builds its handoff
       tools from a ``set``) finds the same cache and the same cached tokens. Calls that
       share a system prompt and tools share a cache, and keep it across restarts.
       Two *unnamed* agents with the same system prompt and tools thus share one cache
       (answers stay correct, but each evicts the other's history): give them names.

    Names go through ``kvshelf.adapters.identity.agent_key``: a valid id is kept as it is
    ("alice"), any other name becomes a readable slug plus a hash of the exact name. The id
    used is in ``response_metadata["kvshelf"]["agent_id"]``.

    **Sampling.** ``temperature`` defaults to 0, i.e. greedy decoding (unlike OpenAI's 1),
    so that agents are reproducible and small models stay on track; pass a temperature
    (and ``seed``) to sample. ``max_tokens`` defaults to ``GenerationParams``' 2048, in process or remote.

    **Results.** ``usage_metadata`` has ``input_token_details.cache_read``: the prompt
    tokens served from the agent's cache. ``response_metadata`` has ``model_name``,
    ``finish_reason`` and kvshelf's ``{"agent_id", "cache": hot|warm|cold, "ttft_s"}``.
    Tools (``bind_tools``, ``tool_choice`` "auto"/"any"/"required"/"none"/a name) and
    ``with_structured_output`` (``json_schema``, ``function_calling``, ``json_mode``)
    are rendered into the prompt; a forced call or JSON object is a best effort on a
    small model, not constrained decoding.
    """

    model: str = "embedded"
    """Model to load in-process: "embedded", an mlx-lm model directory or an HF repo id."""
    base_url: str | None = Field(default_factory=lambda: os.environ.get("KVSHELF_BASE_URL") or None)
    """A running ``kvshelf serve`` (e.g. ``http://127.0.0.1:8000/v1``); in-process when unset."""
    api_key: SecretStr | None = Field(
        default_factory=lambda: SecretStr(k) if (k := os.environ.get("KVSHELF_API_KEY")) else None
    )
    """The server's API key (remote mode only); defaults to ``$KVSHELF_API_KEY``."""
    cache_dir: str | None = None
    """Where in-process agents' caches live on disk (default: kvshelf's user cache dir)."""
    budget: int | str | None = None
    """RAM budget for resident caches when the in-process engine is created (e.g. "2GB")."""
    agent_id: str | None = None
    """The agent whose cache every call of this instance uses (see the resolution order)."""
    temperature: float = _DEFAULTS.temperature
    """0 (the default, ``GenerationParams``') decodes greedily."""
    max_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    top_p: float | None = None
    timeout: float | None = None
    """Accepted for LangChain's standard parameters; remote requests use the backend's timeout."""
    max_retries: int | None = None
    """Accepted for LangChain's standard parameters; kvshelf does not retry."""
    streaming: bool = False
    """When True, ``invoke`` streams internally (LangChain's own switch; callbacks get each token)."""
    engine: Any = Field(default=None, exclude=True)
    """An ``kvshelf.runtime.engine.Engine`` the caller owns, used instead of the shared one."""

    model_config = ConfigDict(populate_by_name=True)

    _backend: Backend | None = PrivateAttr(default=None)

    # -- LangChain plumbing --------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "kvshelf"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "base_url": self.base_url,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "agent_id": self.agent_id,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvshelf"
        params["ls_model_name"] = kwargs.get("model") or self.model
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stops := (stop or self.stop):
            params["ls_stop"] = list(stops)
        return params

    @property
    def backend(self) -> Backend:
        """The backend, connected on first use (so constructing a model is cheap)."""
        if self._backend is None:
            key = self.api_key.get_secret_value() if self.api_key else None
            self._backend = connect(
                self.model,
                base_url=self.base_url,
                api_key=key,
                cache_dir=self.cache_dir,
                budget=self.budget,
                engine=self.engine,
            )
        return self._backend

    # -- requests ------------------------------------------------------------------------
    def _named_agent(self, kwargs: Mapping[str, Any], run_metadata: Mapping[str, Any] | None) -> AgentId | None:
        """The agent a call names (steps 1 and 2 of the resolution order), None if none."""
        if (bound := kwargs.get("agent_id") or self.agent_id) is not None:
            return agent_key(str(bound))
        sources = (run_metadata or {}, kwargs.get(_RUN_METADATA) or {}, ensure_config().get("metadata") or {})
        found = {key: _first(sources, key) for key in _METADATA_KEYS}
        scope, name = found["agent_id"], found["lc_agent_name"]
        if scope is not None and name is not None:
            return scoped_key(scope, name)  # a caller-wide id never merges a graph's agents
        if (value := scope or name) is not None:
            return agent_key(value)
        return None

    def _request(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: Mapping[str, Any],
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
    ) -> tuple[AgentId, dict[str, Any]]:
        """(agent id, OpenAI chat request body) for one call."""
        openai_messages = [_clean(m) for m in convert_to_openai_messages(messages, text_format="string")]
        body: dict[str, Any] = {
            "messages": openai_messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "top_p": self.top_p,
            "stop": stop or self.stop or None,
        }
        body.update({k: kwargs[k] for k in _BODY_KWARGS if k in kwargs})
        body = {k: v for k, v in body.items() if v is not None}
        named = self._named_agent(kwargs, getattr(run_manager, "metadata", None))
        if named is not None:
            return named, body
        if body.get("tools"):  # keyed by content: canonical content (langgraph-supervisor's tools come from a set)
            body["tools"] = sorted_tools(body["tools"])
        return fallback_key(openai_messages, tools=body.get("tools")), body

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        agent, body = self._request(messages, stop, kwargs, run_manager)
        return _chat_result(self.backend.complete(agent, body))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        agent, body = self._request(messages, stop, kwargs, run_manager)
        return _chat_result(await self.backend.acomplete(agent, body))

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        yield from super().stream(input, config, stop=stop, **_with_run_metadata(config, kwargs))

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        async for chunk in super().astream(input, config, stop=stop, **_with_run_metadata(config, kwargs)):
            yield chunk

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        agent, body = self._request(messages, stop, kwargs, run_manager)
        body["stream_options"] = {"include_usage": True}
        chunks = self.backend.stream(agent, body)
        try:
            for chunk in _generation_chunks(chunks):
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            chunks.close()  # stops the request if we were abandoned

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        agent, body = self._request(messages, stop, kwargs, run_manager)
        body["stream_options"] = {"include_usage": True}
        chunks = self.backend.astream(agent, body)
        converter = _ChunkConverter()
        try:
            async for raw in chunks:
                for chunk in converter.feed(raw):
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
            for chunk in converter.finish():
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            await chunks.aclose()

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Prompt tokens as the model will see them (chat template and tools included)."""
        body: dict[str, Any] = {"messages": [_clean(m) for m in convert_to_openai_messages(messages)]}
        if tools:
            body["tools"] = [convert_to_openai_tool(t) for t in tools]
        return self.backend.count_tokens(body)

    # -- tools and structured output -----------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` to the model. ``tool_choice``: "auto" (the default), "none",
        "any"/"required"/True (must call one), or a tool's name (must call that one)."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = _tool_choice(tool_choice, formatted)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Replies parsed into ``schema`` (a pydantic class, TypedDict or JSON schema).

        ``json_schema`` (the default) shows the schema to the model and opens its reply
        with ``{``; ``function_calling`` forces a call of a tool named after the schema;
        ``json_mode`` asks for any JSON object (describe it in the prompt). None of them
        constrains decoding, so a small model may still produce output that fails to parse:
        ``include_raw=True`` returns ``{"raw", "parsed", "parsing_error"}`` instead of raising.
        """
        if kwargs:
            raise ValueError(f"Unexpected arguments: {sorted(kwargs)}")
        llm: Runnable[LanguageModelInput, AIMessage]
        if method == "json_mode":
            llm = self.bind(
                response_format={"type": "json_object"},
                ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
            )
            parser: Runnable = _json_parser(schema)
        else:
            if schema is None:
                raise ValueError(f"with_structured_output(method={method!r}) needs a schema")
            function = convert_to_openai_tool(schema, strict=strict)["function"]
            structured = {"kwargs": {"method": method, "strict": strict}, "schema": convert_to_openai_tool(schema)}
            if method == "function_calling":
                llm = self.bind_tools(
                    [schema],
                    tool_choice=function["name"],
                    parallel_tool_calls=False,
                    strict=strict,
                    ls_structured_output_format=structured,
                )
                parser = (
                    PydanticToolsParser(tools=[schema], first_tool_only=True)
                    if _is_pydantic_class(schema)
                    else JsonOutputKeyToolsParser(key_name=function["name"], first_tool_only=True)
                )
            elif method == "json_schema":
                response_format = {
                    "type": "json_schema",
                    "json_schema": {
                        "name": function["name"],
                        "description": function.get("description"),
                        "schema": function.get("parameters", {}),
                        "strict": strict,
                    },
                }
                llm = self.bind(response_format=response_format, ls_structured_output_format=structured)
                parser = _json_parser(schema)
            else:
                raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', not {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def _is_pydantic_class(schema: object) -> TypeGuard[TypeBaseModel]:
    """A pydantic model class (v2, or v1 through ``pydantic.v1``): replies parse into instances of it."""
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def _json_parser(schema: object) -> Runnable:
    """Parses a JSON reply: into ``schema`` if it is a pydantic class, else into a dict."""
    if _is_pydantic_class(schema):
        return PydanticOutputParser(pydantic_object=schema)
    return JsonOutputParser()


# -- conversions -------------------------------------------------------------------------
def _first(sources: Sequence[Mapping[str, Any]], key: str) -> str | None:
    """``key``'s value in the first metadata that has one (the call's own before the ambient)."""
    for metadata in sources:
        if value := metadata.get(key):
            return str(value)
    return None


def _with_run_metadata(config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    metadata = ensure_config(config).get("metadata") or {}
    identity = {k: metadata[k] for k in _METADATA_KEYS if metadata.get(k)}
    return {**kwargs, _RUN_METADATA: identity} if identity and _RUN_METADATA not in kwargs else kwargs


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as kvshelf's request schema takes it."""
    message = dict(message)
    if message.get("role") == "assistant" and message.get("tool_calls") and not message.get("content"):
        message["content"] = None
    if message.get("content") is None and not (message.get("role") == "assistant" and message.get("tool_calls")):
        message["content"] = ""
    return message


def _tool_choice(choice: dict | str | bool, tools: list[dict]) -> dict | str:
    names = [t["function"]["name"] for t in tools]
    if choice is True or choice == "any":
        return "required" if len(names) != 1 else {"type": "function", "function": {"name": names[0]}}
    if choice is False:
        return "none"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice  # "auto", "none", "required", or an OpenAI dict


def _usage(usage: Mapping[str, Any] | None) -> UsageMetadata | None:
    if not usage:
        return None
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return UsageMetadata(
        input_tokens=int(usage["prompt_tokens"]),
        output_tokens=int(usage["completion_tokens"]),
        total_tokens=int(usage["total_tokens"]),
        input_token_details=InputTokenDetails(cache_read=cached),
    )


def _metadata(model: str | None, finish_reason: str | None, ext: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"model_name": model, "model_provider": "kvshelf", "finish_reason": finish_reason}
    if ext:
        out["kvshelf"] = dict(ext)
    return out


def _ai_message(message: Mapping[str, Any], usage: UsageMetadata | None, metadata: dict, id_: str | None) -> AIMessage:
    tool_calls, invalid = [], []
    for raw in message.get("tool_calls") or []:
        try:
            tool_calls.append(parse_tool_call(raw, return_id=True))
        except Exception as exc:  # OutputParserException: arguments that are not a JSON object
            invalid.append(make_invalid_tool_call(raw, str(exc)))
    return AIMessage(
        content=message.get("content") or "",
        tool_calls=tool_calls,
        invalid_tool_calls=invalid,
        usage_metadata=usage,
        response_metadata=metadata,
        id=id_,
    )


def _chat_result(body: Mapping[str, Any]) -> ChatResult:
    choice = body["choices"][0]
    metadata = _metadata(body.get("model"), choice.get("finish_reason"), body.get("kvshelf"))
    message = _ai_message(choice["message"], _usage(body.get("usage")), metadata, body.get("id"))
    return ChatResult(
        generations=[ChatGeneration(message=message, generation_info={"finish_reason": choice.get("finish_reason")})],
        llm_output={"model_name": body.get("model"), "kvshelf": body.get("kvshelf")},
    )


class _ChunkConverter:
    """OpenAI stream chunks to LangChain chunks: text and tool-call chunks as they come,
    then one last chunk (``chunk_position="last"``) with usage, finish reason, model name
    and kvshelf's cache/TTFT, so each of those is set exactly once."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.id: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.ext: dict | None = None

    def feed(self, raw: Mapping[str, Any]) -> list[ChatGenerationChunk]:
        self.model = raw.get("model") or self.model
        self.id = raw.get("id") or self.id
        self.usage = raw.get("usage") or self.usage
        self.ext = raw.get("kvshelf") or self.ext
        out = []
        for choice in raw.get("choices") or []:
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            delta = choice.get("delta") or {}
            content = delta.get("content") or ""
            calls = [
                tool_call_chunk(
                    name=(c.get("function") or {}).get("name"),
                    args=(c.get("function") or {}).get("arguments"),
                    id=c.get("id"),
                    index=c.get("index"),
                )
                for c in delta.get("tool_calls") or []
            ]
            if content or calls:
                out.append(
                    ChatGenerationChunk(message=AIMessageChunk(content=content, tool_call_chunks=calls, id=self.id))
                )
        return out

    def finish(self) -> list[ChatGenerationChunk]:
        message = AIMessageChunk(
            content="",
            usage_metadata=_usage(self.usage),
            id=self.id,
            chunk_position="last",
            response_metadata=_metadata(self.model, self.finish_reason, self.ext),
        )
        return [ChatGenerationChunk(message=message, generation_info={"finish_reason": self.finish_reason})]


def _generation_chunks(chunks: Iterator[dict]) -> Iterator[ChatGenerationChunk]:
    converter = _ChunkConverter()
    for raw in chunks:
        yield from converter.feed(raw)
    yield from converter.finish()


__all__ = ["ChatKVShelf"]
