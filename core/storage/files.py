"""A directory as a ``Backend``, and the file primitives every directory store uses.

Writes go to a temp file that is fsynced and then renamed onto the final name, so a
reader sees the old bytes or the new ones, never a mix; every write is a new file, so a
file's identity (``etag_of``: device, inode, size, mtime) changes with every write, as an
S3 ETag does. A conditional write compares that identity under a per-key ``flock``, held
only for the compare and the rename. ``kvshelf.storage.records`` builds the records'
store on these primitives; ``FileBackend`` offers them under the ``Backend`` protocol
for the node-local read-through cache in front of a remote store.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import suppress
from pathlib import Path

import filelock

from kvshelf.errors import StorageError
from kvshelf.storage.backend import NOT_MODIFIED, Blob, Changed, Head

__all__ = ["FileBackend", "etag_of", "fsync_file", "read_file", "write_all"]


def write_all(fd: int, data: memoryview | bytes | bytearray) -> int:
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])
    return written


def fsync_file(fd: int) -> None:
    """fsync; on macOS plain fsync does not reach the platter, F_FULLFSYNC does."""
    if sys.platform == "darwin":
        import fcntl

        with suppress(OSError, AttributeError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)  # type: ignore[attr-defined]
            return
    os.fsync(fd)


def read_file(path: Path | str) -> tuple[bytearray, os.stat_result]:
    """The file's bytes and its ``fstat``: the identity of exactly the bytes read."""
    with open(path, "rb", buffering=0) as file:
        st = os.fstat(file.fileno())
        size = st.st_size
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            count = file.readinto(view[got:])
            if not count:
                break
            got += count
        del view
    return (buffer if got == size else buffer[:got]), st


def etag_of(st: os.stat_result) -> str:
    """A file's tag: device, inode, size and mtime. Every write renames a new file onto the
    name, so every write changes it; it is read with one ``stat`` (or the ``fstat`` of the
    file a read has open)."""
    return f"{st.st_dev:x}.{st.st_ino:x}.{st.st_size:x}.{st.st_mtime_ns:x}"


def _head(st: os.stat_result) -> Head:
    return Head(etag_of(st), st.st_size, st.st_mtime)


class FileBackend:
    """Objects as files under ``root`` (a key's slashes are subdirectories)."""

    def __init__(self, root: Path, *, lock_timeout: float = 60.0) -> None:
        self.root = Path(root)
        self.lock_timeout = lock_timeout

    @property
    def url(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"FileBackend({str(self.root)!r})"

    def path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid key {key!r}")
        return self.root.joinpath(*parts)

    @staticmethod
    def _failed(what: str, path: Path, exc: OSError) -> StorageError:
        return StorageError(exc.errno, f"{what} {path} failed: {exc.strerror or exc}", str(path))

    def get(self, key: str, if_none_match: str | None = None) -> Blob | None | str:
        path = self.path(key)
        try:
            if if_none_match is not None and etag_of(os.stat(path)) == if_none_match:
                return NOT_MODIFIED
            data, st = read_file(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._failed("reading", path, exc) from exc
        return Blob(data, _head(st))

    def get_prefix(self, key: str, length: int) -> tuple[bytes, Head] | None:
        path = self.path(key)
        try:
            with open(path, "rb") as file:
                return file.read(length), _head(os.fstat(file.fileno()))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._failed("reading", path, exc) from exc

    def head(self, key: str) -> Head | None:
        path = self.path(key)
        try:
            return _head(os.stat(path))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._failed("checking", path, exc) from exc

    def put(self, key: str, chunks: Sequence[bytes | bytearray | memoryview], expect: str | None) -> Head:
        return self._write(key, chunks, expect, conditional=True)

    def overwrite(self, key: str, chunks: Sequence[bytes | bytearray | memoryview]) -> Head:
        return self._write(key, chunks, None, conditional=False)

    def _write(
        self, key: str, chunks: Sequence[bytes | bytearray | memoryview], expect: str | None, *, conditional: bool
    ) -> Head:
        path = self.path(key)
        temp = path.with_name(f".{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(path.with_name(f"{path.name}.lock"), is_singleton=True)
            lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as exc:
            raise StorageError(errno.ETIMEDOUT, f"timed out waiting for the lock of {path}", str(path)) from exc
        except OSError as exc:
            raise self._failed("locking", path, exc) from exc
        fd = -1
        try:
            if conditional:
                current = self.head(key)
                if (current.etag if current is not None else None) != expect:
                    raise Changed(f"{path} is not the version expected")
            with suppress(FileNotFoundError):
                temp.unlink()
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(temp, flags, 0o600)
            for chunk in chunks:
                write_all(fd, chunk)
            fsync_file(fd)
            st = os.fstat(fd)
            os.close(fd)
            fd = -1
            os.replace(temp, path)
            return _head(st)
        except OSError as exc:
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
            with suppress(OSError):
                temp.unlink()
            raise self._failed("writing", path, exc) from exc
        finally:
            lock.release()

    def delete(self, key: str) -> None:
        path = self.path(key)
        for victim in (path, path.with_name(f"{path.name}.lock")):
            try:
                victim.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._failed("deleting", victim, exc) from exc

    def list(self, prefix: str, after: str | None = None) -> Iterator[list[tuple[str, Head]]]:
        folder = self.path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        try:
            with os.scandir(folder) as entries:
                names = sorted(e.name for e in entries if not e.name.startswith(".") and e.is_file())
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._failed("listing", folder, exc) from exc
        page: list[tuple[str, Head]] = []
        for name in names:
            key = base + name
            if name.endswith(".lock") or (after is not None and key <= after):
                continue
            if (head := self.head(key)) is not None:
                page.append((key, head))
            if len(page) == 1000:
                yield page
                page = []
        if page:
            yield page
