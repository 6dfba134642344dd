"""On-disk records: one safetensors file per agent per model.

Every agent's quantized KV cache lives in RAM; this module is what survives a
restart. The design follows from three facts:

* A record is only worth anything if it is *exactly* what was saved. A stale,
  torn or foreign record silently fed to the model would produce wrong text,
  whereas a missing record only costs a recompute. So every byte is covered by
  a checksum, and any doubt turns the record into "absent" (``load`` returns
  ``None``) after moving the file aside into ``quarantine/`` for a person to
  look at. Nothing is ever deleted silently.
* Several processes may share one store directory (a server and a CLI, two
  workers). Writes therefore go to a temp file that is fsynced and then
  ``os.replace``-d onto the final name, so a reader sees either the old or the
  new record, never a mix; and an inter-process file lock per agent keeps a
  save, load or delete of one agent from interleaving with another's.
* Records are 10-20 MB and are written on every turn, so tensors are streamed
  to the file straight from MLX's memory (``memoryview``), hashed in place, and
  read back with one read into a buffer plus one copy into MLX.

File layout (a standard safetensors file, readable by ``mx.load``)::

    u64 little-endian header length N | N bytes JSON header | tensor data

The header's ``__metadata__`` (all strings) holds the format version, the full
model fingerprint, the agent id, the caller's ``meta`` as JSON, the token count,
a blake2b-128 checksum per tensor and a blake2b-128 checksum of the header
bytes themselves (computed with its own value zeroed). Token ids are stored as
the int32 tensor ``__tokens__``; prompt text is never stored.

We write the bytes ourselves instead of calling ``mx.save_safetensors``: the
latter reports success even when the disk is full (writing to ``/dev/full``
"succeeds"), which would replace a good record with a truncated one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import filelock
import mlx.core as mx
import numpy as np

from kvshelf.errors import RecordRejected, StorageError
from kvshelf.kv.record import CacheRecord
from kvshelf.storage.agent_id import is_valid_agent_id, validate_agent_id

__all__ = ["FORMAT_VERSION", "CacheRecord", "RecordStore", "TOKENS_TENSOR"]

FORMAT_VERSION: int = 1

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
TEMP_SUFFIX = ".tmp"
TOKENS_TENSOR = "__tokens__"
QUARANTINE_DIRNAME = "quarantine"

# A temp file this old belongs to a writer that died (a save takes well under a
# second); younger ones are left alone in case a writer is still busy with it.
STALE_TEMP_SECONDS = 600.0
# safetensors' own limit; anything larger is a corrupted length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DIGEST_SIZE = 16
_ZERO_DIGEST = "0" * (2 * _DIGEST_SIZE)
_HEX_DIGEST = re.compile(rf"[0-9a-f]{{{2 * _DIGEST_SIZE}}}")
_HEX = re.compile(r"[0-9a-fA-F]+")
_MAX_TOKEN_ID = 2**31 - 1

# __metadata__ keys.
_K_FORMAT = "kvshelf.format_version"
_K_FINGERPRINT = "kvshelf.model_fingerprint"
_K_AGENT = "kvshelf.storage.agent_id"
_K_META = "kvshelf.meta"
_K_NTOKENS = "kvshelf.n_tokens"
_K_CHECKSUMS = "kvshelf.tensor_blake2b"
_K_HEADER_SUM = "kvshelf.header_blake2b"


class _DType(NamedTuple):
    mx_dtype: mx.Dtype
    name: str  # safetensors dtype name
    storage: np.dtype  # how the bytes are viewed in numpy (bf16 has no numpy dtype)


_DTYPES = [
    _DType(mx.bool_, "BOOL", np.dtype(np.bool_)),
    _DType(mx.uint8, "U8", np.dtype(np.uint8)),
    _DType(mx.int8, "I8", np.dtype(np.int8)),
    _DType(mx.uint16, "U16", np.dtype(np.uint16)),
    _DType(mx.int16, "I16", np.dtype(np.int16)),
    _DType(mx.uint32, "U32", np.dtype(np.uint32)),
    _DType(mx.int32, "I32", np.dtype(np.int32)),
    _DType(mx.uint64, "U64", np.dtype(np.uint64)),
    _DType(mx.int64, "I64", np.dtype(np.int64)),
    _DType(mx.float16, "F16", np.dtype(np.float16)),
    _DType(mx.bfloat16, "BF16", np.dtype(np.uint16)),
    _DType(mx.float32, "F32", np.dtype(np.float32)),
    _DType(mx.float64, "F64", np.dtype(np.float64)),
]
_BY_MX = {d.mx_dtype: d for d in _DTYPES}
_BY_NAME = {d.name: d for d in _DTYPES}


# --------------------------------------------------------------------------
# Encoding


class _Payload(NamedTuple):
    name: str
    dtype: _DType
    shape: tuple[int, ...]
    data: memoryview  # flat bytes, borrowed from MLX or numpy memory


def _digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE).hexdigest()


def _tokens_payload(tokens: Sequence[int]) -> _Payload:
    try:
        given = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"record.tokens must be a sequence of int token ids: {exc}") from None
    if given.ndim != 1:
        raise ValueError(f"record.tokens must be one-dimensional, got shape {given.shape}")
    if given.size and given.dtype.kind not in "iu":  # floats, bools, huge ints (object dtype)
        raise ValueError(f"record.tokens must hold int token ids, got {given.dtype} values")
    if given.size and (given.min() < 0 or given.max() > _MAX_TOKEN_ID):
        raise ValueError("record.tokens must be token ids in [0, 2**31)")
    narrow = np.ascontiguousarray(given, dtype=np.int32)
    return _Payload(TOKENS_TENSOR, _BY_NAME["I32"], narrow.shape, memoryview(narrow).cast("B"))


def _tensor_payloads(tensors: Mapping[str, mx.array]) -> list[_Payload]:
    """Borrow each tensor's bytes without copying (unless it is non-contiguous)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"record.tensors must be a dict of name -> mx.array, not {type(tensors).__name__}")
    checked: list[tuple[str, _DType, mx.array]] = []
    for name, array in tensors.items():
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise ValueError(f"tensor name {name!r} is invalid: names must be non-empty str not starting with '__'")
        if not isinstance(array, mx.array):
            raise TypeError(f"tensor {name!r} must be an mx.array, not {type(array).__name__}")
        dtype = _BY_MX.get(array.dtype)
        if dtype is None:
            raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which records cannot store")
        checked.append((name, dtype, array))
    mx.eval([array for _, _, array in checked])  # one evaluation for all lazy arrays
    payloads = []
    for name, dtype, array in checked:
        shape = tuple(array.shape)
        if array.size == 0:
            payloads.append(_Payload(name, dtype, shape, memoryview(b"")))
            continue
        view = memoryview(array)
        if not view.c_contiguous:  # transposed or sliced: the one case that needs a copy
            array = mx.contiguous(array)
            mx.eval(array)
            view = memoryview(array)
        payloads.append(_Payload(name, dtype, shape, view.cast("B")))
    return payloads


