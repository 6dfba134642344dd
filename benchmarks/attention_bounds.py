"""What bounds decode attention here: the bytes it reads, or its loops' arithmetic?

Issue 14's remaining decode goals (batch 8 at 5x batch 1's tokens/s, the 30-layer llama
at 16K within 1.4x of the floor) wait on attention, which grows with the batch and the
context. Two ways forward were on the table: read fewer bytes (the Q4 blocks in place,
4 bits an element against the working set's 32) or make the loops faster. This measures,
side by side in one run, for the embedded Gemma 3's heads (4 query heads on 1 KV head of
256) and the llama's (9 on 3 of 64), every layer at the full context:

- ``hot`` / ``cold``: ``kvshelf.model.native_ops.attend`` (the default kernels' decode
  attention) over one layer's K/V every time, which stays in the last-level cache, and
  over every layer's own, which comes from memory. If the loops ran at memory's pace,
  hot would be much faster than cold;
- ``scores_rows`` / ``scores_tiles`` / ``scores_kivi``: the scores alone, with keys as the working set lays
  them out (a row per column: each score ends in a horizontal sum of a vector), and with
  keys in tiles of 16 columns laid out dimension by dimension (the sums run down the
  lanes, none across them), and with keys read in place as the default scheme keeps them
  at rest (``scores_kivi``: per-channel 4-bit blocks, themselves laid out like tiles);
- ``q4_in_place``: whole attention reading Q4 rows in place (4-bit codes, keys' per-channel
  scales for each block of 64 rows folded into the query, values' scales per row and group
  of 64, the values' rotation undone once per head), each byte unpacked as it is read,
  compiled per head shape, checked against ``attend`` over the same rows dequantized;
- ``q8_in_place``: the same with the codes one byte an element (twice Q4's bytes, a quarter
  of the working set's), compiled per head shape so that its loops unroll: it shows what
  unpacking nibbles costs, and whether codes read in place beat fp32 rows where memory
  is slow against the cores;
- ``coded_attention``: kvshelf's own loop for that (``kvshelf.model.coded_attention``): the
  same layout and arithmetic as ``q4_in_place``, one loop for every head shape, as the
  library compiles it;
- ``q4_at_rest``: ``q4_in_place`` with the keys as ``scores_kivi`` reads them: whole
  attention straight on an agent's blocks as the default scheme keeps them.

These are measuring kernels, not kvshelf's: they say what a change of layout would buy
before the working set is rebuilt around one.

    python benchmarks/attention_bounds.py [--repeats 15]

Run it under the benchmark lock; it writes ``results/attention-bounds-*.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import cache
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import numpy as np
from common import write_json

from kvbench.decode_steps import bandwidth, describe_bandwidth
from kvshelf.model import coded_attention, native_ops, vector_exp
from kvshelf.model.jit import njit, prange

F32 = np.float32
BLOCK = 64  # rows of a key block (per-channel scales) and elements of a value group (per-row scales)
TILE = 16  # key columns a tile holds, one vector's lanes
KIVI_BLOCK = 256  # tokens of a per-channel key block at rest (kvshelf.model.spec.BLOCK_TOKENS)

# (model, query heads, KV heads, head dim, layers, batch, context)
CASES = (
    ("embedded", 4, 1, 256, 18, 1, 1024),
    ("embedded", 4, 1, 256, 18, 4, 1024),
    ("embedded", 4, 1, 256, 18, 8, 1024),
    ("embedded", 4, 1, 256, 18, 1, 16384),
    ("llama30", 9, 3, 64, 30, 1, 1024),
    ("llama30", 9, 3, 64, 30, 4, 1024),
    ("llama30", 9, 3, 64, 30, 1, 16384),
)


@njit
def _half(job: int, n: int) -> tuple[int, int, int]:
    """Job ``job``'s head and its half of ``n`` columns (or tiles): a head's two halves
    go to the two cores."""
    half = n // 2
    lo = (job % 2) * half
    return job // 2, lo, lo + half


@njit(parallel=True, fastmath=True, boundscheck=False)
def scores_rows(q: Any, k: Any, out: Any) -> None:
    """Scores with keys a row per column (heads x width x d), two columns at a time, as
    ``native_ops``'s loop for short heads reads them: each sum ends across a vector."""
    heads, group, d = q.shape
    for job in prange(heads * 2):
        h, lo, hi = _half(job, k.shape[1])
        for t in range(lo, hi, 2):
            for g in range(group):
                s0, s1 = F32(0.0), F32(0.0)
                for i in range(d):
                    s0 += q[h, g, i] * k[h, t, i]
                    s1 += q[h, g, i] * k[h, t + 1, i]
                out[h, g, t] = s0
                out[h, g, t + 1] = s1


