"""The store's metadata index: one SQLite row per record, for listing without reading records.

Listing 100,000 agents must not read 100,000 record headers, and a page of them must
not scan the directory (see ``benchmarks/store_scale.py`` for the figures that chose
this over reading headers page by page). So the store keeps, next to its records, a
small SQLite database (the standard library's) holding what a listing shows: the id,
the token count, the file's size and its mtime. It is a cache of the records, never
the truth, and it is built so that being wrong costs a little time, not an agent:

* every save upserts its row after the record is on disk, and a delete or a
  quarantine removes it; a row never wins over a newer one (``mtime_ns`` only grows);
* the store checks each row it hands out against the file (one ``stat``): a record
  that changed behind the index's back (another process, a crash between the rename
  and the upsert) has its header re-read, a vanished one loses its row;
* when the index is opened, a reconcile pass adds a row for every record file that
  has none, in the background; a listing waits for it. A missing or damaged index is
  rebuilt by the same pass (its token counts are then read lazily, page by page);
* where no index can be written (a read-only store) it lives in memory.

Writes do not wait for the disk (WAL, ``synchronous=NORMAL``): the index is rebuilt
from the records when it is behind, so it needs no fsync of its own on the turn's path.
Erasure does: a deleted agent's row is overwritten (``secure_delete``) and the WAL is
checkpointed, so its id does not linger in the file.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

INDEX_NAME = ".index.sqlite3"
SCHEMA_VERSION = 1
_BATCH = 2000
# SQLite result codes of a file that is not (or no longer) a sound database.
_DAMAGED = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    agent_id TEXT PRIMARY KEY,
    tokens INTEGER,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL
) WITHOUT ROWID
"""
_UPSERT = """
INSERT INTO records (agent_id, tokens, size, mtime_ns) VALUES (?, ?, ?, ?)
ON CONFLICT (agent_id) DO UPDATE SET tokens = excluded.tokens, size = excluded.size, mtime_ns = excluded.mtime_ns
WHERE excluded.mtime_ns >= records.mtime_ns
"""


class Row(NamedTuple):
    """One record as the index knows it; ``tokens`` is None until its header is read."""

    agent_id: str
    tokens: int | None
    size: int
    mtime_ns: int


