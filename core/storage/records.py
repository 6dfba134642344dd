"""On-disk records: one safetensors file per agent per model.

Every agent's quantized KV cache lives in RAM; this module is what survives a
restart. ``kvshelf.storage.codec`` turns a record into verified bytes and back;
this module keeps those bytes on disk. The design follows from three facts:

* A record is only worth anything if it is *exactly* what was saved. A stale,
  torn or foreign record silently fed to the model would produce wrong text,
  whereas a missing record only costs a recompute. So any doubt (the codec's
  ``RecordRejected``) turns the record into "absent" (``load`` returns ``None``)
  after moving the file aside into ``quarantine/`` for a person to look at.
  Nothing is ever deleted silently.
* Several processes may share one store directory (a server and a CLI, two
  workers). Writes therefore go to a temp file that is fsynced and then
  ``os.replace``-d onto the final name, so a reader sees either the old or the
  new record, never a mix; and an inter-process file lock per agent keeps a
  save, load or delete of one agent from interleaving with another's.
* Records are 10-20 MB and are written on every turn, so the codec's chunks
  (tensors borrowed from MLX's memory) are written as they are, and a file is
  read back with one read into a buffer.

* A save costs the same beside 10 agents' files or 100,000: it touches only its
  own agent's names (record, lock, and one temp file whose name is a function of
  the id, so a crashed writer's leftover is simply replaced by the next save and
  removed by a delete). Nothing on a turn's path lists the directory; temp files
  of writers that died are swept once, when the store is opened, by the pass that
  reconciles the metadata index (``kvshelf.storage.index``) with the records.
  Listing and one agent's metadata come from that index, never from a scan.

An agent id becomes a file name in one place, ``agent_id.id_path``, which is
also where the store checks it: every public method builds its path first, so
a bad id raises InvalidAgentId before the disk is touched. Record paths are a
pure function of the id (``<directory>/<id>.safetensors``): a flat directory
costs nothing per save on the file systems measured (``benchmarks/store_scale.py``
puts 100,000 agents' files beside the one saved), so the layout stays as it was
and every existing store opens unchanged.

Shared stores
-------------
Several nodes (``kvshelf serve --shared``) may serve from one store, a directory on an
NFS or SMB mount here. None of them claims it as a whole (``kvshelf.storage.exclusive``
is for a store of one server); instead each agent has one writer at a time, and the
store enforces it:

* every record header carries a ``generation`` (writes of the agent so far) and the
  writer's node id (``codec.Stamp``; older records read as generation 0);
* the store remembers, per agent, the ``Version`` it last read or wrote: the record
  file's identity (``_etag``) and its generation. A save takes the agent's lock only for
  its compare-and-write: it looks at the file again, refuses with ``StaleWrite`` if it is
  not the one remembered, and renames the new record in. A load takes no lock at all.
  So no lock is held across turns, and a node that is paused (SIGSTOP) or cut off holds
  up no one; when it comes back its writes are refused, never written over newer ones;
* ``is_current`` (one ``stat``) tells a node whether its RAM copy is still what the
  store holds, before it reuses it;
* a delete replaces the record with a tombstone (the id, a generation above all earlier
  ones, no tokens), which every older writer's compare then fails on. A node that reads
  the tombstone (a fresh conversation under the same id) writes above it.

A store opened without ``shared`` behaves as before: saves are not conditional (two
engines on one directory, last writer wins) and a delete removes every file.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

import filelock

from kvshelf.errors import RecordRejected, StaleWrite, StorageError
from kvshelf.kv.record import CacheRecord
from kvshelf.storage import codec
from kvshelf.storage.agent_id import AgentId, id_path, is_valid_agent_id
from kvshelf.storage.counters import StoreCounters
from kvshelf.storage.files import etag_of
from kvshelf.storage.files import fsync_file as _fsync_file
from kvshelf.storage.files import read_file as _read_file
from kvshelf.storage.files import write_all as _write_all
from kvshelf.storage.index import AgentIndex, Row

__all__ = ["RecordInfo", "RecordStore", "Version"]

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIRNAME = "quarantine"

# A temp file this old belongs to a writer that died (a save takes well under a
# second); younger ones are left alone in case a writer is still busy with it.
STALE_TEMP_SECONDS = 600.0
_HEX = re.compile(r"[0-9a-fA-F]+")
# Why a lock file could not be made or opened when the store cannot be written at all.
_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# Temp files of earlier versions had a random part: ".<id>.<32 hex>.tmp".
_LEGACY_TEMP = re.compile(r"\.(.+)\.[0-9a-f]{32}\.tmp")
# What an id read back from the index must look like before it names a file (agent_id's whitelist).
_ROW_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


class Version(NamedTuple):
    """What this node last saw of one agent's record, which its next write is conditional on."""

    etag: str | None
    """The store's tag of the record's bytes (on a filesystem the file's identity, see
    ``_etag``; on S3 its ETag); None where there was no record."""
    generation: int
    """The generation in the record's header (0 for none, or a record older than generations)."""


