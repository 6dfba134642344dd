"""Records in a remote object store (``s3://bucket/prefix``), with a local read-through cache.

``RecordStore`` keeps records in a directory; ``RemoteRecordStore`` keeps the same bytes
under the same keys (``<fingerprint[:16]>/<agent id>.safetensors``) in a ``Backend``
(``kvshelf.storage.objects.ObjectBackend`` for S3), so copying an object between a
directory and a bucket moves a record between them. It has the same public methods and
the same rules for shared stores (see ``records``): a save is a conditional PUT
(``create`` for a new agent, ``If-Match`` with the ETag last read or written for an
update; a refusal is ``StaleWrite``), a delete is a tombstone written the same way,
``is_current`` is one HEAD.

The node's local directory is a read-through cache in front of the remote store: every
record read or written is also kept there with the ETag it had, and a load asks the
remote store for the object only ``If-None-Match`` that ETag, so an unchanged record
costs one round trip and no transfer. The cache is never the truth: whatever the remote
store says wins, and a local copy that cannot be read is simply fetched again.

Listing pages through the object listing (no SQLite index: ``kvshelf.storage.index`` is
a local-directory thing) and reads each record's header with one ranged GET. Pages
follow key order, which is id order except that an id with ``-`` where another has its
end sorts first (``a-b`` before ``a``); each agent is still listed exactly once.
Shared prefixes (``fork``'s) stay node-local, so a remote store's forks copy their
blocks instead of sharing them (``shares_prefixes``).
"""

from __future__ import annotations

import errno
import logging
import secrets
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from kvshelf.errors import RecordRejected, StaleWrite, StorageError
from kvshelf.kv.record import CacheRecord
from kvshelf.storage import codec
from kvshelf.storage.agent_id import AgentId, id_path
from kvshelf.storage.backend import NOT_MODIFIED, Backend, Blob, Changed, Head
from kvshelf.storage.counters import StoreCounters
from kvshelf.storage.files import FileBackend, read_file
from kvshelf.storage.records import RECORD_SUFFIX, RecordInfo, RecordStore, Version, _id_of, _safe_name

