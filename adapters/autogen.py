"""AutoGen: kvshelf as an ``autogen_core.models.ChatCompletionClient``.

Install with ``pip install "kvshelf[autogen]"``. One client (or several, or per-agent
views of one) serves any number of AutoGen agents, and each agent gets its own
persistent KV cache::

    from autogen_agentchat.agents import AssistantAgent
    from kvshelf.adapters.autogen import KVShelfChatCompletionClient

    client = KVShelfChatCompletionClient()                  # embedded model, in-process
    # client = KVShelfChatCompletionClient(base_url="http://127.0.0.1:8000/v1")  # kvshelf serve
    alice = AssistantAgent("alice", model_client=client, system_message="You are Alice.")

The adapter is thin: AutoGen messages become an OpenAI chat request (see
``to_openai_messages``), ``kvshelf.adapters.backend`` runs it (tools, JSON mode and stop
strings are handled there, identically in both modes), and the reply becomes a
``CreateResult``.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import re
import threading
import warnings
from collections import deque
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from autogen_core import EVENT_LOGGER_NAME, CancellationToken, Component, FunctionCall, Image, MessageHandlerContext
from autogen_core.logging import LLMCallEvent, LLMStreamEndEvent, LLMStreamStartEvent
from autogen_core.models import (
    AssistantMessage,
    ChatCompletionClient,
    CreateResult,
    FunctionExecutionResultMessage,
    LLMMessage,
    ModelCapabilities,
    ModelFamily,
    ModelInfo,
    RequestUsage,
    SystemMessage,
    UserMessage,
)
from autogen_core.tools import Tool, ToolSchema
from pydantic import BaseModel, SecretStr

from kvshelf.adapters.backend import Backend, connect, merge_chunks
from kvshelf.adapters.identity import agent_key, fallback_key
from kvshelf.runtime.params import GenerationParams
from kvshelf.storage.agent_id import AgentId
from kvshelf.structured.tools import tools_text, with_system_text

if TYPE_CHECKING:  # imported in process only (see kvshelf.adapters.backend)
    from kvshelf.runtime.engine import Engine

__all__ = [
    "KVShelfChatCompletionClient",
    "KVShelfClientConfig",
    "TurnStats",
    "runtime_agent_name",
    "to_openai_messages",
]

event_logger = logging.getLogger(EVENT_LOGGER_NAME)
_DEFAULTS = GenerationParams()  # the engine's and the server's defaults, so local and remote agree

# Options a caller may pass per call in ``extra_create_args`` (OpenAI request fields).
EXTRA_CREATE_ARGS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "parallel_tool_calls",
        "response_format",
    }
)
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "function_calls", "content_filter": "content_filter"}
_TEAM_SUFFIX = re.compile(r"_([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$")
USER_SOURCES = frozenset({"user", ""})  # sources rendered without a speaker name


class KVShelfClientConfig(BaseModel):
    """``KVShelfChatCompletionClient``'s component config (``dump_component()``)."""

    model: str = "embedded"
    base_url: str | None = None
    api_key: SecretStr | None = None
    cache_dir: str | None = None
    budget: int | str | None = None
    agent_id: str | None = None
    agent_prefix: str = ""
    temperature: float = _DEFAULTS.temperature
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    family: str = ModelFamily.UNKNOWN
    prefill_ahead: bool = False


@dataclass(frozen=True)
class TurnStats:
    """One request as kvshelf served it: which agent's cache, where it came from, and
    how many prompt tokens it reused."""

    agent_id: str
    cache: str  # hot (in RAM) | warm (restored from disk) | cold | none
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str


class _Ledger:
    """Usage and per-turn stats of one client; each record also counts in its parent's
    ledger, so the client a view came from totals the usage of all its views."""

    def __init__(self, parent: _Ledger | None = None, keep: int = 1000) -> None:
        self.parent, self.lock = parent, threading.Lock()
        self.prompt = self.completion = 0
        self.turns: deque[TurnStats] = deque(maxlen=keep)

    def record(self, turn: TurnStats) -> None:
        ledger: _Ledger | None = self
        while ledger is not None:
            with ledger.lock:
                ledger.prompt += turn.prompt_tokens
                ledger.completion += turn.completion_tokens
                ledger.turns.append(turn)
            ledger = ledger.parent


