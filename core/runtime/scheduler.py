"""The step loop: every agent's work interleaved on one thread, disk I/O on another.

One worker thread owns the model and every cache. Each step it
1. admits waiting requests (per agent in arrival order, one at a time, and only once
   that agent's previous save is on disk); an agent that is not in RAM is restored
   from disk on the I/O thread meanwhile (prefetch), while others keep decoding;
2. runs one prefill call (at most ``prefill_chunk`` tokens) for the oldest request
   still prefilling, so a long prompt never stalls decoding agents by more than a chunk;
3. runs one batched decode step for every agent that is generating.
Finished agents are saved behind, on the I/O thread, from a snapshot of their blocks.
Control calls (listing, erasing, evicting agents) run on the worker between steps, so
no lock guards the caches: only the worker touches them.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.errors import StorageError
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.batch import batch_views
from kvshelf.kv.record import CacheRecord, agent_record
from kvshelf.runtime.results import ChatResult, Usage
from kvshelf.runtime.sampling import Sampler

log = logging.getLogger(__name__)

# A short input runs in one call with logits for every position (cheaper than a
# separate call for the last token); a longer one is chunked, then its last token.
FINAL_CALL_MAX_TOKENS = 32

# A save that failed (full disk, lost permissions) is retried on its own, first after
# RETRY_FIRST_S, then at doubling intervals up to RETRY_MAX_S, so a disk that frees up
# gets the agents back on it without anyone calling flush(), and a disk that stays
# full costs one attempt (and one logged error) per agent a minute.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


def forward_plan(n: int, chunk: int) -> list[int]:
    """Sizes of the model calls that feed ``n`` tokens; only the last call's logits are used."""
    if n <= FINAL_CALL_MAX_TOKENS:
        return [n]
    body = n - 1
    return [min(chunk, body - i) for i in range(0, body, chunk)] + [1]


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing chars could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def _release_mlx_thread() -> None:
    """MLX streams belong to threads; a thread must drain and drop its own before it ends."""
    mx.synchronize()
    mx.clear_streams()