@njit(parallel=True, fastmath=True, boundscheck=False)
def scores_tiles(q: Any, kt: Any, out: Any) -> None:
    """Scores with keys in tiles (heads x tiles x d x TILE): four query rows against a tile's
    columns at once, the sums down the lanes."""
    heads, group, d = q.shape
    for job in prange(heads * 2):
        h, lo, hi = _half(job, kt.shape[1])
        s = np.zeros((4, TILE), dtype=F32)
        for tile in range(lo, hi):
            for g0 in range(0, group, 4):
                rows = min(4, group - g0)
                s[:] = 0.0
                for i in range(d):
                    x0 = q[h, g0, i]
                    x1 = q[h, g0 + 1, i] if rows > 1 else F32(0.0)
                    x2 = q[h, g0 + 2, i] if rows > 2 else F32(0.0)
                    x3 = q[h, g0 + 3, i] if rows > 3 else F32(0.0)
                    for c in range(TILE):
                        key = kt[h, tile, i, c]
                        s[0, c] += x0 * key
                        s[1, c] += x1 * key
                        s[2, c] += x2 * key
                        s[3, c] += x3 * key
                for g in range(rows):
                    for c in range(TILE):
                        out[h, g0 + g, tile * TILE + c] = s[g, c]


@cache
def _kivi_block_scores(group: int, d: int) -> Any:
    """The scores of ``n`` tokens from ``lo`` (a block boundary) with keys read in place as
    the default scheme keeps them at rest (KIVI): each block of ``KIVI_BLOCK`` tokens
    quantized per channel in groups of ``BLOCK`` tokens, a channel's codes contiguous (two
    tokens a byte, the even one in the low nibble), so the sums run down the lanes over
    tokens, as in ``scores_tiles``, from 4-bit codes. A group's scale goes into the query
    element, its offset into one sum a query row.

    q (group, d), scaled; kc (blocks, d, KIVI_BLOCK // 2) uint8; ks/kz (blocks, d,
    KIVI_BLOCK // BLOCK); scores (group, >= n): column ``u`` is token ``lo + u``."""
    half_group = BLOCK // 2

    @njit(fastmath=True, boundscheck=False)
    def block_scores(q: Any, kc: Any, ks: Any, kz: Any, lo: int, n: int, scores: Any) -> None:
        even = np.empty((group, half_group), dtype=F32)
        odd = np.empty((group, half_group), dtype=F32)
        offsets = np.empty(group, dtype=F32)
        scaled = np.empty(group, dtype=F32)
        for first in range(lo, lo + n, BLOCK):
            block, grp = first // KIVI_BLOCK, (first % KIVI_BLOCK) // BLOCK
            even[:] = 0.0
            odd[:] = 0.0
            offsets[:] = 0.0
            for c in range(d):
                for g in range(group):
                    scaled[g] = q[g, c] * ks[block, c, grp]
                    offsets[g] += q[g, c] * kz[block, c, grp]
                for j in range(half_group):
                    xf = F32(kc[block, c, grp * half_group + j])
                    high = np.floor(xf * F32(0.0625))
                    low = xf - F32(16.0) * high
                    for g in range(group):
                        even[g, j] += scaled[g] * low
                        odd[g, j] += scaled[g] * high
            for g in range(group):
                for j in range(half_group):
                    scores[g, first - lo + 2 * j] = even[g, j] + offsets[g]
                    scores[g, first - lo + 2 * j + 1] = odd[g, j] + offsets[g]

    return block_scores