@dataclass
class _Heard:
    """A group-chat agent's last call and reply: what prefill ahead extends."""

    name: str  # its name in other agents' message sources
    messages: list[LLMMessage]
    reply: str
    body: dict[str, Any]


def predict_context(
    listener: _Heard, speaker: str, messages: Sequence[LLMMessage], reply: str
) -> list[LLMMessage] | None:
    """What ``listener`` will be sent at its next turn, from what ``speaker`` was just sent
    and said, in a group chat where every message is visible to every agent.

    The speaker's history shows the listener's last reply as ``UserMessage(source=listener)``;
    everything after it (and the speaker's new reply) is new to the listener, which hears
    it as user turns. None when the listener's last reply is not in that history (it is
    not in this group, or has not spoken yet) or nothing is new.
    """
    transcript = [m for m in messages if not isinstance(m, SystemMessage)]
    transcript.append(AssistantMessage(content=reply, source=speaker))
    last = next(
        (
            i
            for i in range(len(transcript) - 1, -1, -1)
            if isinstance(m := transcript[i], UserMessage) and m.source == listener.name and m.content == listener.reply
        ),
        None,
    )
    if last is None:
        return None
    heard: list[LLMMessage] = []
    for m in transcript[last + 1 :]:
        if isinstance(m, UserMessage):
            heard.append(m)
        elif isinstance(m, AssistantMessage) and isinstance(m.content, str):
            heard.append(UserMessage(content=m.content, source=speaker))
        # the speaker's tool calls and their results stay the speaker's own
    if not heard:
        return None
    return [*listener.messages, AssistantMessage(content=listener.reply, source=listener.name), *heard]


class _Shared:
    """What a client and its views share: one backend (connected on first use) and what
    each agent has seen."""

    def __init__(self, connect_args: dict[str, Any], engine: Engine | None) -> None:
        self.connect_args, self.engine = connect_args, engine
        self.backend: Backend | None = None
        self.lock = threading.Lock()
        self.conversations: dict[str, dict[str, Any]] = {}
        self.tools: dict[str, list[dict[str, Any]]] = {}  # the tools each agent was last offered
        self.heard: dict[AgentId, _Heard] = {}  # group-chat agents' last turns, for prefill ahead
        self.closed = False

    def get(self) -> Backend:
        with self.lock:
            if self.closed:
                raise RuntimeError("this KVShelfChatCompletionClient is closed")
            if self.backend is None:
                self.backend = connect(engine=self.engine, **self.connect_args)
            return self.backend


# -- message conversion ------------------------------------------------------------------------
def _user_text(message: UserMessage) -> str:
    if isinstance(message.content, str):
        text = message.content
    else:
        if any(isinstance(part, Image) for part in message.content):
            raise ValueError(
                "kvshelf's models take text only (model_info['vision'] is False), but a UserMessage "
                f"from {message.source!r} holds an image. Remove it, or describe it in text."
            )
        text = "\n".join(cast(list[str], message.content))
    return text if message.source in USER_SOURCES else f"{message.source}: {text}"


