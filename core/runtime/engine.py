"""The engine: one model, many agents, each with its own persistent Q4 KV cache.

A request names an agent. Its cache is found in RAM (hot), on disk (warm) or nowhere
(cold); the new prompt's token ids are matched against the cached ones, the cache is
cut back to the common prefix, only the rest is prefilled, and the reply is generated
and saved. The model runs on the scheduler (``kvshelf.runtime.scheduler``), which batches
every agent's decode steps together; every cache lives on the shelf
(``kvshelf.runtime.shelf``). This module is the public surface: it validates input in
the caller's thread (agent ids once, as ``AgentId``), builds requests and forwards
control calls; nothing below it calls back up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvshelf.errors import ContextLengthExceeded, KVShelfError
from kvshelf.kv.schemes import DEFAULT_SCHEME, KVScheme
from kvshelf.kv.schemes import scheme as kv_scheme_named
from kvshelf.model.loader import LoadedModel, fingerprint_of, load
from kvshelf.model.template import Message, ToolParser, native_tool_parser, validate_messages
from kvshelf.paths import default_cache_dir
from kvshelf.runtime.anonymous import MAX_ENTRIES as ANONYMOUS_ENTRIES
from kvshelf.runtime.boundaries import message_boundaries
from kvshelf.runtime.events import Event, Failed, Finished, Prefilled, Text
from kvshelf.runtime.loop_warmup import compile_in_child
from kvshelf.runtime.params import GenerationParams
from kvshelf.runtime.repetition import Breakers, DryPenalty
from kvshelf.runtime.results import (  # noqa: F401  (re-exported)
    AgentInfo,
    AgentPage,
    Appended,
    ChatResult,
    ForgetResult,
    ForkResult,
    Residency,
    Usage,
)
from kvshelf.runtime.sampling import Sampler
from kvshelf.runtime.scheduler import Request, Scheduler
from kvshelf.runtime.shelf import Shelf
from kvshelf.storage.agent_id import AgentId, validate_agent_id
from kvshelf.storage.counters import StoreCounters
from kvshelf.storage.location import local_root, open_store, parse_store
from kvshelf.structured.constraint import TokenConstraint, Vocabulary
from kvshelf.structured.grammar import Grammar
from kvshelf.structured.plan import plan_output
from kvshelf.structured.tools import ToolCall

log = logging.getLogger(__name__)

# ``agents()`` reads the store's index this many agents at a time: small pages hold the
# GIL only briefly, so the decode thread is never kept waiting behind a listing.
FULL_LISTING_PAGE = 100


class Engine:
    """Runs one model for many agents, each with its own persistent 4-bit KV cache.

    All requests go through one scheduler, so concurrent callers (threads or asyncio
    tasks) are batched without doing anything. The engine itself only checks input (in
    the caller's thread, so bad input fails fast and alone) and forwards: the scheduler
    runs the model, the shelf (``kvshelf.runtime.shelf``) keeps every agent's cache.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel = "embedded",
        cache_dir: str | Path | None = None,
        budget: int | str | None = None,
        *,
        prefill_chunk: int = 256,
        kv_scheme: str = DEFAULT_SCHEME,
        progress: bool = True,
        durable: bool = False,
        store: str | Path | None = None,
        shared: bool = False,
        node_id: str | None = None,
        anonymous_prefixes: int = ANONYMOUS_ENTRIES,
    ) -> None:
        """``durable=True``: a turn's result is handed over only once its save has ended,
        and says whether it reached the disk (``ChatResult.saved``), so a returned turn
        survives a crash. The default writes saves behind, after the result is returned:
        faster to answer, but a crash in between loses that turn's cache.

        ``store``: where the records live, as a URL (``kvshelf.storage.location``: a path,
        ``file:///path`` or ``s3://bucket/prefix``); the same as ``cache_dir`` for a path,
        so give one or the other. ``shared=True``: other nodes serve from the same store at
        once; every save is then conditional on the record this node last read or wrote
        (a refused one is answered ``saved: false`` and the agent's RAM copy dropped), and
        a RAM copy is reused only while the store still holds the record it came from.
        ``node_id`` names this node in the records it writes (default: the host name).

        ``anonymous_prefixes``: how many finished requests that name no agent keep their
        cache in RAM for a later prompt that starts with the same tokens
        (``kvshelf.runtime.anonymous``); 0 keeps none, so every such request starts cold."""
        location = parse_store(store if store is not None else cache_dir or default_cache_dir())
        if store is not None and cache_dir is not None and location.path is not None:
            raise ValueError("give a directory as cache_dir or as store, not both")
        if not isinstance(model, LoadedModel):  # this process then loads every loop (loop_warmup)
            compile_in_child(model, fingerprint_of(model, progress=progress), progress)
        self.loaded: LoadedModel = load(model, progress=progress)
        self.cache_dir = local_root(location, Path(cache_dir) if cache_dir is not None else None)
        """The node's own directory: the store for a directory store; the read-through cache
        (and this node's shared prefixes) for a remote one (``cache_dir``, if given)."""
        self._scheme = kv_scheme_named(kv_scheme)
        self._shelf = Shelf(
            self.cache_dir,
            self.loaded.fingerprint,
            self.loaded.spec,
            self._scheme,
            budget=budget,
            durable=durable,
            anonymous_prefixes=anonymous_prefixes,
            store=open_store(
                location, self.loaded.fingerprint, shared=shared, node_id=node_id, cache_dir=self.cache_dir
            ),
        )
        self._closed = False
        self._vocabulary = Vocabulary(self.loaded.tokenizer)  # built on first use, shared by engines on one tokenizer
        self._breakers: dict[tuple[str, ...], Breakers] = {}  # DRY's breaker tokens, per breaker strings
        self._breakers_lock = threading.Lock()
        self._scheduler = Scheduler(self.loaded, self._shelf, prefill_chunk=prefill_chunk)

    @property
    def durable(self) -> bool:
        """Whether a turn's result waits for its save (see ``__init__``)."""
        return self._shelf.durable

    @property
    def kv_scheme(self) -> KVScheme:
        """How new agents' caches are quantized (a record keeps the scheme it was written in)."""
        return self._scheme

    @property
    def vocabulary(self) -> Vocabulary:
        """The model's tokens as the grammar library sees them (built on first use)."""
        return self._vocabulary

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def shared(self) -> bool:
        """Whether other nodes serve from this engine's store at once (see ``__init__``)."""
        return self._shelf.store.shared

    @property
    def node_id(self) -> str | None:
        """This node's name in the records it writes (None: an unshared store and no name given)."""
        return self._shelf.store.node_id

    @property
    def store_counters(self) -> StoreCounters:
        """The store's round trips, failures, takeovers and refused writes
        (``kvshelf.storage.counters``): what ``/metrics`` exports."""
        return self._shelf.store.counters

    @property
    def store_dir(self) -> Path:
        """The folder holding this model's agent records (what one server claims)."""
        return self._shelf.store.directory

    def guard_store(self, check: Callable[[], None]) -> None:
        """Run ``check`` before every write to this engine's store directories; it raises
        StorageError to refuse one. ``kvshelf serve`` passes its owner check here
        (``kvshelf.storage.exclusive``), so that it never saves into a directory that is
        no longer the one it claimed."""
        self._shelf.store.before_write = check
        self._shelf.shared.store.before_write = check

    # -- generation ------------------------------------------------------------------
    def chat(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        params: GenerationParams | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        until: Callable[[str], int] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: Grammar | None = None,
    ) -> ChatResult:
        """Generate the agent's next message. ``agent_id=None`` is served but never persisted.

        ``params`` (default ``GenerationParams()``) sets how the reply is generated; a
        keyword given here overrides its field. ``until(text)`` may end the reply early:
        given the text so far, it returns the length to keep once the reply is complete
        (``json_mode.end_of_object`` does this for a JSON object), or -1 to go on.

        ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` take
        OpenAI's shapes and are enforced by constrained decoding (``kvshelf.structured``):
        the result's ``tool_calls`` then always parse, their arguments match their tool's
        schema, and a JSON ``text`` matches its schema (unless ``max_tokens`` cut it:
        ``finish_reason`` "length"). ``grammar`` constrains the reply to any
        ``kvshelf.structured.grammar.Grammar``."""
        p = _merged(params, max_tokens, temperature, top_p, stop, seed)
        if tools is None and response_format is None:
            return _last(self.stream(agent_id, messages, p, until=until, grammar=grammar))
        plan = plan_output(tools, tool_choice, parallel_tool_calls, response_format, native=self.native_tools)
        result = _last(
            self.stream(
                agent_id,
                plan.messages(messages),
                p,
                until=until or plan.until(),
                grammar=plan.grammar,
                tools=plan.template_tools,
            )
        )
        return _shaped(result, *plan.parse(result.text))

    def stream(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        params: GenerationParams | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        until: Callable[[str], int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        grammar: Grammar | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Generator[str | ChatResult, None, None]:
        """Yield text chunks as they are generated, then the final ``ChatResult``.

        The request is queued at once (so several streams opened in turn for one agent
        are served in that order). Closing the iterator early cancels the request; the
        agent's cache is kept as far as it got. ``progress(done, total)`` is called after
        each prefill chunk but the last (prompt tokens in the cache so far, of the
        prompt's), from the engine's thread, so a long cold prefill can be shown.
        ``grammar`` constrains the reply (the messages already hold what its plan renders:
        see ``kvshelf.structured.plan``). ``tools`` are handed to the model's own chat
        template, for one that shows them (``OutputPlan.template_tools``); the reply is
        not parsed here (``chat`` does that).
        """
        p = _merged(params, max_tokens, temperature, top_p, stop, seed)
        inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        request = self._request(_agent(agent_id), messages, inbox.put, p, until=until, grammar=grammar, tools=tools)
        request.progress = progress
        self._scheduler.submit(request)
        return self._drain(inbox, request)

    @staticmethod
    def _drain(inbox: queue.SimpleQueue[Event], request: Request) -> Generator[str | ChatResult, None, None]:
        try:
            while True:
                item = _shown(inbox.get())
                yield item
                if isinstance(item, ChatResult):
                    return
        finally:
            request.cancelled = True

    async def achat(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        params: GenerationParams | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        until: Callable[[str], int] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: Grammar | None = None,
    ) -> ChatResult:
        """``chat`` for asyncio: the event loop is never blocked."""
        p = _merged(params, max_tokens, temperature, top_p, stop, seed)
        plan = None
        template_tools = None
        if tools is not None or response_format is not None:
            plan = plan_output(tools, tool_choice, parallel_tool_calls, response_format, native=self.native_tools)
            messages, grammar, until = plan.messages(messages), plan.grammar, until or plan.until()
            template_tools = plan.template_tools
        async for item in self.astream(agent_id, messages, p, until=until, grammar=grammar, tools=template_tools):
            if isinstance(item, ChatResult):
                return item if plan is None else _shaped(item, *plan.parse(item.text))
        raise RuntimeError("generation ended without a result")  # pragma: no cover

    async def astream(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        params: GenerationParams | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        until: Callable[[str], int] | None = None,
        grammar: Grammar | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> AsyncGenerator[str | ChatResult, None]:
        """``stream`` for asyncio: text chunks, then the final ``ChatResult``."""
        p = _merged(params, max_tokens, temperature, top_p, stop, seed)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, event)

        request = self._request(_agent(agent_id), messages, emit, p, until=until, grammar=grammar, tools=tools)
        self._scheduler.submit(request)
        try:
            while True:
                item = _shown(await inbox.get())
                yield item
                if isinstance(item, ChatResult):
                    return
        finally:
            request.cancelled = True

    def prefill(self, agent_id: str | None, messages: Sequence[Message]) -> np.ndarray:
        """Bring the agent's cache up to date with ``messages`` without generating.

        Returns the next-token logits (float32) after the rendered prompt. Useful to
        warm an agent ahead of its turn, and to compare states exactly in tests.
        """
        done: Future[np.ndarray] = Future()

        def emit(event: Event) -> None:
            if done.done():
                return
            if isinstance(event, Failed):
                done.set_exception(event.error)
            elif isinstance(event, Prefilled):
                done.set_result(event.logits)

        request = self._request(_agent(agent_id), messages, emit, None)
        self._scheduler.submit(request)
        return done.result()

    def append(self, agent_id: str, messages: Sequence[Message]) -> Appended:
        """Carry the agent into its next phase: prefill new context without generating.

        ``messages`` is the agent's whole conversation so far, ending with what is new
        (the next phase's instructions, the other agents' messages), as it will be sent
        at the agent's next turn. The cached part is reused token for token, only the
        new tokens are computed, and the agent's next ``chat`` with these messages (plus
        anything later) starts from there. Returns prompt and cached token counts, and
        on a durable engine (which answers once the save has ended) whether it was saved.
        """
        return self.prefill_ahead(agent_id, messages, background=False).result()

    def prefill_ahead(
        self,
        agent_id: str,
        messages: Sequence[Message],
        *,
        background: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Future[Appended]:
        """Like ``append``, but queued at the lowest priority; returns a Future of ``Usage``.

        Background prefill runs one chunk at a time, only while no request waits for its
        first token, so it never delays one by more than a chunk. A later request for the
        same agent (a chat, or a newer ``prefill_ahead``) takes over: the background work
        stops after its chunk, keeps what it computed, and its Future resolves with the
        tokens done so far. Meant for group chats: when a message is added to the shared
        history, queue it for the agents who will speak later.
        ``tools``: for a model's own template that shows them, as in ``stream`` (the
        agent's next chat renders them alike).
        """
        done: Future[Appended] = Future()

        def emit(event: Event) -> None:
            if done.done():
                return
            if isinstance(event, Failed):
                done.set_exception(event.error)
            else:  # finished, stopped or superseded: the tokens computed so far
                saved = event.saved if isinstance(event, Prefilled) else None
                done.set_result(Appended(len(request.prompt), request.cached, 0, saved=saved))

        request = self._request(validate_agent_id(agent_id), messages, emit, None, tools=tools)
        request.background = background
        self._scheduler.submit(request)
        return done

    def _request(
        self,
        aid: AgentId | None,
        messages: Sequence[Message],
        emit: Callable[[Event], None],
        params: GenerationParams | None,
        *,
        until: Callable[[str], int] | None = None,
        grammar: Grammar | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Request:
        """Build a request (``params`` None: prefill only) from input checked here, in the
        caller's thread, so bad input fails fast and alone (a grammar's matcher too)."""
        self._check_open()
        messages = validate_messages(messages)
        prompt = self._encode(messages, tools)
        # every request is cut at its boundaries, named or not, so that its numbers do not
        # depend on whether it is kept (each call's chunking shapes the last bits)
        boundaries = message_boundaries(self.loaded, messages, prompt, tools)
        if params is None:
            return Request(aid, prompt, 1, None, [], emit, boundaries=boundaries)
        vocab = getattr(getattr(self.loaded.model, "args", None), "vocab_size", None)
        if vocab is not None and params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise ValueError(
                f"logit_bias names token {params.logit_bias[-1][0]}; this model's token ids go up to {vocab - 1}"
            )
        sampler = Sampler(
            params.temperature,
            params.top_p,
            params.seed,
            logit_bias=dict(params.logit_bias),
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            dry=self._dry(params, prompt),
        )
        max_tokens = min(params.max_tokens, self.loaded.context_length - len(prompt))
        constraint = TokenConstraint(grammar, self._vocabulary) if grammar is not None else None
        return Request(
            aid,
            prompt,
            max_tokens,
            sampler,
            list(params.stop),
            emit,
            until=until,
            boundaries=boundaries,
            constraint=constraint,
        )

    def _dry(self, params: GenerationParams, prompt: list[int]) -> DryPenalty | None:
        """The request's DRY penalty over its prompt, or None where it is off."""
        if not params.dry_multiplier:
            return None
        return DryPenalty(
            prompt,
            multiplier=params.dry_multiplier,
            base=params.dry_base,
            allowed_length=params.dry_allowed_length,
            penalty_last_n=params.dry_penalty_last_n,
            breakers=self._breaker_tokens(params.dry_sequence_breakers),
        )

    def _breaker_tokens(self, strings: tuple[str, ...]) -> Breakers:
        """The tokens whose text holds one of ``strings`` (special tokens as written), one
        set per engine and breaker strings, shared by the requests."""
        with self._breakers_lock:
            if strings not in self._breakers:
                tok = self.loaded.tokenizer.tokenizer
                self._breakers[strings] = Breakers(lambda t: tok.decode([t], skip_special_tokens=False), strings)
            return self._breakers[strings]

    @property
    def native_tools(self) -> ToolParser | None:
        """The model's own tool-call format, where its template shows tools (else kvshelf's)."""
        return native_tool_parser(self.loaded.template)

    def _encode(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        prompt = self.loaded.tokenizer.encode_prompt(self.loaded.template.render(messages, tools=tools))
        if len(prompt) >= self.loaded.context_length:
            raise ContextLengthExceeded(
                f"the prompt is {len(prompt)} tokens; this model's context is {self.loaded.context_length}"
            )
        return prompt

    @property
    def stats(self) -> dict[str, int]:
        """Scheduler counters: decode steps run, tokens decoded in them, largest batch."""
        return dict(self._scheduler.stats)

    # -- agents ---------------------------------------------------------------------------
    def fork(self, source: str, new_agent: str) -> ForkResult:
        """Start ``new_agent`` from a copy of ``source``'s cache, sharing its whole blocks.

        The blocks are held once in RAM and on disk, copy-on-write, for every agent
        forked from the same state (see ``kvshelf.kv.shared``); each agent's later
        tokens are its own. Seed many agents from one preamble with
        ``prefill(seed, preamble)`` and then ``fork(seed, name)`` for each. A durable
        engine answers once both records (and the shared prefix) are on disk.
        """
        src, dst = validate_agent_id(source), validate_agent_id(new_agent)
        if src == dst:
            raise ValueError("an agent cannot be forked onto itself")
        answered = self._scheduler.call(lambda: self._shelf.fork(src, dst), quiet=(src, dst))
        return answered.result()

    def agents(self) -> list[AgentInfo]:
        """Every agent this engine knows, resident or on disk, in id order.

        Read page by page from the store's metadata index in the caller's thread: it
        never runs on the scheduler, so generation goes on meanwhile. For a large
        store prefer ``agents_page``, which costs the same at 100 agents or 100,000."""
        out: list[AgentInfo] = []
        after: AgentId | None = None
        while True:
            page = self._shelf.agents_page(after, FULL_LISTING_PAGE)
            out += page.data
            if not page.has_more or not page.data:
                return out
            after = validate_agent_id(page.data[-1].agent_id)

    def agents_page(self, limit: int = 20, after: str | None = None) -> AgentPage:
        """Up to ``limit`` agents (1 to 1000) whose ids sort after ``after``, in id order.

        The OpenAI way of paging a list: pass the last id of a page as ``after`` while
        ``has_more`` is true. Every agent present throughout is listed exactly once,
        however many are added or erased between pages. Runs in the caller's thread."""
        if not 1 <= limit <= 1000:
            raise ValueError(f"limit must be between 1 and 1000, got {limit}")
        return self._shelf.agents_page(_agent(after), limit)

    def agent(self, agent_id: str) -> AgentInfo | None:
        """One agent's listing entry (resident or on disk), None if it has no cache:
        a lookup in RAM and one index row, however many agents the store holds."""
        return self._shelf.agent_info(validate_agent_id(agent_id))

    def residency(self) -> Residency:
        """How many agents are resident in RAM and in the store, and their bytes; runs in
        the caller's thread (a snapshot and one index query), never on the scheduler."""
        return self._shelf.residency()

    def shared_prefixes(self) -> dict[str, list[str]]:
        """Every shared prefix on disk, with the agents whose records start on it.

        A prefix is the whole blocks that ``fork`` made shared: stored once, however
        many agents use it, and deleted with its last user."""
        return self._scheduler.call(self._shelf.shared_prefixes)

    def forget(self, agent_id: str) -> ForgetResult:
        """Erase an agent from RAM and disk. Returns what was removed."""
        aid = validate_agent_id(agent_id)
        return self._scheduler.call(lambda: self._shelf.forget(aid), quiet=(aid,))

    def evict(self, agent_id: str) -> bool:
        """Drop an agent from RAM once its record is safely on disk."""
        aid = validate_agent_id(agent_id)
        return self._scheduler.call(lambda: self._shelf.evict(aid))

    def flush(self) -> list[str]:
        """Wait for pending saves, and retry any that failed earlier (e.g. on a full disk).

        Returns the agents whose state is still not on disk (empty when everything is):
        failed saves are also retried on their own, with backoff, but only a caller that
        checks this knows that what it was told is durable.
        """
        return self._scheduler.call(self._shelf.flush)

    def close(self) -> list[str]:
        """Finish requests in flight, flush pending saves, and stop.

        Returns the agents whose latest state could not be saved (empty when every
        turn is on disk), as ``flush`` does: it is lost with the process, and a caller
        that promised durability (``kvshelf serve``) says so."""
        if self._closed:
            return []
        unsaved = self.flush()
        self._closed = True
        self._scheduler.close()
        return unsaved

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVShelfError("this engine is closed")


def _agent(agent_id: str | None) -> AgentId | None:
    return validate_agent_id(agent_id) if agent_id is not None else None


def _merged(
    params: GenerationParams | None,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    stop: str | Sequence[str] | None,
    seed: int | None,
) -> GenerationParams:
    """``params`` (or the defaults) with the fields a caller gave as keywords replaced."""
    base = params if params is not None else GenerationParams()
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stop": stop, "seed": seed}
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    return replace(base, **changes) if changes else base


def _last(items: Generator[str | ChatResult, None, None]) -> ChatResult:
    for item in items:
        if isinstance(item, ChatResult):
            return item
    raise RuntimeError("generation ended without a result")  # pragma: no cover


def _shaped(result: ChatResult, content: str, calls: list[ToolCall]) -> ChatResult:
    """``result`` as its plan reads it: the content (with the opening) and the calls."""
    return replace(
        result, text=content, tool_calls=calls, finish_reason="tool_calls" if calls else result.finish_reason
    )


def _shown(event: Event) -> str | ChatResult:
    """What a stream yields for an event: text, the final result, or the error raised."""
    if isinstance(event, Text):
        return event.text
    if isinstance(event, Finished):
        return event.result
    if isinstance(event, Failed):
        raise event.error
    raise RuntimeError(f"a chat stream got {event!r}")  # pragma: no cover