@cache
def scores_kivi(group: int, d: int) -> Any:
    """Scores with keys read in place as KIVI keeps them at rest (``_kivi_block_scores``), a
    block of every head a job. Compiled per head shape.

    q (heads, group, d), scaled; kc (heads, blocks, d, KIVI_BLOCK // 2) uint8; ks/kz (heads,
    blocks, d, KIVI_BLOCK // BLOCK); out (heads, group, width)."""
    block_scores = _kivi_block_scores(group, d)

    @njit(parallel=True, fastmath=True, boundscheck=False)
    def scores(q: Any, kc: Any, ks: Any, kz: Any, out: Any) -> None:
        heads, blocks = kc.shape[0], kc.shape[1]
        for job in prange(heads * blocks):
            h = job // blocks
            block = job - h * blocks
            lo = block * KIVI_BLOCK
            block_scores(q[h], kc[h], ks[h], kz[h], lo, KIVI_BLOCK, out[h, :, lo : lo + KIVI_BLOCK])

    return scores


# How ``in_place`` reads the K/V: Q4 rows (two elements a byte), one-byte codes (the same
# rows unpacked once), or the keys as the default scheme keeps them at rest (KIVI blocks)
# with Q4 value rows: attention straight on an agent's blocks.
LAYOUTS = ("q4_rows", "q8_rows", "q4_at_rest")


@njit(fastmath=True, boundscheck=False)
def _nibbles(x: Any) -> tuple[Any, Any]:
    """A byte's two 4-bit codes as floats (low, high), unpacked in floats: integer masks and
    shifts are typed 64-bit by numba, and loops that unpacked so came out about twice as
    slow (the llama's heads at 1K, batch 1: 5.57 ms against 2.85; at 16K 71.0 against 55.2;
    two scratch runs minutes apart, 2026-12-07, in which ``attend`` over fp32 rows took
    4.57 and 4.64 ms, 45.1 and 64.8)."""
    xf = F32(x)
    high = np.floor(xf * F32(0.0625))
    return xf - F32(16.0) * high, high