def _meta_json(meta: Mapping[str, Any]) -> str:
    if not isinstance(meta, Mapping):
        raise TypeError(f"record.meta must be a dict, not {type(meta).__name__}")
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"record.meta must be JSON-serialisable: {exc}") from None


def _sum_field(value: str) -> bytes:
    """The exact bytes of the header-checksum entry inside the header JSON."""
    return f'"{_K_HEADER_SUM}":"{value}"'.encode("ascii")


def _encode_header(metadata: Mapping[str, str], table: Mapping[str, Mapping[str, Any]]) -> bytes:
    """Length prefix + JSON header, with the header checksum filled in.

    The checksum covers every header byte (padding included) as written with
    the checksum's own value set to zeros, so a reader can verify the raw bytes
    rather than a re-serialisation (which would miss e.g. changed whitespace).
    """
    document = {"__metadata__": {**metadata, _K_HEADER_SUM: _ZERO_DIGEST}, **table}
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)  # 8-byte alignment of the data section, as safetensors does
    if text.count(_sum_field(_ZERO_DIGEST)) != 1:
        raise ValueError("a tensor name or metadata value collides with the header checksum field")
    text = text.replace(_sum_field(_ZERO_DIGEST), _sum_field(_digest(text)))
    return len(text).to_bytes(8, "little") + text


# --------------------------------------------------------------------------
# Decoding


