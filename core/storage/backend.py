"""The bytes a store keeps, and the one promise a shared store needs: a write that is
refused when the object changed since it was read.

``RecordStore`` (``kvshelf.storage.records``) turns records into bytes and decides what a
write is conditional on; a ``Backend`` only keeps bytes under keys. Keys are the same
relative names everywhere (``<fingerprint[:16]>/<agent id>.safetensors``), so a record
copied from one backend to another is found at the same key, byte for byte.

Two backends implement it: ``kvshelf.storage.files.FileBackend`` (a directory: a node's
read-through cache, or any local or mounted directory) and
``kvshelf.storage.objects.ObjectBackend`` (S3-compatible services, through obstore).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

__all__ = ["Backend", "Blob", "Changed", "Head", "NOT_MODIFIED"]


class Head(NamedTuple):
    """What a backend says of one object without reading it."""

    etag: str
    """Changes with every write (an S3 ETag; a file's identity, ``files.etag_of``)."""
    size: int
    mtime: float


class Blob(NamedTuple):
    """An object's bytes and the ``Head`` of exactly those bytes."""

    data: bytes | bytearray | memoryview
    head: Head


class Changed(Exception):
    """A conditional write was refused: the object is not the one the writer expected
    (another writer came first, or it exists where none was expected)."""


NOT_MODIFIED = "not-modified"
"""What ``get`` returns when the object still has the ETag given as ``if_none_match``."""


class Backend(Protocol):
    """Bytes under keys, with conditional writes (see the module docstring)."""

    @property
    def url(self) -> str:
        """Where the objects live, for messages (no credentials)."""

    def get(self, key: str, if_none_match: str | None = None) -> Blob | None | str:
        """The object's bytes, None if there is none, ``NOT_MODIFIED`` if its ETag is still
        ``if_none_match`` (the caller's copy is current: nothing is transferred)."""

    def get_prefix(self, key: str, length: int) -> tuple[bytes, Head] | None:
        """The first ``length`` bytes of the object (fewer if it is shorter) and its head."""

    def head(self, key: str) -> Head | None:
        """The object's head, None if there is none."""

    def put(self, key: str, chunks: Sequence[bytes | bytearray | memoryview], expect: str | None) -> Head:
        """Write the object atomically if it still has the ETag ``expect`` (or, for None,
        if there is no object); raise ``Changed`` otherwise. Returns the new head."""

    def overwrite(self, key: str, chunks: Sequence[bytes | bytearray | memoryview]) -> Head:
        """Write the object atomically, whatever is there."""

    def delete(self, key: str) -> None:
        """Remove the object (nothing if there is none)."""

    def list(self, prefix: str, after: str | None = None) -> Iterator[list[tuple[str, Head]]]:
        """Pages of (key, head) under ``prefix`` whose keys sort after ``after``, in key order."""
