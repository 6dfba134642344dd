"""Exception types shared by kvshelf's modules.

Every kvshelf error derives from :class:`KVShelfError` so that a caller can catch
"anything kvshelf raised" in one clause, while the second base class keeps the
error catchable the way Python code already expects (a bad id is a
``ValueError``, a failed write is an ``OSError`` that carries its ``errno``).
"""

from __future__ import annotations


class KVShelfError(Exception):
    """Base class of all errors raised by kvshelf."""


class InvalidAgentId(KVShelfError, ValueError):
    """An agent id that cannot safely name a file.

    Raised before any filesystem access, so a bad id never touches the disk.
    """


class StorageError(KVShelfError, OSError):
    """A record could not be written or read because of the filesystem.

    Typical causes are a full disk (``ENOSPC``), missing permissions
    (``EACCES``) or a lock that could not be taken in time. ``errno`` and
    ``filename`` are set when known. When a *save* fails the previously stored
    record is left untouched.
    """


class RecordRejected(KVShelfError):
    """Why a stored record was judged unusable (and moved to quarantine).

    Internal to the store: ``RecordStore.load`` catches it, quarantines the file
    and returns ``None`` so that the caller simply recomputes the cache.
    """

    @property
    def reason(self) -> str:
        """The human-readable reason (also written to the ``.reason`` file)."""
        return str(self.args[0]) if self.args else "unknown reason"


class ContextLengthExceeded(KVShelfError, ValueError):
    """The prompt does not fit the model's context window."""


class AgentBusy(KVShelfError):
    """The agent has a request in flight; erase or evict it once that finishes."""


class AgentExists(KVShelfError):
    """A fork would overwrite an agent that already has a cache; forget it first."""


class UnknownAgent(KVShelfError, KeyError):
    """No cache for this agent, in RAM or on disk."""
