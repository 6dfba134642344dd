"""KV coding schemes: variants of the 4-bit block cache that trade bytes for quality.

Plain 4-bit group-64 per-token KV costs Gemma 3 270M +29..41% perplexity when every
layer is quantized (see docs). The known culprits are outlier channels (a few
channels of K carry most of the magnitude, so a per-token group spends its 16 levels
on them) and the first tokens ("attention sinks"), which draw much of the attention.
Each scheme is one frozen ``KVScheme`` that makes ``SchemeLayerCache`` objects:

- ``rotate_keys`` / ``rotate_values``: an orthonormal Hadamard transform of each head
  vector before quantizing spreads outliers over all channels. The transform is its own
  inverse, so the dense path un-rotates after dequantizing. mlx-lm's attention does
  not rotate the query, so such a cache cannot hand packed rows to ``quantized_matmul``
  and always returns dense K/V (``QUANTIZED_DECODE = False``).
- ``channel_keys`` (KIVI): a full 256-token block of keys is quantized per channel,
  in groups of ``group_size`` tokens, so each outlier channel gets its own scale. The
  partial block at the end (the tail) stays fp16 until it fills, then is quantized as
  a whole. A block's packed words and scales have exactly as many elements as the
  per-token layout's, so they live in the same row buffers (reshaped): growth, window
  eviction and export need no changes. Dense path only.
- ``sinks``: the first ``sinks`` tokens of the sequence are also kept in fp16 and
  replace their quantized rows on the dense path.

Determinism: every stored element is a function of the tokens alone, and so is what
attention reads: every query reads each past token in one representation whatever path
computed it (cold prefill in any chunk size, an extension, decode, a restore, a fork;
see "what attention reads" in ``SchemeLayerCache``). The fp16 tail and
the sinks are exported as they are, and a block is quantized from the fp16 tail both
when it fills in RAM and after a restore, so a restored cache continues bit-identically.
Rewinding into an already quantized block turns its kept rows back into an fp16 tail
(their dequantized values): also a pure function of the state, in both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.kv import row_coding
from kvshelf.kv.blocks import (
    SCALE_DTYPE,
    CodedRows,
    Codes,
    LayerRows,
    QTriple,
    QuantizedLayerCache,
    RowCodes,
    Settled,
    SharedLayer,
    each,
)
from kvshelf.model.spec import BLOCK_TOKENS, LayerSpec

FP16 = mx.float16

# Every query reads every past token in one representation (see "what attention reads"
# below). False brings back the earlier reads (a chunk's own keys as the buffer holds them
# right after its append), only so that benchmarks/invariance.py can measure both in one run.
ONE_REPRESENTATION = True


@dataclass(frozen=True)
class KVScheme:
    """One KV coding scheme; ``name`` goes into records so a reader can refuse others."""

    name: str
    bits: int = 4
    group_size: int = 64
    rotate_keys: bool = False
    rotate_values: bool = False
    channel_keys: bool = False
    sinks: int = 0

    @property
    def plain(self) -> bool:
        return not (self.rotate_keys or self.rotate_values or self.channel_keys or self.sinks)

    def make(self, layer: LayerSpec) -> QuantizedLayerCache:
        if self.plain:
            return QuantizedLayerCache(layer, self.bits, self.group_size)
        return SchemeLayerCache(layer, self)

    def bytes_per_token(self, layer: LayerSpec, tokens: int | None = None) -> float:
        """Storage per cached token in one layer; ``tokens`` amortizes the fp16 extras.

        Per-channel keys cost the same per token as per-token groups (one scale and bias
        per ``group_size`` values either way). The fp16 tail (0..255 tokens) and sinks are
        not per-token costs: with ``tokens`` they are counted at their size after that
        many tokens (tail = tokens % 256), otherwise left out (the asymptotic figure).
        """
        per = layer.bytes_per_token(self.bits, self.group_size)
        if tokens is None or tokens == 0:
            return per
        extra = 0.0
        fp16_token = layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * 2
        if self.sinks:
            extra += min(self.sinks, tokens) * fp16_token
        if self.channel_keys:
            extra += (tokens % BLOCK_TOKENS) * layer.kv_heads * layer.k_head_dim * 2
        return per + extra / tokens


def _to_block(columns: int) -> int:
    """Columns to add to ``columns`` to reach a whole number of blocks."""
    return -columns % BLOCK_TOKENS


def _rotate(x: mx.array) -> mx.array:
    # Orthonormal (scale 1/sqrt(d)) and symmetric, hence its own inverse.
    return mx.hadamard_transform(x)


class SchemeLayerCache(QuantizedLayerCache):
    """A ``QuantizedLayerCache`` coded by a ``KVScheme`` (rotation, per-channel keys, sinks)."""

    QUANTIZED_DECODE = False

    def __init__(self, layer: LayerSpec, scheme: KVScheme):
        super().__init__(layer, scheme.bits, scheme.group_size)
        if scheme.channel_keys and BLOCK_TOKENS % self.group_size:
            raise ValueError("per-channel key groups must divide the block")
        self.scheme = scheme
        self._k_tail: mx.array | None = None
        self.sink_k: mx.array | None = None  # fp16 K/V of positions 0..sinks-1
        self.sink_v: mx.array | None = None

    k_tail: Settled[mx.array | None] = Settled()  # fp16 keys of the partial last block

    def stage(self, keys: np.ndarray, values: np.ndarray, codes: RowCodes) -> None:
        super().stage(keys, values, codes)
        if self.scheme.channel_keys and self._staged and self.stable_until == self.offset:
            self.settle()  # the token closed its key block: quantize it now, as an append would

    def arrays(self) -> list[mx.array]:
        return super().arrays() + [x for x in (self._k_tail, self.sink_k, self.sink_v) if x is not None]

    # -- coding -----------------------------------------------------------------------
    def _code(self, x: mx.array, rotate: bool) -> QTriple:
        return self._quantize(_rotate(x) if rotate else x)

    def code_rows(self, keys: mx.array, values: mx.array) -> Codes:
        """Values coded row by row (rotated first if the scheme says so); keys too, unless
        they are per-channel, which wait in the fp16 tail until their block is full."""
        sch = self.scheme
        key_codes = None if sch.channel_keys else self._code(keys, sch.rotate_keys)
        return key_codes, self._code(values, sch.rotate_values)

    def _write(self, keys: mx.array, values: mx.array, used: int, codes: Codes) -> None:
        n, sch = keys.shape[2], self.scheme
        if sch.sinks and self.offset < sch.sinks:
            take = sch.sinks - self.offset
            new_k, new_v = keys[..., :take, :].astype(FP16), values[..., :take, :].astype(FP16)
            self.sink_k = new_k if self.sink_k is None else mx.concatenate([self.sink_k, new_k], axis=2)
            self.sink_v = new_v if self.sink_v is None else mx.concatenate([self.sink_v, new_v], axis=2)
        assert self.keys is not None and self.values is not None  # _make_room allocated them
        key_codes, value_codes = codes
        for part, x in zip(self.values, value_codes, strict=True):
            part[..., used : used + n, :] = x
        if key_codes is not None:
            for part, x in zip(self.keys, key_codes, strict=True):
                part[..., used : used + n, :] = x
            return
        tail = used % BLOCK_TOKENS  # the buffer starts on a block boundary
        pending = keys.astype(FP16)
        if tail:
            assert self.k_tail is not None  # a partial block's keys wait in the fp16 tail
            pending = mx.concatenate([self.k_tail, pending], axis=2)
        full = (tail + n) // BLOCK_TOKENS * BLOCK_TOKENS
        if full:
            row = used - tail
            for part, x in zip(self.keys, self._quantize_blocks(pending[..., :full, :]), strict=True):
                part[..., row : row + full, :] = x
        self.k_tail = pending[..., full:, :]

    def _quantize_blocks(self, x: mx.array) -> QTriple:
        """Whole blocks of keys, per channel with groups along tokens, in row layout."""
        b, h, rows, d = x.shape
        nb = rows // BLOCK_TOKENS
        x = x.astype(mx.float32)
        if self.scheme.rotate_keys:
            x = _rotate(x)
        x = x.reshape(b, h, nb, BLOCK_TOKENS, d).swapaxes(-1, -2)
        w, s, z = mx.quantize(x, group_size=self.group_size, bits=self._bits)
        as_rows = lambda a: a.reshape(b, h, rows, -1)  # noqa: E731
        return as_rows(w), as_rows(s.astype(SCALE_DTYPE)), as_rows(z.astype(SCALE_DTYPE))

    def _dequantize_blocks(self, q: QTriple, dtype: mx.Dtype) -> mx.array:
        w, s, z = q
        b, h, rows, _ = w.shape
        nb = rows // BLOCK_TOKENS
        d = self.layer.k_head_dim
        as_blocks = lambda a: a.reshape(b, h, nb, d, -1)  # noqa: E731
        x = mx.dequantize(
            as_blocks(w),
            as_blocks(s).astype(dtype),
            as_blocks(z).astype(dtype),
            group_size=self.group_size,
            bits=self._bits,
        )
        x = x.swapaxes(-1, -2).reshape(b, h, rows, d)
        return _rotate(x) if self.scheme.rotate_keys else x

    # -- dense path ---------------------------------------------------------------------
    def _with_sinks(self, x: mx.array, sink: mx.array | None) -> mx.array:
        if sink is None or self.start != 0:
            return x
        return mx.concatenate([sink.astype(x.dtype), x[..., sink.shape[2] :, :]], axis=2)

    def _dequantize_keys(self, q: QTriple, dtype: mx.Dtype) -> mx.array:
        if not self.scheme.channel_keys:
            x = self._dequantize(q, dtype)
            x = _rotate(x) if self.scheme.rotate_keys else x
        else:
            assert self.k_tail is not None  # per-channel keys always keep a (maybe empty) tail
            full = q[0].shape[2] - self.k_tail.shape[2]
            x = self.k_tail.astype(dtype)
            if full:
                head = self._dequantize_blocks(each(q, lambda a: a[..., :full, :]), dtype)
                x = mx.concatenate([head, x], axis=2)
        return self._with_sinks(x, self.sink_k)

    def _dequantize_values(self, q: QTriple, dtype: mx.Dtype) -> mx.array:
        x = self._dequantize(q, dtype)
        x = _rotate(x) if self.scheme.rotate_values else x
        return self._with_sinks(x, self.sink_v)

    # -- what attention reads: one representation of every past token --------------------
    # A per-channel key block is quantized once it is full; until then its keys are the
    # fp16 tail. A query reads every token in that same form, whichever path computes it:
    # the blocks that closed before the query's own block quantized, its own block (the
    # open tail, up to the query) in fp16. So a query at a block's last position still
    # reads the block in fp16 (the block closes with its last token, for the queries
    # after it), and a call that closes blocks before its last query shows those blocks
    # twice: quantized to the queries after them, fp16 (extra key columns, which the mask
    # gives only the queries inside the block) to the queries before. Cold prefill in
    # any chunk size, an extension from any offset, decode and a restore then read the
    # same values (``kvshelf.kv.working_set`` keeps the same rule between steps).
    def _closing_inside(self, n: int) -> list[int]:
        """Ends of the key blocks that a call of ``n`` tokens closes before its last query."""
        if not self.open_key_block:
            return []
        first = (self.offset // BLOCK_TOKENS + 1) * BLOCK_TOKENS  # blocks lie on absolute multiples
        return list(range(first, self.offset + n, BLOCK_TOKENS))

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        ends = self._closing_inside(n)
        if not ends:
            return super().make_mask(n, window_size, return_array)
        window = window_size or self.window
        q = mx.arange(self.offset, self.offset + n)[:, None]
        k = mx.arange(self.start_after(n), self.offset + n)[None]
        main = k <= q
        for e in ends:  # a block closed inside the call is quantized only to queries from its end
            main = main & ~((k >= e - BLOCK_TOKENS) & (k < e) & (q < e))
        dup_k = mx.concatenate([mx.arange(e - BLOCK_TOKENS, e) for e in ends])[None]
        dup_end = mx.concatenate([mx.full((BLOCK_TOKENS,), e) for e in ends])[None]
        dup = (dup_k <= q) & (q < dup_end)
        if window is not None:
            main, dup = main & (k > q - window), dup & (dup_k > q - window)
        gap = mx.zeros((n, _to_block(k.shape[1])), dtype=mx.bool_)
        return mx.concatenate([main, gap, dup], axis=1)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if not self.open_key_block:
            return super().update_and_fetch(keys, values)
        n, p0 = keys.shape[2], self.offset
        ends = self._closing_inside(n)
        open_from = p0 // BLOCK_TOKENS * BLOCK_TOKENS  # where the open block (the fp16 tail) starts
        pending = keys.astype(FP16)
        if p0 > open_from:
            assert self.k_tail is not None and self.k_tail.shape[2] == p0 - open_from
            pending = mx.concatenate([self.k_tail, pending], axis=2)
        k, v = super().update_and_fetch(keys, values)
        start = self.start

        def open_rows(end: int) -> mx.array:  # the block ending at ``end``, in fp16 as it was open
            return pending[..., end - BLOCK_TOKENS - open_from : end - open_from, :].astype(k.dtype)

        end = p0 + n
        if end % BLOCK_TOKENS == 0:  # closed by the call's last query, which still reads it open
            k = mx.concatenate([k[..., : end - BLOCK_TOKENS - start, :], open_rows(end)], axis=2)
        if ends:  # (a sink's fp16 copy is these very fp16 keys)
            # The shown-again blocks start on a block multiple of columns, as their
            # positions do, so that an attention summing per block (kvshelf.model.attention)
            # finds every block on its own 256 columns.
            gap = lambda x: mx.zeros((*x.shape[:2], _to_block(x.shape[2]), x.shape[3]), dtype=x.dtype)  # noqa: E731
            dup_v = [v[..., e - BLOCK_TOKENS - start : e - start, :] for e in ends]
            k = mx.concatenate([k, gap(k), *(open_rows(e) for e in ends)], axis=2)
            v = mx.concatenate([v, gap(v), *dup_v], axis=2)
        return k, v

    def exact_rewind_point(self, position: int) -> int:
        """A cut inside a quantized key block cannot bring back its fp16 keys (only their
        dequantized values): the block's start, from which a prefill recomputes them."""
        if not self.open_key_block or position % BLOCK_TOKENS == 0 or position >= self.stable_until:
            return position
        return max(self.start, position // BLOCK_TOKENS * BLOCK_TOKENS)

    # -- rows for a decode working set ----------------------------------------------------
    @property
    def open_key_block(self) -> bool:
        return self.scheme.channel_keys and ONE_REPRESENTATION

    @property
    def stable_until(self) -> int:
        if self.scheme.channel_keys and self._k_tail is not None:
            # staged keys join the open block (``stage`` settles the one that fills it)
            return self.offset - (self._k_tail.shape[2] + len(self._staged)) % BLOCK_TOKENS
        return self.offset

    def attention_rows(self, lo: int, hi: int, dtype: mx.Dtype, dense: bool = False) -> tuple[Any, Any]:
        """Rows ``lo..hi`` of what ``fetch`` returns, computed row for row the same way."""
        v = self._dequantize(self.packed_rows("values", lo, hi), dtype)
        v = _rotate(v) if self.scheme.rotate_values else v
        if not self.scheme.channel_keys:
            k = self._dequantize(self.packed_rows("keys", lo, hi), dtype)
            k = _rotate(k) if self.scheme.rotate_keys else k
        else:
            full = self.stable_until  # whole quantized blocks end here, the fp16 tail begins
            parts = []
            if lo < full:  # whole blocks (block-aligned from ``start``) around lo..min(hi, full)
                b0 = self.start + (lo - self.start) // BLOCK_TOKENS * BLOCK_TOKENS
                b1 = self.start + -(-(min(hi, full) - self.start) // BLOCK_TOKENS) * BLOCK_TOKENS
                block = self._dequantize_blocks(self.packed_rows("keys", b0, b1), dtype)
                parts.append(block[..., lo - b0 : min(hi, full) - b0, :])
            if hi > full:
                tail = self.k_tail
                assert tail is not None  # rows past ``full`` are the tail's
                parts.append(tail[..., max(lo, full) - full : hi - full, :].astype(dtype))
            k = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
        return self._sink_rows(k, self.sink_k, lo, hi), self._sink_rows(v, self.sink_v, lo, hi)

    def coded_rows(
        self, keys: mx.array, values: mx.array, dtype: mx.Dtype, dense: bool = False, codes: Codes | None = None
    ) -> tuple[Any, Any]:
        sch = self.scheme
        key_codes, value_codes = codes if codes is not None else self.code_rows(keys, values)
        v = self._dequantize(value_codes, dtype)
        v = _rotate(v) if sch.rotate_values else v
        if key_codes is None:  # a new key waits in the fp16 tail
            return keys.astype(FP16).astype(dtype), v
        k = self._dequantize(key_codes, dtype)
        return (_rotate(k) if sch.rotate_keys else k), v

    def _coded_back(self, keys: np.ndarray, values: np.ndarray) -> CodedRows:
        """``code_rows`` and ``coded_rows(..., float32, dense=True)`` on fp32 numpy rows, bit
        for bit (``kvshelf.kv.row_coding`` mirrors MLX's arithmetic): what a decode step's
        own token reads of itself and stores, without an MLX evaluation inside the step."""
        sch = self.scheme
        g, bits = self.group_size, self._bits
        value_codes, v = (row_coding.quantize_rotated if sch.rotate_values else row_coding.quantize)(values, g, bits)
        if sch.channel_keys:  # a new key waits in the fp16 tail
            return CodedRows(row_coding.fp16_rounded(keys), v, None, value_codes)
        key_codes, k = (row_coding.quantize_rotated if sch.rotate_keys else row_coding.quantize)(keys, g, bits)
        return CodedRows(k, v, key_codes, value_codes)

    def own_rows_at(self, position: int) -> bool:
        return position < self.scheme.sinks

    def _sink_rows(self, x: mx.array, sink: mx.array | None, lo: int, hi: int) -> mx.array:
        """``_with_sinks`` for rows ``lo..hi``: sink positions among them read the fp16 copy."""
        if sink is None or self.start != 0 or lo >= sink.shape[2]:
            return x
        m = min(hi, sink.shape[2])
        return mx.concatenate([sink[..., lo:m, :].astype(x.dtype), x[..., m - lo :, :]], axis=2)

    # -- rewind -------------------------------------------------------------------------
    def rewind_to(self, position: int) -> None:
        # Rows below the tail are whole quantized blocks; remember where they end.
        full = self.used - self.k_tail.shape[2] if self.k_tail is not None else 0
        super().rewind_to(position)
        if self.sink_k is not None and self.sink_v is not None and position < self.sink_k.shape[2]:
            self.sink_k, self.sink_v = self.sink_k[..., :position, :], self.sink_v[..., :position, :]
        if self.keys is None and self.base is None:
            self.k_tail = self.sink_k = self.sink_v = None
            return
        if not self.scheme.channel_keys:
            return
        used = self.used
        row = used // BLOCK_TOKENS * BLOCK_TOKENS
        if row >= full:
            assert self.k_tail is not None
            self.k_tail = self.k_tail[..., : used - full, :]
        else:  # back into a quantized block: its kept rows become the fp16 tail
            assert self.keys is not None  # rows below ``full`` that are not the base's are our own
            own_row = row - self.base_rows  # the base is whole blocks below ``full``
            block = each(self.keys, lambda a: a[..., own_row : own_row + BLOCK_TOKENS, :])
            self.k_tail = self._dequantize_blocks(block, mx.float32)[..., : used - row, :].astype(FP16)

    # -- persistence --------------------------------------------------------------------
    def own_rows(self) -> LayerRows:
        rows = super().own_rows()
        if rows.keys is None:
            return rows
        rows.k_tail, rows.sink_k, rows.sink_v = self.k_tail, self.sink_k, self.sink_v
        return rows

    def restore(self, rows: LayerRows, start: int, offset: int, base: SharedLayer | None = None) -> None:
        super().restore(rows, start, offset, base)
        self.k_tail, self.sink_k, self.sink_v = rows.k_tail, rows.sink_k, rows.sink_v
        packed = self.keys if self.keys is not None else (self.base.keys if self.base is not None else None)
        if self.scheme.channel_keys and packed is not None and self.k_tail is None:
            b, h, _, _ = packed[0].shape  # a whole number of blocks: the tail is empty
            self.k_tail = mx.zeros((b, h, 0, self.layer.k_head_dim), dtype=FP16)


SCHEMES: dict[str, KVScheme] = {
    s.name: s
    for s in (
        KVScheme("q4-g64-per-token-v1"),
        KVScheme("q8-g64", bits=8),
        KVScheme("q4-g32", group_size=32),
        KVScheme("q4-g128", group_size=128),
        KVScheme("q4-g64-sink4", sinks=4),
        KVScheme("q4-g64-rot", rotate_keys=True, rotate_values=True),
        KVScheme("q4-g64-rot-sink4", rotate_keys=True, rotate_values=True, sinks=4),
        KVScheme("q4-g64-kivi", channel_keys=True),
        KVScheme("q4-g64-kivi-rotv", channel_keys=True, rotate_values=True),
        KVScheme("q4-g64-kivi-rotv-sink4", channel_keys=True, rotate_values=True, sinks=4),
        KVScheme("q4-g32-kivi-rotv", group_size=32, channel_keys=True, rotate_values=True),
        KVScheme("q4-g32-rot", group_size=32, rotate_keys=True, rotate_values=True),
    )
}


# Measured on the embedded Gemma 3 270M, every layer coded, 4096 tokens (see
# benchmarks/perplexity.py): +2.6% / +2.2% perplexity on GPL-3 / pydoc prose at 0.281x
# the bytes of fp16, against +27% / +42% for plain per-token Q4.
DEFAULT_SCHEME = "q4-g64-kivi-rotv"


def scheme(name: str) -> KVScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown KV scheme {name!r}; known: {', '.join(SCHEMES)}") from None
