"""The step loop: every agent's work interleaved on one thread, disk I/O on another.

One worker thread owns the model and every cache. Each step it
1. admits waiting requests (per agent in arrival order, one at a time, and only once
   that agent's previous save is on disk); an agent that is not in RAM is restored
   from disk on the I/O thread meanwhile (prefetch), while others keep decoding;
2. runs prefill calls for the requests still prefilling, at most ``prefill_chunk``
   tokens' worth in all, so a long prompt never stalls decoding agents by more than a
   chunk, while short turns (cut at a message boundary for a checkpoint) each end in one
   step, several to a step. A turn whose whole prefill fits the step goes first (its
   first token comes now), then the rest oldest first; one that was passed over goes
   first the next step, so a long prompt still gets a chunk at least every other step;
3. runs one batched decode step for every agent that is generating, over the decode
   working set (``kvshelf.kv.working_set``), which it keeps while that set is unchanged.
Every agent's cache is borrowed from the shelf (``kvshelf.runtime.shelf``), which owns
residency, restoring, saving and the budget, and handed back to it when the request
ends. Control calls (listing, forking, erasing, evicting agents) run on the worker
between steps, so no lock guards the caches: only the worker touches them. The loop
knows nothing of the engine in front of it: it is built from the model and the shelf.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import mlx.core as mx
import numpy as np

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.coded_working_set import reads_codes
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.head import prefill_logits
from kvshelf.model.loader import LoadedModel
from kvshelf.runtime.events import Event, Failed, Finished, Prefilled, Stopped, Text
from kvshelf.runtime.iothread import release_mlx_thread
from kvshelf.runtime.results import CacheSource, ChatResult, Timeline, Usage
from kvshelf.runtime.sampling import Sampler
from kvshelf.runtime.shelf import Shelf
from kvshelf.storage.agent_id import AgentId
from kvshelf.structured.constraint import TokenConstraint

log = logging.getLogger(__name__)

# A short input runs in one call with logits for every position (cheaper than a
# separate call for the last token); a longer one is chunked, then its last token.
FINAL_CALL_MAX_TOKENS = 32

# Every model call reads all the weights once, however few its tokens: on the embedded
# Gemma 3 here (2 cores, under the benchmark lock) a 3-token call took 150-260 ms and an
# 11-token one 270-400 ms, against about 1.4 s for a 256-token chunk. So a step's prefill
# budget counts each call as at least this many tokens: a few small calls share a step,
# and a step's prefill stays within about a chunk's time.
CALL_COST_FLOOR = 64

T = TypeVar("T")


def call_cost(n: int, chunk: int) -> int:
    """What a prefill call of ``n`` tokens takes from a step's budget of ``chunk``: never
    more than all of it, so a step always has room for its first call."""
    return min(max(n, CALL_COST_FLOOR), chunk)


def forward_plan(n: int, chunk: int) -> list[int]:
    """Sizes of the model calls that feed ``n`` tokens; only the last call's logits are used."""
    if n <= FINAL_CALL_MAX_TOKENS:
        return [n]
    body = n - 1
    return [min(chunk, body - i) for i in range(0, body, chunk)] + [1]


