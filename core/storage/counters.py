"""What a store did, counted: the one object ``/metrics`` reads for the store.

A node of a cluster talks to its store on every turn (a save, a version check, a load
when an agent moves), so an operator needs to see those round trips, how many failed,
how often agents moved to this node, and how often this node was stopped from writing
over a newer record. The store (``kvshelf.storage.records``) and the shelf add to it;
the server exports it. Plain integers under a lock: read from any thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class StoreCounters:
    """Monotonic counts since the store was opened (``snapshot()`` reads them together)."""

    round_trips: int = 0
    """Requests to the store: a read, a write, a version check (stat or HEAD), a delete, a listing page."""
    failures: int = 0
    """Round trips that failed (I/O error, unreachable service, lock timeout); refused writes are not failures."""
    takeovers: int = 0
    """Agents this node loaded from a record that another node wrote: ownership moved here."""
    stale_reloads: int = 0
    """Times a RAM copy was found older than the store's record before reuse, and the newer one used."""
    refused_writes: int = 0
    """Saves refused because the record had changed since this node read or wrote it (``StaleWrite``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, count: int = 1) -> None:
        """Add ``count`` to the counter ``name`` (one of the fields above)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + count)

    def snapshot(self) -> dict[str, int]:
        """Every counter at one instant, by name."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