__all__ = ["RemoteRecordStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_ABSENT = Version(None, 0)
# The first ranged read of a header: a record's header is a few KB (a checksum per tensor).
_HEADER_PROBE = 64 * 1024
_DELETE_ATTEMPTS = 8


class RemoteRecordStore(RecordStore):
    """Per-agent records of one model in a remote ``backend``, cached under ``cache_root``."""

    shares_prefixes = False

    def __init__(
        self,
        backend: Backend,
        cache_root: Path,
        model_fingerprint: str,
        *,
        shared: bool = False,
        node_id: str | None = None,
        counters: StoreCounters | None = None,
        lock_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            cache_root,
            model_fingerprint,
            lock_timeout=lock_timeout,
            indexed=False,
            shared=shared,
            node_id=node_id,
            counters=counters,
        )
        self.backend = backend
        self.cache = FileBackend(Path(cache_root), lock_timeout=lock_timeout)
        self._folder = self.model_fingerprint[:16]

    def __repr__(self) -> str:
        return f"RemoteRecordStore({self.backend.url!r}, cache={str(self.directory)!r})"

    @property
    def url(self) -> str:
        return self.backend.url

    # -- keys and round trips --------------------------------------------------------
    def key_for(self, agent_id: str) -> str:
        """The agent's key in the backend (and in the local cache): a pure function of the id."""
        return f"{self._folder}/{_id_of(self.path_for(agent_id))}{RECORD_SUFFIX}"

    def _call(self, what: Callable[..., T], *args: Any) -> T:
        """One round trip to the remote store, counted (a failure too)."""
        self.counters.add("round_trips")
        try:
            return what(*args)
        except StorageError:
            self.counters.add("failures")
            raise

    def _stamped(self, key: str) -> tuple[int, codec.Stamp, Head] | None:
        """Token count, stamp and head of the object at ``key`` from its header (one or two
        ranged reads); None if there is none. An unusable header reads as a live record of
        generation 0 with no tokens (a load quarantines it)."""
        got = self._call(self.backend.get_prefix, key, _HEADER_PROBE)
        if got is None:
            return None
        prefix, head = got
        try:
            found = codec.header_of(prefix, head.size, self.model_fingerprint)
            if isinstance(found, int):
                got = self._call(self.backend.get_prefix, key, found)
                if got is None:
                    return None
                prefix, head = got
                found = codec.header_of(prefix, head.size, self.model_fingerprint)
            if isinstance(found, int):
                raise RecordRejected("the header changed while it was read")
        except RecordRejected:
            return 0, codec.Stamp(0, None, False), head
        return found[0], found[1], head

    # -- the local cache ---------------------------------------------------------------
    def _etag_file(self, agent_id: AgentId) -> Path:
        return id_path(self.directory, agent_id, ".etag").with_name(f".{agent_id}.etag")

    def _cached(self, agent_id: AgentId) -> str | None:
        """The remote ETag of the local copy, if there is a local copy."""
        try:
            return self._etag_file(agent_id).read_text(encoding="ascii").strip() or None
        except OSError:
            return None

    def _keep(self, agent_id: AgentId, key: str, chunks: Sequence[bytes | bytearray | memoryview], etag: str) -> None:
        """Keep a copy of the record in the local cache, with its remote ETag (best effort:
        a cache that cannot be written only costs transfers)."""
        try:
            self._drop_copy(agent_id)
            self.cache.overwrite(key, chunks)
            self._etag_file(agent_id).write_text(etag, encoding="ascii")
        except (OSError, StorageError) as exc:
            log.warning(
                "kvshelf: cannot keep a local copy of agent %r's record (%s); it is read remotely", agent_id, exc
            )

    def _drop_copy(self, agent_id: AgentId) -> None:
        for path in (self._etag_file(agent_id), self.path_for(agent_id)):
            with suppress(FileNotFoundError):
                path.unlink()

    # -- records -----------------------------------------------------------------------
    def save(self, agent_id: str, record: CacheRecord) -> int:
        """Write the agent's record (conditional in a shared store); returns the bytes written."""
        aid = _id_of(self.path_for(agent_id))
        key = self.key_for(aid)
        self._ensure_directory()  # the local cache (and the before_write hook)
        known = self.version(aid)
        if known is None:
            known = self._learn_remote(aid, key)
        chunks = self._encode(record, aid, known)
        try:
            if self.shared:
                head = self._call(self.backend.put, key, chunks, known.etag)
            else:
                head = self._call(self.backend.overwrite, key, chunks)
        except Changed:
            raise self._refused_remote(aid, key, known) from None
        self._remember(aid, Version(head.etag, known.generation + 1))
        self._keep(aid, key, chunks, head.etag)
        return sum(len(memoryview(c)) for c in chunks)

    def _learn_remote(self, aid: AgentId, key: str) -> Version:
        """As ``RecordStore._learn``: what a save of an agent never read is conditional on."""
        found = self._stamped(key)
        if found is None:
            return _ABSENT
        _, stamp, head = found
        if stamp.tombstone or not self.shared:
            return Version(head.etag, stamp.generation)
        raise self._refused_remote(aid, key, None)

    def _refused_remote(self, aid: AgentId, key: str, known: Version | None) -> StaleWrite:
        self.counters.add("refused_writes")
        self.forget_version(aid)
        try:
            found = self._stamped(key)
        except StorageError:
            found = None
        held = f"generation {known.generation}" if known is not None else "no record of it"
        if found is None:
            what = "its record was removed"
        else:
            stamp = found[1]
            by = f" by node {stamp.node_id!r}" if stamp.node_id else ""
            what = f"{'it was deleted' if stamp.tombstone else 'it was written'} at generation {stamp.generation}{by}"
        return StaleWrite(
            errno.ESTALE,
            f"not saving agent {aid!r}: its record changed since this node read it ({what}; this node held {held})",
            f"{self.backend.url}/{key}",
        )

    def load(self, agent_id: str) -> CacheRecord | None:
        """The agent's record, or None (no record, a tombstone, or an unusable record,
        which is quarantined). One round trip, with no transfer when the local copy is current."""
        path = self.path_for(agent_id)
        aid = _id_of(path)
        key = self.key_for(aid)
        cached = self._cached(aid) if path.exists() else None
        got = self._call(self.backend.get, key, cached)
        if got == NOT_MODIFIED:
            try:
                data, _ = read_file(path)
            except OSError:  # the copy went: fetch the record itself
                got = self._call(self.backend.get, key, None)
            else:
                got = Blob(data, Head(str(cached), len(data), 0.0))
                fresh = False
        else:
            fresh = True
        if got is None or got == NOT_MODIFIED:
            self._drop_copy(aid)
            self._remember(aid, _ABSENT)
            return None
        assert isinstance(got, Blob)
        buffer = got.data if isinstance(got.data, bytearray) else bytearray(got.data)
        try:
            decoded = codec.decode(buffer, self.model_fingerprint)
        except RecordRejected as rejected:
            self._quarantine_remote(aid, key, buffer, got.head.etag, rejected.reason)
            return None
        stamp = decoded.stamp
        self._remember(aid, Version(got.head.etag, stamp.generation))
        if stamp.tombstone:
            self._drop_copy(aid)
            return None
        if fresh:
            self._keep(aid, key, [buffer], got.head.etag)
        if self.shared and stamp.node_id is not None and stamp.node_id != self.node_id:
            self.counters.add("takeovers")
        return self._ours(aid, path, decoded)

    def _quarantine_remote(self, aid: AgentId, key: str, data: bytearray, etag: str, reason: str) -> str | None:
        """Copy an unusable record aside (``quarantine/`` beside the records, with a reason)
        and put a tombstone in its place, if it is still the bytes judged; never delete it."""
        when = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        target = f"quarantine/{self._folder}/{aid}.{when}.{secrets.token_hex(4)}"
        note = f"agent: {aid}\nreason: {reason}\nmoved from: {self.backend.url}/{key}\nquarantined at: {when}\n"
        try:
            self._call(self.backend.overwrite, target + RECORD_SUFFIX, [data])
            self._call(self.backend.overwrite, target + ".reason", [note.encode()])
            known = self.version(aid)
            generation = (known.generation if known is not None else 0) + 1
            tomb = codec.encode_tombstone(aid, self.model_fingerprint, generation, self.node_id)
            head = self._call(self.backend.put, key, tomb, etag)
            self._remember(aid, Version(head.etag, generation))
        except Changed:
            log.warning("kvshelf: agent %r's record changed while it was quarantined; the newer one stays", aid)
            self.forget_version(aid)
            return None
        except StorageError as exc:
            log.error("kvshelf: agent %r's record is unusable (%s) and could not be quarantined (%s)", aid, reason, exc)
            return None
        self._drop_copy(aid)
        log.warning(
            "kvshelf: the record of agent %r was rejected (%s); moved to %s/%s and will be recomputed",
            aid,
            reason,
            self.backend.url,
            target + RECORD_SUFFIX,
        )
        return target + RECORD_SUFFIX

    def quarantine(self, agent_id: str, reason: str) -> Path | None:
        aid = _id_of(self.path_for(agent_id))
        key = self.key_for(aid)
        got = self._call(self.backend.get, key, None)
        if not isinstance(got, Blob):
            return None
        moved = self._quarantine_remote(aid, key, bytearray(got.data), got.head.etag, reason)
        return Path(moved) if moved is not None else None

    def delete(self, agent_id: str) -> list[Path]:
        """Erase the agent: a tombstone in a shared store (as ``RecordStore.delete``), the
        object itself otherwise; the local copy goes either way. Returns the keys removed."""
        aid = _id_of(self.path_for(agent_id))
        key = self.key_for(aid)
        self._ensure_directory()
        try:
            if not self.shared:
                found = self._call(self.backend.head, key)
                self._call(self.backend.delete, key)
                return [Path(key)] if found is not None else []
            for _ in range(_DELETE_ATTEMPTS):  # a delete is never refused: retried while writers race it
                stamped = self._stamped(key)
                if stamped is not None and stamped[1].tombstone:
                    self._remember(aid, Version(stamped[2].etag, stamped[1].generation))
                    return []
                known = self.version(aid)
                generation = max(stamped[1].generation if stamped else 0, known.generation if known else 0) + 1
                tomb = codec.encode_tombstone(aid, self.model_fingerprint, generation, self.node_id)
                try:
                    head = self._call(self.backend.put, key, tomb, stamped[2].etag if stamped else None)
                except Changed:
                    continue
                self._remember(aid, Version(head.etag, generation))
                return [Path(key)] if stamped is not None else []
            raise StorageError(errno.EAGAIN, f"could not delete agent {aid!r}: its record kept changing", key)
        finally:
            self._drop_copy(aid)

    # -- versions and metadata ---------------------------------------------------------
    def is_current(self, agent_id: str) -> bool:
        """Whether the remote record is still the one last read or written here: one HEAD."""
        aid = _id_of(self.path_for(agent_id))
        known = self.version(aid)
        head = self._call(self.backend.head, self.key_for(aid))
        return known is not None and (head.etag if head is not None else None) == known.etag

    def has_record(self, agent_id: str) -> bool:
        return self.info(agent_id) is not None

    def probe(self) -> None:
        """One listing request: the bucket answers and these credentials may read it."""
        self._ensure_directory()
        self._call(lambda: next(iter(self.backend.list(self._folder + "/", None)), None))

    def info(self, agent_id: str) -> RecordInfo | None:
        aid = _id_of(self.path_for(agent_id))
        stamped = self._stamped(self.key_for(aid))
        if stamped is None or stamped[1].tombstone:
            return None
        return RecordInfo(aid, stamped[0], stamped[2].size, stamped[2].mtime)

    def size_on_disk(self, agent_id: str) -> int:
        found = self.info(agent_id)
        return found.disk_bytes if found is not None else 0

    def mtime(self, agent_id: str) -> float | None:
        found = self.info(agent_id)
        return found.mtime if found is not None else None

    def token_count(self, agent_id: str) -> int:
        found = self.info(agent_id)
        return found.tokens if found is not None else 0

    def page(self, after: str | None = None, limit: int = 100) -> tuple[list[RecordInfo], bool]:
        """Up to ``limit`` records after ``after`` and whether more follow, paged through the
        object listing (key order: see the module docstring), one ranged GET per record."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        folder = self._folder + "/"
        offset = self.key_for(after) if after is not None else None
        found: list[RecordInfo] = []
        pages = self.backend.list(folder, offset)
        while True:
            try:
                self.counters.add("round_trips")
                chunk = next(pages)
            except StopIteration:
                return found, False
            except StorageError:
                self.counters.add("failures")
                raise
            for key, _ in chunk:
                name = key[len(folder) :]
                if not key.startswith(folder) or not name.endswith(RECORD_SUFFIX):
                    continue
                candidate = name[: -len(RECORD_SUFFIX)]
                if not _safe_name(candidate):
                    continue
                stamped = self._stamped(key)
                if stamped is None or stamped[1].tombstone:
                    continue
                if len(found) == limit:
                    return found, True
                found.append(RecordInfo(str.__new__(AgentId, candidate), stamped[0], stamped[2].size, stamped[2].mtime))

    def agent_ids(self) -> list[AgentId]:
        """Ids of every agent with a record (the whole listing: for large stores, use ``page``)."""
        ids: list[AgentId] = []
        after: str | None = None
        while True:
            infos, more = self.page(after, 1000)
            ids += [i.agent_id for i in infos]
            if not more or not infos:
                return sorted(ids)
            after = infos[-1].agent_id

    def open_index(self) -> None:
        """No SQLite index for a remote store: listings page through the object listing."""
        return None
