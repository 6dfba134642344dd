"""One server per store directory: a second ``kvshelf serve`` on the same records refuses to start.

Two processes on one cache directory never corrupt a record (atomic writes and
per-agent locks see to that; two engines may share a directory). But a server makes
promises that span requests: ``DELETE /v1/agents/{id}`` says the agent is gone, and a
durable answer says its turn is on disk. A second server would hold its own RAM copy
of the same agents: it could write an erased agent back, or overwrite the newer
record of the first. So a server takes an exclusive lock on the store directory for
its whole life and a second one stops with a message that says who holds it.

The lock is an ``flock`` on ``<store dir>/.server.lock``: the kernel drops it when its
process dies, however it dies, so a crashed server never blocks the next one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from kvshelf.errors import KVShelfError

LOCK_NAME = ".server.lock"


class DirectoryInUse(KVShelfError):
    """Another server process is already serving this store directory."""


def claim(directory: Path) -> IO[str]:
    """Lock ``directory`` for this process; keep the returned file open for as long as it serves.

    Raises DirectoryInUse (naming the holder's pid) when another process holds it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_NAME, "a+", encoding="ascii")  # noqa: SIM115  (held open on purpose)
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise DirectoryInUse(
            f"another kvshelf server (pid {holder}) is already serving the records in {directory}; "
            "stop it, or give this server its own --cache-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
