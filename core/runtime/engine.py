"""The engine: one model, many agents, each with its own persistent Q4 KV cache.

A request names an agent. Its cache is found in RAM (hot), on disk (warm) or nowhere
(cold); the new prompt's token ids are matched against the cached ones, the cache is
cut back to the common prefix, only the rest is prefilled, and the reply is generated
and saved. All of that runs on the scheduler (``kvshelf.runtime.scheduler``), which batches
every agent's decode steps together; this module is the public surface: it validates
input in the caller's thread and hands requests to the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.errors import KVShelfError, StorageError
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.record import CacheRecord
from kvshelf.kv.schemes import DEFAULT_SCHEME
from kvshelf.kv.schemes import scheme as kv_scheme_named
from kvshelf.kv.shared import SharedPrefix
from kvshelf.model.loader import LoadedModel, load
from kvshelf.model.template import Message, validate_messages
from kvshelf.paths import default_cache_dir
from kvshelf.runtime.pool import BlockPool
from kvshelf.runtime.results import AgentInfo, ChatResult, Usage  # noqa: F401  (re-exported)
from kvshelf.runtime.sampling import Sampler
from kvshelf.runtime.scheduler import Request, Scheduler
from kvshelf.storage.agent_id import validate_agent_id
from kvshelf.storage.prefixes import SharedPrefixes
from kvshelf.storage.records import RecordStore

log = logging.getLogger(__name__)


class ContextLengthExceeded(KVShelfError, ValueError):
    """The prompt does not fit the model's context window."""


class AgentBusy(KVShelfError):
    """The agent has a request in flight; erase or evict it once that finishes."""


class AgentExists(KVShelfError):
    """A fork would overwrite an agent that already has a cache; forget it first."""


class UnknownAgent(KVShelfError, KeyError):
    """No cache for this agent, in RAM or on disk."""


