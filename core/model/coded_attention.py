"""Decode attention over the default scheme's 4-bit codes, read in place.

Why: a decode working set (``kvshelf.kv.working_set``) holds every agent's past K/V as fp32
rows while it decodes: 55 MB an agent at 4K context on the embedded Gemma 3, 130 MB at
16K, against 9 and 20 MB of Q4 blocks. Attention reads all of it every step, so at long
contexts and in batches the step waits on those bytes. This loop reads the codes instead,
about a sixth of the bytes, and folds the scales into the arithmetic rather than
dequantizing a row: a key group's per-channel scales go into the query once
(``q * scale``, and ``q . offset`` added to each score), a value row's scales into its
weight, and the values' rotation is undone once per head, not once per row (the
Hadamard transform is orthonormal, so rotating the weighted sum back equals weighting the
rows rotated back). Measured against ``native_ops.attend`` over the same values as
fp32 rows from memory, side by side, every layer at once (``benchmarks/attention_bounds.py``,
``results/attention-bounds-20261208-002355.json``, load 0.45 -> 1.21): Gemma 3's heads (4
query heads on one KV head of 256) took 3.61 against 4.79 ms at 1K context and batch 1,
13.96 against 15.68 at batch 4, 24.56 against 31.57 at batch 8 and 46.17 against 63.06 at
16K. The llama's short heads (9 on 3 of 64) lost: 7.25 against 5.39 ms at 1K, 83.64
against 50.12 at 16K; there the loop's arithmetic, not memory, sets the pace, so a caller
keeps fp32 rows for them (``worth_reading``). The same arithmetic compiled per head shape
(the benchmark's ``in_place``) was faster still (0.54-0.75x ``attend``'s time), at a
compile per shape.

What it reads (the layout a coded working set holds; rows as ``native_ops.attend`` takes
them: head ``(b, h)``'s column ``c`` is row ``(b * kv_heads + h) * pitch + c``):

- key codes, uint8 ``(rows, d // 2)``: a column's 4-bit codes, element ``2j`` in byte
  ``j``'s low nibble and ``2j + 1`` in its high one (a uint8 view of MLX's packed words).
  The default scheme keeps a full block of keys per channel (KIVI); here each token is a
  row, its channels' codes side by side (``key_rows`` turns blocks into rows);
- key scales and offsets, fp32 ``(heads, groups, d)``: one per channel for each 64
  tokens; column ``c`` of agent ``b`` takes row ``(c + shift[b]) // 64`` of its head's;
- the open block's keys (not quantized yet: fp16 values), fp32 ``(heads, rows, d)``:
  column ``c >= closed[b]`` of agent ``b`` is row ``c - closed[b]`` of its head's;
- value codes, uint8 ``(rows, dv // 2)`` in the same nibble order, and their scales and
  offsets, fp32 ``(rows, dv // 64)``; rotated (a Hadamard transform over ``dv``) where
  ``rotated``.

The rest is ``native_ops.attend``'s: a mask as scores to add (``MASKED``: the column is
not read), each KV head read once for the query heads that share it, each head's columns
in ``splits`` ranges across the cores, merged at their common maximum. A column's score
does not depend on its neighbours or on where a range starts, so an agent's bits do not
depend on who shares its batch beyond the ranges ``attend`` would also cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from kvshelf.model.coded_loops import GROUP
from kvshelf.model.native_ops import F32, column_splits
from kvshelf.model.spec import BLOCK_TOKENS

# The shortest head worth reading in codes on this kind of machine (see the module's figures):
# Gemma 3's 256-float heads gain, the llama's 64-float heads lose.
CODED_FROM_HEAD_DIM = 128


def worth_reading(head_dim: int) -> bool:
    """Whether heads of ``head_dim`` floats attend faster over codes than over fp32 rows."""
    return head_dim >= CODED_FROM_HEAD_DIM and head_dim % GROUP == 0


@cache
def _coded_kernel() -> Any:
    """The loop (compiled once per process, cached on disk by numba)."""
    from kvshelf.model import coded_loops, decode_softmax  # reached as module attributes: see those modules
    from kvshelf.model.jit import njit, prange

    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def coded_decode(q, kc, ks, kz, open_k, vc, vs, vz, pitch, first, shift, closed, bias, splits, rotated, out):
        batch, kv, group, d = q.shape
        width, dv = bias.shape[1], out.shape[3]
        span = -(-width // splits)
        tops = np.empty((batch * kv, splits, group), dtype=np.float32)
        sums = np.empty((batch * kv, splits, group), dtype=np.float32)
        parts = np.empty((batch * kv, splits, group, dv), dtype=np.float32)
        for job in prange(batch * kv * splits):
            head = job // splits
            part = job - head * splits
            b = head // kv
            h = head - b * kv
            br = b if bias.shape[0] > 1 else 0
            lo = part * span
            n = max(min(width, lo + span) - lo, 0)
            scores = np.empty((group, max(n, 1)), dtype=np.float32)
            c0 = first + lo
            coded_loops.key_scores(
                q[b, h],
                kc,
                ks[head],
                kz[head],
                open_k[head],
                head * pitch,
                c0,
                shift[b],
                closed[b],
                bias[br, lo : lo + n],
                scores,
            )
            decode_softmax.weigh(scores, n, tops[head, part], sums[head, part])
            coded_loops.value_sums(scores[:, :n], vc, vs, vz, head * pitch + c0, parts[head, part])
        for head in prange(batch * kv):  # each head's ranges at their common maximum, normalized
            b = head // kv
            h = head - b * kv
            decode_softmax.merge(tops[head], sums[head], parts[head], out[b, h])
            if not rotated:
                continue
            for g in range(group):  # the values' rotation undone once: a normalized Hadamard is its own inverse
                step = 1
                while step < dv:
                    for i0 in range(0, dv, 2 * step):
                        for i in range(i0, i0 + step):
                            x0, x1 = out[b, h, g, i], out[b, h, g, i + step]
                            out[b, h, g, i] = x0 + x1
                            out[b, h, g, i + step] = x0 - x1
                    step *= 2
                norm = np.float32(1.0 / np.sqrt(np.float32(dv)))
                for i in range(dv):
                    out[b, h, g, i] *= norm

    return coded_decode


@dataclass
class CodedLayer:
    """One layer's K/V for a decode batch in codes (the module's layout), (batch, kv_heads,
    ...) arrays: ``key_codes`` (columns, d // 2) and ``value_codes`` (columns, dv // 2)
    uint8; ``key_scales``/``key_offsets`` (groups, d) and ``value_scales``/``value_offsets``
    (columns, dv // 64) fp32; ``open_keys`` (rows, d) fp32; ``shift`` and ``closed`` per
    agent; ``rotated``: whether the values are stored rotated."""

    key_codes: np.ndarray
    key_scales: np.ndarray
    key_offsets: np.ndarray
    open_keys: np.ndarray
    value_codes: np.ndarray
    value_scales: np.ndarray
    value_offsets: np.ndarray
    shift: np.ndarray
    closed: np.ndarray
    rotated: bool


def _heads(a: np.ndarray) -> np.ndarray:
    """(batch, kv, n, m) as a C-contiguous (batch * kv, n, m) array (a view where it is one)."""
    return np.ascontiguousarray(a).reshape(-1, a.shape[2], a.shape[3])


def attend_coded(
    q: np.ndarray,
    layer: CodedLayer,
    bias: np.ndarray | None,
    scale: float,
    span: tuple[int, int] | None = None,
    splits: int | None = None,
) -> np.ndarray:
    """``native_ops.attend`` over ``layer``'s codes: (batch, heads, d) queries against the
    columns ``lo..end`` of ``span`` (None: all), ``bias`` from ``native_ops.mask_bias``
    (None: every column). Returns (batch, heads * value_dim)."""
    b, heads, d = q.shape
    _, kv, columns, _ = layer.key_codes.shape
    dv = layer.value_codes.shape[3] * 2
    first, end = (0, columns) if span is None else span
    width = end - first
    if bias is None:
        bias = np.zeros((1, width), dtype=F32)
    if bias.shape[1] != width or bias.shape[0] not in (1, b) or not 0 <= first <= end <= columns:
        raise ValueError(f"a decode mask of shape {bias.shape} for {b} rows of {width} columns")
    if d % GROUP or dv % GROUP or (layer.rotated and dv & (dv - 1)):
        raise ValueError(f"coded attention takes heads in whole groups of {GROUP} (a power of 2 if rotated)")
    grouped = np.ascontiguousarray((q * F32(scale)).reshape(b, kv, heads // kv, d))
    out = np.empty((b, kv, heads // kv, dv), dtype=F32)
    splits = column_splits(b * kv, width) if splits is None else splits
    rows = lambda a: np.ascontiguousarray(a).reshape(-1, a.shape[3])  # noqa: E731
    _coded_kernel()(
        grouped,
        rows(layer.key_codes),
        _heads(layer.key_scales),
        _heads(layer.key_offsets),
        _heads(layer.open_keys),
        rows(layer.value_codes),
        rows(layer.value_scales),
        rows(layer.value_offsets),
        columns,
        first,
        np.ascontiguousarray(layer.shift, dtype=np.int64),
        np.ascontiguousarray(layer.closed, dtype=np.int64),
        np.ascontiguousarray(bias, dtype=F32),
        splits,
        layer.rotated,
        out,
    )
    return out.reshape(b, heads * dv)


def value_rows(words: np.ndarray) -> np.ndarray:
    """MLX's packed 4-bit words (..., dv // 8) uint32 as the module's value codes: a uint8
    view, two elements a byte (the even one low), no copy."""
    return np.ascontiguousarray(words).view(np.uint8)


def key_rows(words: np.ndarray, scales: np.ndarray, offsets: np.ndarray, d: int) -> tuple[np.ndarray, ...]:
    """Whole per-channel key blocks as the default scheme stores them (``kvshelf.kv.schemes``:
    each block of ``BLOCK_TOKENS`` quantized channel by channel in groups of 64 tokens, its
    words and scales reshaped to the block's rows: (..., rows, d // 8) words, (..., rows,
    d // 64) scales and offsets) as this module reads them: each token a row of codes
    (..., rows, d // 2) uint8, and for every 64 tokens a row of per-channel scales and one
    of offsets (..., rows // 64, d) fp32."""
    *lead, rows, _ = words.shape
    blocks = rows // BLOCK_TOKENS
    by_channel = np.ascontiguousarray(words).reshape(*lead, blocks, d, BLOCK_TOKENS // 8).view(np.uint8)
    codes = np.stack([by_channel & 15, by_channel >> 4], axis=-1).reshape(*lead, blocks, d, BLOCK_TOKENS)
    by_token = codes.swapaxes(-1, -2)  # (..., blocks, tokens, d)
    packed = (by_token[..., 0::2] | (by_token[..., 1::2] << 4)).astype(np.uint8).reshape(*lead, rows, d // 2)
    per_group = lambda a: (  # noqa: E731
        np.asarray(a, dtype=F32).reshape(*lead, blocks, d, BLOCK_TOKENS // GROUP).swapaxes(-1, -2)
    ).reshape(*lead, rows // GROUP, d)
    return packed, per_group(scales), per_group(offsets)
