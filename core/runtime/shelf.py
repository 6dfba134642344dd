"""The shelf: one owner for every agent's cache through its whole life.

An agent's cache is resident (in the byte-budget pool), lent out (to the step loop, for
one request at a time), being saved (written behind on the I/O thread from a snapshot),
unsaved (its last save failed: kept in RAM and retried with backoff), on disk only, or
erased. Every move between those states happens here, so residency, saving, retrying,
the budget, forks and erasure follow one set of rules:

- a cache is never dropped from RAM unless its record on disk holds it;
- a lent cache is never saved, spilled, forked, evicted or erased under the loop;
- a durable shelf answers (a turn, a fork) only once the save it needs has ended.

Everything but the reader and I/O threads' reads and writes runs on the scheduler's worker
thread (``kvshelf.runtime.scheduler``), between steps, so no lock guards the caches.
The one exception is reading the listing (``agent_info``, ``agents_page``): it runs in
the caller's thread, from the pool's snapshot of resident agents and the store's
metadata index, so listing 100,000 agents never holds up a decode step.

What the shelf keeps per agent is bounded by what is resident or pending: the save
table holds only saves not yet finished (each is dropped on the worker once it ends),
``unsaved`` only agents whose latest state is in RAM alone.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import cast

import mlx.core as mx

from kvshelf.errors import AgentBusy, AgentExists, StaleWrite, StorageError, UnknownAgent
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.record import CacheRecord, agent_cache_from_record, agent_record, shared_prefix_id
from kvshelf.kv.schemes import KVScheme
from kvshelf.kv.shared import SharedPrefix
from kvshelf.model.spec import ModelCacheSpec
from kvshelf.runtime.anonymous import MAX_ENTRIES as ANONYMOUS_ENTRIES
from kvshelf.runtime.anonymous import AnonymousPrefixes
from kvshelf.runtime.iothread import IOThread
from kvshelf.runtime.pool import BlockPool, Resident
from kvshelf.runtime.results import AgentInfo, AgentPage, CacheSource, ForgetResult, ForkResult, Residency
from kvshelf.storage.agent_id import AgentId
from kvshelf.storage.prefixes import SharedPrefixes
from kvshelf.storage.records import RecordInfo, RecordStore

log = logging.getLogger(__name__)

# A save that failed (full disk, lost permissions) is retried on its own, first after
# RETRY_FIRST_S, then at doubling intervals up to RETRY_MAX_S, so a disk that frees up
# gets the agents back on it without anyone calling flush(), and a disk that stays
# full costs one attempt (and one logged error) per agent a minute.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
# While requests are in flight, a page of the listing takes at most this share of the
# time: it sleeps after its work for the rest. A listing is an operator's view, generation
# the product: on two cores a listing at full speed (its Python work holds the GIL) would
# slow every decoding agent by half, while paced it runs in the gaps. Idle, it runs flat out.
# At a tenth, chats overlapping a full listing of 100,000 agents took no longer than the
# others (benchmarks/store_scale.py: 0.90x; a twentieth measured the same, 0.92x).
LISTING_SHARE_WHILE_BUSY = 0.1


def _resident(aid: str) -> AgentId:
    """A key of the pool as the AgentId it is: only this shelf puts agents there, by AgentId."""
    return cast(AgentId, aid)


Restored = tuple[AgentCache | None, CacheSource]
"""What a restore found: the cache to use (None: start cold) and where it came from."""


def _done(value: object) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class Shelf:
    """Agents' caches in RAM and on disk, for one model and one cache directory."""

    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        spec: ModelCacheSpec,
        scheme: KVScheme,
        *,
        budget: int | str | None = None,
        durable: bool = False,
        store: RecordStore | None = None,
        anonymous_prefixes: int = ANONYMOUS_ENTRIES,
    ) -> None:
        """``store``: where the agents' records live (default: ``RecordStore(cache_dir,
        fingerprint)``); ``cache_dir`` holds the shared prefixes either way. A shared
        store (``RecordStore.shared``) makes the shelf check the store's version of an
        agent before it reuses its RAM copy, and drop that copy when a save is refused."""
        self.spec = spec
        self.scheme = scheme
        self.durable = durable
        self.store = store if store is not None else RecordStore(cache_dir, fingerprint)
        self.shared = SharedPrefixes(cache_dir, fingerprint, spec)
        self.pool = BlockPool(budget)
        self.anonymous = AnonymousPrefixes(anonymous_prefixes)
        """Requests that name no agent: RAM only, within what the named agents leave of the budget."""
        self.unsaved: set[AgentId] = set()
        """Resident agents whose last save failed: their record on disk is behind."""
        self._lent: set[AgentId] = set()
        self.listing_share = LISTING_SHARE_WHILE_BUSY
        """The share of the time a listing may take while agents generate (0 < share <= 1)."""
        self._saves: dict[AgentId, Future] = {}
        """Saves not finished yet, by agent (its latest one)."""
        self._finished: queue.SimpleQueue[tuple[AgentId, Future]] = queue.SimpleQueue()
        self._refused: queue.SimpleQueue[AgentId] = queue.SimpleQueue()
        """Agents whose save the store refused (``StaleWrite``): their RAM copy is dropped on the worker."""
        self._io = IOThread("kvshelf-io")
        # Restores run on their own thread: a turn waiting for its record must not queue
        # behind other agents' write-behind saves (each an fsynced write), which on a node
        # that just took over a dead one's agents are many. A restore never overlaps a save
        # of the same agent: the loop lends an agent only once its last save has ended.
        self._reader = IOThread("kvshelf-read")
        # A shared store's version checks run on their own thread: a hot turn must not wait
        # behind other agents' saves to learn that its RAM copy is still current.
        self._probe = IOThread("kvshelf-probe") if self.store.shared else None
        self.store.open_index()  # reconciles with the records in the background from now
        self._retry_delay = RETRY_FIRST_S
        self._retry_at = 0.0

    # -- lending to the step loop -------------------------------------------------------
    def new_cache(self) -> AgentCache:
        """An empty cache for this model and KV scheme (a new agent, or one never saved)."""
        return AgentCache.empty(self.spec, self.scheme)

    def anonymous_cache(self, prompt: list[int]) -> AgentCache:
        """A cache for a request that names no agent: an anonymous one sharing the prompt's
        first tokens exactly (``kvshelf.runtime.anonymous``), else an empty one."""
        return self.anonymous.take(prompt) or self.new_cache()

    def keep_anonymous(self, cache: AgentCache | None) -> None:
        """Take back an anonymous request's cache: kept in RAM for the next prompt that
        starts with its tokens, never saved, in what room the named agents leave."""
        if cache is not None:
            self.anonymous.keep(cache)
            self.enforce_budget()

    def can_lend(self, aid: AgentId) -> bool:
        """False while the agent is lent out or its last save is still being written."""
        self._forget_finished_saves()
        save = self._saves.get(aid)
        return aid not in self._lent and (save is None or save.done())

    def lent(self, aid: AgentId) -> bool:
        """True while a request holds the agent's cache."""
        return aid in self._lent

    def lend(self, aid: AgentId) -> AgentCache | None:
        """Lend the agent out; its resident cache, or None if it must be restored first
        (always, in a shared store: the RAM copy is used once the store says it is current)."""
        self._forget_finished_saves()  # a refused save's RAM copy goes before it can be lent
        self._lent.add(aid)
        cache = self.pool.get(aid)
        return None if self.store.shared else cache

    def restore(self, aid: AgentId) -> Future:
        """Read and verify the agent's record on the reader thread (prefetch while others
        decode): a Future of ``Restored``. In a shared store a resident agent's RAM copy is
        checked against the store's version first (``_current_or_newer``)."""
        resident = self.pool.get(aid) if self._probe is not None else None
        if self._probe is not None and resident is not None:
            return self._probe.submit(self._current_or_newer, aid, resident)
        return self._reader.submit(self._from_store, aid)

    def restored(self, aid: AgentId, found: Restored) -> tuple[AgentCache, CacheSource]:
        """Take what a restore found (worker thread): the cache to lend and its source. A
        RAM copy that the store superseded leaves the pool here."""
        cache, source = found
        if source != "hot" and aid in self.pool:
            self.pool.pop(aid)
        return (cache, source) if cache is not None else (self.new_cache(), "cold")

    def _from_store(self, aid: AgentId) -> Restored:
        cache = self.load(aid)
        return cache, ("warm" if cache is not None else "cold")

    def _current_or_newer(self, aid: AgentId, resident: AgentCache) -> Restored:
        """The resident copy if the store still holds the record it was saved as or loaded
        from (one stat or HEAD); else the store's newer record (another node moved the agent
        on: counted as a stale reload), or nothing if the agent was deleted. Probe thread."""
        try:
            if self.store.is_current(aid):
                return resident, "hot"
        except StorageError as exc:  # unreachable: serve what is here; the next save is conditional anyway
            log.warning("agent %s: cannot check the store's version (%s); serving this node's RAM copy", aid, exc)
            return resident, "hot"
        self.store.counters.add("stale_reloads")
        log.info("agent %s: the store holds a newer record than this node's RAM copy; using the store's", aid)
        return self._from_store(aid)

    def give_back(self, aid: AgentId, cache: AgentCache | None) -> Future:
        """Take the agent back after its request: keep it resident, save it behind, spill
        over budget. Returns a Future of what its result may say about durability
        (``ChatResult.saved``): None unless durable; else whether the save succeeded."""
        self._lent.discard(aid)
        if cache is None:  # never got its cache: the old record stands
            return _done(False if self.durable else None)
        if any(c.offset != len(cache.tokens) for c in cache.layers):
            log.warning("agent %s: interrupted mid-forward; dropping its RAM cache", aid)
            self.pool.pop(aid)
            return _done(False if self.durable else None)
        cache.settle()  # before the pool lists its bytes (the save would settle it after)
        self.pool.put(aid, cache)
        saving = self.save_behind(aid, cache)
        self.enforce_budget()
        return self._settled(saving)

    def drop(self, aid: AgentId) -> None:
        """Take the agent back after a failed request: its cache may be half-updated, so
        it is never reused (the record on disk stands)."""
        self.pool.pop(aid)
        self._lent.discard(aid)

    def unlend(self, aid: AgentId) -> None:
        """Take the agent back from a request that never got its cache."""
        self._lent.discard(aid)

    def _settled(self, saving: Future) -> Future:
        if not self.durable:
            return _done(None)
        out: Future = Future()
        saving.add_done_callback(lambda f: out.set_result(f.exception() is None and bool(f.result())))
        return out

    # -- saving ----------------------------------------------------------------------------
    def save_behind(self, aid: AgentId, cache: AgentCache) -> Future:
        """Snapshot the agent's blocks now; write them on the I/O thread."""
        record = agent_record(cache)  # drops a prefix no layer uses any more: read ``shared`` after
        mx.eval(list(record.tensors.values()))  # a snapshot now; the I/O thread writes it later
        fut = self._io.submit(self._write, aid, record, cache.shared)
        self._saves[aid] = fut
        fut.add_done_callback(lambda f: self._finished.put((aid, f)))  # dropped from the table on the worker
        return fut

    def _forget_finished_saves(self) -> None:
        """Drop ended saves from the table (worker thread): it holds what is pending only.
        A failed one leaves the agent in ``unsaved``, which is what ``wait_saved`` reads."""
        while True:
            try:
                refused = self._refused.get_nowait()
            except queue.Empty:
                break
            if refused not in self._lent:
                self.pool.pop(refused)
        while True:
            try:
                aid, fut = self._finished.get_nowait()
            except queue.Empty:
                return
            if self._saves.get(aid) is fut:
                del self._saves[aid]

    def _write(self, aid: AgentId, record: CacheRecord, prefix: SharedPrefix | None) -> bool:
        """Write an agent's record (I/O thread), and its shared prefix first if it has
        one: prefix file, then this agent's user marker, then the record, then the
        markers it no longer needs. A crash between steps leaves at most an unused prefix.
        A failed write keeps the agent in RAM, marked unsaved, to be retried."""
        try:
            try:
                if prefix is not None:
                    self.shared.ensure_saved(prefix)
                    self.shared.add_user(prefix.id, aid)
                self.store.save(aid, record)
                self.shared.release(aid, keep=prefix.id if prefix is not None else None)
            except StorageError:
                raise
            except OSError as exc:
                raise StorageError(
                    exc.errno or 0, f"could not write the shared prefix of agent {aid!r}: {exc}"
                ) from exc
        except StaleWrite as exc:  # another node moved the agent on, or it was deleted: never retried
            log.warning("agent %s: %s; dropping this node's RAM copy of it", aid, exc)
            self.unsaved.discard(aid)
            self._refused.put(aid)
            return False
        except StorageError as exc:
            log.error("could not save agent %s; keeping it in RAM and retrying later: %s", aid, exc)
            self.unsaved.add(aid)
            return False
        self.unsaved.discard(aid)
        return True

    def load(self, aid: AgentId) -> AgentCache | None:
        """Read and verify an agent's record; None if absent or unusable (an unusable one
        is quarantined, so the agent simply starts cold). The loop runs it on the reader
        thread (``restore``); it leaves the pool as it is."""
        record = self.store.load(aid)
        if record is None:
            return None
        try:
            prefix = None
            if (pid := shared_prefix_id(record)) is not None:
                prefix = self.shared.get(pid)
                if prefix is None:
                    raise ValueError(f"its shared prefix {pid!r} is missing or unreadable")
            cache = agent_cache_from_record(self.spec, record, prefix)
        except (ValueError, KeyError) as exc:
            self.store.quarantine(aid, f"record does not fit this model: {exc}")
            return None
        mx.eval(cache.arrays())  # MLX streams are per thread: materialise here, use on the worker
        return cache

    def retry_unsaved(self) -> None:
        """Save again, with backoff, the resident agents whose last save failed."""
        self._forget_finished_saves()
        if not self.unsaved:
            self._retry_delay = RETRY_FIRST_S
            return
        now = time.monotonic()
        if now < self._retry_at:
            return
        for aid in sorted(self.unsaved):
            cache = self.pool.get(aid)
            if cache is not None and self.can_lend(aid):
                self.save_behind(aid, cache)
        self._retry_at = now + self._retry_delay
        self._retry_delay = min(2 * self._retry_delay, RETRY_MAX_S)

    def wait_saved(self, aid: AgentId) -> bool:
        """Wait for the agent's last save; True if it reached the disk (or there was none)."""
        fut = self._saves.get(aid)
        return aid not in self.unsaved if fut is None else bool(fut.result())

    def enforce_budget(self) -> None:
        """Spill the least recently used agents until the rest fit the byte budget.

        Anonymous prefixes yield first: they shrink to what the named agents leave."""
        if self.pool.budget is not None:
            self.anonymous.shrink_to(self.pool.budget - self.pool.resident_bytes - self.pool.working_bytes())
        for victim in map(_resident, self.pool.over_budget_victims()):
            if victim in self._lent:
                continue
            cache = self.pool.get(victim)
            if cache is None:
                continue
            if not self.wait_saved(victim) and not self.save_behind(victim, cache).result():
                continue  # never drop state that is not safely on disk
            self.pool.pop(victim)
            self.store.forget_version(victim)

    # -- control calls ---------------------------------------------------------------------
    def fork(self, src: AgentId, dst: AgentId) -> Future:
        """Start ``dst`` from a copy of ``src``, sharing its whole blocks (interned once).

        Returns a Future of the ``ForkResult``: resolved at once, or on a durable shelf
        only once both records (and the shared prefix) are on disk."""
        if src in self._lent or dst in self._lent:
            raise AgentBusy(f"agent {src if src in self._lent else dst!r} has a request in flight")
        if dst in self.pool or self.store.has_record(dst):
            raise AgentExists(f"agent {dst!r} already has a cache; forget it first")
        cache = self.pool.get(src)
        if cache is None:
            cache = self.load(src)
            if cache is None:
                raise UnknownAgent(f"no cache for agent {src!r}")
            self.pool.put(src, cache)
        prefix = cache.share_prefix() if self.store.shares_prefixes else None  # else the twin copies
        if prefix is not None:
            cache.adopt(self.shared.intern(prefix))
        twin = cache.fork()
        self.pool.put(src, cache)  # its blocks moved into the prefix: the listing's snapshot follows
        self.pool.put(dst, twin)
        saves = [self.save_behind(src, cache), self.save_behind(dst, twin)]
        self.enforce_budget()
        result = ForkResult(
            agent_id=dst,
            source=src,
            tokens=len(twin.tokens),
            shared_tokens=len(prefix.tokens) if prefix is not None else 0,
            shared_prefix=prefix.id if prefix is not None else None,
        )
        if not self.durable:
            return _done(result)
        answered: Future = Future()
        pending = len(saves)

        def one_done(save: Future) -> None:  # runs on the I/O thread, in save order
            nonlocal pending
            pending -= 1
            if (exc := save.exception()) is not None and not answered.done():
                answered.set_exception(exc)
            elif pending == 0 and not answered.done():
                answered.set_result(replace(result, saved=all(s.result() for s in saves)))

        for save in saves:
            save.add_done_callback(one_done)
        return answered

    def forget(self, aid: AgentId) -> ForgetResult:
        """Erase the agent: its RAM cache, its record, its shared-prefix markers (and a
        prefix nobody else uses). Its running save, if any, ends first."""
        if aid in self._lent:
            raise AgentBusy(f"agent {aid!r} has a request in flight")
        self.wait_saved(aid)
        removed = self.store.delete(aid)  # first: where the disk refuses, RAM keeps the agent whole
        removed += self.shared.release(aid)  # its prefix markers; a prefix with no users left
        cache = self.pool.pop(aid)
        self.unsaved.discard(aid)
        self._saves.pop(aid, None)
        return ForgetResult(
            agent_id=aid,
            ram_bytes_freed=cache.nbytes if cache else 0,
            tokens_freed=len(cache.tokens) if cache else 0,
            files_removed=[str(p) for p in removed],
        )

    def evict(self, aid: AgentId) -> bool:
        """Drop the agent from RAM once its record is safely on disk."""
        if aid in self._lent or aid not in self.pool or not self.wait_saved(aid):
            return False
        self.pool.pop(aid)
        self.store.forget_version(aid)
        return True

    def flush(self) -> list[str]:
        """Wait for pending saves and retry failed ones; the agents still not on disk."""
        for aid in sorted(self.unsaved):
            cache = self.pool.get(aid)
            if cache is not None and aid not in self._lent:
                self.save_behind(aid, cache)
        for fut in list(self._saves.values()):
            fut.result()
        self._forget_finished_saves()  # and drops the RAM copies of refused saves
        return sorted(self.unsaved)

    # -- listing (any thread) -------------------------------------------------------------
    def agent_info(self, aid: AgentId) -> AgentInfo | None:
        """One agent, resident or on disk, or None: a snapshot lookup and one index row."""
        resident = self.pool.residents().get(aid)
        record = self.store.info(aid)
        if resident is not None and record is None and not self._unsaved_here(aid):
            resident = None  # a shared store's record was deleted by another node: so is the agent
        return _agent_info(aid, resident, record) if resident or record else None

    def _unsaved_here(self, aid: AgentId) -> bool:
        """Whether a resident agent without a record is simply not saved yet (always, in a
        store of one server); in a shared store only if this node never saw a record of it:
        else another node deleted it, and its RAM copy is only a stale one."""
        if not self.store.shared:
            return True
        version = self.store.version(aid)
        return version is None or version.etag is None

    def agents_page(self, after: AgentId | None = None, limit: int = 100) -> AgentPage:
        """Up to ``limit`` agents with ids after ``after``, resident or on disk, in id order.

        Merges the store's page of records with the resident agents (some are not on
        disk yet): every record past the store's page sorts after all of it, and so does
        every resident agent past its last id, so neither can be in this page. While
        requests are in flight it is paced (``listing_share``)."""
        started = time.perf_counter()
        records, more = self.store.page(after, limit)
        residents = {a: r for a, r in self.pool.residents().items() if after is None or a > after}
        if more:
            residents = {a: r for a, r in residents.items() if a <= records[-1].agent_id}
        by_id: dict[str, RecordInfo] = {r.agent_id: r for r in records}
        residents = {a: r for a, r in residents.items() if a in by_id or self._unsaved_here(_resident(a))}
        ids = sorted(by_id.keys() | residents.keys())
        data = [_agent_info(_resident(a), residents.get(a), by_id.get(a)) for a in ids[:limit]]
        if self._lent:  # agents are generating: let them have the machine
            time.sleep((time.perf_counter() - started) * (1 / self.listing_share - 1))
        return AgentPage(data, more or len(ids) > limit)

    def residency(self) -> Residency:
        """Agents in RAM and in the store, with their bytes: a snapshot of the pool and one
        aggregate query of the store's index (any thread)."""
        residents = self.pool.residents()
        index = self.store.open_index()
        store_agents, store_bytes = index.totals() if index is not None else (0, 0)
        return Residency(len(residents), sum(r.ram_bytes for r in residents.values()), store_agents, store_bytes)

    def shared_prefixes(self) -> dict[str, list[str]]:
        """Each shared prefix on disk and the agents marked as its users."""
        return {pid: self.shared.users(pid) for pid in self.shared.on_disk()}

    def close(self) -> None:
        """Let every save end (failed ones included), then stop the I/O thread."""
        for fut in list(self._saves.values()):
            fut.exception()
        self._io.shutdown()
        self._reader.shutdown()
        if self._probe is not None:
            self._probe.shutdown()
        self.store.close()


def _agent_info(aid: AgentId, resident: Resident | None, record: RecordInfo | None) -> AgentInfo:
    """What a listing says of an agent: its RAM state if resident, its record's otherwise."""
    return AgentInfo(
        agent_id=aid,
        tokens=resident.tokens if resident else record.tokens if record else 0,
        ram_bytes=resident.ram_bytes if resident else 0,
        disk_bytes=record.disk_bytes if record else 0,
        last_used=resident.last_used if resident else record.mtime if record else None,
        resident=resident is not None,
    )
