"""The engine: one model, many agents, each with its own persistent Q4 KV cache.

A request names an agent. The engine finds that agent's cache (in RAM: hot; on disk:
warm; nowhere: cold), matches the new prompt's token ids against the cached ones,
cuts the cache back to the common prefix, prefills only the rest, generates, and
saves the agent's record. The byte budget is enforced after every request by
spilling the least recently used agents to disk.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

from .agent_cache import AgentCache
from .agent_id import validate_agent_id
from .errors import KVShelfError, StorageError
from .model import LoadedModel, load
from .paths import default_cache_dir
from .pool import BlockPool
from .sampling import Sampler
from .store import CacheRecord, RecordStore
from .template import Message, validate_messages

log = logging.getLogger("kvshelf.engine")

# A short input runs in one call with logits for every position (cheaper than a
# separate call for the last token); a longer one is chunked, then its last token.
FINAL_CALL_MAX_TOKENS = 32

CacheSource = Literal["hot", "warm", "cold", "none"]


class ContextLengthExceeded(KVShelfError, ValueError):
    """The prompt does not fit the model's context window."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class ChatResult:
    text: str
    finish_reason: Literal["stop", "length"]
    usage: Usage
    ttft_s: float
    total_s: float = 0.0
    cache: CacheSource = "cold"  # where the agent's cache came from for this request
    agent_id: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class AgentInfo:
    agent_id: str
    tokens: int
    ram_bytes: int
    disk_bytes: int
    last_used: float | None
    resident: bool


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing chars could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class Engine:
    """Runs one model for many agents, each with its own persistent 4-bit KV cache."""

    def __init__(
        self,
        model: str | Path | LoadedModel = "embedded",
        cache_dir: str | Path | None = None,
        budget: int | str | None = None,
        *,
        prefill_chunk: int = 256,
        progress: bool = True,
    ) -> None:
        self.loaded = load(model, progress=progress)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.spec = self.loaded.spec
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.store = RecordStore(self.cache_dir, self.loaded.fingerprint)
        self.pool = BlockPool(budget)
        self.prefill_chunk = prefill_chunk
        self._lock = threading.RLock()
        self._unsaved: set[str] = set()
        self._closed = False

    # -- public API ------------------------------------------------------------------
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
    ) -> ChatResult:
        """Generate the agent's next message. ``agent_id=None`` is served but never persisted."""
        for item in self.stream(
            agent_id, messages, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed
        ):
            if isinstance(item, ChatResult):
                return item
        raise RuntimeError("generation ended without a result")  # pragma: no cover

    def stream(
        self,
        agent_id: str | None,
        messages: Sequence[Message],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> Iterator[str | ChatResult]:
        """Yield text chunks as they are generated, then the final ``ChatResult``."""
        aid = validate_agent_id(agent_id) if agent_id is not None else None
        msgs = validate_messages(messages)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        sampler = Sampler(temperature, top_p, seed)
        prompt = self._encode(msgs)
        max_tokens = min(max_tokens, self.loaded.context_length - len(prompt))
        self._check_open()
        with self._lock:
            yield from self._generate(aid, prompt, max_tokens, sampler, stops)

    def prefill(self, agent_id: str | None, messages: Sequence[Message]) -> "np.ndarray":
        """Bring the agent's cache up to date with ``messages`` without generating.

        Returns the next-token logits (float32) after the rendered prompt. Useful to
        warm an agent ahead of its turn, and to compare states exactly in tests.
        """
        aid = validate_agent_id(agent_id) if agent_id is not None else None
        prompt = self._encode(validate_messages(messages))
        self._check_open()
        with self._lock:
            cache, _ = self._acquire(aid)
            cached = cache.reuse_prefix(prompt)
            logits = self._forward(cache, prompt[cached:])
            self._finish(aid, cache)
            return np.array(logits.astype(mx.float32))

    async def achat(self, agent_id: str | None, messages: Sequence[Message], **kwargs) -> ChatResult:
        return await asyncio.to_thread(self.chat, agent_id, messages, **kwargs)

    async def astream(
        self, agent_id: str | None, messages: Sequence[Message], **kwargs
    ) -> AsyncIterator[str | ChatResult]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def produce() -> None:
            try:
                for item in self.stream(agent_id, messages, **kwargs):
                    loop.call_soon_threadsafe(queue.put_nowait, item)
            except BaseException as exc:  # handed to the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            loop.call_soon_threadsafe(queue.put_nowait, done)

        worker = asyncio.ensure_future(asyncio.to_thread(produce))
        try:
            while (item := await queue.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await worker

    def agents(self) -> list[AgentInfo]:
        """Every agent this engine knows, resident or on disk."""
        with self._lock:
            ids = sorted(set(self.pool) | set(self.store.agent_ids()))
            out = []
            for aid in ids:
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
        with self._lock:
            cache = self.pool.pop(aid)
            self.pool.last_used.pop(aid, None)
            self._unsaved.discard(aid)
            removed = self.store.delete(aid)
            return {
                "agent_id": aid,
                "ram_bytes_freed": cache.nbytes if cache else 0,
                "tokens_freed": len(cache.tokens) if cache else 0,
                "files_removed": [str(p) for p in removed],
            }

    def evict(self, agent_id: str) -> bool:
        """Save an agent and drop it from RAM (its next request restores it from disk)."""
        aid = validate_agent_id(agent_id)
        with self._lock:
            cache = self.pool.get(aid)
            if cache is None or (aid in self._unsaved and not self._save(aid, cache)):
                return False
            self.pool.pop(aid)
            return True

    def flush(self) -> None:
        """Retry any saves that failed earlier (for example on a full disk)."""
        with self._lock:
            for aid in sorted(self._unsaved):
                cache = self.pool.get(aid)
                if cache is not None:
                    self._save(aid, cache)

    def close(self) -> None:
        """Flush pending saves and stop accepting requests."""
        with self._lock:
            if self._closed:
                return
            self.flush()
            self._closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise KVShelfError("this engine is closed")

    def _encode(self, messages: Sequence[Message]) -> list[int]:
        prompt = self.tokenizer.encode_prompt(self.loaded.template.render(messages))
        if len(prompt) >= self.loaded.context_length:
            raise ContextLengthExceeded(
                f"the prompt is {len(prompt)} tokens; this model's context is {self.loaded.context_length}"
            )
        return prompt

    def _finish(self, aid: str | None, cache: AgentCache) -> None:
        """Keep the agent's cache in RAM, save its record, and respect the budget."""
        if aid is None:
            return
        self.pool.put(aid, cache)
        self._save(aid, cache)
        self._enforce_budget()

    def _acquire(self, aid: str | None) -> tuple[AgentCache, CacheSource]:
        if aid is None:
            return AgentCache.empty(self.spec), "none"
        cache = self.pool.get(aid)
        if cache is not None:
            return cache, "hot"
        cache = self._restore(aid)
        if cache is not None:
            return cache, "warm"
        return AgentCache.empty(self.spec), "cold"

    def _restore(self, aid: str) -> AgentCache | None:
        record = self.store.load(aid)
        if record is None:
            return None
        try:
            return AgentCache.from_record_parts(self.spec, record.tokens, record.tensors, record.meta)
        except (ValueError, KeyError) as exc:
            self.store.quarantine(aid, f"record does not fit this model: {exc}")
            return None

    def _save(self, aid: str, cache: AgentCache) -> bool:
        tensors, meta = cache.to_record_parts()
        try:
            self.store.save(aid, CacheRecord(tokens=list(cache.tokens), tensors=tensors, meta=meta))
        except StorageError as exc:
            log.error("could not save agent %s; keeping it in RAM and retrying later: %s", aid, exc)
            self._unsaved.add(aid)
            return False
        self._unsaved.discard(aid)
        return True

    def _enforce_budget(self) -> None:
        for victim in self.pool.over_budget_victims():
            if victim in self._unsaved and not self._save(victim, self.pool.get(victim)):
                continue  # never drop state that is not safely on disk
            self.pool.pop(victim)

    def _forward(self, cache: AgentCache, ids: list[int]) -> mx.array:
        """Run ``ids`` through the model into ``cache``; return the last position's logits.

        Long inputs go in prefill chunks whose logits are never evaluated, so the
        vocabulary projection (262K rows for Gemma) runs for the final call only; that
        final call is the last token, or all of a short input at once.
        """
        final = len(ids) if len(ids) <= FINAL_CALL_MAX_TOKENS else 1
        body, last = ids[: len(ids) - final], ids[len(ids) - final :]
        for i in range(0, len(body), self.prefill_chunk):
            self.model(mx.array(body[i : i + self.prefill_chunk])[None], cache=cache.layers)
            mx.eval(cache.arrays())
        logits = self.model(mx.array(last)[None], cache=cache.layers)[0, -1]
        mx.eval(logits, cache.arrays())
        cache.tokens.extend(ids)
        return logits

    def _generate(
        self, aid: str | None, prompt: list[int], max_tokens: int, sampler: Sampler, stops: list[str]
    ) -> Iterator[str | ChatResult]:
        t0 = time.perf_counter()
        cache, source = self._acquire(aid)
        cached = cache.reuse_prefix(prompt)
        logits = self._forward(cache, prompt[cached:])
        stop_ids = self.tokenizer.stop_ids
        all_stops = stops + list(self.loaded.template.stop_strings)
        generated: list[int] = []
        text, emitted, ttft, finish = "", 0, 0.0, "length"
        try:
            while True:
                token = int(sampler(logits).item())
                if not generated and ttft == 0.0:
                    ttft = time.perf_counter() - t0
                if token in stop_ids:
                    finish = "stop"
                    break
                generated.append(token)
                text = self.tokenizer.decode(generated)
                cut = min((i for i in (text.find(s) for s in all_stops) if i >= 0), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                    break
                if len(generated) >= max_tokens:
                    break
                safe = len(text) - _held_back(text, all_stops)
                if safe > emitted and not text[:safe].endswith("\ufffd"):
                    yield text[emitted:safe]
                    emitted = safe
                logits = self._forward(cache, [token])
        finally:
            self._finish(aid, cache)
        if len(text) > emitted:
            yield text[emitted:]
        yield ChatResult(
            text=text,
            finish_reason=finish,  # type: ignore[arg-type]
            usage=Usage(len(prompt), cached, len(generated)),
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            cache=source,
            agent_id=aid,
            token_ids=generated,
        )