@cache
def in_place(group: int, d: int, layout: str) -> Any:
    """Decode attention over K/V codes read in place (``LAYOUTS``), compiled per head shape
    (``group`` query rows, ``d`` floats) so that its loops have constant trip counts.

    q (batch, kv, group, d), scaled. Rows: kc/vc (heads * width, d // 2) uint8 for Q4, the
    even element in a byte's low nibble (a uint8 view of MLX's packed words), or (heads *
    width, d) for one-byte codes; ks/kz (heads * width // BLOCK, d): a key block's scale
    and offset per channel; vs/vz (heads * width, d // BLOCK): a value row's per group. At
    rest, kc, ks and kz as ``scores_kivi`` takes them (each job's columns then start at a
    block). A key block's scales go into the query once (q * scale, and q . offset added to
    each score); a value row's scale into its weight. The values are rotated (a Hadamard
    transform over the head, as the default scheme rotates them): the weighted sum is taken
    rotated and turned back once per head.

    The prototype before this one, which unpacked a row at a time into arrays with integer
    operations, was slower than fp32 rows on the llama
    (``results/attention-bounds-20261207-150638.json``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"a layout of {LAYOUTS}, not {layout!r}")
    one_byte = layout == "q8_rows"
    row_width = d if one_byte else d // 2
    groups = d // BLOCK

    @njit(fastmath=True, boundscheck=False)
    def row_scores(q: Any, kc: Any, ks: Any, kz: Any, head: int, base: int, lo: int, n: int, scores: Any) -> None:
        """Key rows ``base + lo ..``, a key block's scales folded into the query (its even
        and odd elements apart for Q4, whose bytes hold one of each)."""
        scaled = np.empty((group, d), dtype=F32)
        offsets = np.empty(group, dtype=F32)
        t = 0
        while t < n:
            block = (base + lo + t) // BLOCK
            stop = min(n, (block + 1) * BLOCK - base - lo)
            for g in range(group):
                c = F32(0.0)
                for i in range(d):
                    at = i if one_byte else (i % 2) * (d // 2) + i // 2  # Q4: evens, then odds
                    scaled[g, at] = q[g, i] * ks[block, i]
                    c += q[g, i] * kz[block, i]
                offsets[g] = c
            for u in range(t, stop):
                r = base + lo + u
                for g in range(group):
                    s = F32(0.0)
                    for j in range(row_width):
                        if one_byte:
                            s += scaled[g, j] * F32(kc[r, j])
                        else:
                            low, high = _nibbles(kc[r, j])
                            s += scaled[g, j] * low + scaled[g, row_width + j] * high
                    scores[g, u] = s + offsets[g]
            t = stop

    block_scores = _kivi_block_scores(group, d)

    @njit(fastmath=True, boundscheck=False)
    def kivi_scores(q: Any, kc: Any, ks: Any, kz: Any, head: int, base: int, lo: int, n: int, scores: Any) -> None:
        block_scores(q, kc[head], ks[head], kz[head], lo, n, scores)

    key_scores = kivi_scores if layout == "q4_at_rest" else row_scores
    aligned = KIVI_BLOCK if layout == "q4_at_rest" else 1  # where a job's columns may start

    @njit(fastmath=True, boundscheck=False)
    def value_sums(scores: Any, vc: Any, vs: Any, vz: Any, base: int, lo: int, n: int, out: Any) -> None:
        """The weighted sum (group x d, rotated) of value rows ``base + lo ..``, each row's
        scale folded into its weight and its offsets summed apart."""
        acc = np.zeros((group, d), dtype=F32)  # Q4: the even elements, then the odd
        shifts = np.zeros((group, groups), dtype=F32)
        per_group = BLOCK if one_byte else BLOCK // 2
        for u in range(n):
            r = base + lo + u
            for g in range(group):
                w = scores[g, u]
                for grp in range(groups):
                    a = w * vs[r, grp]
                    shifts[g, grp] += w * vz[r, grp]
                    for j in range(grp * per_group, (grp + 1) * per_group):
                        if one_byte:
                            acc[g, j] += a * F32(vc[r, j])
                        else:
                            low, high = _nibbles(vc[r, j])
                            acc[g, j] += a * low
                            acc[g, row_width + j] += a * high
        for g in range(group):
            for i in range(d):
                at = i if one_byte else (i % 2) * (d // 2) + i // 2
                out[g, i] = acc[g, at] + shifts[g, i // BLOCK]

    @njit(parallel=True, fastmath=True, boundscheck=False)
    def attend_codes(q: Any, kc: Any, ks: Any, kz: Any, vc: Any, vs: Any, vz: Any, splits: int, out: Any) -> None:
        batch, kv = q.shape[0], q.shape[1]
        width = vc.shape[0] // (batch * kv)
        span = -(-width // splits // aligned) * aligned
        tops = np.empty((batch * kv, splits, group), dtype=F32)
        sums = np.empty((batch * kv, splits, group), dtype=F32)
        parts = np.empty((batch * kv, splits, group, d), dtype=F32)
        for job in prange(batch * kv * splits):
            head = job // splits
            part = job - head * splits
            b = head // kv
            h = head - b * kv
            lo = part * span
            n = max(min(width, lo + span) - lo, 0)
            base = head * width
            scores = np.empty((group, n), dtype=F32)
            key_scores(q[b, h], kc, ks, kz, head, base, lo, n, scores)
            powers = np.empty(n, dtype=np.int32)
            for g in range(group):
                top = F32(-3.0e38)
                for u in range(n):
                    top = max(top, scores[g, u])
                for u in range(n):
                    e, powers[u] = vector_exp.parts(max(scores[g, u] - top, vector_exp.FLOOR))
                    scores[g, u] = e
                scales = powers.view(F32)
                total = F32(0.0)
                for u in range(n):
                    e = scores[g, u] * scales[u]
                    scores[g, u] = e
                    total += e
                tops[head, part, g] = top
                sums[head, part, g] = total
            value_sums(scores, vc, vs, vz, base, lo, n, parts[head, part])
        for head in prange(batch * kv):
            b = head // kv
            h = head - b * kv
            for g in range(group):
                top = F32(-3.0e38)
                for part in range(splits):
                    top = max(top, tops[head, part, g])
                total = F32(0.0)
                for i in range(d):
                    out[b, h, g, i] = 0.0
                for part in range(splits):
                    w = np.exp(tops[head, part, g] - top)
                    total += w * sums[head, part, g]
                    for i in range(d):
                        out[b, h, g, i] += w * parts[head, part, g, i]
                for i in range(d):
                    out[b, h, g, i] /= total
                step = 1  # the rotation undone: a normalized Hadamard is its own inverse
                while step < d:
                    for i0 in range(0, d, 2 * step):
                        for i in range(i0, i0 + step):
                            x0, x1 = out[b, h, g, i], out[b, h, g, i + step]
                            out[b, h, g, i] = x0 + x1
                            out[b, h, g, i + step] = x0 - x1
                    step *= 2
                for i in range(d):
                    out[b, h, g, i] *= F32(d**-0.5)

    return attend_codes


@njit(parallel=True, fastmath=True, boundscheck=False)
def _parallel_sum(x: Any) -> Any:
    total = F32(0.0)
    for i in prange(x.shape[0]):
        total += x[i]
    return total


def parallel_read_gbs(megabytes: int = 512, repeats: int = 15) -> float:
    """The best pass of a plain sum on every core over ``megabytes``: numpy's sum (the
    floor of ``kvbench.decode_steps.bandwidth`` without a model) reads on one core only."""
    x = np.ones(megabytes * 2**20 // 4, dtype=F32)
    _parallel_sum(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        _parallel_sum(x)
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def _hadamard(n: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix, the order the butterflies above take."""
    m = np.ones((1, 1), dtype=F32)
    while m.shape[0] < n:
        m = np.block([[m, m], [m, -m]])
    return (m / np.sqrt(n)).astype(F32)


