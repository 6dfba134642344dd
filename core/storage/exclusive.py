"""One server per store directory, for as long as it serves, even if the directory is deleted.

Two processes on one cache directory never corrupt a record (atomic writes and
per-agent locks see to that; two engines may share a directory). But a server makes
promises that span requests: ``DELETE /v1/agents/{id}`` says the agent is gone, and a
durable answer says its turn is on disk. A second server would hold its own RAM copy
of the same agents: it could write an erased agent back, or overwrite the newer
record of the first. So a server claims its store directory for its whole life and a
second one stops with a message that says who holds it.

The claim must not live in a file a user can delete (``rm -rf`` of the cache under a
running server used to take the lock file with it, and the next server started on the
recreated directory). It is two locks the kernel drops when the process dies, however
it dies, so a crashed server never blocks the next one:

* a lock on the directory's **path**: on Linux an abstract-namespace Unix socket named
  after the resolved path (it is not a file: nothing on disk can remove it, and a
  second server learns the holder's pid from the socket itself); elsewhere an
  ``flock`` on a file named after the path in the system's temp directory;
* an ``flock`` on the directory's **inode**, held through an open descriptor, which
  also shows whether the path still leads to the directory that was claimed.

If it no longer does (the directory was deleted, or replaced), ``Ownership.check``
raises ``StoreLost`` before every write: the server stops saving (agents stay in RAM,
answered ``saved: false``), logs an ERROR once, and its ``/health`` says unhealthy
until it is restarted, while the path lock still refuses a second server.

A ``.server.pid`` file in the directory names the holder where the platform cannot,
and writing it proves at start-up that the store is writable (``StoreUnusable``
otherwise, which ``kvshelf serve`` reports in one line).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import socket
import struct
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING

from kvshelf.errors import KVShelfError, StorageError

if TYPE_CHECKING:
    from kvshelf.storage.location import StoreLocation

log = logging.getLogger(__name__)

PID_NAME = ".server.pid"


class DirectoryInUse(KVShelfError):
    """Another server process is already serving this store directory."""


class StoreUnusable(KVShelfError):
    """The store directory cannot be created, opened or written (a read-only file
    system, missing permissions, a file in its place)."""


class StoreLost(StorageError):
    """The claimed store directory was deleted or replaced under the server: nothing is
    saved any more (to a directory that is no longer the claimed one) until a restart."""


def _path_key(directory: Path) -> str:
    return hashlib.sha256(str(directory).encode("utf-8", "surrogateescape")).hexdigest()[:40]


class _PathLock:
    """The lock on the directory's path (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        key = _path_key(directory)
        self._sock: socket.socket | None = None
        self._file: IO[bytes] | None = None
        if sys.platform.startswith("linux"):
            name = f"\0kvshelf-server-{key}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(name)
                sock.listen(1)  # a second server connects to learn who holds it
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise DirectoryInUse(_in_use(directory, _socket_holder(name))) from None
            self._sock = sock
        else:
            folder = Path(tempfile.gettempdir()) / f"kvshelf-servers-{os.getuid()}"
            folder.mkdir(mode=0o700, exist_ok=True)
            handle = open(folder / f"{key}.lock", "a+b")  # noqa: SIM115  (held open on purpose)
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                raise DirectoryInUse(_in_use(directory, _pid_in(directory))) from None
            self._file = handle

    def close(self) -> None:
        for held in (self._sock, self._file):
            if held is not None:
                held.close()


def _socket_holder(name: str) -> str:
    """The pid of the process listening on abstract socket ``name`` (SO_PEERCRED)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return str(struct.unpack("3i", creds)[0])
    except OSError:
        return "unknown"


def _pid_in(directory: Path) -> str:
    try:
        return (directory / PID_NAME).read_text(encoding="ascii").strip() or "unknown"
    except OSError:
        return "unknown"


def _in_use(directory: Path, holder: str) -> str:
    return (
        f"another kvshelf server (pid {holder}) is already serving the records in {directory}; "
        "stop it, or give this server its own --cache-dir"
    )


def _unusable(directory: Path, exc: OSError) -> StoreUnusable:
    return StoreUnusable(f"cannot use the store directory {directory}: {exc.strerror or exc}")


class Ownership:
    """This process's claim on one store directory; keep it for as long as it serves."""

    def __init__(self, directory: Path, path_lock: _PathLock, fd: int) -> None:
        self.directory = directory
        self._path_lock, self._fd = path_lock, fd
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._lost = threading.Event()

    def intact(self) -> bool:
        """Whether the directory's path still leads to the directory that was claimed."""
        if self._lost.is_set():
            return False
        try:
            st = os.stat(self.directory)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == self._identity:
            return True
        self._lost.set()
        log.error(
            "kvshelf: the store directory %s was deleted or replaced while this server held it; "
            "no record is saved any more (agents stay in RAM, answered saved: false) "
            "until the server is restarted",
            self.directory,
        )
        return False

    def check(self) -> None:
        """Raise StoreLost unless the claimed directory is still where it was: run before
        every write, so that a save never recreates a directory another server may own."""
        if not self.intact():
            raise StoreLost(
                errno.ENOENT,
                "the store directory was deleted or replaced under this server; restart it to save again",
                str(self.directory),
            )

    def close(self) -> None:
        """Give the claim up (the kernel does so too when the process ends)."""
        os.close(self._fd)
        self._path_lock.close()


def claim(directory: Path) -> Ownership:
    """Claim ``directory`` for this process (creating it), before anything is loaded.

    Raises DirectoryInUse (naming the holder's pid) when another process holds it, and
    StoreUnusable when the directory cannot be created, opened or written.
    """
    directory = Path(os.path.abspath(directory))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        directory = directory.resolve()
    except OSError as exc:
        raise _unusable(directory, exc) from None
    path_lock = _PathLock(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        path_lock.close()
        raise _unusable(directory, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        path_lock.close()
        raise DirectoryInUse(_in_use(directory, _pid_in(directory))) from None
    try:
        (directory / PID_NAME).write_text(str(os.getpid()), encoding="ascii")  # also proves it is writable
    except OSError as exc:
        os.close(fd)
        path_lock.close()
        raise _unusable(directory, exc) from None
    return Ownership(directory, path_lock, fd)


def check_usable(location: StoreLocation, model_fingerprint: str) -> None:
    """What ``claim`` proves at start-up, for a store that many nodes share and none claims:
    that this node can create and write the model's store directory (or, for an object
    store, list it). Raises StoreUnusable, which ``kvshelf serve`` reports in one line."""
    if location.path is None:
        from kvshelf.storage.location import open_store

        try:
            open_store(location, model_fingerprint, shared=True).probe()
        except (StorageError, ValueError) as exc:
            raise StoreUnusable(f"cannot use the store {location.url}: {exc}") from None
        return
    directory = Path(os.path.abspath(location.path)) / model_fingerprint.lower()[:16]
    probe = directory / f".probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise _unusable(directory, exc) from None
