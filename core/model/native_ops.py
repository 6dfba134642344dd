"""The small operations of a decode step, on numpy rows: norms, RoPE, activations, attention.

Why numpy: at decode, each of these touches a few hundred floats per agent, and MLX's CPU
backend spends far longer scheduling such an operation (and, between the layers'
projections that run outside its graph, evaluating the graph up to it) than computing it.
``kvshelf.model.native_decode`` runs a whole decode step on these and
``kvshelf.model.skinny``'s products; only the cache update stays in MLX.

Each mirrors the MLX function the model calls (``mx.fast.rms_norm``, ``mx.fast.rope``,
``nn.gelu_approx``, ``nn.silu``, mlx-lm's ``scaled_dot_product_attention``) in fp32, to
fp32 rounding, not bit for bit: the native decoder is checked against the model's own
call when it is built.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvshelf.model.blas import usable_cpus

F32 = np.float32
_GELU_C = F32(np.sqrt(2.0 / np.pi))  # the tanh GELU's sqrt(2 / pi)


@cache
def _rms_kernel() -> Any:
    """The norm of each row, one compiled pass (a numpy norm is five operations, 27 us a call
    on Gemma 3's 640 floats, and a step makes 109 of them)."""
    from kvshelf.model.jit import njit

    @njit(fastmath=True, cache=True, boundscheck=False)
    def rms_rows(x, weight, eps, out):
        rows, n = x.shape
        for r in range(rows):
            total = np.float32(0.0)
            for i in range(n):
                total += x[r, i] * x[r, i]
            scale = np.float32(1.0) / np.sqrt(total / np.float32(n) + eps)
            for i in range(n):
                out[r, i] = x[r, i] * scale * weight[i]

    return rms_rows


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``mx.fast.rms_norm(x, weight, eps)`` over the last axis (fp32 sums)."""
    rows = np.ascontiguousarray(x, dtype=F32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    _rms_kernel()(rows, weight, F32(eps), out)
    return out.reshape(x.shape)


@cache
def _gate_kernel() -> Any:
    """An MLP's gate: ``act(gate) * up`` in one compiled pass over the rows (as numpy, ten
    operations on Gemma 3's 2048 floats, 24-28 us a layer), both activations as
    ``x * sigmoid(z)``: the tanh GELU is ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``,
    SiLU ``x * sigmoid(x)``. The exp in two vector loops (``kvshelf.model.vector_exp``),
    its argument kept within fp32's range, so the sigmoid goes to exactly 0 or 1 at the
    ends (compiled once per process, cached on disk by numba)."""
    from kvshelf.model import vector_exp  # reached as a module attribute: see that module
    from kvshelf.model.jit import njit

    @njit(fastmath=True, cache=True, boundscheck=False)
    def gate_times_up(gate, up, gelu, out):
        n = gate.shape[0]
        powers = np.empty(n, dtype=np.int32)  # 2**k of each exp, as fp32 bits
        for i in range(n):
            x = gate[i]
            z = np.float32(2.0) * _GELU_C * (x + np.float32(0.044715) * x * x * x) if gelu else x
            out[i], powers[i] = vector_exp.parts(min(max(-z, vector_exp.FLOOR), vector_exp.CEILING))  # exp(-z)
        scales = powers.view(np.float32)
        for i in range(n):
            out[i] = gate[i] / (np.float32(1.0) + out[i] * scales[i]) * up[i]

    return gate_times_up


def _gated(gate: np.ndarray, up: np.ndarray, gelu: bool) -> np.ndarray:
    flat = np.ascontiguousarray(gate, dtype=F32).reshape(-1)
    out = np.empty_like(flat)
    _gate_kernel()(flat, np.ascontiguousarray(up, dtype=F32).reshape(-1), gelu, out)
    return out.reshape(gate.shape)


def gelu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``nn.gelu_approx(gate) * up`` (Gemma 3's MLP), to fp32 rounding."""
    return _gated(gate, up, True)


def silu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``nn.silu(gate) * up`` (the llama's SwiGLU), to fp32 rounding."""
    return _gated(gate, up, False)


class Rope:
    """``mx.fast.rope`` as an ``nn.RoPE`` (or mlx-lm's ``Llama3RoPE`` and DeepSeek-V2's YaRN, which
    hand it their own ``freqs``) applies it: the first ``dims`` features of each head rotated by position.

    The angles are MLX's own to the bit (its CPU rope is the fallback in mlx/fast.cpp: fp32
    inverse frequencies ``exp(-i * log(base) / (dims / 2))`` or ``1 / freqs``, times the fp32
    position): at position 3000 an angle rounded otherwise is off by 1e-4 radians."""

    def __init__(self, dims: int, traditional: bool, inverse_frequencies: np.ndarray, scale: float):
        self.dims = dims
        self.traditional = traditional
        self.inverse_frequencies = inverse_frequencies.astype(F32)
        self.scale = scale
        # What ``tables`` depends on: layers whose rotations share it share their tables.
        self.angles_key = (self.scale, self.inverse_frequencies.tobytes())

    @classmethod
    def of(cls, module: Any) -> Rope | None:
        """The rotation ``module`` applies, if it is one this mirrors (else None)."""
        if isinstance(module, nn.RoPE):
            half = module.dims // 2
            inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (mx.log(mx.array(module.base, mx.float32)) / half))
            return cls(module.dims, module.traditional, np.array(inv), float(module.scale))
        if type(module).__name__ == "Llama3RoPE":  # mlx-lm's: its own frequencies, scale 1
            return cls(module.dims, bool(module.traditional), np.array(mx.reciprocal(module._freqs)), 1.0)
        if type(module).__name__ == "DeepseekV2YarnRotaryEmbedding" and module.mscale == 1.0:
            # mlx-lm's YaRN for DeepSeek-V2: every feature of its input, neighbours paired, its own
            # frequencies (a magnitude factor other than 1, which would scale the input first, is not mirrored)
            freqs = module._freqs
            return cls(2 * freqs.size, True, np.array(mx.reciprocal(freqs)), 1.0)
        return None

    def angles(self, positions: np.ndarray) -> np.ndarray:
        """Each position's fp32 angles, (positions, dims/2), rounded as MLX's fallback rounds them."""
        return (positions.astype(F32) * F32(self.scale))[:, None] * self.inverse_frequencies[None]

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of each position's angles, (positions, dims/2), broadcast over heads."""
        angles = self.angles(positions)
        return np.cos(angles), np.sin(angles)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """``x`` (batch, heads, head_dim) with each batch row at its own position: the pairs
        ``(a, b)`` of the first ``dims`` features (neighbours if ``traditional``, else the
        halves) become ``(a cos - b sin, a sin + b cos)``, each product rounded apart."""
        rows = np.ascontiguousarray(x, dtype=F32)
        out = np.empty_like(rows)
        _rope_kernel()(rows, np.ascontiguousarray(cos), np.ascontiguousarray(sin), self.dims, self.traditional, out)
        return out


@cache
def _rope_kernel() -> Any:
    """The rotation in one compiled pass (as numpy, it was eleven operations a call, and a
    decode step makes two a layer). Without fast-math, so every product and sum rounds as
    numpy's did: ``a * c - b * s`` is two rounded products, then their rounded difference."""
    from kvshelf.model.jit import njit

    @njit(cache=True, boundscheck=False)
    def rotate(x, cos, sin, dims, traditional, out):
        batch, heads, width = x.shape
        half = dims // 2
        for r in range(batch):
            for h in range(heads):
                for i in range(width):
                    out[r, h, i] = x[r, h, i]
                for i in range(half):
                    first, second = (2 * i, 2 * i + 1) if traditional else (i, i + half)
                    a, b = x[r, h, first], x[r, h, second]
                    c, s = cos[r, i], sin[r, i]
                    out[r, h, first] = a * c - b * s
                    out[r, h, second] = a * s + b * c

    return rotate


# What a masked score becomes: finite, so that the compiled loops may assume no infinities,
# and so negative that its exponential is exactly zero beside any visible score.
MASKED = F32(-np.finfo(np.float32).max)


def mask_bias(mask: Any) -> np.ndarray | None:
    """The model's decode mask as scores to add, (batch or 1, width) fp32: None for None or
    ``"causal"`` (one query sees every cached column), 0 / ``MASKED`` for MLX's boolean mask
    (True: visible), an additive mask as it is (its infinities made ``MASKED``)."""
    if mask is None or isinstance(mask, str):
        return None
    m = np.asarray(mask)
    m = m.reshape(-1, m.shape[-1]) if m.ndim <= 2 else m.reshape(m.shape[0], m.shape[-1])
    if m.dtype == np.bool_:
        return np.where(m, F32(0.0), MASKED)
    return np.maximum(m.astype(F32), MASKED)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy). numba compiles a loop apart for each argument
    type, and read-only is a type of its own: a working set's buffer read in place
    (``_rows_of``) came read-only, a whole buffer writable, so one step's two ways to the
    same attention ran two compiled variants of the loop, which need not round alike (one
    compiled in the process, the other loaded from numba's cache: ``kvshelf.model.jit``
    says why they differ). Every input read-only, the loop has one variant."""
    view = a.view()
    view.flags.writeable = False
    return view


def _rows_of(a: np.ndarray) -> tuple[np.ndarray, int]:
    """(batch, kv_heads, width, d) keys or values as a C-contiguous (rows, d) array and its
    pitch: head ``(b, h)``'s column ``t`` is row ``(b * kv_heads + h) * pitch + t``.

    A decode working set hands over its whole buffer (``attend``'s ``span``): a reshape.
    The last ``width`` columns of a larger buffer (each head's rows contiguous, heads
    ``capacity`` rows apart) are that buffer's own rows, read in place, no copy. Anything
    laid out otherwise is copied once."""
    b, kv, width, d = a.shape
    if a.flags.c_contiguous:
        return a.reshape(b * kv * width, d), width
    s0, s1, s2, s3 = a.strides
    item = a.itemsize
    if s3 == item and s2 == d * item and s1 % s2 == 0 and s0 % s2 == 0:
        pitch = s1 // s2 if kv > 1 else s0 // s2 if b > 1 else width
        if pitch >= width and (b == 1 or kv == 1 or s0 == kv * s1):
            rows = (b * kv - 1) * pitch + width
            return np.lib.stride_tricks.as_strided(a, shape=(rows, d), strides=(s2, s3), writeable=False), pitch
    return np.ascontiguousarray(a).reshape(b * kv * width, d), width


# How many rows ahead of the columns it reads decode attention asks for keys and values
# (``_attention_kernel``, which reads them in pairs). Whole decode steps, one column at a
# time without a prefetch against pairs 16 rows ahead, in turn in one process, ms of
# attention a step (2026-12-07, scratch): the llama (bf16) at 1K, batch 4 9.20 -> 7.84 and
# batch 8 19.86 -> 16.27 (steps 42.39 -> 37.95); Gemma 3 about even (batch 8 at 1K 8.41
# -> 9.13 and 9.74 -> 9.52, batch 4 at 16K 22.01 -> 21.43). Fours gained no more than
# pairs, and lost much without a prefetch (the llama at batch 8 36.91 against 23.93). One
# llama layer at 16K (random K/V, the cache flushed first): 857 us one column at a time,
# 667 pairs 16 ahead.
ATTENTION_AHEAD = 16

# The shortest head whose query rows decode attention takes two at a time (each key and
# value element then loaded once for both rows, not once a row). Whole steps alternating
# the kernels in one process (2026-12-07, scratch), ms of attention a step: Gemma 3's
# 256-float heads at 1K 1.92 -> 1.80 at batch 1, 4.71 -> 3.92 at batch 4, 9.27 -> 7.45 at
# batch 8, at 16K 5.83 -> 5.13 and 19.33 -> 16.34; the llama's 64-float heads lost (1K
# 2.13 -> 2.28, 6.83 -> 7.33, 13.29 -> 13.77; 16K batch 1 22.69 -> 23.63), so they go a
# row at a time.
ROW_PAIRS_FROM = 128

# Columns below which a head's keys are not split between jobs: a job's fixed cost (a few
# microseconds) would outweigh what a second core reads.
SPLIT_COLUMNS = 256


@cache
def _attention_kernel() -> Any:
    """Grouped decode attention in ``splits`` column ranges per (agent, KV head), every
    (agent, head, range) a job across the cores: that head's query rows scored against each
    key row once, a max-subtracted softmax and the values weighted in one pass, per range;
    then each head's ranges merged (rescaled to the common maximum), and normalized last.
    One agent's one KV head (Gemma 3 at batch 1) thus reads its keys on both cores. A
    column the mask hides (``MASKED``) is not read at all: a working set keeps a sliding
    layer's rows back to its last block boundary (Gemma 3 at 1K: 768 columns for a window
    of 512) and a batch's left padding, and their weights are exactly 0, which adds nothing
    to any sum; a range of columns all hidden weighs nothing, and a row that sees no column
    gets zeros (compiled once per process, cached on disk by numba).

    Keys and values are read two columns at a time where both count, each pair with a
    prefetch ``ATTENTION_AHEAD`` rows on: each query element loaded once for two keys,
    each output element loaded and stored once for two values, and memory asked for
    before the loads wait on it (the bits came out the same as one column at a time, both
    models' head sizes, 2026-12-07). Heads of at least ``ROW_PAIRS_FROM`` floats (Gemma 3's
    256) also take their query rows two at a time, each key and value element loaded once
    for both rows where it was loaded once a row: that moved sums by up to 1e-7, and one
    loop body then serves every column (a lone one goes as a pair with itself, at weight 0
    for its values), because a separate loop for lone columns gave other bits than pairs,
    and a column's bits must not depend on its neighbour. Shorter heads keep the loops
    before (the same bits)."""
    from kvshelf.model import decode_softmax, prefetch  # reached as module attributes: see those modules
    from kvshelf.model.jit import njit, prange
    from kvshelf.model.prefetch import LINE_FLOATS

    @njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
    def grouped_decode(q, k, v, pitch, first, bias, splits, new_k, new_v, extra, out):
        batch, kv, group, d = q.shape
        width, dv = bias.shape[1], v.shape[1]
        stored = width - extra  # columns in k and v; the last ``extra`` (0 or 1) are new_k/new_v
        span = -(-width // splits)
        paired_rows = d >= ROW_PAIRS_FROM and dv >= ROW_PAIRS_FROM
        tops = np.empty((batch * kv, splits, group), dtype=np.float32)
        sums = np.empty((batch * kv, splits, group), dtype=np.float32)
        parts = np.empty((batch * kv, splits if splits > 1 else 0, group, dv), dtype=np.float32)
        for job in prange(batch * kv * splits):
            head = job // splits
            part = job - head * splits
            b = head // kv
            h = head - b * kv
            base = head * pitch + first
            br = b if bias.shape[0] > 1 else 0
            lo = part * span
            hi = min(width, lo + span)
            n = max(hi - lo, 0)
            scores = np.empty((group, max(n, 1)), dtype=np.float32)
            m = max(min(hi, stored) - lo, 0)  # of them, stored columns; the rest is the new row
            if paired_rows:
                # One loop body scores every column: a lone one (a hidden neighbour, the last, the step's
                # new row) goes as a pair with itself, so a column's bits do not depend on its neighbour
                # (the working set's hidden columns and the step's new row move with the step). Separate
                # copies of the same loop for lone columns gave other bits (LLVM optimizes each its way).
                t = 0
                while t < n:
                    if t < m:  # a stored column, paired with the next where both count
                        keys, r = k, base + lo + t
                        pair = t + 1 < m and bias[br, lo + t] != MASKED and bias[br, lo + t + 1] != MASKED
                    else:  # the step's new row
                        keys, r = new_k[b], h
                        pair = False
                    if not pair and bias[br, lo + t] == MASKED:  # a hidden column: its key is not read
                        for g in range(group):
                            scores[g, t] = MASKED
                        t += 1
                        continue
                    if pair and t + ATTENTION_AHEAD + 1 < m:
                        for i in range(0, d, LINE_FLOATS):
                            prefetch.line(k, r + ATTENTION_AHEAD, i)
                            prefetch.line(k, r + ATTENTION_AHEAD + 1, i)
                    r1 = r + 1 if pair else r
                    g = 0
                    while g + 1 < group:  # two query rows at a time: each key element loaded once for both
                        s00, s01 = np.float32(0.0), np.float32(0.0)
                        s10, s11 = np.float32(0.0), np.float32(0.0)
                        for i in range(d):
                            x0, x1 = q[b, h, g, i], q[b, h, g + 1, i]
                            k0, k1 = keys[r, i], keys[r1, i]
                            s00 += x0 * k0
                            s01 += x0 * k1
                            s10 += x1 * k0
                            s11 += x1 * k1
                        scores[g, t] = s00 + bias[br, lo + t]
                        scores[g + 1, t] = s10 + bias[br, lo + t]
                        if pair:
                            scores[g, t + 1] = s01 + bias[br, lo + t + 1]
                            scores[g + 1, t + 1] = s11 + bias[br, lo + t + 1]
                        g += 2
                    while g < group:  # a row alone (an odd last one, or every one of short rows)
                        this_total, next_total = np.float32(0.0), np.float32(0.0)
                        for i in range(d):
                            x = q[b, h, g, i]
                            this_total += x * keys[r, i]
                            next_total += x * keys[r1, i]
                        scores[g, t] = this_total + bias[br, lo + t]
                        if pair:
                            scores[g, t + 1] = next_total + bias[br, lo + t + 1]
                        g += 1
                    t += 2 if pair else 1
            else:  # short rows: a row at a time, a lone column by its own loop (the same bits)
                t = 0
                while t < m:
                    r = base + lo + t
                    if t + 1 < m and bias[br, lo + t] != MASKED and bias[br, lo + t + 1] != MASKED:
                        if t + ATTENTION_AHEAD + 1 < m:
                            for i in range(0, d, LINE_FLOATS):
                                prefetch.line(k, r + ATTENTION_AHEAD, i)
                                prefetch.line(k, r + ATTENTION_AHEAD + 1, i)
                        for g in range(group):  # two visible columns
                            this_total, next_total = np.float32(0.0), np.float32(0.0)
                            for i in range(d):
                                x = q[b, h, g, i]
                                this_total += x * k[r, i]
                                next_total += x * k[r + 1, i]
                            scores[g, t] = this_total + bias[br, lo + t]
                            scores[g, t + 1] = next_total + bias[br, lo + t + 1]
                        t += 2
                        continue
                    if bias[br, lo + t] == MASKED:  # a hidden column: its key is not read
                        for g in range(group):
                            scores[g, t] = MASKED
                    else:
                        for g in range(group):
                            total = np.float32(0.0)
                            for i in range(d):
                                total += q[b, h, g, i] * k[r, i]
                            scores[g, t] = total + bias[br, lo + t]
                    t += 1
                for t in range(m, n):
                    for g in range(group):
                        total = np.float32(0.0)
                        for i in range(d):
                            total += q[b, h, g, i] * new_k[b, h, i]
                        scores[g, t] = total + bias[br, lo + t]
            decode_softmax.weigh(scores, n, tops[head, part], sums[head, part])
            acc = np.zeros((group, dv), dtype=np.float32)
            if paired_rows:
                # Likewise one loop body weighs every value: a lone column goes with itself at weight 0
                # (its value is finite: some row weighs it).
                t = 0
                while t < n:
                    if t < m:  # two columns the first query row weighs (every row's weight of a hidden
                        # column is 0, and a visible column's value is finite, so another row's 0 adds nothing)
                        values, r = v, base + lo + t
                        pair = t + 1 < m and scores[0, t] != 0.0 and scores[0, t + 1] != 0.0
                    else:  # the step's new row
                        values, r = new_v[b], h
                        pair = False
                    if pair and t + ATTENTION_AHEAD + 1 < m:
                        for i in range(0, dv, LINE_FLOATS):
                            prefetch.line(v, r + ATTENTION_AHEAD, i)
                            prefetch.line(v, r + ATTENTION_AHEAD + 1, i)
                    if not pair:
                        weighed = False
                        for g in range(group):
                            weighed = weighed or scores[g, t] != 0.0
                        if not weighed:  # a hidden column: adding 0 changes no sum, so its value is not read
                            t += 1
                            continue
                    r1 = r + 1 if pair else r
                    g = 0
                    while g + 1 < group:  # two query rows at a time: each value element loaded once for both
                        w00, w10 = scores[g, t], scores[g + 1, t]
                        w01 = scores[g, t + 1] if pair else np.float32(0.0)
                        w11 = scores[g + 1, t + 1] if pair else np.float32(0.0)
                        for i in range(dv):
                            v0, v1 = values[r, i], values[r1, i]
                            acc[g, i] += w00 * v0 + w01 * v1
                            acc[g + 1, i] += w10 * v0 + w11 * v1
                        g += 2
                    while g < group:  # a row alone
                        this_weight = scores[g, t]
                        next_weight = scores[g, t + 1] if pair else np.float32(0.0)
                        for i in range(dv):
                            acc[g, i] += this_weight * values[r, i] + next_weight * values[r1, i]
                        g += 1
                    t += 2 if pair else 1
            else:
                t = 0
                while t < m:
                    r = base + lo + t
                    if t + ATTENTION_AHEAD + 1 < m:
                        for i in range(0, dv, LINE_FLOATS):
                            prefetch.line(v, r + ATTENTION_AHEAD, i)
                            prefetch.line(v, r + ATTENTION_AHEAD + 1, i)
                    # two columns the first query row weighs (every row's weight of a hidden column is 0,
                    # and a visible column's value is finite, so another row's 0 adds nothing)
                    if t + 1 < m and scores[0, t] != 0.0 and scores[0, t + 1] != 0.0:
                        for g in range(group):
                            this_weight, next_weight = scores[g, t], scores[g, t + 1]
                            for i in range(dv):
                                acc[g, i] += this_weight * v[r, i] + next_weight * v[r + 1, i]
                        t += 2
                        continue
                    for g in range(group):
                        p = scores[g, t]
                        if p == 0.0:  # a hidden column's weight: adding 0 changes no sum, so skip its value
                            continue
                        for i in range(dv):
                            acc[g, i] += p * v[r, i]
                    t += 1
                for t in range(m, n):
                    for g in range(group):
                        p = scores[g, t]
                        for i in range(dv):
                            acc[g, i] += p * new_v[b, h, i]
            if splits == 1:  # nothing to merge: normalize into the output at once
                for g in range(group):
                    total = sums[head, 0, g]  # 0 only for a row that sees no column: zeros
                    scale = np.float32(1.0) / total if total > 0.0 else np.float32(0.0)
                    for i in range(dv):
                        out[b, h, g, i] = acc[g, i] * scale
            else:
                parts[head, part] = acc
        if splits > 1:  # each head's ranges, rescaled to their common maximum
            for head in prange(batch * kv):
                b = head // kv
                decode_softmax.merge(tops[head], sums[head], parts[head], out[b, head - b * kv])

    return grouped_decode


_NO_ROW = np.zeros((1, 1, 1), dtype=F32)  # new_keys/new_values when there is no new column


def column_splits(heads: int, width: int) -> int:
    """How many column ranges each of ``heads`` (agent, KV head) pairs is cut into: the
    fewest that give every core the same number of jobs (the llama's 3 KV heads on 2 cores
    left one core two heads: 45 ms of attention a step at 16K, most of it waiting on that
    core), none shorter than ``SPLIT_COLUMNS``."""
    cpus = usable_cpus()
    return max(1, min(cpus // math.gcd(heads, cpus), width // SPLIT_COLUMNS))


def attend(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    bias: np.ndarray | None,
    scale: float,
    splits: int | None = None,
    new_keys: np.ndarray | None = None,
    new_values: np.ndarray | None = None,
    span: tuple[int, int] | None = None,
) -> np.ndarray:
    """One query row per agent against its cached keys: (batch, heads, head_dim) queries,
    (batch, kv_heads, width, head_dim) keys and values (a working set's strides read in
    place), ``bias`` from ``mask_bias`` (None: every column); each KV head read once for
    the query heads that share it; each head's columns in ``splits`` ranges (None:
    ``column_splits``). ``new_keys``/``new_values`` (batch, kv_heads, head_dim): one more
    column after the cached ones (the step's own token, not yet in the buffer), read
    in the same order as if it were, so the bits do not change. ``span``: the columns
    ``lo..end`` of ``keys`` and ``values`` that the queries read (a working set's whole
    buffers, read in place without a view made a call); None: all. Returns
    (batch, heads * value_dim)."""
    b, heads, d = q.shape
    kv = keys.shape[1]
    first, end = (0, keys.shape[2]) if span is None else span
    extra = 0 if new_keys is None else 1
    width = end - first + extra
    if bias is None:
        bias = np.zeros((1, width), dtype=F32)
    if bias.shape[1] != width or bias.shape[0] not in (1, b) or not 0 <= first <= end <= keys.shape[2]:
        raise ValueError(f"a decode mask of shape {bias.shape} for {b} rows of {width} columns")
    k, pitch = _rows_of(keys)
    v, v_pitch = _rows_of(values)
    if v_pitch != pitch:
        v = np.ascontiguousarray(values).reshape(-1, values.shape[3])
        k, pitch = np.ascontiguousarray(keys).reshape(-1, d), keys.shape[2]
    if new_keys is None or new_values is None:
        new_keys, new_values = _NO_ROW, _NO_ROW
    grouped = np.ascontiguousarray((q * F32(scale)).reshape(b, kv, heads // kv, d))
    out = np.empty((b, kv, heads // kv, values.shape[3]), dtype=F32)
    splits = column_splits(b * kv, width) if splits is None else splits
    kernel = _attention_kernel()
    inputs = (_read_only(x) for x in (grouped, k, v, np.ascontiguousarray(bias, dtype=F32), new_keys, new_values))
    grouped, k, v, bias, new_keys, new_values = inputs
    kernel(grouped, k, v, pitch, first, bias, splits, new_keys, new_values, extra, out)
    return out.reshape(b, heads * values.shape[3])