class IOThread:
    """One background thread for record reads and writes (a tiny executor).

    Not a ``ThreadPoolExecutor``: its thread must release its MLX streams on the way
    out, or the process aborts at exit.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
                mx.synchronize()
            # Drop the finished job now, not when the next one comes: its arguments (a
            # save's snapshot of an agent's blocks) must not outlive it, e.g. an erasure.
            del job, fut, fn, args
        _release_mlx_thread()


def _close_at_exit(scheduler: Scheduler) -> None:
    """Flush and stop a scheduler that was never closed, before the interpreter exits.

    MLX streams belong to threads; a thread torn down with work on its stream aborts
    the process. ``threading``'s own exit hooks run before daemon threads are killed
    (``concurrent.futures`` uses the same hook), so saves still complete.
    """
    ref = weakref.ref(scheduler)

    def hook() -> None:
        if (s := ref()) is not None:
            s.close()

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(hook)
    else:  # pragma: no cover
        atexit.register(hook)


@dataclass(eq=False)
class Request:
    """One chat (or prefill-only) request and its progress through the loop."""

    agent_id: str | None
    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None  # None: prefill only, the result is the next-token logits
    stops: list[str]
    emit: Callable[[Any], None]
    t0: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    background: bool = False  # prefill ahead: lowest priority, superseded by any later request
    until: Callable[[str], int] | None = None  # where the reply is complete (e.g. a JSON object), or -1
    cache: AgentCache | None = None
    restoring: Future | None = None
    planned: bool = False
    source: str = "cold"
    cached: int = 0
    todo: list[int] = field(default_factory=list)
    plan: list[int] = field(default_factory=list)
    next_token: int | None = None
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    ttft: float | None = None
    finish: str = "length"


class Scheduler:
    """Runs the step loop for an engine."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[Request] = []
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._busy: set[str] = set()
        self._saves: dict[str, Future] = {}
        self._io = IOThread("kvshelf-io")
        self._stopping = False
        self._closed = False
        self._retry_delay = RETRY_FIRST_S
        self._retry_at = 0.0
        self.stats = {"decode_steps": 0, "decoded_tokens": 0, "max_batch": 0, "prefill_calls": 0, "background_calls": 0}
        self._thread = threading.Thread(target=self._run, name="kvshelf-scheduler", daemon=True)
        self._thread.start()
        _close_at_exit(self)

    # -- called from any thread --------------------------------------------------------
    def submit(self, request: Request) -> None:
        self._inbox.put(request)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker between steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        done: Future = Future()
        self._inbox.put((fn, done))
        return done.result()

    def busy(self, aid: str) -> bool:
        """True while ``aid`` has a request admitted (worker thread only)."""
        return aid in self._busy

    def close(self) -> None:
        """Finish admitted work, wait for every save, stop both threads."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._thread.join()
        self._io.shutdown()

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        worked = True
        while True:
            idle = not (self._waiting or self._prefilling or self._decoding)
            if idle and self._stopping:
                break
            # Idle: sleep until a request comes. Stalled (every request waits on a
            # restore or a save): nap briefly in C instead of spinning, which would
            # hold the GIL and slow the very I/O thread being waited on.
            self._drain(timeout=0.5 if idle else (0.0 if worked else 0.002))
            try:
                self._retry_unsaved()
                self._admit()
                prefilled = self._prefill_step()
                worked = self._decode_step() or prefilled
            except Exception as exc:  # never let one bad step kill the loop
                log.exception("scheduler step failed")
                for r in self._prefilling + self._decoding:
                    self._fail(r, exc)
        for fut in list(self._saves.values()):
            fut.exception()
        _release_mlx_thread()

    def _drain(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is None:
                self._stopping = True
            elif isinstance(item, Request):
                if item.agent_id is not None:
                    self.cancel_background(item.agent_id)  # the newer request takes over
                self._waiting.append(item)
            else:
                fn, done = item
                try:
                    done.set_result(fn())
                except BaseException as exc:
                    done.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        blocked: set[str] = set()
        for r in list(self._waiting):
            if r.cancelled:
                self._waiting.remove(r)
                if r.background:
                    r.emit(None)  # resolves its Future: nothing was computed
                continue
            aid = r.agent_id
            if aid is not None:
                save = self._saves.get(aid)
                if aid in self._busy or aid in blocked or (save is not None and not save.done()):
                    blocked.add(aid)  # keeps this agent's later requests behind this one
                    continue
                self._busy.add(aid)
            self._waiting.remove(r)
            self._start(r)
            self._prefilling.append(r)

    def _start(self, r: Request) -> None:
        eng = self.engine
        aid = r.agent_id
        if aid is None:
            r.cache, r.source = AgentCache.empty(eng.spec, eng.scheme), "none"
        elif (cache := eng.pool.get(aid)) is not None:
            r.cache, r.source = cache, "hot"
        else:  # prefetch: read and verify the record on the I/O thread while others decode
            r.restoring = self._io.submit(eng.load_record, aid)

    def _ready(self, r: Request) -> bool:
        """True once ``r`` has its cache (restored, if it was on disk) and a prefill plan."""
        if r.restoring is not None:
            if not r.restoring.done():
                return False
            cache = r.restoring.result()  # load_record quarantines bad records itself
            r.restoring = None
            r.cache, r.source = (
                (cache, "warm")
                if cache is not None
                else (AgentCache.empty(self.engine.spec, self.engine.scheme), "cold")
            )
        if not r.planned:
            r.cached = r.cache.reuse_prefix(r.prompt)
            r.todo = r.prompt[r.cached :]
            chunk = self.engine.prefill_chunk
            # prefill ahead needs no logits, so no separate last call either
            r.plan = (
                [min(chunk, len(r.todo) - i) for i in range(0, len(r.todo), chunk)]
                if r.background
                else forward_plan(len(r.todo), chunk)
            )
            r.planned = True
        return True

    def _prefill_step(self) -> bool:
        """One model call for the oldest prefilling request that is ready; False if none was.

        Background requests (prefill ahead) get a call only while no other request waits
        for its first token, so such a request waits at most for one background chunk.
        """
        foreground = any(not r.background for r in self._waiting + self._prefilling)
        for r in self._prefilling:
            if r.cancelled:
                self._prefilling.remove(r)
                self._complete(r)
                return True
            if r.background and foreground:
                continue
            try:
                if not self._ready(r):
                    continue
            except Exception as exc:  # the record could not be read at all
                self._fail(r, exc)
                return True
            n = r.plan.pop(0)
            self.stats["prefill_calls"] += 1
            self.stats["background_calls"] += r.background
            ids, r.todo = r.todo[:n], r.todo[n:]
            out = self.engine.model(mx.array(ids)[None], cache=r.cache.layers)
            r.cache.tokens.extend(ids)
            if r.plan:
                mx.eval(r.cache.arrays())
                return True
            if r.background:  # its logits are never read: only the cache is computed
                mx.eval(r.cache.arrays())
                self._prefilling.remove(r)
                self._complete(r, emit_result=False)
                r.emit(None)
                return True
            logits = out[0, -1]
            mx.eval(logits, r.cache.arrays())
            self._prefilling.remove(r)
            if r.sampler is None:
                result = np.array(logits.astype(mx.float32))
                self._complete(r, emit_result=False)
                r.emit((result, r.cached))
            else:
                self._accept(r, logits)
            return True
        return False

    def _decode_step(self) -> bool:
        """One batched decode step for every generating agent; False if there were none."""
        for r in [r for r in self._decoding if r.cancelled]:
            self._decoding.remove(r)
            self._complete(r)
        if not self._decoding:
            return False
        batch = list(self._decoding)
        self.stats["decode_steps"] += 1
        self.stats["decoded_tokens"] += len(batch)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        x = mx.array([[r.next_token] for r in batch])
        if len(batch) == 1:
            caches: list = batch[0].cache.layers
        else:
            caches = batch_views([r.cache.layers for r in batch])
        logits = self.engine.model(x, cache=caches)[:, -1]
        mx.eval(logits, [a for r in batch for a in r.cache.arrays()])
        for b, r in enumerate(batch):
            r.cache.tokens.append(r.next_token)
            self._accept(r, logits[b])
        return True

    # -- per-token bookkeeping ------------------------------------------------------------
    def _accept(self, r: Request, logits: mx.array) -> None:
        """Sample the next token, stream text, and decide whether ``r`` goes on."""
        eng = self.engine
        token = int(r.sampler(logits).item())
        if r.ttft is None:
            r.ttft = time.perf_counter() - r.t0
        stops = r.stops + list(eng.loaded.template.stop_strings)
        done = token in eng.tokenizer.stop_ids
        if done:
            r.finish = "stop"
        else:
            r.generated.append(token)
            r.text = eng.tokenizer.decode(r.generated)
            cut = min((i for i in (r.text.find(s) for s in stops) if i >= 0), default=-1)
            if r.until is not None and (end := r.until(r.text)) >= 0:
                cut = end if cut < 0 else min(cut, end)
            if cut >= 0:
                r.text, r.finish, done = r.text[:cut], "stop", True
            elif len(r.generated) >= r.max_tokens:
                done = True
            else:
                safe = len(r.text) - held_back(r.text, stops)
                if safe > r.emitted and not r.text[:safe].endswith("\ufffd"):
                    r.emit(r.text[r.emitted : safe])
                    r.emitted = safe
        if r in self._decoding and done:
            self._decoding.remove(r)
        if done:
            self._complete(r)
        elif r not in self._decoding:
            self._decoding.append(r)
        r.next_token = token

    def _complete(self, r: Request, emit_result: bool = True) -> None:
        """Hand the agent's cache back (pool, save, budget), then tell the caller.

        A durable engine hands the result over only once the turn's save has ended (from
        the I/O thread, so the step loop never waits on the disk), with ``saved`` saying
        whether the record on disk now holds the turn.
        """
        saving = self._release(r)
        if emit_result:
            if len(r.text) > r.emitted:
                r.emit(r.text[r.emitted :])
            result = ChatResult(
                text=r.text,
                finish_reason=r.finish,  # type: ignore[arg-type]
                usage=Usage(len(r.prompt), r.cached, len(r.generated)),
                ttft_s=r.ttft or 0.0,
                total_s=time.perf_counter() - r.t0,
                cache=r.source,  # type: ignore[arg-type]
                agent_id=r.agent_id,
                token_ids=r.generated,
            )
            if self.engine.durable and r.agent_id is not None:
                if saving is None:  # the cache was dropped, not saved: the old record stands
                    r.emit(replace(result, saved=False))
                else:
                    emit = r.emit  # not r: a done future keeps its callbacks, which must not keep the cache
                    saving.add_done_callback(
                        lambda f: emit(replace(result, saved=f.exception() is None and bool(f.result())))
                    )
            else:
                r.emit(result)

    def _fail(self, r: Request, exc: BaseException) -> None:
        for group in (self._prefilling, self._decoding):
            if r in group:
                group.remove(r)
        if r.agent_id is not None:
            self.engine.pool.pop(r.agent_id)  # possibly half-updated: never reuse it
            self._busy.discard(r.agent_id)
        r.emit(exc)

    def _release(self, r: Request) -> Future | None:
        """Return the agent's cache to the pool and start its save; the save, if any."""
        aid = r.agent_id
        if aid is None:
            return None
        self._busy.discard(aid)
        cache = r.cache
        if cache is None:
            return None
        if any(c.offset != len(cache.tokens) for c in cache.layers):
            log.warning("agent %s: interrupted mid-forward; dropping its RAM cache", aid)
            self.engine.pool.pop(aid)
            return None
        self.engine.pool.put(aid, cache)
        saving = self.save_behind(aid, cache)
        self.enforce_budget()
        return saving

    # -- saving and the budget (worker thread) ---------------------------------------------
    def save_behind(self, aid: str, cache: AgentCache) -> Future:
        """Snapshot the agent's blocks now; write them on the I/O thread."""
        record = agent_record(cache)
        mx.eval(list(record.tensors.values()))
        fut = self._io.submit(self._write, aid, record, cache.shared)
        self._saves[aid] = fut
        return fut

    def _write(self, aid: str, record: CacheRecord, prefix: Any = None) -> bool:
        try:
            self.engine.write_record(aid, record, prefix)
        except StorageError as exc:
            log.error("could not save agent %s; keeping it in RAM and retrying later: %s", aid, exc)
            self.engine.unsaved.add(aid)
            return False
        self.engine.unsaved.discard(aid)
        return True

    def _retry_unsaved(self) -> None:
        """Save again, with backoff, the resident agents whose last save failed."""
        eng = self.engine
        if not eng.unsaved:
            self._retry_delay = RETRY_FIRST_S
            return
        now = time.monotonic()
        if now < self._retry_at:
            return
        for aid in sorted(eng.unsaved):
            cache, save = eng.pool.get(aid), self._saves.get(aid)
            if cache is not None and aid not in self._busy and (save is None or save.done()):
                self.save_behind(aid, cache)
        self._retry_at = now + self._retry_delay
        self._retry_delay = min(2 * self._retry_delay, RETRY_MAX_S)

    def cancel_background(self, aid: str) -> None:
        """Stop ``aid``'s prefill-ahead work now, keeping what it computed (worker thread)."""
        for r in [r for r in self._waiting if r.background and r.agent_id == aid]:
            self._waiting.remove(r)
            r.emit(None)
        for r in [r for r in self._prefilling if r.background and r.agent_id == aid]:
            r.cancelled = True
            self._prefilling.remove(r)
            if r.restoring is not None:  # never got its cache: nothing to hand back
                self._busy.discard(aid)
                r.emit(None)
            else:
                self._complete(r)

    def forget(self, aid: str) -> None:
        """Drop every trace of ``aid`` from the scheduler's bookkeeping (its save has ended)."""
        self._saves.pop(aid, None)

    def wait_saved(self, aid: str) -> bool:
        fut = self._saves.get(aid)
        return True if fut is None else bool(fut.result())

    def wait_all_saves(self) -> None:
        for fut in list(self._saves.values()):
            fut.result()

    def enforce_budget(self) -> None:
        pool = self.engine.pool
        for victim in pool.over_budget_victims():
            if victim in self._busy:
                continue
            if not self.wait_saved(victim) and not self.save_behind(victim, pool.get(victim)).result():
                continue  # never drop state that is not safely on disk
            pool.pop(victim)