class AgentIndex:
    """Rows of one store directory's records, kept in ``<directory>/.index.sqlite3``.

    ``scan()`` yields a row (tokens unknown) for every record file in the directory; it
    is how the index is reconciled at open and rebuilt when damaged. Every method is
    thread-safe and none raises for the index's own trouble: a damaged file is removed
    and rebuilt, a busy one (another process writing) is logged and skipped, since
    the rows are checked against the files anyway.
    """

    def __init__(self, directory: Path, scan: Callable[[], Iterable[Row]]) -> None:
        self.path = directory / INDEX_NAME
        self._scan = scan
        self._lock = threading.RLock()
        self._ready = threading.Event()
        self._closed = False
        self.in_memory = False
        self._db = self._connect()
        self._reconciler = threading.Thread(target=self._reconcile, name="kvshelf-index", daemon=True)
        self._reconciler.start()

    # -- opening ---------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        """The on-disk index (made if missing, removed and remade if damaged), else one in memory."""
        for attempt in range(2):
            try:
                return self._open(str(self.path))
            except sqlite3.DatabaseError as exc:
                if attempt == 0 and _damaged(exc) and self._discard(exc):
                    continue
                log.warning("kvshelf: cannot use the index %s (%s); keeping it in memory", self.path, exc)
                break
        self.in_memory = True
        return self._open(":memory:")

    @staticmethod
    def _open(target: str) -> sqlite3.Connection:
        db = sqlite3.connect(target, timeout=5.0, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA secure_delete = ON")
            version = db.execute("PRAGMA user_version").fetchone()[0]  # reads the header: fails on garbage
            if target != ":memory:":
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = NORMAL")
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"index schema {version} is not {SCHEMA_VERSION}")
            db.execute(_SCHEMA)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("SELECT count(*) FROM (SELECT 1 FROM records LIMIT 1)").fetchone()
        except BaseException:
            db.close()
            raise
        if target != ":memory:":
            os.chmod(target, 0o600)  # it names the agents
        return db

    def _discard(self, exc: BaseException) -> bool:
        """Remove a damaged index: it holds nothing the records do not (and it names
        agents, so a copy kept aside could outlive an agent's erasure)."""
        try:
            for name in (INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm"):
                self.path.with_name(name).unlink(missing_ok=True)
        except OSError as err:
            log.warning("kvshelf: the index %s is damaged (%s) and cannot be removed: %s", self.path, exc, err)
            return False
        log.warning("kvshelf: the index %s was damaged (%s); rebuilding it from the records", self.path, exc)
        return True

    def _reconcile(self) -> None:
        """Add a row (tokens unknown) for every record file that has none."""
        try:
            batch: list[Row] = []
            for row in self._scan():
                if self._closed:
                    return
                batch.append(row)
                if len(batch) >= _BATCH:
                    self._add_missing(batch)
                    batch = []
            self._add_missing(batch)
        except Exception:
            log.exception("kvshelf: reconciling the index %s with the records failed", self.path)
        finally:
            self._ready.set()

    def _add_missing(self, rows: Sequence[Row]) -> None:
        if rows:
            self._run(lambda db: db.executemany("INSERT OR IGNORE INTO records VALUES (?, ?, ?, ?)", rows), True)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the reconcile pass (a listing needs every record's row)."""
        return self._ready.wait(timeout)

    # -- rows ------------------------------------------------------------------------
    def put(self, row: Row) -> None:
        """Record a save (never over a newer row)."""
        self._run(lambda db: db.execute(_UPSERT, row))

    def remove(self, agent_id: str, *, mtime_ns: int | None = None, erase: bool = False) -> None:
        """Drop a row: any row (a delete), or only the one with ``mtime_ns`` (a stale row
        seen by a listing, which must not drop a newer save's). ``erase`` also scrubs the
        WAL, so an erased agent's id is gone from the index's files."""
        if mtime_ns is None:
            self._run(lambda db: db.execute("DELETE FROM records WHERE agent_id = ?", (agent_id,)))
        else:
            sql = "DELETE FROM records WHERE agent_id = ? AND mtime_ns = ?"
            self._run(lambda db: db.execute(sql, (agent_id, mtime_ns)))
        if erase and not self.in_memory:
            self._run(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))

    def get(self, agent_id: str) -> Row | None:
        found = self._run(
            lambda db: db.execute("SELECT * FROM records WHERE agent_id = ?", (agent_id,)).fetchone(), default=None
        )
        return Row(*found) if found else None

    def after(self, agent_id: str | None, limit: int) -> list[Row]:
        """Up to ``limit`` rows with ids after ``agent_id`` (all ids if None), in id order."""
        self._ready.wait()
        sql = "SELECT * FROM records WHERE agent_id > ? ORDER BY agent_id LIMIT ?"
        found = self._run(lambda db: db.execute(sql, (agent_id or "", limit)).fetchall(), default=[])
        return [Row(*r) for r in found]

    def count(self) -> int:
        self._ready.wait()
        return int(self._run(lambda db: db.execute("SELECT count(*) FROM records").fetchone()[0], default=0))

    def totals(self) -> tuple[int, int]:
        """How many records the index holds and their bytes: one aggregate query, for ``/metrics``."""
        self._ready.wait()
        sql = "SELECT count(*), coalesce(sum(size), 0) FROM records"
        count, size = self._run(lambda db: db.execute(sql).fetchone(), default=(0, 0))
        return int(count), int(size)

    def close(self) -> None:
        self._closed = True
        self._reconciler.join()
        with self._lock:
            self._db.close()

    # -- running statements ------------------------------------------------------------
    def _run(self, work: Callable[[sqlite3.Connection], Any], batch: bool = False, default: Any = None) -> Any:
        """Run ``work`` on the connection (in one transaction if ``batch``); ``default``
        if the index failed, after rebuilding it if it was damaged."""
        with self._lock:
            if self._closed:
                return default
            try:
                if not batch:
                    return work(self._db)
                self._db.execute("BEGIN")
                try:
                    result = work(self._db)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                return result
            except sqlite3.Error as exc:
                if _damaged(exc):
                    self._rebuild(exc)
                else:
                    log.warning("kvshelf: the index %s was not updated (%s); rows are checked on use", self.path, exc)
                return default

    def _rebuild(self, exc: BaseException) -> None:
        """The index went bad under us: start again from the records (lock held)."""
        self._db.close()
        if not self.in_memory:
            self._discard(exc)
        self.in_memory = False
        self._db = self._connect()
        self._ready.clear()
        self._reconcile()


def _damaged(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGED
    return "not a database" in str(exc) or "malformed" in str(exc) or "schema" in str(exc)