class Engine:
    """Runs one model for many agents, each with its own persistent 4-bit KV cache.

    All requests go through one scheduler, so concurrent callers (threads or asyncio
    tasks) are batched without doing anything.
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
    ) -> None:
        """``durable=True``: a turn's result is handed over only once its save has ended,
        and says whether it reached the disk (``ChatResult.saved``), so a returned turn
        survives a crash. The default writes saves behind, after the result is returned:
        faster to answer, but a crash in between loses that turn's cache."""
        self.loaded = load(model, progress=progress)
        self.model = self.loaded.forward
        self.tokenizer = self.loaded.tokenizer
        self.spec = self.loaded.spec
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.store = RecordStore(self.cache_dir, self.loaded.fingerprint)
        self.shared = SharedPrefixes(self.cache_dir, self.loaded.fingerprint, self.spec)
        self.pool = BlockPool(budget)
        self.prefill_chunk = prefill_chunk
        self.scheme = kv_scheme_named(kv_scheme)
        self.durable = durable
        self.unsaved: set[str] = set()
        self._closed = False
        self._scheduler = Scheduler(self)

    # -- generation ------------------------------------------------------------------
    def chat(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        until: Callable[[str], int] | None = None,
    ) -> ChatResult:
        """Generate the agent's next message. ``agent_id=None`` is served but never persisted.

        ``until(text)`` may end the reply early: given the text so far, it returns the
        length to keep once the reply is complete (``json_mode.end_of_object`` does this
        for a JSON object), or -1 to go on."""
        for item in self.stream(
            agent_id,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            until=until,
        ):
            if isinstance(item, ChatResult):
                return item
        raise RuntimeError("generation ended without a result")  # pragma: no cover

    def stream(self, agent_id: str | None, messages: Sequence[Message], **params: Any) -> Iterator[str | ChatResult]:
        """Yield text chunks as they are generated, then the final ``ChatResult``.

        The request is queued at once (so several streams opened in turn for one agent
        are served in that order). Closing the iterator early cancels the request; the
        agent's cache is kept as far as it got.
        """
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        request = self._request(agent_id, messages, inbox.put, **params)
        self._scheduler.submit(request)
        return self._drain(inbox, request)

    @staticmethod
    def _drain(inbox: queue.SimpleQueue, request: Request) -> Iterator[str | ChatResult]:
        try:
            while True:
                item = inbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, ChatResult):
                    return
        finally:
            request.cancelled = True

    async def achat(self, agent_id: str | None, messages: Sequence[Message], **params: Any) -> ChatResult:
        async for item in self.astream(agent_id, messages, **params):
            if isinstance(item, ChatResult):
                return item
        raise RuntimeError("generation ended without a result")  # pragma: no cover

    async def astream(
        self, agent_id: str | None, messages: Sequence[Message], **params: Any
    ) -> AsyncIterator[str | ChatResult]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        request = self._request(agent_id, messages, lambda x: loop.call_soon_threadsafe(inbox.put_nowait, x), **params)
        self._scheduler.submit(request)
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
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
        done: Future = Future()

        def emit(item: Any) -> None:
            if not done.done():
                (done.set_exception if isinstance(item, BaseException) else done.set_result)(item)

        request = self._request(agent_id, messages, emit, prefill_only=True)
        self._scheduler.submit(request)
        return done.result()[0]

    def append(self, agent_id: str, messages: Sequence[Message]) -> Usage:
        """Carry the agent into its next phase: prefill new context without generating.

        ``messages`` is the agent's whole conversation so far, ending with what is new
        (the next phase's instructions, the other agents' messages), as it will be sent
        at the agent's next turn. The cached part is reused token for token, only the
        new tokens are computed, and the agent's next ``chat`` with these messages (plus
        anything later) starts from there. Returns prompt and cached token counts.
        """
        return self.prefill_ahead(agent_id, messages, background=False).result()

    def prefill_ahead(self, agent_id: str, messages: Sequence[Message], *, background: bool = True) -> Future:
        """Like ``append``, but queued at the lowest priority; returns a Future of ``Usage``.

        Background prefill runs one chunk at a time, only while no request waits for its
        first token, so it never delays one by more than a chunk. A later request for the
        same agent (a chat, or a newer ``prefill_ahead``) takes over: the background work
        stops after its chunk, keeps what it computed, and its Future resolves with the
        tokens done so far. Meant for group chats: when a message is added to the shared
        history, queue it for the agents who will speak later.
        """
        done: Future = Future()

        def emit(item: Any) -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
            else:
                done.set_result(Usage(len(request.prompt), request.cached, 0))

        request = self._request(validate_agent_id(agent_id), messages, emit, prefill_only=True)
        request.background = background
        self._scheduler.submit(request)
        return done

    def fork(self, source: str, new_agent: str) -> dict:
        """Start ``new_agent`` from a copy of ``source``'s cache, sharing its whole blocks.

        The blocks are held once in RAM and on disk, copy-on-write, for every agent
        forked from the same state (see ``kvshelf.kv.shared``); each agent's later
        tokens are its own. Seed many agents from one preamble with
        ``prefill(seed, preamble)`` and then ``fork(seed, name)`` for each.
        """
        src, dst = validate_agent_id(source), validate_agent_id(new_agent)
        if src == dst:
            raise ValueError("an agent cannot be forked onto itself")

        def do_fork() -> dict:
            sched = self._scheduler
            sched.cancel_background(src)
            sched.cancel_background(dst)
            if sched.busy(src) or sched.busy(dst):
                raise AgentBusy(f"agent {src if sched.busy(src) else dst!r} has a request in flight")
            if dst in self.pool or self.store.path_for(dst).exists():
                raise AgentExists(f"agent {dst!r} already has a cache; forget it first")
            cache = self.pool.get(src)
            if cache is None:
                cache = self.load_record(src)
                if cache is None:
                    raise UnknownAgent(f"no cache for agent {src!r}")
                self.pool.put(src, cache)
            prefix = cache.share_prefix()
            if prefix is not None:
                live = self.shared.intern(prefix)
                cache.adopt(live)
            twin = cache.fork()
            self.pool.put(dst, twin)
            saves.extend((sched.save_behind(src, cache), sched.save_behind(dst, twin)))
            sched.enforce_budget()
            return {
                "agent_id": dst,
                "source": src,
                "tokens": len(twin.tokens),
                "shared_tokens": len(prefix.tokens) if prefix is not None else 0,
                "shared_prefix": prefix.id if prefix is not None else None,
            }

        saves: list[Future] = []
        info = self._scheduler.call(do_fork)
        if self.durable:  # answered only once both records (and the prefix) are on disk
            for save in saves:
                save.result()
        return info

    def _request(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        emit: Any,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        until: Callable[[str], int] | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Validate everything in the caller's thread, so bad input fails fast and alone."""
        self._check_open()
        aid = validate_agent_id(agent_id) if agent_id is not None else None
        prompt = self._encode(validate_messages(messages))
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        sampler = None if prefill_only else Sampler(temperature, top_p, seed)
        max_tokens = min(max_tokens, self.loaded.context_length - len(prompt))
        return Request(aid, prompt, max_tokens, sampler, stops, emit, until=until)

    def _encode(self, messages: Sequence[Message]) -> list[int]:
        prompt = self.tokenizer.encode_prompt(self.loaded.template.render(messages))
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
    def agents(self) -> list[AgentInfo]:
        """Every agent this engine knows, resident or on disk."""
        return self._scheduler.call(self._agents_now)

    def _agents_now(self) -> list[AgentInfo]:
        out = []
        for aid in sorted(set(self.pool) | set(self.store.agent_ids())):
            cache = self.pool.get(aid)
            out.append(
                AgentInfo(
                    agent_id=aid,
                    tokens=len(cache.tokens) if cache else self.store.token_count(aid),
                    ram_bytes=cache.nbytes if cache else 0,
                    disk_bytes=self.store.size_on_disk(aid),
                    last_used=self.pool.last_used.get(aid) or self.store.mtime(aid),
                    resident=cache is not None,
                )
            )
        return out

    def forget(self, agent_id: str) -> dict:
        """Erase an agent from RAM and disk. Returns what was removed."""
        aid = validate_agent_id(agent_id)

        def erase() -> dict:
            self._scheduler.cancel_background(aid)
            if self._scheduler.busy(aid):
                raise AgentBusy(f"agent {aid!r} has a request in flight")
            self._scheduler.wait_saved(aid)
            cache = self.pool.pop(aid)
            self.pool.last_used.pop(aid, None)
            self.unsaved.discard(aid)
            self._scheduler.forget(aid)
            removed = self.store.delete(aid)
            removed += self.shared.release(aid)  # its prefix markers; a prefix with no users left
            return {
                "agent_id": aid,
                "ram_bytes_freed": cache.nbytes if cache else 0,
                "tokens_freed": len(cache.tokens) if cache else 0,
                "files_removed": [str(p) for p in removed],
            }

        return self._scheduler.call(erase)

    def evict(self, agent_id: str) -> bool:
        """Drop an agent from RAM once its record is safely on disk."""
        aid = validate_agent_id(agent_id)

        def drop() -> bool:
            if self._scheduler.busy(aid) or aid not in self.pool or not self._scheduler.wait_saved(aid):
                return False
            self.pool.pop(aid)
            return True

        return self._scheduler.call(drop)

    def flush(self) -> list[str]:
        """Wait for pending saves, and retry any that failed earlier (e.g. on a full disk).

        Returns the agents whose state is still not on disk (empty when everything is):
        failed saves are also retried on their own, with backoff, but only a caller that
        checks this knows that what it was told is durable.
        """

        def retry() -> list[str]:
            for aid in sorted(self.unsaved):
                cache = self.pool.get(aid)
                if cache is not None and not self._scheduler.busy(aid):
                    self._scheduler.save_behind(aid, cache)
            self._scheduler.wait_all_saves()
            return sorted(self.unsaved)

        return self._scheduler.call(retry)

    def close(self) -> None:
        """Finish requests in flight, flush pending saves, and stop."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVShelfError("this engine is closed")

    def write_record(self, aid: str, record: CacheRecord, prefix: SharedPrefix | None) -> None:
        """Write an agent's record (on the I/O thread), and its shared prefix first if it
        has one: prefix file, then this agent's user marker, then the record, then the
        markers it no longer needs. A crash between steps leaves at most an unused prefix."""
        try:
            if prefix is not None:
                self.shared.ensure_saved(prefix)
                self.shared.add_user(prefix.id, aid)
            self.store.save(aid, record)
            self.shared.release(aid, keep=prefix.id if prefix is not None else None)
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(exc.errno or 0, f"could not write the shared prefix of agent {aid!r}: {exc}") from exc

    def load_record(self, aid: str) -> AgentCache | None:
        """Read and verify an agent's record (runs on the I/O thread); None if unusable."""
        record = self.store.load(aid)
        if record is None:
            return None
        try:
            prefix = None
            if (pid := record.meta.get("shared_prefix")) is not None:
                prefix = self.shared.get(pid)
                if prefix is None:
                    raise ValueError(f"its shared prefix {pid!r} is missing or unreadable")
            cache = AgentCache.from_record_parts(self.spec, record.tokens, record.tensors, record.meta, prefix)
        except (ValueError, KeyError) as exc:
            self.store.quarantine(aid, f"record does not fit this model: {exc}")
            return None
        mx.eval(cache.arrays())  # MLX streams are per thread: materialise here, use on the worker
        return cache
