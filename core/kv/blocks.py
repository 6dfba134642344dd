"""A 4-bit KV cache for one attention layer, full or sliding-window, in 256-token blocks.

mlx-lm quantizes only full-attention caches (``RotatingKVCache.to_quantized`` raises),
so Gemma 3's sliding layers need this class. It keeps K and V as packed uint32 data
with 16-bit scales and biases, one quantization group per ``group_size`` channels of
each token, in a buffer that grows and shrinks a whole 256-token block at a time.

Why this shape:
- Each token is quantized on its own, so a partial block is as exact as a full one,
  and cutting the cache back to any position leaves the same bits as if it had
  never gone further. That is what makes a restore from disk bit-identical.
- A sliding layer drops its oldest blocks once they are more than one block beyond
  the window (the "slack" block). Memory stays bounded however long the conversation
  grows, yet the cache can always rewind a turn's worth of tokens (the next prompt
  often re-renders the last few tokens of the previous reply differently).
- Attention reads the quantized blocks directly. For a few query tokens (decode) on a
  GPU, the cache exposes ``bits`` so that mlx-lm's attention runs ``quantized_matmul``
  over the packed data. For a long chunk (prefill), ``quantized_matmul`` is 10x slower
  than dequantizing once and running the fused dense kernel, so the cache then hides
  ``bits`` and returns the dequantized blocks; so it does for decode on the CPU, where
  ``quantized_matmul`` is slow too (``packed_decode``). Either way every token is seen through
  its 4-bit representation, including the chunk's own tokens (per-channel key schemes
  keep an open fp16 block; ``kvschemes`` says how a query reads it).
- A forked agent starts on a shared base (``SharedLayer``): whole blocks of a common
  prefix, held once in RAM however many agents use them, and never written. The
  cache's own buffer holds only the rows after the base. MLX arrays are values, so
  the partial block a fork starts with is copied on its first write, not before.
  Rewinding into the base copies the kept rows into the cache's own buffer first
  (copy-on-write), so a shared block is never changed under another agent.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache

from kvshelf.kv import row_coding
from kvshelf.kv.row_coding import NpTriple
from kvshelf.model.spec import BLOCK_TOKENS, LayerSpec

# Up to this many query tokens, attention runs quantized_matmul on the packed blocks
# (measured on the CPU: best for one query, worse than dequantize + dense from 4 up).
QUANTIZED_ATTENTION_MAX_QUERY = 1
SCALE_DTYPE = mx.float16

# Whether a plain scheme's decode step hands its packed rows to ``quantized_matmul``
# (``packed_decode``); None: where that pays, on a GPU. On the CPU, MLX's 4-bit
# ``quantized_matmul`` runs at about 1.7 GFLOP/s, so plain per-token Q4 decoded 3.4-12.8x
# slower than the default scheme's dense working set on the embedded model and 5.7-11.9x
# on the llama, at 1K-16K and batch 1-8 (``benchmarks/decode.py``,
# ``decode-20261207-170858.json`` and ``-171859.json``): there its full blocks are now held
# dequantized while the agent decodes, as every other scheme's are. Tests set it to keep
# the packed path covered on the CPU.
PACKED_DECODE: bool | None = None


def packed_decode() -> bool:
    """Whether plain schemes decode on their packed rows (``PACKED_DECODE``)."""
    if PACKED_DECODE is not None:
        return PACKED_DECODE
    return mx.default_device().type == mx.gpu


QTriple = tuple[mx.array, mx.array, mx.array]
# New rows' at-rest codes (``QuantizedLayerCache.code_rows``): keys (None where keys wait
# in fp16 until their block is full) and values.
Codes = tuple[QTriple | None, QTriple]
# One token's codes on numpy rows (``CodedRows.member``): what ``stage`` takes.
RowCodes = tuple[NpTriple | None, NpTriple]
# A token staged for a later write (``QuantizedLayerCache.stage``): its fp32 K and V rows
# (heads x dim) and their codes.
Staged = tuple[np.ndarray, np.ndarray, RowCodes]


@dataclass
class CodedRows:
    """New rows coded on numpy rows with MLX's bits (``kvshelf.kv.row_coding``): what
    attention reads of them once appended (fp32), and their at-rest codes (packed words,
    fp16 scales and biases; keys None where they wait in fp16 until their block is full)."""

    keys: np.ndarray
    values: np.ndarray
    key_codes: NpTriple | None
    value_codes: NpTriple

    def member(self, b: int) -> RowCodes:
        """Row ``b``'s codes (one agent's token of a decode step), as ``stage`` takes them."""
        row = lambda q: (q[0][b], q[1][b], q[2][b])  # noqa: E731
        return (row(self.key_codes) if self.key_codes is not None else None), row(self.value_codes)


_NO_STATE = (
    "a kvshelf KV cache cannot be saved or loaded through mlx-lm's cache state "
    "(save_prompt_cache/load_prompt_cache): it would write an empty cache. "
    "Use kvshelf's records instead (the engine saves every agent to its RecordStore)."
)


@dataclass
class LayerRows:
    """A layer cache's own rows as a record stores them: packed K/V rows after any
    shared base (None when it holds none), and the fp16 extras of coded schemes."""

    keys: QTriple | None = None
    values: QTriple | None = None
    k_tail: mx.array | None = None  # per-channel keys' partial last block
    sink_k: mx.array | None = None  # attention sinks
    sink_v: mx.array | None = None


class SharedLayer:
    """Whole blocks of one layer's K/V that several agents' caches start with.

    ``rows`` rows, from absolute position ``start``; immutable once built. Caches hold
    it by reference, so it stays in RAM exactly as long as some resident agent uses it.
    """

    __slots__ = ("keys", "values", "start", "rows", "__weakref__")

    def __init__(self, keys: QTriple, values: QTriple, start: int) -> None:
        self.keys, self.values, self.start = keys, values, start
        self.rows = keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.keys, *self.values))

    def tail(self, drop: int) -> SharedLayer | None:
        """The same blocks without the first ``drop`` rows (a window moving past them)."""
        if drop >= self.rows:
            return None
        cut = lambda q: tuple(x[..., drop:, :] for x in q)  # noqa: E731
        return SharedLayer(cut(self.keys), cut(self.values), self.start + drop)


def group_size_for(layer: LayerSpec, preferred: int = 64) -> int:
    """The largest supported group size that divides both K and V head dims."""
    for g in (preferred, 64, 32):
        if layer.k_head_dim % g == 0 and layer.v_head_dim % g == 0:
            return g
    raise ValueError(
        f"head dims {layer.k_head_dim}/{layer.v_head_dim} are not multiples of 32; "
        "kvshelf cannot quantize this model's KV cache"
    )


def _map3(f: Callable[[mx.array], mx.array], q: QTriple) -> QTriple:
    return f(q[0]), f(q[1]), f(q[2])


def each(q: QTriple, fn: Callable[[mx.array], mx.array]) -> QTriple:
    """``fn`` applied alike to the packed words, the scales and the biases."""
    return fn(q[0]), fn(q[1]), fn(q[2])


def pairwise(a: QTriple, b: QTriple, fn: Callable[[mx.array, mx.array], mx.array]) -> QTriple:
    """``fn`` on matching parts of two triples (words with words, scales with scales...)."""
    return fn(a[0], b[0]), fn(a[1], b[1]), fn(a[2], b[2])


T = TypeVar("T")


class Settled(Generic[T]):
    """A layer cache's buffer field (stored as ``_<name>``): reading or writing it first
    writes the tokens the cache holds staged (``QuantizedLayerCache.stage``), so nothing
    outside the cache sees a buffer without them."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._raw = "_" + name

    @overload
    def __get__(self, obj: None, owner: type) -> Settled[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        obj.settle()
        return getattr(obj, self._raw)

    def __set__(self, obj: Any, value: T) -> None:
        obj.settle()
        setattr(obj, self._raw, value)


def _stacked(rows: list[np.ndarray]) -> mx.array:
    """One token's (heads, x) rows each, as one (1, heads, tokens, x) MLX array."""
    return mx.array(np.stack(rows, axis=1)[None])


def _stacked_codes(codes: list[NpTriple]) -> QTriple:
    w, s, z = (_stacked([c[i] for c in codes]) for i in range(3))
    return w, s, z


def _blocks(n: int) -> int:
    return -(-n // BLOCK_TOKENS)


class PackedFetch:
    """The ``bits`` attribute, present only while the last fetch returned packed data.

    mlx-lm's attention runs ``quantized_matmul`` on any cache that has ``bits``; hiding
    it makes the same cache hand over dense K/V instead (see the module doc).
    """

    _bits: int
    _quantized_fetch: bool = False

    @property
    def bits(self) -> int:
        if not self._quantized_fetch:
            raise AttributeError("bits")
        return self._bits


class QuantizedLayerCache(PackedFetch, _BaseCache):
    """One layer's K/V in 4-bit blocks; a drop-in cache for mlx-lm attention layers.

    Subclasses (``kvschemes``) change how tokens are coded through a few hooks:
    ``_write`` (store new tokens), ``_dequantize_keys``/``_dequantize_values`` (the
    dense path) and ``QUANTIZED_DECODE`` (whether the packed rows can go straight to
    mlx-lm's ``quantized_matmul``, which they then do where that pays: ``packed_decode``).
    """

    QUANTIZED_DECODE = True

    @property
    def quantized_decode(self) -> bool:
        """Whether a decode step's fetch hands packed rows to ``quantized_matmul``: a scheme
        whose rows it can read, on a device where that is faster than dense rows."""
        return self.QUANTIZED_DECODE and packed_decode()

    @property
    def dense_decode(self) -> bool:
        """Whether a decode step's fetch hands over dense K/V (else packed rows, for
        ``quantized_matmul``): what ``kvshelf.model.native_decode`` takes."""
        return not self.quantized_decode

    def __init__(self, layer: LayerSpec, bits: int = 4, group_size: int = 64):
        self._staged: list[Staged] = []  # first: every field below settles it when set
        self.layer = layer
        self.window = layer.window
        self._bits = bits
        self.group_size = group_size_for(layer, group_size)
        self._keys: QTriple | None = None
        self._values: QTriple | None = None
        self._start = 0
        self.offset = 0  # tokens seen so far; mlx-lm uses it as the RoPE offset
        self._base: SharedLayer | None = None
        self._quantized_fetch = False

    # -- staged tokens ---------------------------------------------------------------
    # A decode step that codes its tokens on numpy rows (``kvshelf.kv.working_set``) hands
    # each agent's token over with ``stage``: the offset moves at once, the buffers are
    # written at the next read of any of them (``settle``), all staged tokens in one
    # append. Per token and layer, an append is a dozen MLX operations to build and
    # evaluate, which for 8 agents cost about 10 of a 90 ms step; one append of many
    # tokens gives the same buffers (every row is coded on its own; per-channel key blocks
    # are quantized from the same fp16 rows whenever they close). Every field the buffers
    # live in (``keys``, ``values``, ``start``, ``base``; a scheme's ``k_tail``) settles on
    # read and write, so nothing outside sees an unwritten token; what a decode step asks
    # between tokens (``offset``, ``start_after``, ``stable_until``, masks) does not.
    STAGED_MAX = BLOCK_TOKENS  # settled at the latest this often: a window drops rows staged earlier than that

    def stage(self, keys: np.ndarray, values: np.ndarray, codes: RowCodes) -> None:
        """Append one token (fp32 K and V rows, heads x dim, and their ``read_back`` codes,
        ``CodedRows.member``) and write it to the buffers later, together with the next."""
        self._staged.append((keys, values, codes))
        self.offset += 1
        if len(self._staged) >= self.STAGED_MAX or self._keys is None or self.own_rows_at(self.offset - 1):
            self.settle()

    def settle(self) -> None:
        """Write the staged tokens: one append, as if each had been appended on its arrival
        (any read of the buffers does it; an agent's cache also does when its request ends)."""
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        n = len(staged)
        key_codes = [c[0] for _, _, c in staged if c[0] is not None]
        codes = (_stacked_codes(key_codes) if key_codes else None), _stacked_codes([c[1] for _, _, c in staged])
        keys, values = _stacked([k for k, _, _ in staged]), _stacked([v for _, v, _ in staged])
        self.offset -= n
        # where one-by-one appends would leave the start: as of the last token's arrival
        self._append(keys, values, codes, self._start_for(self.offset + n - 1))

    def _start_for(self, position: int) -> int:
        """Where the buffer starts once the token at ``position`` is in."""
        if self.window is None:
            return self._start
        keep_from = position - self.window + 1 - BLOCK_TOKENS
        return max(self._start, keep_from // BLOCK_TOKENS * BLOCK_TOKENS)

    keys: Settled[QTriple | None] = Settled()
    values: Settled[QTriple | None] = Settled()
    start: Settled[int] = Settled()  # absolute position of row 0 (a block boundary)
    # rows 0..base_rows-1 live in this shared base; own buffer row i is row base_rows+i
    base: Settled[SharedLayer | None] = Settled()

    def arrays(self) -> list[mx.array]:
        """Every array this cache holds alone, to evaluate after a step (staged tokens are
        numpy rows: nothing to evaluate, so they stay staged)."""
        return [*(self._keys or ()), *(self._values or ())]

    # -- mlx-lm cache protocol -------------------------------------------------
    @property
    def used(self) -> int:
        return self.offset - self.start

    @property
    def base_rows(self) -> int:
        return self.base.rows if self.base is not None else 0

    def start_after(self, n: int) -> int:
        """Where the buffer will start once ``n`` more tokens arrive.

        A pure function of the current state, so ``make_mask`` (called before the
        update) and ``update_and_fetch`` agree.
        """
        return self._start_for(self.offset)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        window = window_size or self.window
        start = self.start_after(n)
        if window is None and start == 0:
            if n == 1:
                return None
            if not return_array:
                return "causal"
        q_pos = mx.arange(self.offset, self.offset + n)[:, None]
        k_pos = mx.arange(start, self.offset + n)[None]
        mask = k_pos <= q_pos
        if window is not None:
            if n == 1 and self.offset - start < window and not return_array:
                return None
            mask = mask & (k_pos > q_pos - window)
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self.append(keys, values)
        return self.fetch(dense_dtype=keys.dtype, queries=keys.shape[2])

    def append(self, keys: mx.array, values: mx.array, codes: Codes | None = None) -> None:
        """Store new tokens without fetching (a decode working set reads only the new rows).

        ``codes``: ``code_rows(keys, values)``, when the caller has them already (a decode
        step codes its members' new rows once, together)."""
        self.settle()
        codes = codes if codes is not None else self.code_rows(keys, values)
        self._append(keys, values, codes, self.start_after(keys.shape[2]))

    def _append(self, keys: mx.array, values: mx.array, codes: Codes, new_start: int) -> None:
        n = keys.shape[2]
        self._make_room(new_start, n, keys, values)
        self._write(keys, values, self.used - self.base_rows, codes)
        self.offset += n

    def code_rows(self, keys: mx.array, values: mx.array) -> Codes:
        """The at-rest codes of new rows: keys and values, each row coded on its own, so
        the codes of several agents' rows, sliced, are each agent's own."""
        return self._quantize(keys), self._quantize(values)

    def _write(self, keys: mx.array, values: mx.array, used: int, codes: Codes) -> None:
        """Store new tokens at own-buffer rows ``used..used+n`` (room is already made).

        The base is whole blocks, so ``used`` and the row count agree modulo a block."""
        n = keys.shape[2]
        assert self.keys is not None and self.values is not None  # _make_room allocated them
        key_codes, value_codes = codes
        assert key_codes is not None  # row-coded keys
        for buf, new in ((self.keys, key_codes), (self.values, value_codes)):
            for part, x in zip(buf, new, strict=True):
                part[..., used : used + n, :] = x

    def fetch(self, dense_dtype: mx.Dtype, queries: int) -> tuple[Any, Any]:
        """The cached K and V: packed for short queries, dequantized otherwise."""
        k, v = self._rows(self.keys, "keys"), self._rows(self.values, "values")
        self._quantized_fetch = self.quantized_decode and queries <= QUANTIZED_ATTENTION_MAX_QUERY
        if self._quantized_fetch:
            return k, v
        return self._dequantize_keys(k, dense_dtype), self._dequantize_values(v, dense_dtype)

    def _rows(self, own: QTriple | None, which: str) -> QTriple:
        """All valid rows, the shared base's first, as one packed triple."""
        n = self.used - self.base_rows
        mine = each(own, lambda x: x[..., :n, :]) if own is not None else None
        if self.base is None:
            assert mine is not None  # a cache without a base has its own rows
            return mine
        shared: QTriple = getattr(self.base, which)
        if not n or mine is None:
            return shared
        return pairwise(shared, mine, lambda b, x: mx.concatenate([b, x], axis=2))

    # -- rows for a decode working set (kvshelf.kv.working_set) ---------------------
    def packed_rows(self, which: str, lo: int, hi: int) -> QTriple:
        """The packed ``keys`` or ``values`` of positions ``lo..hi`` (within ``start..offset``),
        shared base rows included; a copy only where the range straddles base and own rows."""
        a, b, nb = lo - self.start, hi - self.start, self.base_rows
        parts = []
        if a < nb:
            parts.append(tuple(x[..., a : min(b, nb), :] for x in getattr(self.base, which)))
        if b > nb:
            parts.append(tuple(x[..., max(a, nb) - nb : b - nb, :] for x in getattr(self, which)))
        if len(parts) == 1:
            return parts[0]
        return tuple(mx.concatenate(list(p), axis=2) for p in zip(*parts))  # type: ignore[return-value]

    def attention_rows(self, lo: int, hi: int, dtype: mx.Dtype, dense: bool = False) -> tuple[Any, Any]:
        """K and V of positions ``lo..hi`` exactly as ``fetch`` hands them to one query:
        packed triples where ``quantized_decode`` (unless ``dense``), else dequantized."""
        k, v = self.packed_rows("keys", lo, hi), self.packed_rows("values", lo, hi)
        if self.quantized_decode and not dense:
            return k, v
        return self._dequantize(k, dtype), self._dequantize(v, dtype)

    def coded_rows(
        self, keys: mx.array, values: mx.array, dtype: mx.Dtype, dense: bool = False, codes: Codes | None = None
    ) -> tuple[Any, Any]:
        """What ``attention_rows`` returns for ``keys``/``values`` once they are appended,
        computed from them (or from their ``codes``, ``code_rows``'s) directly: coding is
        row by row, so one call serves the new rows of a whole decode batch. Exact unless
        ``own_rows_at`` says otherwise."""
        k, v = codes if codes is not None else self.code_rows(keys, values)
        assert k is not None  # row-coded keys
        if self.quantized_decode and not dense:
            return k, v
        return self._dequantize(k, dtype), self._dequantize(v, dtype)

    def read_back(self, keys: np.ndarray, values: np.ndarray) -> CodedRows | None:
        """New rows (fp32 numpy) coded as ``code_rows`` and ``coded_rows`` (dense) code them,
        bit for bit (``kvshelf.kv.row_coding``), or None where the step hands packed rows
        to ``quantized_matmul`` instead (a scheme's cache codes them its own way,
        ``_coded_back``; ``kvshelf.kv.schemes``)."""
        if self.quantized_decode or keys.dtype != np.float32 or values.dtype != np.float32:
            return None
        return self._coded_back(keys, values)

    def _coded_back(self, keys: np.ndarray, values: np.ndarray) -> CodedRows:
        """``read_back``'s coding of fp32 rows: each row quantized on its own."""
        key_codes, k = row_coding.quantize(keys, self.group_size, self._bits)
        value_codes, v = row_coding.quantize(values, self.group_size, self._bits)
        return CodedRows(k, v, key_codes, value_codes)

    def own_rows_at(self, position: int) -> bool:
        """Whether a row appended at ``position`` reads back other than ``coded_rows`` says
        (a sink's fp16 copy); a filled per-channel key block shows in ``stable_until``."""
        return False

    @property
    def stable_until(self) -> int:
        """Positions below this keep their ``attention_rows`` until the cache is rewound;
        later ones may change when more tokens arrive (a per-channel key block filling)."""
        return self.offset

    @property
    def open_key_block(self) -> bool:
        """Whether keys wait in an fp16 open block that is quantized when full (so a query
        reads the blocks before its own quantized, its own in fp16; see ``kvschemes``)."""
        return False

    # -- buffer management -------------------------------------------------------
    def _quantize(self, x: mx.array) -> QTriple:
        w, s, b = mx.quantize(x, group_size=self.group_size, bits=self._bits)
        return w, s.astype(SCALE_DTYPE), b.astype(SCALE_DTYPE)

    def _dequantize(self, q: QTriple, dtype: mx.Dtype) -> mx.array:
        # Widen the scales first: an fp16 dequantize runs 5x slower on the CPU.
        w, s, b = q
        return mx.dequantize(w, s.astype(dtype), b.astype(dtype), group_size=self.group_size, bits=self._bits)

    def _dequantize_keys(self, q: QTriple, dtype: mx.Dtype) -> mx.array:
        return self._dequantize(q, dtype)

    def _dequantize_values(self, q: QTriple, dtype: mx.Dtype) -> mx.array:
        return self._dequantize(q, dtype)

    def _empty(self, like: mx.array, rows: int) -> QTriple:
        b, h, _, d = like.shape
        per_int = 32 // self._bits
        return (
            mx.zeros((b, h, rows, d // per_int), dtype=mx.uint32),
            mx.zeros((b, h, rows, d // self.group_size), dtype=SCALE_DTYPE),
            mx.zeros((b, h, rows, d // self.group_size), dtype=SCALE_DTYPE),
        )

    def _make_room(self, new_start: int, n: int, keys: mx.array, values: mx.array) -> None:
        """Drop blocks before ``new_start`` and grow capacity to fit ``n`` more tokens."""
        if self.base is not None and new_start > self.start:
            drop = min(new_start - self.start, self.base.rows)
            self.base = self.base.tail(drop)
            self.start += drop
        if self.keys is None:
            rows = _blocks(n) * BLOCK_TOKENS
            self.keys, self.values = self._empty(keys, rows), self._empty(values, rows)
            self.start = new_start
            return
        drop = new_start - self.start
        own_used = self.used - self.base_rows
        need = own_used - drop + n
        capacity = self.keys[0].shape[2]
        if drop == 0 and need <= capacity:
            return
        rows = _blocks(need) * BLOCK_TOKENS
        keep = own_used - drop
        assert self.values is not None

        def regrown(buf: QTriple, like: mx.array) -> QTriple:
            fresh = self._empty(like, rows)
            return pairwise(
                buf, fresh, lambda x, f: mx.concatenate([x[..., drop : drop + keep, :], f[..., keep:, :]], axis=2)
            )

        self.keys, self.values = regrown(self.keys, keys), regrown(self.values, values)
        self.start = new_start

    def unshare(self) -> None:
        """Copy the shared base into this cache's own buffer (before writing inside it).

        New array objects throughout: MLX's ``x[...] = y`` updates the object in place,
        so an object shared with the base would carry writes into other agents' caches.
        """
        if self.base is None:
            return

        def join(shared: QTriple, own: QTriple | None) -> QTriple:
            if own is None:
                return each(shared, lambda x: x[..., : x.shape[2], :])
            return pairwise(shared, own, lambda x, o: mx.concatenate([x, o], axis=2))

        self.keys, self.values = join(self.base.keys, self.keys), join(self.base.values, self.values)
        self.base = None

    def clone(self) -> QuantizedLayerCache:
        """A copy that shares every array (and the base) until either side writes."""
        self.settle()
        twin = copy.copy(self)
        twin._staged = []  # its own list: a token staged on one side is not the other's
        if self.keys is not None and self.values is not None:  # new objects: writes go through ``x[...] = y``
            twin.keys = each(self.keys, lambda x: x[..., : x.shape[2], :])
            twin.values = each(self.values, lambda x: x[..., : x.shape[2], :])
        return twin

    def attach_base(self, base: SharedLayer) -> None:
        """Start on ``base``: its rows replace this cache's first ``base.rows`` rows,
        which must hold the same data (the caller checked the tokens)."""
        if base.start != self.start or base.rows > self.used or self.base is not None:
            raise ValueError("a shared base must cover this cache's first rows")
        rest = self.used - base.rows
        if self.keys is not None and self.values is not None:
            if rest:  # own copies of the rows after the base, so the old buffer can go
                end = base.rows + _blocks(rest) * BLOCK_TOKENS

                def own(x: mx.array) -> mx.array:
                    return mx.contiguous(x[..., base.rows : end, :])

                self.keys, self.values = each(self.keys, own), each(self.values, own)
            else:
                self.keys = self.values = None
        self.base = base

    # -- rewind -------------------------------------------------------------------
    def exact_rewind_point(self, position: int) -> int:
        """The latest position at or before ``position`` to which a cut leaves exactly what
        a prefill of the tokens up to there holds (every row here is coded on its own)."""
        return position

    def can_rewind_to(self, position: int) -> bool:
        """True if the cache can be cut back to ``position`` tokens and stay exact."""
        if position > self.offset:
            return False
        if self.window is None or self.start == 0:
            return True
        # The next query, at ``position``, must still see the whole window behind it.
        return position - self.window + 1 >= self.start

    def rewind_to(self, position: int) -> None:
        if not self.can_rewind_to(position):
            raise ValueError(f"cannot rewind a window-{self.window} layer from {self.offset} to {position}")
        if position - self.start < self.base_rows:
            self.unshare()
        self.offset = position
        if self.keys is not None and self.used == 0 and self.start == 0:
            self.keys = self.values = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.rewind_to(self.offset - n)
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds alone (a shared base is counted once, by the pool), its
        staged tokens' numpy rows included (up to ``STAGED_MAX`` of them, alike in shape)."""
        staged = 0
        if self._staged:
            k, v, (key_codes, value_codes) = self._staged[0]
            row = k.nbytes + v.nbytes + sum(x.nbytes for x in (*(key_codes or ()), *value_codes))
            staged = row * len(self._staged)
        return sum(x.nbytes for x in self.arrays()) + staged

    # -- persistence -----------------------------------------------------------------
    # The record format (tensor names, header, checks) lives in ``kvshelf.kv.record``;
    # a layer cache only hands out and takes back its own rows.
    def own_rows(self) -> LayerRows:
        """This cache's own valid rows (after any shared base), without padding."""
        n = self.used - self.base_rows
        if self.keys is None or self.values is None or n <= 0:
            return LayerRows()
        return LayerRows(_map3(lambda x: x[..., :n, :], self.keys), _map3(lambda x: x[..., :n, :], self.values))

    def restore(self, rows: LayerRows, start: int, offset: int, base: SharedLayer | None = None) -> None:
        """Take back ``own_rows()`` output: rows ``start..offset`` after ``base``, padded
        to whole blocks. Trusts its input: ``kvshelf.kv.record`` checks that a record fits
        (row counts, base position) before calling this."""
        self.start, self.offset, self.base = start, offset, base
        if rows.keys is None or rows.values is None:
            self.keys = self.values = None
            return
        used = offset - start - self.base_rows
        capacity = _blocks(used) * BLOCK_TOKENS

        def padded(x: mx.array) -> mx.array:
            pad = mx.zeros((*x.shape[:2], capacity - x.shape[2], x.shape[3]), dtype=x.dtype)
            return mx.concatenate([x, pad], axis=2)

        self.keys, self.values = _map3(padded, rows.keys), _map3(padded, rows.values)

    # mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` go through ``state``, which
    # ``_BaseCache`` defines as an empty list: a kvshelf cache would be written as an
    # empty file without a word. Generation never reads it (only mlx-lm's own
    # ``generate_step``/``stream_generate`` evaluate it, and kvshelf does not use them).
    @property
    def state(self) -> Any:
        raise NotImplementedError(_NO_STATE)

    @state.setter
    def state(self, value: Any) -> None:
        raise NotImplementedError(_NO_STATE)

    @property
    def meta_state(self) -> Any:
        raise NotImplementedError(_NO_STATE)

    @meta_state.setter
    def meta_state(self, value: Any) -> None:
        raise NotImplementedError(_NO_STATE)
