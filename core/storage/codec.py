"""The record file format: a CacheRecord as safetensors bytes, sealed with checksums.

``kvshelf.storage.records`` (the file store) decides where the bytes go and how they
get there safely; this module only turns a record into bytes and back, and judges
whether bytes are a sound record of this model (``RecordRejected`` says why not).

Layout (a standard safetensors file, readable by ``mx.load``)::

    u64 little-endian header length N | N bytes JSON header | tensor data

The header's ``__metadata__`` (all strings) holds the format version, the full
model fingerprint, the agent id, the caller's ``meta`` as JSON, the token count,
a blake2b-128 checksum per tensor and a blake2b-128 checksum of the header
bytes themselves (computed with its own value zeroed). Token ids are stored as
the int32 tensor ``__tokens__``; prompt text is never stored. For shared stores the
header also holds the record's ``generation`` and the writer's node id, and a delete's
tombstone is a record with no tokens marked ``tombstone`` (``Stamp``); records written
before these keys existed read as generation 0, written by no named node.

A record is only worth anything if it is *exactly* what was saved, so every byte is
covered by a checksum and every structural fact is verified before anything indexes
into the data. Tensors are streamed straight from MLX's memory (``memoryview``),
hashed in place, and read back with one copy into MLX. We write the bytes ourselves
instead of calling ``mx.save_safetensors``: the latter reports success even when the
disk is full, which would replace a good record with a truncated one.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import mlx.core as mx
import numpy as np

from kvshelf.errors import RecordRejected
from kvshelf.kv.record import CacheRecord
from kvshelf.model.arrays import borrow

__all__ = [
    "FORMAT_VERSION",
    "TOKENS_TENSOR",
    "Decoded",
    "RecordRejected",
    "Stamp",
    "decode",
    "encode",
    "header_of",
    "read_header",
    "read_token_count",
]

FORMAT_VERSION: int = 1
TOKENS_TENSOR = "__tokens__"

# safetensors' own limit; anything larger is a corrupted length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DIGEST_SIZE = 16
_ZERO_DIGEST = "0" * (2 * _DIGEST_SIZE)
_HEX_DIGEST = re.compile(rf"[0-9a-f]{{{2 * _DIGEST_SIZE}}}")
_MAX_TOKEN_ID = 2**31 - 1

# __metadata__ keys.
_K_FORMAT = "kvshelf.format_version"
_K_FINGERPRINT = "kvshelf.model_fingerprint"
_K_AGENT = "kvshelf.storage.agent_id"
_K_META = "kvshelf.meta"
_K_NTOKENS = "kvshelf.n_tokens"
_K_CHECKSUMS = "kvshelf.tensor_blake2b"
_K_HEADER_SUM = "kvshelf.header_blake2b"
# Added for shared stores (``kvshelf.storage.records``); absent from older records, which read
# as generation 0, written by no named node, and live.
_K_GENERATION = "kvshelf.generation"
_K_NODE = "kvshelf.node_id"
_K_TOMBSTONE = "kvshelf.tombstone"


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
    return _Payload(TOKENS_TENSOR, _BY_NAME["I32"], narrow.shape, narrow.data.cast("B"))


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
        view = borrow(array)
        if not view.c_contiguous:  # transposed or sliced: the one case that needs a copy
            array = mx.contiguous(array)
            mx.eval(array)
            view = borrow(array)
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


def encode_header(metadata: Mapping[str, str], table: Mapping[str, Mapping[str, Any]]) -> bytes:
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


def encode(
    record: CacheRecord,
    agent_id: str,
    model_fingerprint: str,
    *,
    generation: int = 0,
    node_id: str | None = None,
    tombstone: bool = False,
) -> list[bytes | memoryview]:
    """The file's bytes, in chunks to write in order (tensors borrowed, not copied).

    ``generation`` (how many writes of this agent came before, plus one) and ``node_id``
    (the writer) go in the header, under its checksum; ``tombstone`` marks the record
    that a delete leaves in a shared store (no tokens, no tensors: see ``Decoded.tombstone``).
    Raises ValueError/TypeError for a malformed record, before anything is written.
    """
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise ValueError(f"generation must be a non-negative int, got {generation!r}")
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
        _K_FINGERPRINT: model_fingerprint,
        _K_AGENT: agent_id,
        _K_META: _meta_json(record.meta),
        _K_NTOKENS: str(tokens.shape[0]),
        _K_CHECKSUMS: json.dumps({p.name: _digest(p.data) for p in payloads}, sort_keys=True, separators=(",", ":")),
        _K_GENERATION: str(generation),
    }
    if node_id is not None:
        metadata[_K_NODE] = node_id
    if tombstone:
        metadata[_K_TOMBSTONE] = "1"
    return [encode_header(metadata, table), *(p.data for p in payloads)]


# --------------------------------------------------------------------------
# Decoding


class _Entry(NamedTuple):
    name: str
    dtype: _DType
    shape: tuple[int, ...]
    begin: int
    end: int


class Stamp(NamedTuple):
    """Who wrote a record and its place in the agent's history, from its header alone."""

    generation: int
    """Writes of this agent before this one, plus one (0: a record older than generations)."""
    node_id: str | None
    """The node that wrote it (None: not written by a named node)."""
    tombstone: bool
    """A delete's mark in a shared store: the agent is gone, and no older writer may come back."""