def prefill_plan(n: int, chunk: int, stops: Sequence[int] = (), logits: bool = True) -> list[int]:
    """Sizes of the model calls that feed ``n`` tokens, a call ending at each of ``stops``
    (offsets into the ``n``, where boundary checkpoints are taken). Only the last call's
    logits are used; ``logits=False`` (prefill ahead) needs no separate last call."""
    plan, at = [], 0
    for end in [*sorted(s for s in set(stops) if 0 < s < n), n]:
        span = end - at
        if end == n and logits:
            plan += forward_plan(span, chunk)
        else:
            plan += [min(chunk, span - i) for i in range(0, span, chunk)]
        at = end
    return plan


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing chars could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def _close_at_exit(scheduler: Scheduler) -> None:
    """Stop a scheduler (and its shelf) that was never closed, before the interpreter exits.

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

    agent_id: AgentId | None
    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None  # None: prefill only, the result is the next-token logits
    stops: list[str]
    emit: Callable[[Event], None]
    t0: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    background: bool = False  # prefill ahead: lowest priority, superseded by any later request
    until: Callable[[str], int] | None = None  # where the reply is complete (e.g. a JSON object), or -1
    progress: Callable[[int, int], None] | None = None  # (prompt tokens done, of) after each prefill chunk
    boundaries: tuple[int, ...] = ()  # prompt positions that end a message: checkpoint there
    constraint: TokenConstraint | None = None  # the grammar's token mask (kvshelf.structured.constraint)
    cache: AgentCache | None = None
    restoring: Future | None = None
    planned: bool = False
    source: CacheSource = "cold"
    cached: int = 0
    todo: list[int] = field(default_factory=list)
    plan: list[int] = field(default_factory=list)
    next_token: int | None = None
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    ttft: float | None = None
    finish: Literal["stop", "length"] = "length"
    # where the time to first token went (``Timeline``): the loop's clock and counters
    seen: tuple[int, int] = (0, 0)  # (decode steps, prefill calls) run when it reached the loop
    admitted: float | None = None
    restored: float | None = None  # set on the I/O thread when the restore ends
    cache_ready: float | None = None
    calls: int = 0
    passed: int = 0  # steps in a row it was passed over (``_prefill_order``)
    passed_total: int = 0
    timeline: Timeline | None = None


class Scheduler:
    """Runs the step loop: the model over the caches the shelf lends it."""

    def __init__(self, loaded: LoadedModel, shelf: Shelf, *, prefill_chunk: int = 256):
        self._loaded = loaded  # its forward, for requests that sample
        # for requests at temperature 0: built now, its load-time checks included, not in the first request
        self._greedy_forward = loaded.greedy_forward
        self._tokenizer = loaded.tokenizer
        self._template_stops = list(loaded.template.stop_strings)
        self._shelf = shelf
        self._prefill_chunk = prefill_chunk
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: list[Request] = []
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._working = WorkingSets()  # the decoding agents' rows, kept ready across steps
        working, decoding = self._working, self._decoding  # counted in the budget (no cycle to self)
        shelf.pool.working_bytes = lambda: working.nbytes_of(decoding)
        self._stopping = False
        self._closed = False
        self.stats = {
            "decode_steps": 0,
            "decoded_tokens": 0,
            "max_batch": 0,
            "prefill_calls": 0,
            "prefill_steps": 0,  # steps that ran prefill calls (several calls may share one)
            "background_calls": 0,
        }
        self._thread = threading.Thread(target=self._run, name="kvshelf-scheduler", daemon=True)
        self._thread.start()
        _close_at_exit(self)

    # -- called from any thread --------------------------------------------------------
    def submit(self, request: Request) -> None:
        self._inbox.put(request)

    def call(self, fn: Callable[[], T], *, quiet: Sequence[AgentId] = ()) -> T:
        """Run ``fn`` on the worker between steps and return its result.

        ``quiet``: agents whose prefill-ahead work stops first (keeping what it
        computed), so a control call on them is not refused for background work."""

        def run() -> T:
            for aid in quiet:
                self._cancel_background(aid)
            return fn()

        if threading.current_thread() is self._thread:
            return run()
        done: Future = Future()
        self._inbox.put((run, done))
        return done.result()

    def close(self) -> None:
        """Finish admitted work, then stop the worker, which closes the shelf (every save
        ends, then the I/O thread stops)."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._thread.join()

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
                self._shelf.retry_unsaved()
                self._admit()
                prefilled = self._prefill_step()
                worked = self._decode_step() or prefilled
            except Exception as exc:  # never let one bad step kill the loop
                log.exception("scheduler step failed")
                for r in self._prefilling + self._decoding:
                    self._fail(r, exc)
        self._shelf.close()
        release_mlx_thread()

    def _drain(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is None:
                self._stopping = True
            elif isinstance(item, Request):
                item.seen = (self.stats["decode_steps"], self.stats["prefill_calls"])
                if item.agent_id is not None:
                    self._cancel_background(item.agent_id)  # the newer request takes over
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
                    r.emit(Stopped())  # resolves its Future: nothing was computed
                continue
            aid = r.agent_id
            if aid is not None and (aid in blocked or not self._shelf.can_lend(aid)):
                blocked.add(aid)  # keeps this agent's later requests behind this one
                continue
            self._waiting.remove(r)
            self._start(r)
            self._prefilling.append(r)

    def _start(self, r: Request) -> None:
        aid = r.agent_id
        r.admitted = time.perf_counter()
        if aid is None:  # never persisted; may start on an anonymous prefix in RAM
            r.cache, r.source = self._shelf.anonymous_cache(r.prompt), "none"
        elif (cache := self._shelf.lend(aid)) is not None:
            r.cache, r.source = cache, "hot"
        else:  # prefetch: read and verify the record on a reader thread while others decode
            r.restoring = self._shelf.restore(aid)
            r.restoring.add_done_callback(lambda _: setattr(r, "restored", time.perf_counter()))
        if r.cache is not None:
            r.cache_ready = r.admitted

    def _ready(self, r: Request) -> bool:
        """True once ``r`` has its cache (restored, if it was on disk) and a prefill plan."""
        if r.restoring is not None:
            if not r.restoring.done():
                return False
            assert r.agent_id is not None  # the shelf quarantines bad records itself
            r.cache, r.source = self._shelf.restored(r.agent_id, r.restoring.result())
            r.restoring = None
            r.cache_ready = time.perf_counter()
        if not r.planned:
            assert r.cache is not None
            r.cached = r.cache.reuse_prefix(r.prompt)
            if r.cached in r.boundaries:  # cut back to a boundary: keep it before going on
                r.cache.checkpoint()
            r.todo = r.prompt[r.cached :]
            # a call ends at each message boundary still to compute, where a checkpoint is
            # taken; prefill ahead needs no logits, so no separate last call either
            stops = [b - r.cached for b in r.boundaries]
            r.plan = prefill_plan(len(r.todo), self._prefill_chunk, stops, logits=not r.background)
            r.planned = True
        return True

    def _prefill_step(self) -> bool:
        """Prefill calls for the ready requests, in ``_prefill_order``, at most
        ``prefill_chunk`` tokens' worth in all (``call_cost``); False if none ran.

        A turn's few new tokens are cut at a message boundary into two calls, and several
        agents' turns may be ready at once: one call a step would make each call wait a
        whole batched decode round of every other agent (a moved agent's 14 tokens, 3 + 11,
        waited 0.3-0.7 s so on a loaded node, then as long again behind another agent's
        turn). The calls are the same, so are the numbers; only how decode rounds
        interleave them changes. A request that still has calls left when the budget is
        spent keeps its place: no later one in the order goes ahead of it.

        Background requests (prefill ahead) get a call only while no other request waits
        for its first token, so such a request waits at most for one background chunk.
        """
        foreground = any(not r.background for r in self._waiting + self._prefilling)
        budget, worked = self._prefill_chunk, False
        ready: list[Request] = []
        for r in list(self._prefilling):
            if r.cancelled:
                self._prefilling.remove(r)
                self._complete(r)
                worked = True
                continue
            if r.background and foreground:
                continue
            try:
                if self._ready(r):
                    ready.append(r)
            except Exception as exc:  # the record could not be read at all
                self._fail(r, exc)
                worked = True
        served: set[int] = set()  # positions in ``ready`` (arrival order) that got a call
        for r in self._prefill_order(ready):
            while r in self._prefilling and not r.cancelled and call_cost(r.plan[0], self._prefill_chunk) <= budget:
                budget -= call_cost(r.plan[0], self._prefill_chunk)
                self._prefill_call(r)
                served.add(next(i for i, x in enumerate(ready) if x is r))
                worked = True
            if r in self._prefilling:
                break
        for i, r in enumerate(ready):  # passed over: calls left, none this step, a younger one served
            if i in served:
                r.passed = 0
            elif r in self._prefilling and any(j > i for j in served):
                r.passed += 1
                r.passed_total += 1
        self.stats["prefill_steps"] += budget < self._prefill_chunk
        return worked

    def _prefill_order(self, ready: list[Request]) -> list[Request]:
        """The order the ready requests get this step's prefill budget in (all oldest first
        within their group): turns that end their prefill in this step first (a hot or
        restored turn's few new tokens: its first token comes now, not after every chunk
        of a long prompt that came before it), then the others. Bounded: a request that
        was passed over in the last step keeps its place in arrival order this step, so a
        long prompt gets a chunk at least every other step however many short turns come."""
        chunk = self._prefill_chunk
        if any(r.passed for r in ready):
            first_passed = next(i for i, r in enumerate(ready) if r.passed)
            head, tail = ready[: first_passed + 1], ready[first_passed + 1 :]
        else:
            head, tail = [], ready

        def finishing(r: Request) -> bool:
            return not r.background and sum(call_cost(n, chunk) for n in r.plan) <= chunk

        return head + [r for r in tail if finishing(r)] + [r for r in tail if not finishing(r)]

    def _prefill_call(self, r: Request) -> None:
        """``r``'s next prefill call (its cache ready). The last call samples the first
        token (``r`` then decodes) or ends a prefill-only request."""
        assert r.cache is not None
        n = r.plan.pop(0)
        self.stats["prefill_calls"] += 1
        r.calls += 1
        self.stats["background_calls"] += r.background
        ids, r.todo = r.todo[:n], r.todo[n:]
        want = not r.plan and not r.background  # only the last call's logits are read
        out = prefill_logits(self._forward([r]), mx.array(ids)[None], r.cache.layers, want)
        r.cache.tokens.extend(ids)
        if r.plan:
            mx.eval(r.cache.arrays())
            if r.progress is not None:  # a caller showing a long prefill (worker thread: keep it quick)
                r.progress(len(r.prompt) - len(r.todo), len(r.prompt))
            if len(r.cache.tokens) in r.boundaries:
                r.cache.checkpoint()
            return
        if r.background:  # its logits are never read: only the cache is computed
            mx.eval(r.cache.arrays())
            self._prefilling.remove(r)
            self._complete(r, emit_result=False)
            r.emit(Stopped())
            return
        assert out is not None
        logits = out
        mx.eval(logits, r.cache.arrays())
        self._prefilling.remove(r)
        if r.sampler is None:
            result = np.array(logits.astype(mx.float32))
            settled = self._complete(r, emit_result=False)
            if settled is None:
                r.emit(Prefilled(result, r.cached))
            else:  # a durable shelf answers once the save has ended, saying how it went
                # A done future keeps its callbacks: hand over through a box emptied on
                # use, so the logits and the caller's emit (which may hold the request
                # and its cache) are not kept alive with the agent's last save.
                box = [(r.emit, result, r.cached)]

                def deliver(f: Future) -> None:
                    emit, logits, cached = box.pop()
                    emit(Prefilled(logits, cached, f.result()))

                settled.add_done_callback(deliver)
        else:
            self._accept(r, logits)

    def _forward(self, requests: list[Request]) -> Any:
        """The model call for a step of ``requests``: the shape-invariant kernels if any of
        them decodes at temperature 0 or only prefills (``LoadedModel.greedy_forward``), so a
        greedy reply never depends on its batch-mates; the default ones otherwise."""
        greedy = any(r.sampler is None or r.sampler.temperature == 0 for r in requests)
        return self._greedy_forward if greedy else self._loaded.forward

    def _decode_step(self) -> bool:
        """One batched decode step for every generating agent; False if there were none."""
        for r in [r for r in self._decoding if r.cancelled]:
            self._decoding.remove(r)
            self._complete(r)
        if not self._decoding:
            self._working.clear()
            return False
        batch = list(self._decoding)
        self.stats["decode_steps"] += 1
        self.stats["decoded_tokens"] += len(batch)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        x = mx.array([[r.next_token] for r in batch])
        held = [_cache_of(r) for r in batch]
        forward = self._forward(batch)
        caches = self._working.caches(batch, [c.layers for c in held], in_codes=reads_codes(forward, len(batch)))
        logits = forward(x, cache=caches)[:, -1]
        # One evaluation computes the step; then each member chooses from its own row
        # (numpy, ``kvshelf.runtime.sampling``).
        mx.eval(logits, [a for c in held for a in c.arrays()], self._working.arrays())
        rows = _numpy_rows(logits)
        tokens = [self._choose(r, rows[b]) for b, r in enumerate(batch)]
        for r, c, token in zip(batch, held, tokens):
            c.tokens.append(r.next_token)  # type: ignore[arg-type]
            self._take(r, token)
        return True

    # -- per-token bookkeeping ------------------------------------------------------------
    def _accept(self, r: Request, logits: mx.array) -> None:
        """Sample the next token, stream text, and decide whether ``r`` goes on."""
        self._take(r, self._choose(r, _numpy_rows(logits)))

    @staticmethod
    def _choose(r: Request, logits: np.ndarray) -> int:
        """``r``'s next token from its logits."""
        assert r.sampler is not None
        if r.constraint is not None:  # the only hook of constrained decoding: mask, then sample
            logits = r.constraint.masked(logits)
        return r.sampler(logits)

    def _take(self, r: Request, token: int) -> None:
        """Stream ``token``'s text and decide whether ``r`` goes on."""
        if r.ttft is None:
            r.ttft = time.perf_counter() - r.t0
            r.timeline = self._timeline(r)
        stops = r.stops + self._template_stops
        done = token in self._tokenizer.stop_ids
        if done:
            r.finish = "stop"
        else:
            r.generated.append(token)
            r.text = self._tokenizer.decode(r.generated)
            complete = r.constraint is not None and r.constraint.advance(token)
            cut = min((i for i in (r.text.find(s) for s in stops) if i >= 0), default=-1)
            if r.until is not None and (end := r.until(r.text)) >= 0:
                cut = end if cut < 0 else min(cut, end)
            if cut >= 0:
                r.text, r.finish, done = r.text[:cut], "stop", True
            elif complete:
                r.finish, done = "stop", True
            elif len(r.generated) >= r.max_tokens:
                done = True
            else:
                safe = len(r.text) - held_back(r.text, stops)
                if safe > r.emitted and not r.text[:safe].endswith("\ufffd"):
                    r.emit(Text(r.text[r.emitted : safe]))
                    r.emitted = safe
        if r in self._decoding and done:
            self._decoding.remove(r)
        if done:
            self._complete(r)
        elif r not in self._decoding:
            self._decoding.append(r)
        r.next_token = token

    def _timeline(self, r: Request) -> Timeline:
        """Where ``r``'s time to first token went (at its first token, worker thread)."""
        assert r.ttft is not None and r.admitted is not None and r.cache_ready is not None

        def since(t: float) -> float:
            return round(t - r.t0, 4)

        decode0, calls0 = r.seen
        return Timeline(
            admitted_s=since(r.admitted),
            cache_ready_s=since(r.cache_ready),
            first_token_s=round(r.ttft, 4),
            restored_s=None if r.restored is None else since(r.restored),
            prefill_calls=r.calls,
            others_prefill_calls=self.stats["prefill_calls"] - calls0 - r.calls,
            decode_steps=self.stats["decode_steps"] - decode0,
            passed_over=r.passed_total,
        )

    def _complete(self, r: Request, emit_result: bool = True) -> Future | None:
        """Hand the agent's cache back to the shelf (which keeps, saves and spills it),
        then tell the caller.

        A durable shelf has the result handed over only once the turn's save has ended
        (from the I/O thread, so the step loop never waits on the disk), with ``saved``
        saying whether the record on disk now holds the turn.
        """
        if r.agent_id is not None and r.cache is not None:
            r.cache.prune_checkpoints()  # the turn is over: only checkpoints still useful stay
        settled = None
        if r.agent_id is not None:
            settled = self._shelf.give_back(r.agent_id, r.cache)
        else:
            self._shelf.keep_anonymous(r.cache)
        if not emit_result:
            return settled
        if len(r.text) > r.emitted:
            r.emit(Text(r.text[r.emitted :]))
        result = ChatResult(
            text=r.text,
            finish_reason=r.finish,
            usage=Usage(len(r.prompt), r.cached, len(r.generated)),
            ttft_s=r.ttft or 0.0,
            total_s=time.perf_counter() - r.t0,
            cache=r.source,
            agent_id=r.agent_id,
            token_ids=r.generated,
            timeline=r.timeline,
        )
        if settled is None:
            r.emit(Finished(result))
        else:
            emit = r.emit  # not r: a done future keeps its callbacks, which must not keep the cache
            settled.add_done_callback(lambda f: emit(Finished(replace(result, saved=f.result()))))
        return settled

    def _fail(self, r: Request, exc: BaseException) -> None:
        for group in (self._prefilling, self._decoding):
            if r in group:
                group.remove(r)
        if r.agent_id is not None:
            self._shelf.drop(r.agent_id)  # possibly half-updated: never reuse it
        r.emit(Failed(exc))

    def _cancel_background(self, aid: AgentId) -> None:
        """Stop ``aid``'s prefill-ahead work now, keeping what it computed (worker thread)."""
        for r in [r for r in self._waiting if r.background and r.agent_id == aid]:
            self._waiting.remove(r)
            r.emit(Stopped())
        for r in [r for r in self._prefilling if r.background and r.agent_id == aid]:
            r.cancelled = True
            self._prefilling.remove(r)
            if r.restoring is not None:  # never got its cache: nothing to hand back
                self._shelf.unlend(aid)
                r.emit(Stopped())
            else:
                self._complete(r)


def _cache_of(r: Request) -> AgentCache:
    """The cache of a request past its prefill (always set by then)."""
    assert r.cache is not None
    return r.cache


def _numpy_rows(logits: mx.array) -> np.ndarray:
    """The step's logits as numpy (fp32; no copy where they are fp32 already), for the
    samplers to choose from."""
    return np.asarray(logits if logits.dtype == mx.float32 else logits.astype(mx.float32))