class Layer:
    """One layer's K/V for a batch: Q4 codes and scales, and the same rows dequantized."""

    def __init__(self, rng: np.random.Generator, batch: int, kv: int, d: int, width: int):
        rows = batch * kv * width
        self.kc = rng.integers(0, 256, (rows, d // 2), dtype=np.uint8)
        self.vc = rng.integers(0, 256, (rows, d // 2), dtype=np.uint8)
        self.ks = (rng.random((rows // BLOCK, d), dtype=F32) * F32(0.2)).astype(F32)
        self.kz = (-self.ks * F32(7.5)).astype(F32)
        self.vs = (rng.random((rows, d // BLOCK), dtype=F32) * F32(0.2)).astype(F32)
        self.vz = (-self.vs * F32(7.5)).astype(F32)
        nibbles = lambda c: np.stack([c & 15, c >> 4], axis=-1).reshape(rows, d)  # noqa: E731
        self.kc8, self.vc8 = nibbles(self.kc), nibbles(self.vc)  # one byte an element
        codes = lambda c: nibbles(c).astype(F32)  # noqa: E731
        k = codes(self.kc) * np.repeat(self.ks, BLOCK, axis=0) + np.repeat(self.kz, BLOCK, axis=0)
        v_rotated = codes(self.vc) * np.repeat(self.vs, BLOCK, axis=1) + np.repeat(self.vz, BLOCK, axis=1)
        v = v_rotated @ _hadamard(d)
        self.k = k.reshape(batch, kv, width, d).astype(F32)
        self.v = v.reshape(batch, kv, width, d).astype(F32)
        heads_k = self.k.reshape(batch * kv, width, d)
        self.k_tiles = np.ascontiguousarray(heads_k.reshape(batch * kv, width // TILE, TILE, d).transpose(0, 1, 3, 2))
        # the same keys at rest as KIVI keeps them: per block, channel by channel, two tokens a byte
        blocks = width // KIVI_BLOCK
        by_channel = self.kc8.reshape(batch * kv, blocks, KIVI_BLOCK, d).transpose(0, 1, 3, 2)
        self.kc_kivi = np.ascontiguousarray(by_channel[..., 0::2] | (by_channel[..., 1::2] << 4))
        per_group = lambda x: np.ascontiguousarray(  # noqa: E731
            x.reshape(batch * kv, blocks, KIVI_BLOCK // BLOCK, d).transpose(0, 1, 3, 2)
        )
        self.ks_kivi, self.kz_kivi = per_group(self.ks), per_group(self.kz)
        # the same rows as kvshelf's coded attention reads them (no open block: every key coded)
        heads = lambda x: x.reshape(batch, kv, -1, x.shape[-1])  # noqa: E731
        self.coded = coded_attention.CodedLayer(
            heads(self.kc),
            heads(self.ks),
            heads(self.kz),
            np.zeros((batch, kv, 1, d), F32),
            heads(self.vc),
            heads(self.vs),
            heads(self.vz),
            np.zeros(batch, np.int64),
            np.full(batch, width, np.int64),
            rotated=True,
        )

    @property
    def dense_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def q4_bytes(self) -> int:
        return sum(x.nbytes for x in (self.kc, self.vc, self.ks, self.kz, self.vs, self.vz))

    @property
    def q4_value_bytes(self) -> int:
        return sum(x.nbytes for x in (self.vc, self.vs, self.vz))

    @property
    def kivi_key_bytes(self) -> int:
        return sum(x.nbytes for x in (self.kc_kivi, self.ks_kivi, self.kz_kivi))

    @property
    def q8_bytes(self) -> int:
        return sum(x.nbytes for x in (self.kc8, self.vc8, self.ks, self.kz, self.vs, self.vz))


def case(heads: int, kv: int, d: int, layers: int, batch: int, context: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(batch * 1000 + context)
    stack = [Layer(rng, batch, kv, d, context) for _ in range(layers)]
    q = rng.standard_normal((batch, heads, d), dtype=F32)
    scale = d**-0.5
    grouped = np.ascontiguousarray((q * F32(scale)).reshape(batch, kv, heads // kv, d))
    per_head = grouped.reshape(batch * kv, heads // kv, d)
    splits = native_ops.column_splits(batch * kv, context)
    in_nibbles, in_bytes, at_rest = (in_place(heads // kv, d, layout) for layout in LAYOUTS)
    out = np.empty_like(grouped)
    s_rows = np.empty((batch * kv, heads // kv, context), dtype=F32)
    s_tiles = np.empty_like(s_rows)
    s_kivi = np.empty_like(s_rows)
    kivi = scores_kivi(heads // kv, d)

    def timed(fn: Callable[[Layer], Any], layers_read: list[Layer]) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            for layer in layers_read:
                fn(layer)
            return (time.perf_counter() - t) * 1e3

        return run

    # each in-place attention over one layer, and the bytes it reads of that layer
    attentions: dict[str, tuple[Callable[[Layer], Any], Callable[[Layer], int]]] = {
        "q4_in_place": (
            lambda x: in_nibbles(grouped, x.kc, x.ks, x.kz, x.vc, x.vs, x.vz, splits, out),
            lambda x: x.q4_bytes,
        ),
        "q8_in_place": (
            lambda x: in_bytes(grouped, x.kc8, x.ks, x.kz, x.vc8, x.vs, x.vz, splits, out),
            lambda x: x.q8_bytes,
        ),
        "coded_attention": (
            lambda x: coded_attention.attend_coded(q, x.coded, None, scale, splits=splits),
            lambda x: x.q4_bytes,
        ),
        "q4_at_rest": (
            lambda x: at_rest(grouped, x.kc_kivi, x.ks_kivi, x.kz_kivi, x.vc, x.vs, x.vz, splits, out),
            lambda x: x.kivi_key_bytes + x.q4_value_bytes,
        ),
    }
    # the scores alone, over one layer's keys laid out each way, into their own output
    score_runs: dict[str, Callable[[Layer], Any]] = {
        "scores_rows": lambda x: scores_rows(per_head, x.k.reshape(batch * kv, context, d), s_rows),
        "scores_tiles": lambda x: scores_tiles(per_head, x.k_tiles, s_tiles),
        "scores_kivi": lambda x: kivi(per_head, x.kc_kivi, x.ks_kivi, x.kz_kivi, s_kivi),
    }
    variants = {
        "hot": timed(lambda x: native_ops.attend(q, x.k, x.v, None, scale), [stack[0]] * layers),
        "cold": timed(lambda x: native_ops.attend(q, x.k, x.v, None, scale), stack),
        **{name: timed(fn, stack) for name, fn in score_runs.items()},
        **{name: timed(fn, stack) for name, (fn, _) in attentions.items()},
    }
    first = stack[0]
    dense = native_ops.attend(q, first.k, first.v, None, scale)
    differences = {}
    for name, (fn, _) in attentions.items():
        fn(first)
        differences[name] = float(np.abs(out.reshape(dense.shape) - dense).max())
    for fn in score_runs.values():
        fn(first)
    differences["scores_tiles"] = float(np.abs(s_rows - s_tiles).max())
    differences["scores_kivi"] = float(np.abs(s_rows - s_kivi).max())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats + 2):
        for name, run in variants.items():
            t = run()
            if r >= 2:
                times[name].append(t)
    dense_mb = sum(x.dense_bytes for x in stack) / 1e6
    key_mb = sum(x.k.nbytes for x in stack) / 1e6
    ms = {name: round(statistics.median(t), 2) for name, t in times.items()}
    read_mb = {"hot": dense_mb, "cold": dense_mb, "scores_rows": key_mb, "scores_tiles": key_mb}
    read_mb["scores_kivi"] = sum(x.kivi_key_bytes for x in stack) / 1e6
    read_mb.update({name: sum(nbytes(x) for x in stack) / 1e6 for name, (_, nbytes) in attentions.items()})
    return {
        "ms": ms,
        "mb_read": {k: round(v, 1) for k, v in read_mb.items()},
        # hot reads one layer's rows again and again: its figure is the rate the loops take them at
        "gbs_of_rows": {k: round(read_mb[k] / 1e3 / (ms[k] / 1e3), 1) for k in ms},
        "layer_mb": round(first.dense_bytes / 1e6, 1),
        **{f"{name}_max_abs_difference": diff for name, diff in differences.items()},
    }


def read_rate() -> tuple[dict[str, Any], float]:
    """The run's bandwidth readings, and the best of them and a parallel sum's (GB/s)."""
    bw = bandwidth(megabytes=512)
    return bw, max(bw["gbs"], parallel_read_gbs())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds a case")
    load_start = list(os.getloadavg())
    bw, gbs = read_rate()
    print(f"load average {load_start}; {describe_bandwidth(bw)}; a parallel sum's best {gbs:.1f} GB/s")
    repeats = parser.parse_args().repeats
    rows = []
    for name, heads, kv, d, layers, batch, context in CASES:
        row: dict[str, Any] = {"model": name, "layers": layers, "batch": batch, "context": context}
        row.update(case(heads, kv, d, layers, batch, context, repeats))
        row["cold_floor_ms"] = round(row["mb_read"]["cold"] / 1e3 / gbs * 1e3, 2)
        rows.append(row)
        ms, rate = row["ms"], row["gbs_of_rows"]
        print(
            f"{name} batch {batch} at {context} (a layer {row['layer_mb']} MB): attend hot {ms['hot']} ms "
            f"({rate['hot']} GB/s of rows), cold {ms['cold']} ({rate['cold']}; the floor {row['cold_floor_ms']}); "
            f"scores rows {ms['scores_rows']} ({rate['scores_rows']}), tiles {ms['scores_tiles']} "
            f"({rate['scores_tiles']}), KIVI blocks in place {ms['scores_kivi']} ({row['mb_read']['scores_kivi']} MB; "
            f"max |diff| {row['scores_kivi_max_abs_difference']:.1e}); Q4 in place "
            f"{ms['q4_in_place']} ms ({row['mb_read']['q4_in_place']} MB; max |diff| "
            f"{row['q4_in_place_max_abs_difference']:.1e}); 8-bit codes in place {ms['q8_in_place']} ms "
            f"({row['mb_read']['q8_in_place']} MB; max |diff| {row['q8_in_place_max_abs_difference']:.1e}); "
            f"Q4 at rest in place {ms['q4_at_rest']} ms ({row['mb_read']['q4_at_rest']} MB; max |diff| "
            f"{row['q4_at_rest_max_abs_difference']:.1e}); kvshelf's coded attention {ms['coded_attention']} ms "
            f"(max |diff| {row['coded_attention_max_abs_difference']:.1e})",
            flush=True,
        )
    load_end = list(os.getloadavg())
    print(f"load average at end {load_end}")
    loads = {"load_average_at_start": load_start, "load_average_at_end": load_end}
    out = write_json("attention-bounds", {"bandwidth": bw, "read_gbs": round(gbs, 1), **loads, "rows": rows})
    print("wrote", out)


if __name__ == "__main__":
    main()