class _Entry(NamedTuple):
    name: str
    dtype: _DType
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class _Decoded:
    agent_id: str
    tokens: list[int]
    meta: dict[str, Any]
    entries: list[_Entry]
    buffer: bytearray
    data_start: int

    def to_record(self) -> CacheRecord:
        """Copy each tensor once, from the read buffer into MLX memory."""
        tensors: dict[str, mx.array] = {}
        for entry in self.entries:
            if entry.name == TOKENS_TENSOR:
                continue
            flat = np.frombuffer(
                self.buffer,
                dtype=entry.dtype.storage,
                count=math.prod(entry.shape),
                offset=self.data_start + entry.begin,
            )
            array = mx.array(flat.reshape(entry.shape))
            if entry.dtype.mx_dtype != array.dtype:  # bfloat16 travelled as uint16
                array = array.view(entry.dtype.mx_dtype)
            tensors[entry.name] = array
        mx.eval(list(tensors.values()))
        return CacheRecord(tokens=self.tokens, tensors=tensors, meta=self.meta)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entries(document: dict[str, Any], data_length: int) -> list[_Entry]:
    entries = []
    for name, info in document.items():
        if not isinstance(info, dict):
            raise RecordRejected(f"garbled header: entry {name!r} is not an object")
        dtype = _BY_NAME.get(info.get("dtype"))  # type: ignore[arg-type]
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if dtype is None:
            raise RecordRejected(f"garbled header: tensor {name!r} has unknown dtype {info.get('dtype')!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise RecordRejected(f"garbled header: tensor {name!r} has an invalid shape")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise RecordRejected(f"garbled header: tensor {name!r} has invalid data offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.storage.itemsize:
            raise RecordRejected(f"garbled header: tensor {name!r}'s offsets do not match its shape")
        entries.append(_Entry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            raise RecordRejected("garbled header: tensor data overlaps or leaves gaps")
        expected = entry.end
    if expected > data_length:
        raise RecordRejected(f"truncated: the header describes {expected} data bytes but the file holds {data_length}")
    if expected < data_length:
        raise RecordRejected(f"{data_length - expected} unexpected bytes after the tensor data")
    return entries


def _verify_header_checksum(raw: bytes, metadata: dict[str, str]) -> None:
    stored = metadata.get(_K_HEADER_SUM)
    if not isinstance(stored, str) or not _HEX_DIGEST.fullmatch(stored):
        raise RecordRejected("garbled header: header checksum is missing or malformed")
    if raw.count(_sum_field(stored)) != 1:
        raise RecordRejected("garbled header: header checksum field is not where it belongs")
    if _digest(raw.replace(_sum_field(stored), _sum_field(_ZERO_DIGEST))) != stored:
        raise RecordRejected("header checksum mismatch: the header was modified or corrupted")


def _json_field(metadata: dict[str, str], key: str, kind: type) -> Any:
    try:
        value = json.loads(metadata[key])
    except (KeyError, TypeError, ValueError):
        value = None
    if not isinstance(value, kind):
        raise RecordRejected(f"garbled header: field {key!r} is missing or not a JSON {kind.__name__}")
    return value


def _header_length(prefix: bytes | bytearray, size: int) -> int:
    """Length of the JSON header from the first 8 bytes of a file of ``size`` bytes."""
    if size < 8:
        raise RecordRejected(f"truncated: the file has only {size} bytes")
    header_length = int.from_bytes(prefix[:8], "little")
    if header_length == 0 or header_length > _MAX_HEADER_BYTES:
        raise RecordRejected(f"garbled header: impossible header length {header_length}")
    if 8 + header_length > size:
        raise RecordRejected(f"truncated: the header needs {8 + header_length} bytes but the file has {size}")
    return header_length


def _decode_header(raw: bytes, model_fingerprint: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse and authenticate the JSON header: (tensor table, metadata)."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RecordRejected(f"garbled header: not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise RecordRejected("garbled header: not a JSON object")
    metadata = document.pop("__metadata__", None)
    if not isinstance(metadata, dict) or _K_FORMAT not in metadata:
        raise RecordRejected("missing kvshelf header: not a kvshelf record")
    if not all(isinstance(v, str) for v in metadata.values()):
        raise RecordRejected("garbled header: metadata values must be strings")
    # The version comes first: a future format may checksum its header differently.
    if metadata[_K_FORMAT] != str(FORMAT_VERSION):
        raise RecordRejected(
            f"unsupported format version {metadata[_K_FORMAT]!r} (this kvshelf reads version {FORMAT_VERSION})"
        )
    _verify_header_checksum(raw, metadata)
    fingerprint = metadata.get(_K_FINGERPRINT)
    if fingerprint != model_fingerprint:
        raise RecordRejected(
            f"foreign model: written for model fingerprint {str(fingerprint)[:24]!r}, "
            f"expected {model_fingerprint[:24]!r}"
        )
    return document, metadata


def _decode(buffer: bytearray, model_fingerprint: str) -> _Decoded:
    """Validate a whole record file in memory; raise RecordRejected if unusable.

    Checks run from the cheapest to the most expensive, and every structural
    fact is verified before anything indexes into the data, so a corrupted file
    can only ever produce RecordRejected (MLX never sees unchecked bytes).
    """
    size = len(buffer)
    header_length = _header_length(buffer, size)
    document, metadata = _decode_header(bytes(buffer[8 : 8 + header_length]), model_fingerprint)
    data_start = 8 + header_length
    entries = _parse_entries(document, size - data_start)
    meta = _json_field(metadata, _K_META, dict)
    checksums = _json_field(metadata, _K_CHECKSUMS, dict)
    if set(checksums) != {e.name for e in entries}:
        raise RecordRejected("garbled header: the checksum list does not match the tensors")
    data = memoryview(buffer)[data_start:]
    for entry in entries:
        if _digest(data[entry.begin : entry.end]) != checksums[entry.name]:
            raise RecordRejected(f"checksum mismatch in tensor {entry.name!r}: the data is corrupted")
    token_entry = next((e for e in entries if e.name == TOKENS_TENSOR), None)
    if token_entry is None or token_entry.dtype.name != "I32" or len(token_entry.shape) != 1:
        raise RecordRejected(f"garbled header: no int32 vector {TOKENS_TENSOR!r}")
    n_tokens = metadata.get(_K_NTOKENS, "")
    if not n_tokens.isdigit() or int(n_tokens) != token_entry.shape[0]:
        raise RecordRejected(
            f"token count mismatch: the header says {n_tokens!r}, the token tensor holds {token_entry.shape[0]}"
        )
    agent_id = metadata.get(_K_AGENT)
    if not isinstance(agent_id, str):
        raise RecordRejected("garbled header: agent id is missing")
    tokens = np.frombuffer(
        buffer, dtype=np.int32, count=token_entry.shape[0], offset=data_start + token_entry.begin
    ).tolist()
    return _Decoded(agent_id, tokens, meta, entries, buffer, data_start)


# --------------------------------------------------------------------------
# Filesystem helpers


def _write_all(fd: int, data: memoryview | bytes) -> int:
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])
    return written


def _fsync_file(fd: int) -> None:
    """fsync; on macOS plain fsync does not reach the platter, F_FULLFSYNC does."""
    if sys.platform == "darwin":
        import fcntl

        with suppress(OSError, AttributeError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)  # type: ignore[attr-defined]
            return
    os.fsync(fd)


def _read_file(path: Path) -> bytearray:
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            count = file.readinto(view[got:])
            if not count:
                break
            got += count
        del view
    return buffer if got == size else buffer[:got]


# --------------------------------------------------------------------------
# The store


class RecordStore:
    """Per-agent records of one model under ``root/<fingerprint[:16]>/``.

    Layout of that directory::

        <agent_id>.safetensors   the record
        <agent_id>.lock          its inter-process lock file
        .<agent_id>.<hex>.tmp    a save in progress (or left by a crashed writer)
        quarantine/              rejected records and their .reason files
    """

    def __init__(self, root: Path, model_fingerprint: str, *, lock_timeout: float = 60.0) -> None:
        """``model_fingerprint`` must be a hex digest (e.g. sha256) of the model.

        ``lock_timeout`` bounds how long save/load/delete wait for another
        process's hold on the same agent before raising StorageError.
        """
        if (
            not isinstance(model_fingerprint, str)
            or len(model_fingerprint) < 16
            or not _HEX.fullmatch(model_fingerprint)
        ):
            raise ValueError(
                "model_fingerprint must be a hex digest of at least 16 characters "
                f"(e.g. hashlib.sha256(...).hexdigest()), got {model_fingerprint!r:.80}"
            )
        self.model_fingerprint = model_fingerprint.lower()
        self.root = Path(root)
        self.directory = self.root / self.model_fingerprint[:16]
        self.quarantine_dir = self.directory / QUARANTINE_DIRNAME
        self.lock_timeout = lock_timeout

    def __repr__(self) -> str:
        return f"RecordStore({str(self.directory)!r})"

    # -- paths ---------------------------------------------------------------

    def path_for(self, agent_id: str) -> Path:
        """The record path of ``agent_id``; raises InvalidAgentId for a bad id.

        Besides validating the id, the resolved path must sit directly inside
        the store directory, so a symlink planted at the record's name cannot
        make a load read (or a quarantine move) a file elsewhere.
        """
        agent_id = validate_agent_id(agent_id)
        path = self.directory / f"{agent_id}{RECORD_SUFFIX}"
        if path.resolve().parent != self.directory.resolve():
            raise StorageError(
                errno.EPERM,
                f"refusing to use the record of agent {agent_id!r}: it links outside the store",
                str(path),
            )
        return path

    def _lock_path(self, agent_id: str) -> Path:
        return self.directory / f"{agent_id}{LOCK_SUFFIX}"

    def _ensure_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            message = f"cannot create the store directory: {exc.strerror}"
            raise StorageError(exc.errno, message, str(self.directory)) from exc

    # -- locking -------------------------------------------------------------

    def lock(self, agent_id: str) -> filelock.BaseFileLock:
        """The inter-process lock of one agent, usable as ``with store.lock(id):``.

        It is reentrant in a thread (the store's own methods may be called while
        it is held) and shared by every RecordStore of the process for that path.
        A plain ``with`` waits indefinitely; use ``.acquire(timeout=...)`` to bound it.
        """
        agent_id = validate_agent_id(agent_id)
        self._ensure_directory()
        return filelock.FileLock(self._lock_path(agent_id), is_singleton=True)

    @contextmanager
    def _held(self, agent_id: str) -> Iterator[filelock.BaseFileLock]:
        lock = self.lock(agent_id)
        try:
            lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as exc:
            raise StorageError(
                errno.ETIMEDOUT,
                f"timed out after {self.lock_timeout}s waiting for the lock of agent {agent_id!r}",
                str(lock.lock_file),
            ) from exc
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot lock agent {agent_id!r}: {exc}", str(lock.lock_file)) from exc
        try:
            yield lock
        finally:
            lock.release()

    # -- public operations ---------------------------------------------------

    def save(self, agent_id: str, record: CacheRecord) -> int:
        """Atomically replace the agent's record; returns the bytes written.

        Raises ValueError/TypeError for a malformed record (nothing is written)
        and StorageError when the filesystem fails, in which case the previous
        record is left exactly as it was.
        """
        agent_id = validate_agent_id(agent_id)
        path = self.path_for(agent_id)
        tokens = _tokens_payload(record.tokens)
        payloads = [tokens, *_tensor_payloads(record.tensors)]
        # Largest items first keeps every tensor aligned to its item size.
        payloads.sort(key=lambda p: (-p.dtype.storage.itemsize, p.name))
        table, offset = {}, 0
        for payload in payloads:
            table[payload.name] = {
                "dtype": payload.dtype.name,
                "shape": list(payload.shape),
                "data_offsets": [offset, offset + len(payload.data)],
            }
            offset += len(payload.data)
        metadata = {
            _K_FORMAT: str(FORMAT_VERSION),
            _K_FINGERPRINT: self.model_fingerprint,
            _K_AGENT: agent_id,
            _K_META: _meta_json(record.meta),
            _K_NTOKENS: str(tokens.shape[0]),
            _K_CHECKSUMS: json.dumps(
                {p.name: _digest(p.data) for p in payloads}, sort_keys=True, separators=(",", ":")
            ),
        }
        header = _encode_header(metadata, table)
        with self._held(agent_id):
            self._remove_stale_temps(agent_id)
            return self._write_atomically(agent_id, path, [header, *(p.data for p in payloads)])

    def load(self, agent_id: str) -> CacheRecord | None:
        """The agent's record, or None when there is none or it was unusable.

        An unusable record (truncated, corrupted, foreign model, unknown format,
        ...) is moved to ``quarantine_dir`` with a ``.reason`` file and a
        warning is logged. Raises StorageError only when the file exists but
        cannot be read (permissions, I/O error) or the lock cannot be taken.
        """
        agent_id = validate_agent_id(agent_id)
        path = self.path_for(agent_id)
        if not path.exists():  # no lock file is created for agents never saved
            return None
        with self._held(agent_id):
            try:
                buffer = _read_file(path)
            except FileNotFoundError:
                return None
            except OSError as exc:
                logger.error("kvshelf: cannot read the record of agent %r at %s: %s", agent_id, path, exc)
                message = f"cannot read the record of agent {agent_id!r}: {exc.strerror}"
                raise StorageError(exc.errno, message, str(path)) from exc
            try:
                decoded = _decode(buffer, self.model_fingerprint)
            except RecordRejected as rejected:
                self._quarantine(agent_id, path, rejected.reason)
                return None
        if decoded.agent_id != agent_id:
            # A valid record of another agent, e.g. "Alice" vs "alice" on a
            # case-insensitive filesystem: not corrupt, just not ours.
            logger.warning(
                "kvshelf: %s holds the record of agent %r, not %r; ignoring it (the next save replaces it)",
                path,
                decoded.agent_id,
                agent_id,
            )
            return None
        return decoded.to_record()

    def delete(self, agent_id: str) -> list[Path]:
        """Erase the agent: its record, lock file, temp files and quarantined records.

        This is the erasure of a person's data, so nothing of the agent stays:
        temp files that a crashed save left behind go however young they are (a
        live writer holds the lock we hold, so every one left is dead), and so do
        its quarantined records and their reason files (they hold its token ids).
        The lock file is kept when the caller itself holds the agent's lock around
        this call, so that its hold stays meaningful. Other agents' files,
        including ones whose id merely starts with this one, are never touched.
        Returns the paths removed.
        """
        agent_id = validate_agent_id(agent_id)
        path = self.path_for(agent_id)
        lock_path = self._lock_path(agent_id)
        if not (path.exists() or lock_path.exists() or self._stale_temps(agent_id, 0.0) or self._quarantined(agent_id)):
            return []  # nothing to remove, and no lock file left behind by looking
        removed: list[Path] = []
        with self._held(agent_id) as lock:
            for victim in [path, *self._stale_temps(agent_id, 0.0), *self._quarantined(agent_id)]:
                with suppress(FileNotFoundError):
                    victim.unlink()
                    removed.append(victim)
            if lock.lock_counter == 1:  # our hold is the outermost one
                with suppress(FileNotFoundError):
                    lock_path.unlink()
                    removed.append(lock_path)
        if removed:
            self._fsync_directory()
        return removed

    def size_on_disk(self, agent_id: str) -> int:
        """Bytes of the agent's record on disk, 0 when there is none."""
        try:
            return self.path_for(agent_id).stat().st_size
        except FileNotFoundError:
            return 0

    def mtime(self, agent_id: str) -> float | None:
        """When the agent's record was last saved (``time.time()`` scale), None if absent."""
        try:
            return self.path_for(agent_id).stat().st_mtime
        except FileNotFoundError:
            return None

    def token_count(self, agent_id: str) -> int:
        """Tokens in the agent's record, read from its header alone; 0 if none.

        A cheap peek for listings: it trusts a header that passes its own
        checksum and fingerprint check but does not verify the tensor data (that
        is load's job), and it never quarantines anything.
        """
        try:
            with open(self.path_for(agent_id), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                header_length = _header_length(file.read(8), size)
                _, metadata = _decode_header(file.read(header_length), self.model_fingerprint)
        except (OSError, RecordRejected):
            return 0
        count = metadata.get(_K_NTOKENS, "")
        return int(count) if count.isdigit() else 0

    def quarantine(self, agent_id: str, reason: str) -> Path | None:
        """Move the agent's record aside because the caller found it unusable.

        For records that pass every check here but do not fit the model's cache
        layout. Returns where the file went, None if there was no record.
        """
        agent_id = validate_agent_id(agent_id)
        path = self.path_for(agent_id)
        if not path.exists():
            return None
        with self._held(agent_id):
            return self._quarantine(agent_id, path, reason)

    def agent_ids(self) -> list[str]:
        """Sorted ids of the agents that have a record in this store."""
        try:
            with os.scandir(self.directory) as listing:
                entries = list(listing)
        except FileNotFoundError:
            return []
        ids = []
        for entry in entries:
            if entry.name.endswith(RECORD_SUFFIX) and entry.is_file(follow_symlinks=False):
                candidate = entry.name[: -len(RECORD_SUFFIX)]
                if is_valid_agent_id(candidate):
                    ids.append(candidate)
        return sorted(ids)

    # -- internals -----------------------------------------------------------

    def _write_atomically(self, agent_id: str, path: Path, chunks: list[memoryview | bytes]) -> int:
        """Temp file, fsync, rename, fsync dir; on failure the old record stays."""
        temp = self.directory / f".{agent_id}.{secrets.token_hex(16)}{TEMP_SUFFIX}"
        fd = -1
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(temp, flags, 0o600)  # a KV cache reveals its prompt: owner-only
            written = sum(_write_all(fd, chunk) for chunk in chunks)
            _fsync_file(fd)
            os.close(fd)
            fd = -1
            os.replace(temp, path)
        except BaseException as exc:
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)
            with suppress(OSError):
                temp.unlink()
            if not isinstance(exc, OSError):
                raise
            logger.error("kvshelf: saving the record of agent %r to %s failed: %s", agent_id, path, exc)
            reason = exc.strerror or str(exc)
            raise StorageError(
                exc.errno,
                f"could not save the record of agent {agent_id!r} ({reason}); the previous record is unchanged",
                str(path),
            ) from exc
        self._fsync_directory()
        return written

    def _fsync_directory(self) -> None:
        """Make renames durable. Some filesystems refuse to fsync a directory;
        the rename has happened by then, so that is only worth a warning."""
        try:
            fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning(
                "kvshelf: could not fsync %s (%s); the last change may not survive a power loss", self.directory, exc
            )

    def _quarantined(self, agent_id: str) -> list[Path]:
        """This agent's quarantined records and reason files (see ``_quarantine`` for the names)."""
        pattern = re.compile(rf"{re.escape(agent_id)}\.\d{{8}}T\d{{6}}\.\d{{6}}Z\.[0-9a-f]{{8}}\.(safetensors|reason)")
        with suppress(FileNotFoundError), os.scandir(self.quarantine_dir) as entries:
            return [Path(e.path) for e in entries if pattern.fullmatch(e.name)]
        return []

    def _stale_temps(self, agent_id: str, min_age: float = STALE_TEMP_SECONDS) -> list[Path]:
        """Temp files of this agent's writers that died mid-save (at least ``min_age`` s old)."""
        pattern = re.compile(rf"\.{re.escape(agent_id)}\.[0-9a-f]{{32}}{re.escape(TEMP_SUFFIX)}")
        deadline = time.time() - min_age
        stale = []
        with suppress(FileNotFoundError), os.scandir(self.directory) as entries:
            for entry in entries:
                if pattern.fullmatch(entry.name):
                    with suppress(OSError):
                        if min_age <= 0 or entry.stat(follow_symlinks=False).st_mtime < deadline:
                            stale.append(Path(entry.path))
        return stale

    def _remove_stale_temps(self, agent_id: str) -> None:
        for temp in self._stale_temps(agent_id):
            with suppress(OSError):
                temp.unlink()
                logger.info("kvshelf: removed %s, left by a save that did not finish", temp)

    def _quarantine(self, agent_id: str, path: Path, reason: str) -> Path | None:
        """Move an unusable record aside (never delete it) and say why."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        stem = f"{agent_id}.{stamp}.{secrets.token_hex(4)}"
        target = self.quarantine_dir / f"{stem}{RECORD_SUFFIX}"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.error(
                "kvshelf: the record of agent %r at %s is unusable (%s) and could not be quarantined (%s); ignoring it",
                agent_id,
                path,
                reason,
                exc,
            )
            return None
        note = (
            f"agent: {agent_id}\nreason: {reason}\nmoved from: {path}\n"
            f"quarantined at: {stamp}\nexpected model fingerprint: {self.model_fingerprint}\n"
        )
        try:
            target.with_suffix(".reason").write_text(note, encoding="utf-8")
        except OSError as exc:
            logger.error("kvshelf: could not write the reason file for %s: %s", target, exc)
        self._fsync_directory()
        logger.warning(
            "kvshelf: the record of agent %r was rejected (%s); moved to %s and will be recomputed",
            agent_id,
            reason,
            target,
        )
        return target
