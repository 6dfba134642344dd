"""Where a store lives, from one string: the one place a store URL is read and a store opened.

``kvshelf serve --store URL`` and ``Engine(store=URL)`` take the same forms:

* a path, or ``file:///path``: a directory (today's default; also a shared NFS or SMB
  mount that several nodes open with ``shared=True``);
* ``s3://bucket/prefix``: any S3-compatible service (AWS S3, Cloudflare R2, MinIO, Ceph
  RGW), through obstore, with credentials and the endpoint taken from the standard
  ``AWS_*`` variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP`` for a plain-http endpoint).

A record's place is a pure function of the model and the agent id, the same under a
directory and under an S3 prefix: ``<fingerprint[:16]>/<agent id>.safetensors``.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from kvshelf.paths import kvshelf_home
from kvshelf.storage.counters import StoreCounters
from kvshelf.storage.records import RecordStore

__all__ = ["StoreLocation", "default_node_id", "local_root", "open_store", "parse_store", "validate_node_id"]

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class StoreLocation:
    """A parsed store URL: a directory, or a bucket and a key prefix."""

    scheme: str
    """``file`` or ``s3``."""
    path: Path | None = None
    """The directory of a ``file`` store."""
    bucket: str = ""
    prefix: str = ""
    """The key prefix of an ``s3`` store, without leading or trailing slashes ('' for the bucket's root)."""

    @property
    def url(self) -> str:
        if self.scheme == "file":
            return str(self.path)
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_store(url: str | Path) -> StoreLocation:
    """Read a store URL (see the module docstring); ValueError says what is wrong with it."""
    if isinstance(url, Path):
        return StoreLocation("file", url.expanduser())
    if not isinstance(url, str) or not url:
        raise ValueError("a store is a directory path, file:///path or s3://bucket/prefix")
    if "://" not in url:
        return StoreLocation("file", Path(url).expanduser())
    parts = urlparse(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{url!r}: a file URL names a local path (file:///path), not a host")
        return StoreLocation("file", Path(unquote(parts.path)))
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"{url!r}: an s3 URL names a bucket: s3://bucket/prefix")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: an s3 URL takes no query or fragment; set the endpoint with AWS_ENDPOINT_URL")
        return StoreLocation("s3", bucket=parts.netloc, prefix=parts.path.strip("/"))
    raise ValueError(f"{url!r}: unsupported store scheme {parts.scheme!r} (use a path, file:// or s3://)")


def validate_node_id(node_id: str) -> str:
    """A node id as it goes into record headers and the ``X-KVShelf-Node`` header."""
    if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id):
        raise ValueError(
            f"node id {node_id!r:.80} must be 1 to 64 ASCII letters, digits and . _ -, starting with a letter or digit"
        )
    return node_id


def default_node_id() -> str:
    """This machine's host name, as a node id (several nodes on one machine need --node-id)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].lstrip("._-")
    return name or "node"


def local_root(location: StoreLocation, cache_dir: Path | None = None) -> Path:
    """The node's own directory for a store: the store itself for a directory; for a remote
    store its read-through cache (and the node's shared prefixes), ``cache_dir`` or
    ``$KVSHELF_HOME/remote/<bucket>/<prefix>``."""
    if location.path is not None:
        return location.path
    if cache_dir is not None:
        return Path(cache_dir)
    return kvshelf_home().joinpath("remote", location.bucket, *[p for p in location.prefix.split("/") if p])


def open_store(
    location: StoreLocation | str | Path,
    model_fingerprint: str,
    *,
    shared: bool = False,
    node_id: str | None = None,
    counters: StoreCounters | None = None,
    cache_dir: Path | None = None,
) -> RecordStore:
    """The record store of one model at ``location``: a ``RecordStore`` for a directory, a
    ``remote.RemoteRecordStore`` (same methods) for ``s3://``, cached under ``local_root``.

    ``shared``: several nodes serve from it at once, each writing only on top of what it
    last read (``RecordStore``'s "Shared stores"); ``node_id`` names this node in what it
    writes (default: the host name, when shared).
    """
    where = location if isinstance(location, StoreLocation) else parse_store(location)
    if node_id is not None:
        validate_node_id(node_id)
    elif shared:
        node_id = default_node_id()
    if where.scheme == "file":
        assert where.path is not None
        return RecordStore(where.path, model_fingerprint, shared=shared, node_id=node_id, counters=counters)
    from kvshelf.storage.objects import ObjectBackend
    from kvshelf.storage.remote import RemoteRecordStore

    return RemoteRecordStore(
        ObjectBackend(where.bucket, where.prefix),
        local_root(where, cache_dir),
        model_fingerprint,
        shared=shared,
        node_id=node_id,
        counters=counters,
    )