def _function_call(call: FunctionCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _add_user_turn(out: list[dict[str, Any]], text: str) -> None:
    if out and out[-1]["role"] == "user":
        out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{text}"}
    else:
        out.append({"role": "user", "content": text})


def to_openai_messages(messages: Sequence[LLMMessage]) -> list[dict[str, Any]]:
    """AutoGen messages as OpenAI chat messages: a pure function of the messages, so an
    agent's history renders to the same bytes on every turn (and its cache is reused).

    - ``SystemMessage``s at the start stay system messages. One that comes after the
      conversation has begun becomes a user turn ``"system: ..."``: the chat template
      would otherwise hoist it into the first turn and change the agent's whole history.
    - ``UserMessage``: another agent's turn in a group chat arrives as
      ``UserMessage(source="bob")`` and is rendered ``"bob: ..."``; messages from
      ``source="user"`` (the task) are rendered as they are. A list content is joined
      with newlines; an ``Image`` raises ``ValueError`` (the models are text-only).
    - ``AssistantMessage``: the agent's own turn; function calls become ``tool_calls``
      (with ``thought``, the text before them, as the content).
    - ``FunctionExecutionResultMessage``: one ``tool`` message per result.

    Consecutive user turns (the task, then what other agents said since this agent last
    spoke) are joined into one user message, separated by a blank line, since chat
    templates (Gemma's among them) expect user and assistant turns to alternate. The
    join is stable: a run of user turns is only ever extended at the end of the history.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            if all(m["role"] == "system" for m in out):
                out.append({"role": "system", "content": message.content})
            else:
                _add_user_turn(out, f"system: {message.content}")
        elif isinstance(message, UserMessage):
            _add_user_turn(out, _user_text(message))
        elif isinstance(message, AssistantMessage):
            if isinstance(message.content, str):
                out.append({"role": "assistant", "content": message.content})
            else:
                out.append(
                    {
                        "role": "assistant",
                        "content": message.thought or None,
                        "tool_calls": [_function_call(c) for c in message.content],
                    }
                )
        elif isinstance(message, FunctionExecutionResultMessage):
            out.extend(
                {"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
                for r in message.content
            )
        else:
            raise ValueError(f"unsupported message type {type(message).__name__}")
    return out


def _tool_schema(tool: Tool | ToolSchema) -> dict[str, Any]:
    schema = cast(Mapping[str, Any], tool if isinstance(tool, Mapping) else tool.schema)
    fn: dict[str, Any] = {"name": schema["name"]}
    if schema.get("description"):
        fn["description"] = schema["description"]
    fn["parameters"] = schema.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _response_format(json_output: bool | type[BaseModel] | None) -> dict[str, Any] | None:
    if json_output is None or json_output is False:
        return None
    if json_output is True:
        return {"type": "json_object"}
    if isinstance(json_output, type) and issubclass(json_output, BaseModel):
        return {
            "type": "json_schema",
            "json_schema": {"name": json_output.__name__, "schema": json_output.model_json_schema(), "strict": False},
        }
    raise ValueError(f"json_output must be a bool or a pydantic model class, not {json_output!r}")


def runtime_agent_name(agent_type: str, key: str) -> str:
    """A stable name for an AutoGen runtime ``AgentId``.

    AgentChat teams register each participant as ``AgentId(type=f"{name}_{team_id}",
    key=team_id)``, where ``team_id`` is a fresh uuid4 per team instance. The suffix is
    dropped, so the same agent in the next run of the program (a new team) finds its
    cache: ``"alice_1b4e...-...` -> "alice"``. Other runtimes' ids keep their type, and
    their key unless it is ``"default"`` (``"writer:session-7"``).
    """
    match = _TEAM_SUFFIX.search(agent_type)
    if match:
        name = agent_type[: match.start()]
        return name if key in ("default", "", match.group(1)) else f"{name}:{key}"
    return agent_type if key in ("default", "") else f"{agent_type}:{key}"


class SameNameGuard:
    """Warns, once per agent id, when two different AutoGen agents end up on one cache.

    Team members are keyed by name alone (``runtime_agent_name``), so the next run of a
    program, with new team uuids, finds each agent's cache. The price: two *different*
    agents with one name in one process (two live teams that both have an ``alice``, or
    an ``alice`` whose system message differs) share a cache and evict each other's
    history. Answers stay correct (prefix reuse keeps only what matches), so this is a
    warning, given as soon as the evidence is certain: a second system text for the id,
    or a team coming back to the id after another team used it (so both are alive). A
    team that simply replaces the last one (a loop that builds a new team per task)
    never warns. The uuids change every run, so they cannot become stable ids; the
    warning names the two ways to keep such agents apart.
    """

    TEAMS_KEPT = 16  # the most recent teams remembered per id (a loop of teams stays bounded)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._system: dict[tuple[Any, ...], str] = {}  # digest of the first system text seen
        self._teams: dict[tuple[Any, ...], dict[str, None]] = {}  # recent teams, the last one last
        self._warned: set[tuple[Any, ...]] = set()

    def check(self, scope: tuple[Any, ...], agent_id: AgentId, team: str, system: str) -> None:
        key = (*scope, agent_id)
        digest = hashlib.blake2b(system.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
        with self._lock:
            teams = self._teams.setdefault(key, {})
            reason = None
            if self._system.setdefault(key, digest) != digest:
                reason = "with different system messages"
            elif teams and team != next(reversed(teams)) and team in teams:
                reason = "in two teams at once"
            teams.pop(team, None)
            teams[team] = None
            if len(teams) > self.TEAMS_KEPT:
                del teams[next(iter(teams))]
            if reason is None or key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(
            f"two different AutoGen agents {reason} share the kvshelf cache {agent_id!r} in this process, so "
            "they evict each other's history (answers stay correct, but are recomputed). Give each team its own "
            "client with agent_prefix (KVShelfChatCompletionClient(agent_prefix='team-a.')), or bind each agent "
            "with client.for_agent(name).",
            UserWarning,
            stacklevel=4,
        )


_SAME_NAMES = SameNameGuard()


# -- the client --------------------------------------------------------------------------------
class KVShelfChatCompletionClient(ChatCompletionClient, Component[KVShelfClientConfig]):
    """An AutoGen model client whose every agent keeps its own persistent KV cache.

    Args:
        model: ``"embedded"`` (Gemma 3 270M, the default), an mlx-lm model dir or HF repo id.
        base_url: a running ``kvshelf serve`` (``http://host:port/v1``): remote mode.
            Without it the model runs in this process, in one engine shared by every
            client with the same ``model`` and ``cache_dir``.
        api_key: the server's ``--api-key`` (remote mode).
        cache_dir, budget: the in-process engine's record directory and RAM budget.
        agent_id: bind this client to one agent (as ``for_agent`` does).
        agent_prefix: prepended to every agent id this client derives or is given, to
            keep two applications that reuse agent names apart.
        temperature: 0 (greedy, ``GenerationParams``' default) unless given, so that
            runs are reproducible and a replayed conversation matches the cached tokens.
            ``top_p``, ``max_tokens`` (``GenerationParams``' 2048 when None, local or
            remote), ``seed`` and ``stop`` are sent as given.
        family: ``model_info["family"]``.
        engine: an ``Engine`` the caller owns, used instead of the shared one (not
            part of the component config).

    **Which agent's cache a call uses**, in this order:

    1. the bound agent: ``client.for_agent("alice")`` (a light view sharing this
       client's backend) or ``agent_id=`` in the constructor;
    2. the AutoGen runtime's current agent, ``MessageHandlerContext.agent_id()``, which
       is set whenever an agent runs inside a team or runtime. AgentChat names team
       members ``<name>_<team uuid>``, a new uuid per team instance; the suffix is
       stripped (``runtime_agent_name``) so the same agent restores its cache from disk
       in the next run of the program. Two different agents with the same name in one
       process (two live teams, or different system messages) share a cache id:
       prefix reuse keeps that correct, just slower, and the client warns once per id
       (``SameNameGuard``); give each team's client an ``agent_prefix`` or use
       ``for_agent`` to keep them apart;
    3. otherwise (a bare ``create`` call outside any runtime) a hash of the system
       text: ``fallback_key`` -> ``"anon-<hash>"``. Calls with the same system
       message share a cache, which is stable across restarts.

    Names are made valid agent ids by ``kvshelf.adapters.identity.agent_key``.

    Once an agent has been offered tools, its calls without them keep the same tool
    text in the system message (no call is parsed from the reply), so that
    AssistantAgent's reflection step does not change the agent's cached history.

    ``prefill_ahead=True`` (for group chats such as ``RoundRobinGroupChat``, where every
    agent hears every message): after an agent speaks, each other agent that has spoken
    before gets its cache extended in the background with everything it has not heard
    yet (``Engine.prefill_ahead``; remote: ``POST /v1/agents/{id}/append``), at the
    lowest priority, so at its turn only the latest messages remain to prefill. Replies
    are the same as without it (tested).

    Usage: ``actual_usage()`` and ``total_usage()`` (equal: kvshelf never answers from a
    response cache) count this client's calls; a client counts its views' calls too.
    ``turns`` / ``last_turn`` give each call's agent, cache source, TTFT and cached
    tokens. ``conversation(agent_id)`` is the last request an agent made, with its
    reply appended: everything that agent has seen.
    """

    component_type = "model"
    component_config_schema = KVShelfClientConfig
    component_provider_override = "kvshelf.adapters.autogen.KVShelfChatCompletionClient"

    def __init__(
        self,
        model: str | Path = "embedded",
        *,
        base_url: str | None = None,
        api_key: str | SecretStr | None = None,
        cache_dir: str | Path | None = None,
        budget: int | str | None = None,
        agent_id: str | None = None,
        agent_prefix: str = "",
        temperature: float = _DEFAULTS.temperature,
        top_p: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        family: str = ModelFamily.UNKNOWN,
        prefill_ahead: bool = False,
        engine: Engine | None = None,
    ) -> None:
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self._config = KVShelfClientConfig(
            model=str(model),
            base_url=base_url,
            api_key=SecretStr(key) if key else None,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            budget=budget,
            agent_id=agent_id,
            agent_prefix=agent_prefix,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop=stop,
            family=family,
            prefill_ahead=prefill_ahead,
        )
        self._agent_id = agent_key(agent_id, agent_prefix) if agent_id is not None else None
        self._shared = _Shared(
            {"model": str(model), "base_url": base_url, "api_key": key, "cache_dir": cache_dir, "budget": budget},
            engine,
        )
        self._ledger = _Ledger()
        self._is_view = False

    # -- identity --------------------------------------------------------------------------
    def for_agent(self, name: str) -> KVShelfChatCompletionClient:
        """A light client bound to agent ``name``, sharing this client's backend (and
        engine); its usage also counts in this client's."""
        view = copy.copy(self)
        view._config = self._config.model_copy(update={"agent_id": name})
        view._agent_id = agent_key(name, self._config.agent_prefix)
        view._ledger = _Ledger(parent=self._ledger)
        view._is_view = True
        return view

    @property
    def agent_id(self) -> AgentId | None:
        """The bound agent id (None: resolved per call)."""
        return self._agent_id

    def agent_name(self) -> str | None:
        """The calling agent's name as other agents' messages show it (None outside a
        runtime and unbound)."""
        if self._config.agent_id is not None:
            return self._config.agent_id
        try:
            runtime_id = MessageHandlerContext.agent_id()
        except RuntimeError:
            return None
        match = _TEAM_SUFFIX.search(runtime_id.type)
        return runtime_id.type[: match.start()] if match else runtime_id.type

    async def _prefill_listeners(
        self, agent_id: AgentId, messages: Sequence[LLMMessage], body: dict[str, Any], result: CreateResult
    ) -> None:
        """Group chat: after ``agent_id`` spoke, extend each other agent's cache in the
        background with what it has not heard yet (``Engine.prefill_ahead``), so at its
        turn only the last few tokens remain. Off unless ``prefill_ahead=True``."""
        name = self.agent_name()
        if not self._config.prefill_ahead or name is None or not isinstance(result.content, str):
            return
        shared = self._shared
        shared.heard[agent_id] = _Heard(name, list(messages), result.content, body)
        backend = await self._backend()
        for other, listener in list(shared.heard.items()):
            if other == agent_id or (predicted := predict_context(listener, name, messages, result.content)) is None:
                continue
            ahead = {k: v for k, v in listener.body.items() if k != "messages"}
            ahead["messages"] = to_openai_messages(predicted)
            if "tools" not in ahead and other in shared.tools:
                ahead["messages"] = with_system_text(ahead["messages"], tools_text(shared.tools[other]))
            try:
                await asyncio.to_thread(backend.append, other, ahead, True)
            except Exception as exc:  # an optimisation: never fail the speaker's turn over it
                logging.getLogger(__name__).warning("prefill ahead for %s failed: %s", other, exc)

    def resolve_agent_id(self, messages: Sequence[Mapping[str, Any]]) -> AgentId:
        """The agent whose cache a call with these (OpenAI) messages uses, right now."""
        if self._agent_id is not None:
            return self._agent_id
        prefix = self._config.agent_prefix
        try:
            runtime_id = MessageHandlerContext.agent_id()
        except RuntimeError:
            return fallback_key(messages, prefix=f"{prefix}anon-")
        agent_id = agent_key(runtime_agent_name(runtime_id.type, runtime_id.key), prefix)
        system = next((str(m.get("content") or "") for m in messages if m.get("role") == "system"), "")
        scope = (self._config.model, self._config.base_url, self._config.cache_dir, id(self._shared.engine))
        _SAME_NAMES.check(scope, agent_id, f"{runtime_id.type}/{runtime_id.key}", system)
        return agent_id

    # -- requests --------------------------------------------------------------------------
    def request_body(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = (),
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type[BaseModel] | None = None,
        extra_create_args: Mapping[str, Any] = {},
    ) -> dict[str, Any]:
        """The OpenAI chat request for these arguments (before ``_prepare``'s tool text)."""
        unknown = set(extra_create_args) - EXTRA_CREATE_ARGS
        if unknown:
            raise ValueError(
                f"unsupported extra_create_args {sorted(unknown)}; kvshelf takes {sorted(EXTRA_CREATE_ARGS)}"
            )
        cfg = self._config
        body: dict[str, Any] = {
            "model": cfg.model,
            "messages": to_openai_messages(messages),
            "temperature": cfg.temperature,
        }
        for name in ("top_p", "max_tokens", "seed", "stop"):
            if getattr(cfg, name) is not None:
                body[name] = getattr(cfg, name)
        if tools:
            body["tools"] = [_tool_schema(t) for t in tools]
            if isinstance(tool_choice, str):
                body["tool_choice"] = tool_choice
            else:
                body["tool_choice"] = {"type": "function", "function": {"name": tool_choice.schema["name"]}}
        elif tool_choice not in ("auto", "none"):
            raise ValueError("tool_choice names a tool or is 'required', but no tools were given")
        if (response_format := _response_format(json_output)) is not None:
            body["response_format"] = response_format
        body.update(extra_create_args)
        return body

    def _prepare(
        self,
        messages: Sequence[LLMMessage],
        tools: Sequence[Tool | ToolSchema],
        tool_choice: Any,
        json_output: bool | type[BaseModel] | None,
        extra_create_args: Mapping[str, Any],
    ) -> tuple[AgentId, dict]:
        """The agent and the request body of a call. Once an agent has been offered tools,
        a later call without them (or with ``tool_choice="none"``, as AssistantAgent's
        reflection after a tool call does) still shows the model the same tool text,
        though no call is parsed from its reply: the system text, and so the agent's
        whole cached history, stays the same instead of being recomputed twice."""
        body = self.request_body(
            messages, tools=tools, tool_choice=tool_choice, json_output=json_output, extra_create_args=extra_create_args
        )
        agent_id = self.resolve_agent_id(body["messages"])
        offered = body.get("tools")
        if offered and body.get("tool_choice") != "none":
            self._shared.tools[agent_id] = offered
        elif agent_id in self._shared.tools:
            shown = offered or self._shared.tools[agent_id]
            body.pop("tools", None)
            body.pop("tool_choice", None)
            body["messages"] = with_system_text(body["messages"], tools_text(shown))
        return agent_id, body

    async def _backend(self) -> Backend:
        if self._shared.backend is not None and not self._shared.closed:
            return self._shared.backend
        return await asyncio.to_thread(self._shared.get)  # loading a model must not block the loop

    def _result(
        self,
        agent_id: str,
        body: dict[str, Any],
        message: dict,
        finish: str | None,
        usage: dict | None,
        ext: dict | None,
    ) -> CreateResult:
        usage = usage or {}
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        ext = ext or {}
        calls = message.get("tool_calls") or []
        content: str | list[FunctionCall]
        if calls:
            content = [
                FunctionCall(
                    id=c.get("id") or "",
                    name=c["function"]["name"],
                    arguments=a if isinstance(a := c["function"].get("arguments", "{}"), str) else json.dumps(a),
                )
                for c in calls
            ]
            thought, reason = (message.get("content") or None), "function_calls"
        else:
            content, thought, reason = message.get("content") or "", None, _FINISH.get(finish or "", "unknown")
        turn = TurnStats(
            agent_id=ext.get("agent_id") or agent_id,
            cache=ext.get("cache", "none"),
            ttft_s=float(ext.get("ttft_s") or 0.0),
            prompt_tokens=prompt,
            cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            completion_tokens=completion,
            finish_reason=reason,
        )
        self._ledger.record(turn)
        reply = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        self._shared.conversations[agent_id] = {**body, "messages": [*body["messages"], reply]}
        return CreateResult(
            finish_reason=cast(Any, reason),
            content=content,
            usage=RequestUsage(prompt, completion),
            cached=False,
            thought=thought,
        )

    async def create(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type[BaseModel] | None = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
    ) -> CreateResult:
        """One reply. Cancelling the token cancels the engine request (``CancelledError``);
        the agent's cache keeps what was computed."""
        agent_id, body = self._prepare(messages, tools, tool_choice, json_output, extra_create_args)
        backend = await self._backend()
        task = asyncio.ensure_future(backend.acomplete(agent_id, body))
        if cancellation_token is not None:
            cancellation_token.link_future(task)
        response = await task
        choice = response["choices"][0]
        result = self._result(
            agent_id,
            body,
            choice["message"],
            choice.get("finish_reason"),
            response.get("usage"),
            response.get("kvshelf"),
        )
        event_logger.info(
            LLMCallEvent(
                messages=body["messages"],
                response=response,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                kvshelf_agent_id=agent_id,
            )
        )
        await self._prefill_listeners(agent_id, messages, body, result)
        return result

    async def create_stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type[BaseModel] | None = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
    ) -> AsyncGenerator[str | CreateResult, None]:
        """Text chunks as they are generated, then exactly one ``CreateResult``. Cancelling
        the token (or closing the generator) cancels the engine request."""
        agent_id, body = self._prepare(messages, tools, tool_choice, json_output, extra_create_args)
        body["stream_options"] = {"include_usage": True}
        backend = await self._backend()
        event_logger.info(LLMStreamStartEvent(messages=body["messages"], kvshelf_agent_id=agent_id))
        stream = backend.astream(agent_id, body)
        chunks: list[dict] = []
        try:
            while True:
                step = asyncio.ensure_future(anext(stream))
                if cancellation_token is not None:
                    cancellation_token.link_future(step)
                try:
                    chunk = await step
                except StopAsyncIteration:
                    break
                chunks.append(chunk)
                for choice in chunk.get("choices") or []:
                    if text := (choice.get("delta") or {}).get("content"):
                        yield text
        finally:
            await stream.aclose()
        merged = merge_chunks(chunks)
        del body["stream_options"]
        result = self._result(
            agent_id, body, merged["message"], merged["finish_reason"], merged["usage"], merged["kvshelf"]
        )
        event_logger.info(
            LLMStreamEndEvent(
                response=result.model_dump(),
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                kvshelf_agent_id=agent_id,
            )
        )
        await self._prefill_listeners(agent_id, messages, body, result)
        yield result

    # -- accounting ------------------------------------------------------------------------
    def actual_usage(self) -> RequestUsage:
        return RequestUsage(self._ledger.prompt, self._ledger.completion)

    def total_usage(self) -> RequestUsage:
        return RequestUsage(self._ledger.prompt, self._ledger.completion)

    @property
    def turns(self) -> list[TurnStats]:
        """This client's (and its views') recent calls, oldest first (the last 1000)."""
        return list(self._ledger.turns)

    @property
    def last_turn(self) -> TurnStats | None:
        return self._ledger.turns[-1] if self._ledger.turns else None

    def conversation(self, agent_id: str) -> dict[str, Any] | None:
        """The last request made for ``agent_id`` through this client's backend, with the
        reply appended to its messages: every message that agent has seen, in the form
        that keeps its cache prefix (None if it has made no call here)."""
        conv = self._shared.conversations.get(agent_id)
        return copy.deepcopy(conv) if conv is not None else None

    def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        """Prompt tokens as the model sees them, tools and chat template included."""
        body = self.request_body(messages, tools=tools)
        if not body["messages"]:
            if not tools:
                return 0
            body["messages"] = [{"role": "system", "content": ""}]
        return self._shared.get().count_tokens(body)

    def remaining_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        return max(0, self._shared.get().context_length - self.count_tokens(messages, tools=tools))

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            vision=False,
            function_calling=True,
            json_output=True,
            structured_output=True,
            family=self._config.family,
            multiple_system_messages=False,
        )

    @property
    def capabilities(self) -> ModelCapabilities:  # deprecated in AutoGen; model_info is current
        return cast(ModelCapabilities, {"vision": False, "function_calling": True, "json_output": True})

    async def close(self) -> None:
        """Close the connection to a server (remote mode). Views close nothing; the shared
        in-process engine outlives every client and is closed at interpreter exit."""
        if self._is_view:
            return
        with self._shared.lock:
            backend, self._shared.backend, self._shared.closed = self._shared.backend, None, True
        if backend is not None:
            backend.close()

    # -- component config ------------------------------------------------------------------
    def _to_config(self) -> KVShelfClientConfig:
        return self._config.model_copy()

    @classmethod
    def _from_config(cls, config: KVShelfClientConfig) -> KVShelfChatCompletionClient:
        return cls(**config.model_dump(exclude={"api_key"}), api_key=config.api_key)
