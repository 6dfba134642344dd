"""Shared prefixes on disk: one record per prefix, and a marker file per agent using it.

``kvshelf.kv.shared`` holds a prefix in RAM; this module stores it once under
``shared/<fingerprint>/<prefix id>.safetensors`` with one marker per user
(``<prefix id>.users/<agent id>``), and keeps the live objects in a weak registry so
every resident agent that starts on a prefix uses the same blocks.

Reference counting is those marker files. A marker is written before the agent's
record that needs it and removed only after that record no longer needs it, so a crash
can leave an unused prefix behind (reclaimed when the last marker goes) but never a
record whose prefix is missing.
"""

from __future__ import annotations

import logging
import shutil
import threading
import weakref
from pathlib import Path
from typing import cast

import mlx.core as mx

from kvshelf.kv.record import prefix_from_record, prefix_record
from kvshelf.kv.shared import SharedPrefix
from kvshelf.model.spec import ModelCacheSpec
from kvshelf.storage.agent_id import AgentId, id_path
from kvshelf.storage.records import RecordStore

log = logging.getLogger(__name__)


def _key(pid: str) -> AgentId:
    """A prefix id as the key of its record in the store, which checks it where it
    becomes a file name (``id_path``), like an agent id."""
    return cast(AgentId, pid)


class SharedPrefixes:
    """Shared prefixes in RAM (weakly, by id) and on disk (with user markers)."""

    def __init__(self, cache_dir: Path, fingerprint: str, spec: ModelCacheSpec) -> None:
        self.store = RecordStore(Path(cache_dir) / "shared", fingerprint, indexed=False)
        self.spec = spec
        self._live: weakref.WeakValueDictionary[str, SharedPrefix] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # markers are touched from the I/O and worker threads

    @property
    def directory(self) -> Path:
        return self.store.directory

    def _users_dir(self, pid: str) -> Path:
        return id_path(self.directory, pid, ".users")

    # -- RAM ------------------------------------------------------------------------------
    def intern(self, prefix: SharedPrefix) -> SharedPrefix:
        """The live object for this prefix's id: the given one unless one is already held."""
        with self._lock:
            live = self._live.get(prefix.id)
            if live is None:
                self._live[prefix.id] = live = prefix
            return live

    def get(self, pid: str) -> SharedPrefix | None:
        """The prefix from RAM, else from disk (verified); None if it is missing or bad."""
        with self._lock:
            live = self._live.get(pid)
        if live is not None:
            return live
        record = self.store.load(_key(pid))
        if record is None:
            return None
        try:
            prefix = prefix_from_record(pid, self.spec, record)
        except (ValueError, KeyError) as exc:
            self.store.quarantine(_key(pid), f"shared prefix does not fit this model: {exc}")
            return None
        mx.eval([x for layer in prefix.layers if layer is not None for x in (*layer.keys, *layer.values)])
        return self.intern(prefix)

    def resident(self) -> list[SharedPrefix]:
        with self._lock:
            return list(self._live.values())

    # -- disk ----------------------------------------------------------------------------
    def ensure_saved(self, prefix: SharedPrefix) -> None:
        if not self.store.path_for(_key(prefix.id)).exists():
            self.store.save(_key(prefix.id), prefix_record(prefix, self.spec))

    def add_user(self, pid: str, agent_id: AgentId) -> None:
        """Mark ``agent_id`` as a user of ``pid`` (before its record refers to it)."""
        marker = id_path(self._users_dir(pid), agent_id)  # both ids checked before the disk is touched
        with self._lock:
            marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            marker.touch(mode=0o600)

    def release(self, agent_id: AgentId, keep: str | None = None) -> list[Path]:
        """Drop ``agent_id``'s markers (but ``keep``'s); delete prefixes left without users.

        Returns the files removed."""
        removed: list[Path] = []
        pattern = str(id_path(Path("*.users"), agent_id))  # this agent's marker under any prefix
        with self._lock:
            if not self.directory.is_dir():
                return removed
            for marker in sorted(self.directory.glob(pattern)):
                pid = marker.parent.name.removesuffix(".users")
                if pid == keep:
                    continue
                marker.unlink(missing_ok=True)
                removed.append(marker)
                if not any(marker.parent.iterdir()):
                    removed.extend(self.store.delete(_key(pid)))
                    shutil.rmtree(marker.parent, ignore_errors=True)
        return removed

    def users(self, pid: str) -> list[str]:
        users = self._users_dir(pid)
        return sorted(p.name for p in users.iterdir()) if users.is_dir() else []

    def on_disk(self) -> list[str]:
        return list(self.store.agent_ids())