_ABSENT = Version(None, 0)


_etag = etag_of


@dataclass(frozen=True)
class RecordInfo:
    """What a listing shows of one record, from the store's index (checked against the file)."""

    agent_id: AgentId
    tokens: int
    disk_bytes: int
    mtime: float


# --------------------------------------------------------------------------
# Filesystem helpers


# --------------------------------------------------------------------------
# The store


class RecordStore:
    """Per-agent records of one model under ``root/<fingerprint[:16]>/``.

    Layout of that directory::

        <agent_id>.safetensors   the record
        <agent_id>.lock          its inter-process lock file
        .<agent_id>.tmp          a save in progress (or left by a crashed writer)
        .index.sqlite3[-wal|-shm] the metadata index (``kvshelf.storage.index``)
        quarantine/              rejected records and their .reason files
    """

    shares_prefixes = True
    """Whether records may start on a shared prefix (``kvshelf.storage.prefixes``), which
    lives beside a directory store; a remote store's forks copy their blocks instead."""

    def __init__(
        self,
        root: Path,
        model_fingerprint: str,
        *,
        lock_timeout: float = 60.0,
        indexed: bool = True,
        shared: bool = False,
        node_id: str | None = None,
        counters: StoreCounters | None = None,
    ) -> None:
        """``model_fingerprint`` must be a hex digest (e.g. sha256) of the model.

        ``lock_timeout`` bounds how long save/load/delete wait for another
        process's hold on the same agent before raising StorageError.
        ``indexed``: keep the metadata index that ``info`` and ``page`` serve from
        (a store that is never listed page by page, like the shared prefixes', needs none).
        ``shared``: many nodes serve from this store (see "Shared stores" below), and
        ``node_id`` names this one in the records it writes.
        """
        if (
            not isinstance(model_fingerprint, str)
            or len(model_fingerprint) < 16
            or not _HEX.fullmatch(model_fingerprint)
        ):
            raise ValueError(
                "model_fingerprint must be a hex digest of at least 16 characters "
                f"(e.g. hashlib.sha256(...).hexdigest()), got {model_fingerprint!r:.80}"
            )
        self.model_fingerprint = model_fingerprint.lower()
        self.root = Path(root)
        self.directory = self.root / self.model_fingerprint[:16]
        self.quarantine_dir = self.directory / QUARANTINE_DIRNAME
        self.lock_timeout = lock_timeout
        self.before_write: Callable[[], None] | None = None
        """Run before the store creates its directory or takes a lock to write (and so
        before every save, delete and quarantine): ``kvshelf serve`` sets its owner
        check here (``kvshelf.storage.exclusive``), which raises StorageError once the
        directory it claimed is gone, so that a save never recreates it."""
        self.indexed = indexed
        self.shared = shared
        self.node_id = node_id
        self.counters = counters if counters is not None else StoreCounters()
        """Round trips, failures, takeovers and refused writes (``kvshelf.storage.counters``)."""
        self._versions: dict[str, Version] = {}
        self._versions_lock = threading.Lock()
        self._directory_name = str(self.directory)
        self._index: AgentIndex | None = None
        self._index_lock = threading.Lock()
        self._index_closed = False

    def __repr__(self) -> str:
        return f"RecordStore({str(self.directory)!r})"

    # -- paths ---------------------------------------------------------------

    def path_for(self, agent_id: str) -> Path:
        """The record path of ``agent_id``; raises InvalidAgentId for a bad id.

        Besides the id's check (``id_path``), the resolved path must sit directly
        inside the store directory, so a symlink planted at the record's name
        cannot make a load read (or a quarantine move) a file elsewhere.
        """
        path = id_path(self.directory, agent_id, RECORD_SUFFIX)
        if path.resolve().parent != self.directory.resolve():
            raise StorageError(
                errno.EPERM,
                f"refusing to use the record of agent {_id_of(path)!r}: it links outside the store",
                str(path),
            )
        return path

    def _lock_path(self, agent_id: str) -> Path:
        return id_path(self.directory, agent_id, LOCK_SUFFIX)

    def _ensure_directory(self) -> None:
        if self.before_write is not None:
            self.before_write()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            message = f"cannot create the store directory: {exc.strerror}"
            raise StorageError(exc.errno, message, str(self.directory)) from exc

    # -- locking -------------------------------------------------------------

    def lock(self, agent_id: str) -> filelock.BaseFileLock:
        """The inter-process lock of one agent, usable as ``with store.lock(id):``.

        It is reentrant in a thread (the store's own methods may be called while
        it is held) and shared by every RecordStore of the process for that path.
        A plain ``with`` waits indefinitely; use ``.acquire(timeout=...)`` to bound it.
        """
        path = self._lock_path(agent_id)  # checks the id before the directory is made
        self._ensure_directory()
        return filelock.FileLock(path, is_singleton=True)

    def _acquire(self, lock: filelock.BaseFileLock, agent_id: str) -> None:
        """Take ``lock`` within ``lock_timeout``; failing that, a StorageError that says why
        (``ETIMEDOUT``, or the errno of the OSError behind it, which is its ``__cause__``)."""
        try:
            lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as exc:
            raise StorageError(
                errno.ETIMEDOUT,
                f"timed out after {self.lock_timeout}s waiting for the lock of agent {agent_id!r}",
                str(lock.lock_file),
            ) from exc
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot lock agent {agent_id!r}: {exc}", str(lock.lock_file)) from exc

    @contextmanager
    def _held(self, agent_id: str) -> Iterator[filelock.BaseFileLock]:
        lock = self.lock(agent_id)
        self._acquire(lock, agent_id)
        try:
            yield lock
        finally:
            lock.release()

    # -- public operations ---------------------------------------------------

    def save(self, agent_id: str, record: CacheRecord) -> int:
        """Atomically replace the agent's record; returns the bytes written.

        Raises ValueError/TypeError for a malformed record (nothing is written)
        and StorageError when the filesystem fails, in which case the previous
        record is left exactly as it was.
        """
        path = self.path_for(agent_id)
        agent_id = _id_of(path)
        known = self.version(agent_id)
        chunks = self._encode(record, agent_id, known) if known is not None else None
        try:
            with self._held(agent_id):
                if self.shared or known is None:  # the compare of the compare-and-write, under the lock
                    st = self._stat(path)
                    if known is None:
                        known = self._learn(agent_id, path, st)
                        chunks = self._encode(record, agent_id, known)
                    if self.shared and (_etag(st) if st is not None else None) != known.etag:
                        raise self._refused(agent_id, path, known)
                assert chunks is not None
                written, st = self._write_atomically(agent_id, path, chunks)
                self._remember(agent_id, Version(_etag(st), known.generation + 1))
                if (index := self.open_index()) is not None:
                    index.put(Row(agent_id, len(record.tokens), st.st_size, st.st_mtime_ns))
        except StaleWrite:
            self.counters.add("round_trips")
            raise
        except StorageError:
            self.counters.add("round_trips")
            self.counters.add("failures")
            raise
        self.counters.add("round_trips")
        return written

    # -- versions (shared stores) ----------------------------------------------------

    def version(self, agent_id: str) -> Version | None:
        """What this store last read or wrote of the agent's record (None: nothing yet)."""
        with self._versions_lock:
            return self._versions.get(agent_id)

    def forget_version(self, agent_id: str) -> None:
        """Drop what this store knows of the agent's record, when its RAM copy goes: the
        next load learns it again, so this table holds only the agents in use."""
        with self._versions_lock:
            self._versions.pop(agent_id, None)

    def _remember(self, agent_id: str, version: Version) -> None:
        with self._versions_lock:
            self._versions[agent_id] = version

    def _encode(self, record: CacheRecord, agent_id: AgentId, known: Version) -> list[memoryview | bytes]:
        return codec.encode(
            record, agent_id, self.model_fingerprint, generation=known.generation + 1, node_id=self.node_id
        )

    def _stat(self, path: Path) -> os.stat_result | None:
        try:
            return os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot read the state of {path.name}: {exc.strerror}", str(path)) from exc

    def _header(self, path: Path) -> codec.Stamp | None:
        """The stamp of the record at ``path`` from its header; None if there is none or it
        is unusable (a load quarantines it)."""
        try:
            with open(path, "rb") as file:
                return codec.read_header(file, os.fstat(file.fileno()).st_size, self.model_fingerprint)[1]
        except (OSError, RecordRejected):
            return None

    def _learn(self, agent_id: AgentId, path: Path, st: os.stat_result | None) -> Version:
        """The version a save of an agent this store never read is conditional on (lock held):
        none if there is no record, a tombstone's (a new conversation after a delete starts
        above it), and a refusal in a shared store if a live record is there, which this
        node's state was not built on."""
        if st is None:
            return _ABSENT
        stamp = self._header(path)
        if stamp is None or stamp.tombstone or not self.shared:
            return Version(_etag(st), stamp.generation if stamp is not None else 0)
        raise self._refused(agent_id, path, None)

    def _refused(self, agent_id: AgentId, path: Path, known: Version | None) -> StaleWrite:
        """The error of a refused write (lock held), saying what the store holds instead."""
        self.counters.add("refused_writes")
        self.forget_version(agent_id)
        stamp = self._header(path)
        held = f"generation {known.generation}" if known is not None else "no record of it"
        if stamp is None:
            found = "its record was removed or is unreadable"
        else:
            by = f" by node {stamp.node_id!r}" if stamp.node_id else ""
            found = f"{'it was deleted' if stamp.tombstone else 'it was written'} at generation {stamp.generation}{by}"
        return StaleWrite(
            errno.ESTALE,
            f"not saving agent {agent_id!r}: its record changed since this node read it ({found}; "
            f"this node held {held})",
            str(path),
        )

    def is_current(self, agent_id: str) -> bool:
        """Whether the agent's record is still the one this store last read or wrote: one
        ``stat``, no read. What a node asks before it reuses its RAM copy of an agent."""
        path = self.path_for(agent_id)
        known = self.version(_id_of(path))
        self.counters.add("round_trips")
        try:
            st = self._stat(path)
        except StorageError:
            self.counters.add("failures")
            raise
        return known is not None and (_etag(st) if st is not None else None) == known.etag

    def probe(self) -> None:
        """One round trip that proves the store can be written (here: its directory made);
        StorageError otherwise."""
        self._ensure_directory()

    def has_record(self, agent_id: str) -> bool:
        """Whether the agent has a record (a delete's tombstone is none)."""
        path = self.path_for(agent_id)
        if not path.exists():
            return False
        if not self.shared:
            return True
        stamp = self._header(path)
        return stamp is None or not stamp.tombstone

    def load(self, agent_id: str) -> CacheRecord | None:
        """The agent's record, or None when there is none or it was unusable.

        An unusable record (truncated, corrupted, foreign model, unknown format,
        ...) is moved to ``quarantine_dir`` with a ``.reason`` file and a
        warning is logged. Raises StorageError only when the file exists but
        cannot be read (permissions, I/O error) or the lock cannot be taken in time.

        A read needs no write: where the agent's lock file cannot be created or
        opened (a read-only store, a directory this process may not write), the
        record is read without the lock, which is safe because writers replace a
        record atomically, and a reason is logged. What cannot be read then is a
        cache miss (None, logged), so the agent is served cold rather than refused.
        """
        path = self.path_for(agent_id)
        agent_id = _id_of(path)
        if self.shared:
            return self._load_shared(agent_id, path)
        if not path.exists():  # no lock file is created for agents never saved
            self._remember(agent_id, _ABSENT)
            return None
        lock = self.lock(agent_id)
        try:
            self._acquire(lock, agent_id)
        except StorageError as exc:
            if exc.errno not in _NOT_WRITABLE:
                raise
            return self._load_unlocked(agent_id, path, exc.__cause__ if isinstance(exc.__cause__, OSError) else exc)
        try:
            read = self._read(agent_id, path)
            if read is None:
                return None
            try:
                decoded = codec.decode(read[0], self.model_fingerprint)
            except RecordRejected as rejected:
                self._quarantine(agent_id, path, rejected.reason)
                return None
            self._remember(agent_id, Version(_etag(read[1]), decoded.stamp.generation))
        finally:
            lock.release()
        return self._ours(agent_id, path, decoded)

    def _load_shared(self, agent_id: AgentId, path: Path) -> CacheRecord | None:
        """``load`` in a shared store: no lock (writers replace records atomically, and a
        SIGSTOPped node must not hold up the others), and the version read is remembered
        from the very file read. A tombstone reads as no record."""
        self.counters.add("round_trips")
        try:
            read = self._read(agent_id, path)
        except StorageError:
            self.counters.add("failures")
            raise
        if read is None:
            self._remember(agent_id, _ABSENT)
            return None
        buffer, st = read
        try:
            decoded = codec.decode(buffer, self.model_fingerprint)
        except RecordRejected as rejected:
            with self._held(agent_id):  # only the bytes judged: a newer record stays where it is
                current = self._stat(path)
                if current is not None and _etag(current) == _etag(st):
                    self._quarantine(agent_id, path, rejected.reason)
            self.forget_version(agent_id)
            return None
        stamp = decoded.stamp
        self._remember(agent_id, Version(_etag(st), stamp.generation))
        if stamp.tombstone:
            return None
        if stamp.node_id is not None and stamp.node_id != self.node_id:
            self.counters.add("takeovers")
        return self._ours(agent_id, path, decoded)

    def _load_unlocked(self, agent_id: AgentId, path: Path, why: OSError) -> CacheRecord | None:
        """``load`` where the agent's lock cannot be taken because the store is not writable."""
        logger.warning(
            "kvshelf: cannot take the lock of agent %r (%s); reading its record without it, "
            "as nothing can write to this store either",
            agent_id,
            why.strerror or why,
        )
        try:
            read = self._read(agent_id, path)
        except StorageError:
            return None  # logged by _read: the agent starts cold
        if read is None:
            return None
        try:
            decoded = codec.decode(read[0], self.model_fingerprint)
        except RecordRejected as rejected:
            self._quarantine(agent_id, path, rejected.reason)  # logs that it could not move it
            return None
        return self._ours(agent_id, path, decoded)

    def _read(self, agent_id: AgentId, path: Path) -> tuple[bytearray, os.stat_result] | None:
        try:
            return _read_file(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.error("kvshelf: cannot read the record of agent %r at %s: %s", agent_id, path, exc)
            message = f"cannot read the record of agent {agent_id!r}: {exc.strerror}"
            raise StorageError(exc.errno, message, str(path)) from exc

    def _ours(self, agent_id: AgentId, path: Path, decoded: codec.Decoded) -> CacheRecord | None:
        if decoded.agent_id != agent_id:
            # A valid record of another agent, e.g. "Alice" vs "alice" on a
            # case-insensitive filesystem: not corrupt, just not ours.
            logger.warning(
                "kvshelf: %s holds the record of agent %r, not %r; ignoring it (the next save replaces it)",
                path,
                decoded.agent_id,
                agent_id,
            )
            return None
        return decoded.to_record()

    def delete(self, agent_id: str) -> list[Path]:
        """Erase the agent: its record, lock file, temp files and quarantined records.

        This is the erasure of a person's data, so nothing of the agent stays:
        temp files that a crashed save left behind go however young they are (a
        live writer holds the lock we hold, so every one left is dead), and so do
        its quarantined records and their reason files (they hold its token ids).
        The lock file is kept when the caller itself holds the agent's lock around
        this call, so that its hold stays meaningful. Other agents' files,
        including ones whose id merely starts with this one, are never touched.
        Returns the paths removed.

        In a shared store the record is replaced by a tombstone instead (see "Shared
        stores"): the id and a generation above every earlier one, nothing of the
        conversation. A node still holding the agent then finds its write refused.
        """
        path = self.path_for(agent_id)
        agent_id = _id_of(path)
        if self.shared:
            return self._tombstone(agent_id, path)
        lock_path = self._lock_path(agent_id)
        temp = self._temp_path(agent_id)
        if not (path.exists() or lock_path.exists() or temp.exists() or self._quarantined(agent_id)):
            return []  # nothing to remove, and no lock file left behind by looking
        removed: list[Path] = []
        with self._held(agent_id) as lock:
            for victim in [path, temp, *self._quarantined(agent_id)]:
                with suppress(FileNotFoundError):
                    victim.unlink()
                    removed.append(victim)
            if (index := self.open_index()) is not None:
                index.remove(agent_id, erase=True)
            if lock.lock_counter == 1:  # our hold is the outermost one
                with suppress(FileNotFoundError):
                    lock_path.unlink()
                    removed.append(lock_path)
        if removed:
            self._fsync_directory()
        return removed

    def _tombstone(self, agent_id: AgentId, path: Path) -> list[Path]:
        """``delete`` in a shared store: a tombstone at the record's name, written under the
        agent's lock whatever the record was (a delete is final: it is never refused)."""
        removed: list[Path] = []
        self.counters.add("round_trips")
        try:
            with self._held(agent_id):
                st = self._stat(path)
                stamp = self._header(path) if st is not None else None
                known = self.version(agent_id)
                if stamp is not None and stamp.tombstone:
                    self._remember(agent_id, Version(_etag(st), stamp.generation) if st else _ABSENT)
                else:
                    generation = max(stamp.generation if stamp else 0, known.generation if known else 0) + 1
                    chunks = codec.encode_tombstone(agent_id, self.model_fingerprint, generation, self.node_id)
                    _, written = self._write_atomically(agent_id, path, chunks)
                    self._remember(agent_id, Version(_etag(written), generation))
                    if st is not None:
                        removed.append(path)
                for victim in [self._temp_path(agent_id), *self._quarantined(agent_id)]:
                    with suppress(FileNotFoundError):
                        victim.unlink()
                        removed.append(victim)
                if (index := self.open_index()) is not None:
                    index.remove(agent_id, erase=True)
        except StorageError:
            self.counters.add("failures")
            raise
        return removed

    def size_on_disk(self, agent_id: str) -> int:
        """Bytes of the agent's record on disk, 0 when there is none."""
        try:
            return self.path_for(agent_id).stat().st_size
        except FileNotFoundError:
            return 0

    def mtime(self, agent_id: str) -> float | None:
        """When the agent's record was last saved (``time.time()`` scale), None if absent."""
        try:
            return self.path_for(agent_id).stat().st_mtime
        except FileNotFoundError:
            return None

    def token_count(self, agent_id: str) -> int:
        """Tokens in the agent's record, read from its header alone; 0 if none.

        A cheap peek for listings: it trusts a header that passes its own
        checksum and fingerprint check but does not verify the tensor data (that
        is load's job), and it never quarantines anything.
        """
        path = self.path_for(agent_id)
        try:
            with open(path, "rb") as file:
                return codec.read_token_count(file, os.fstat(file.fileno()).st_size, self.model_fingerprint)
        except (OSError, RecordRejected):
            return 0

    def quarantine(self, agent_id: str, reason: str) -> Path | None:
        """Move the agent's record aside because the caller found it unusable.

        For records that pass every check here but do not fit the model's cache
        layout. Returns where the file went, None if there was no record.
        """
        path = self.path_for(agent_id)
        agent_id = _id_of(path)
        if not path.exists():
            return None
        with self._held(agent_id):
            return self._quarantine(agent_id, path, reason)

    # -- metadata (served from the index) ----------------------------------------------

    def open_index(self) -> AgentIndex | None:
        """The metadata index, opened (and reconciled in the background) on first use;
        None for a store without one or whose directory does not exist yet."""
        if self._index is None and self.indexed and not self._index_closed:
            with self._index_lock:
                if self._index is None and not self._index_closed and self.directory.is_dir():
                    self._index = AgentIndex(self.directory, self._scan)
        return self._index

    def info(self, agent_id: str) -> RecordInfo | None:
        """One agent's record metadata, None if it has no record: one index row and one
        ``stat``, however many agents the store holds."""
        aid = _id_of(self.path_for(agent_id))
        index = self.open_index()
        row = index.get(aid) if index is not None else None
        return self._checked(row or Row(aid, None, -1, -1), index)

    def page(self, after: str | None = None, limit: int = 100) -> tuple[list[RecordInfo], bool]:
        """Up to ``limit`` records with ids after ``after``, in id order, and whether more follow.

        A cursor, not an offset: walking pages with the last id of each lists every
        agent that stays in the store exactly once, however many are added or deleted
        meanwhile. Costs one index query and one ``stat`` per row, whatever the size
        of the store. Never call it on the decode thread: it waits for the index's
        reconcile pass after an open."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if after is not None:
            after = _id_of(id_path(self.directory, after, RECORD_SUFFIX))
        index = self.open_index()
        if index is None:
            return self._page_without_index(after, limit)
        found: list[RecordInfo] = []
        cursor: str | None = after
        while len(found) <= limit:  # stale rows are dropped: ask again until the page is full
            want = limit + 1 - len(found)
            rows = index.after(cursor, want)
            for row in rows:
                if (info := self._checked(row, index)) is not None:
                    found.append(info)
            if len(rows) < want:
                break
            cursor = rows[-1].agent_id
        return found[:limit], len(found) > limit

    def close(self) -> None:
        """Close the index (the records need no closing); listings after this scan the directory."""
        with self._index_lock:
            self._index_closed = True
            if self._index is not None:
                self._index.close()
                self._index = None

    def _page_without_index(self, after: str | None, limit: int) -> tuple[list[RecordInfo], bool]:
        ids = [a for a in self.agent_ids() if after is None or a > after]
        infos = [info for a in ids[: limit + 1] if (info := self._checked(Row(a, None, -1, -1), None)) is not None]
        return infos[:limit], len(ids) > limit

    def _checked(self, row: Row, index: AgentIndex | None) -> RecordInfo | None:
        """The row as it stands on disk: as stored if the file is unchanged, re-read if
        it changed, dropped (None) if it is gone or is not a plain record file."""
        name = row.agent_id
        if not _safe_name(name):  # a row's id becomes a path: nothing may escape
            if index is not None:
                index.remove(name)
            return None
        aid = str.__new__(AgentId, name)  # every row came from a checked id; this is the hot loop of a listing
        path = os.path.join(self._directory_name, name + RECORD_SUFFIX)  # (pathlib would be most of its cost)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            if index is not None and row.mtime_ns >= 0:  # (-1: there was no row)
                index.remove(aid, mtime_ns=row.mtime_ns)
            return None
        if row.tokens is None or st.st_size != row.size or st.st_mtime_ns != row.mtime_ns:
            row = self._header_row(aid, path)
            if row.size < 0:
                return None
            if row.tokens is not None and row.tokens < 0:  # a tombstone: no agent here
                if index is not None:
                    index.remove(aid)
                return None
            if index is not None:
                index.put(row)
        return RecordInfo(aid, row.tokens or 0, row.size, row.mtime_ns / 1e9)

    def _header_row(self, aid: AgentId, path: str) -> Row:
        """A fresh row from the record's header (tokens 0 when the header is unusable;
        load quarantines such a record; -1 for a tombstone). Size and mtime come from the
        same open file."""
        try:
            with open(path, "rb") as file:
                st = os.fstat(file.fileno())
                try:
                    tokens, stamp = codec.read_header(file, st.st_size, self.model_fingerprint)
                    if stamp.tombstone:
                        tokens = -1
                except RecordRejected:
                    tokens = 0
        except OSError:
            return Row(aid, None, -1, -1)
        return Row(aid, tokens, st.st_size, st.st_mtime_ns)

    def _scan(self) -> Iterator[Row]:
        """Every record file as a row (tokens, size and mtime unknown: read from its header
        when first listed), for the index's reconcile pass; sweeps the temp files of
        writers that died on the way (the only sweep there is). One directory listing,
        no ``stat`` per record."""
        deadline = time.time() - STALE_TEMP_SECONDS
        try:
            listing = os.scandir(self.directory)
        except OSError:
            return
        with listing:
            for entry in listing:
                name = entry.name
                try:
                    if name.endswith(RECORD_SUFFIX):
                        candidate = name[: -len(RECORD_SUFFIX)]
                        if _safe_name(candidate) and entry.is_file(follow_symlinks=False):
                            yield Row(candidate, None, 0, 0)
                    elif name.startswith(".") and name.endswith(TEMP_SUFFIX) and self._is_temp_name(name):
                        if entry.stat(follow_symlinks=False).st_mtime < deadline:
                            os.unlink(entry.path)
                            logger.info("kvshelf: removed %s, left by a save that did not finish", entry.path)
                except OSError:
                    continue

    @staticmethod
    def _is_temp_name(name: str) -> bool:
        legacy = _LEGACY_TEMP.fullmatch(name)
        return is_valid_agent_id(name[1 : -len(TEMP_SUFFIX)]) or (legacy is not None and is_valid_agent_id(legacy[1]))

    def agent_ids(self) -> list[AgentId]:
        """Sorted ids of the agents that have a record in this store (a full directory
        scan: for listings, use ``page``)."""
        try:
            with os.scandir(self.directory) as listing:
                entries = list(listing)
        except FileNotFoundError:
            return []
        ids = []
        for entry in entries:
            if entry.name.endswith(RECORD_SUFFIX) and entry.is_file(follow_symlinks=False):
                candidate = entry.name[: -len(RECORD_SUFFIX)]
                if is_valid_agent_id(candidate) and not (self.shared and self._is_tombstone(Path(entry.path))):
                    ids.append(AgentId(candidate))
        return sorted(ids)

    # -- internals -----------------------------------------------------------

    def _is_tombstone(self, path: Path) -> bool:
        stamp = self._header(path)
        return stamp is not None and stamp.tombstone

    def _temp_path(self, agent_id: str) -> Path:
        """Where a save of the agent writes before its rename: one name per agent, as
        only the holder of the agent's lock writes it."""
        return self.directory / f".{agent_id}{TEMP_SUFFIX}"

    def _write_atomically(
        self, agent_id: str, path: Path, chunks: list[memoryview | bytes]
    ) -> tuple[int, os.stat_result]:
        """Temp file, fsync, rename, fsync dir; on failure the old record stays.

        Returns the bytes written and the file's ``fstat`` (the rename keeps it: ``_etag``)."""
        temp = self._temp_path(agent_id)
        fd = -1
        try:
            with suppress(FileNotFoundError):
                temp.unlink()  # a crashed save's leftover: we hold the lock, so nobody writes it now
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(temp, flags, 0o600)  # a KV cache reveals its prompt: owner-only
            written = sum(_write_all(fd, chunk) for chunk in chunks)
            _fsync_file(fd)
            st = os.fstat(fd)
            os.close(fd)
            fd = -1
            os.replace(temp, path)
        except BaseException as exc:
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
            with suppress(OSError):
                temp.unlink()
            if not isinstance(exc, OSError):
                raise
            logger.error("kvshelf: saving the record of agent %r to %s failed: %s", agent_id, path, exc)
            reason = exc.strerror or str(exc)
            raise StorageError(
                exc.errno,
                f"could not save the record of agent {agent_id!r} ({reason}); the previous record is unchanged",
                str(path),
            ) from exc
        self._fsync_directory()
        return written, st

    def _fsync_directory(self) -> None:
        """Make renames durable. Some filesystems refuse to fsync a directory;
        the rename has happened by then, so that is only worth a warning."""
        try:
            fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning(
                "kvshelf: could not fsync %s (%s); the last change may not survive a power loss", self.directory, exc
            )

    def _quarantined(self, agent_id: str) -> list[Path]:
        """This agent's quarantined records and reason files (see ``_quarantine`` for the names)."""
        pattern = re.compile(rf"{re.escape(agent_id)}\.\d{{8}}T\d{{6}}\.\d{{6}}Z\.[0-9a-f]{{8}}\.(safetensors|reason)")
        with suppress(FileNotFoundError), os.scandir(self.quarantine_dir) as entries:
            return [Path(e.path) for e in entries if pattern.fullmatch(e.name)]
        return []

    def _unindex(self, agent_id: str) -> None:
        if (index := self.open_index()) is not None:
            index.remove(agent_id)

    def _quarantine(self, agent_id: str, path: Path, reason: str) -> Path | None:
        """Move an unusable record aside (never delete it) and say why."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        stem = f"{agent_id}.{stamp}.{secrets.token_hex(4)}"
        target = self.quarantine_dir / f"{stem}{RECORD_SUFFIX}"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            self._unindex(agent_id)
            return None
        except OSError as exc:
            logger.error(
                "kvshelf: the record of agent %r at %s is unusable (%s) and could not be quarantined (%s); ignoring it",
                agent_id,
                path,
                reason,
                exc,
            )
            return None
        self._unindex(agent_id)
        note = (
            f"agent: {agent_id}\nreason: {reason}\nmoved from: {path}\n"
            f"quarantined at: {stamp}\nexpected model fingerprint: {self.model_fingerprint}\n"
        )
        try:
            target.with_suffix(".reason").write_text(note, encoding="utf-8")
        except OSError as exc:
            logger.error("kvshelf: could not write the reason file for %s: %s", target, exc)
        self._fsync_directory()
        logger.warning(
            "kvshelf: the record of agent %r was rejected (%s); moved to %s and will be recomputed",
            agent_id,
            reason,
            target,
        )
        return target


def _safe_name(agent_id: str) -> bool:
    """The whitelist of agent ids, without their Windows device-name rule: the cheap check
    for ids read back from the index or a directory listing (hot loops), which were
    checked in full when they were saved."""
    return _ROW_ID.fullmatch(agent_id) is not None and ".." not in agent_id and not agent_id.endswith(".")


def _id_of(record_path: Path) -> AgentId:
    """The id a record path was made from (``id_path`` checked it), for the names the
    store derives from it: temp files, quarantine entries, log lines."""
    return str.__new__(AgentId, record_path.name.removesuffix(RECORD_SUFFIX))
