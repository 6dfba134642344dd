"""S3-compatible object storage (AWS S3, Cloudflare R2, MinIO, Ceph RGW) as a ``Backend``.

Through obstore, a maintained client with one API over S3, GCS and Azure whose puts can
be conditional: ``mode="create"`` for an object that must not exist yet, and
``mode={"e_tag": ...}`` (``If-Match``) for one that must still be the version read. That
is all a shared store needs for one writer per agent (``kvshelf.storage.records``).

Credentials, region and endpoint come from the standard ``AWS_*`` variables, as every
AWS tool reads them: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL`` (for a service other than
AWS) and ``AWS_ALLOW_HTTP=true`` for a plain-http endpoint. obstore is an optional
dependency (``pip install 'kvshelf[s3]'``), imported when an ``s3://`` store is opened.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvshelf.errors import StorageError
from kvshelf.storage.backend import NOT_MODIFIED, Blob, Changed, Head

if TYPE_CHECKING:
    from obstore.store import S3Store

__all__ = ["ObjectBackend"]


def _head(meta: Any) -> Head:
    return Head(str(meta["e_tag"]), int(meta["size"]), meta["last_modified"].timestamp())


class ObjectBackend:
    """Objects under ``s3://bucket/prefix`` (every key is relative to the prefix)."""

    def __init__(self, bucket: str, prefix: str = "") -> None:
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as exc:
            raise StorageError(
                errno.ENOPKG if hasattr(errno, "ENOPKG") else errno.ENOENT,
                f"s3:// stores need obstore: pip install 'kvshelf[s3]' ({exc})",
            ) from None
        self._obs = obstore
        self._exc = obstore.exceptions
        self.bucket, self.prefix = bucket, prefix.strip("/")
        try:
            self._store: S3Store = S3Store(bucket, prefix=self.prefix or None)
        except Exception as exc:  # obstore's configuration errors: a bad variable, no region
            raise StorageError(errno.EINVAL, f"cannot configure the S3 store {self.url}: {exc}") from None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __repr__(self) -> str:
        return f"ObjectBackend({self.url!r})"

    def _failed(self, what: str, key: str, exc: Exception) -> StorageError:
        code = errno.EACCES if isinstance(exc, self._exc.PermissionDeniedError | self._exc.UnauthenticatedError) else 0
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StorageError(code or errno.EIO, f"{what} {self.url}/{key} failed: {first_line[:300]}", key)

    def get(self, key: str, if_none_match: str | None = None) -> Blob | None | str:
        try:
            options: Any = {"if_none_match": if_none_match} if if_none_match else None
            result = self._obs.get(self._store, key, options=options)
            data = result.bytes()
        except FileNotFoundError:  # obstore's NotFoundError
            return None
        except self._exc.NotModifiedError:
            return NOT_MODIFIED
        except Exception as exc:
            raise self._failed("reading", key, exc) from exc
        return Blob(memoryview(data), _head(result.meta))

    def get_prefix(self, key: str, length: int) -> tuple[bytes, Head] | None:
        try:  # a range past the end returns the whole (shorter) object
            result = self._obs.get(self._store, key, options={"range": (0, length)})
            return bytes(result.bytes()), _head(result.meta)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._failed("reading", key, exc) from exc

    def head(self, key: str) -> Head | None:
        try:
            return _head(self._obs.head(self._store, key))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._failed("checking", key, exc) from exc

    def put(self, key: str, chunks: Sequence[bytes | bytearray | memoryview], expect: str | None) -> Head:
        mode: Any = "create" if expect is None else {"e_tag": expect}
        return self._put(key, chunks, mode)

    def overwrite(self, key: str, chunks: Sequence[bytes | bytearray | memoryview]) -> Head:
        return self._put(key, chunks, "overwrite")

    def _put(self, key: str, chunks: Sequence[bytes | bytearray | memoryview], mode: Any) -> Head:
        # one request, never multipart: a conditional put must be a single PUT, and a record is 10-20 MB
        body = b"".join(chunks)
        try:
            result = self._obs.put(self._store, key, body, mode=mode, use_multipart=False)
        except (self._exc.PreconditionError, self._exc.AlreadyExistsError) as exc:
            raise Changed(str(exc).splitlines()[0] if str(exc) else "changed") from None
        except Exception as exc:
            raise self._failed("writing", key, exc) from exc
        etag = result.get("e_tag")
        if not etag:  # a service that answers a PUT without an ETag: ask for it
            head = self.head(key)
            if head is None:
                raise StorageError(errno.EIO, f"writing {self.url}/{key}: the object is missing right after its PUT")
            return head
        return Head(str(etag), len(body), 0.0)

    def delete(self, key: str) -> None:
        try:
            self._obs.delete(self._store, key)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._failed("deleting", key, exc) from exc

    def list(self, prefix: str, after: str | None = None) -> Iterator[list[tuple[str, Head]]]:
        try:
            for chunk in self._obs.list(self._store, prefix=prefix, offset=after, chunk_size=1000):
                yield [(meta["path"], _head(meta)) for meta in chunk]
        except Exception as exc:
            raise self._failed("listing", prefix, exc) from exc