def encode_tombstone(
    agent_id: str, model_fingerprint: str, generation: int, node_id: str | None
) -> list[bytes | memoryview]:
    """The record a delete leaves in a shared store: no tokens, marked a tombstone, at
    ``generation`` (so no stale writer gets past it); the agent starts cold above it."""
    return encode(
        CacheRecord(tokens=[]), agent_id, model_fingerprint, generation=generation, node_id=node_id, tombstone=True
    )


def _stamp(metadata: Mapping[str, str]) -> Stamp:
    generation = metadata.get(_K_GENERATION, "0")
    if not generation.isdigit():
        raise RecordRejected(f"garbled header: generation {generation[:20]!r} is not a number")
    return Stamp(int(generation), metadata.get(_K_NODE), metadata.get(_K_TOMBSTONE) == "1")


@dataclass
class Decoded:
    agent_id: str
    tokens: list[int]
    meta: dict[str, Any]
    entries: list[_Entry]
    buffer: bytearray
    data_start: int
    stamp: Stamp = Stamp(0, None, False)

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


def decode(buffer: bytearray, model_fingerprint: str) -> Decoded:
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
    return Decoded(agent_id, tokens, meta, entries, buffer, data_start, _stamp(metadata))


def read_token_count(file: IO[bytes], size: int, model_fingerprint: str) -> int:
    """The token count from a record's header alone (``file`` at offset 0, ``size`` bytes).

    Trusts a header that passes its own checksum and fingerprint check without
    verifying the tensor data; raises RecordRejected or OSError."""
    return read_header(file, size, model_fingerprint)[0]


def read_header(file: IO[bytes], size: int, model_fingerprint: str) -> tuple[int, Stamp]:
    """The token count and the stamp from a record's header alone (``file`` at offset 0),
    on the same terms as ``read_token_count``."""
    header_length = _header_length(file.read(8), size)
    _, metadata = _decode_header(file.read(header_length), model_fingerprint)
    count = metadata.get(_K_NTOKENS, "")
    return (int(count) if count.isdigit() else 0), _stamp(metadata)


def header_of(prefix: bytes | bytearray, size: int, model_fingerprint: str) -> tuple[int, Stamp] | int:
    """``read_header`` on the first bytes of a record of ``size`` bytes (a ranged read of a
    remote object); the number of leading bytes needed instead when ``prefix`` is too short."""
    header_length = _header_length(prefix, size)
    if len(prefix) < 8 + header_length:
        return 8 + header_length
    _, metadata = _decode_header(bytes(prefix[8 : 8 + header_length]), model_fingerprint)
    count = metadata.get(_K_NTOKENS, "")
    return (int(count) if count.isdigit() else 0), _stamp(metadata)
