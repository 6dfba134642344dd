"""A projection's rows through MLX's own matmul, each row with the bits of that row alone.

The shape-invariant kernels (``kvshelf.model.gemv.SHAPE_INVARIANT``, and every request at
temperature 0) need a row's product not to depend on how many rows come with it: a token's
K/V must be the same whether it was decoded alone or recomputed in a 256-row prefill chunk.
OpenBLAS's sgemm does not give that by itself (it picks its kernel by shape), so until now
every row went to its own sgemv (``kvshelf.model.sgemv.each_row``), which runs a prefill's
products about 4.7x slower than one sgemm (``benchmarks/row_plan.py``).

What OpenBLAS does give, measured on its outputs (2-core AMD EPYC, Debian's OpenBLAS 0.3.21
pthreads, every layer shape of the embedded Gemma 3 and the 30-layer llama): a product of
up to 12 rows gives every row the bits of that row's one-row product; a product of 48*j
rows gives them to the rows at positions 6..11 mod 12, and other bits to the rest (which
of its kernels takes which rows is OpenBLAS's affair; this is what its outputs show). So a
call of R rows runs as one product of C rows (C the smallest measured size with room for
R): the real rows at the positions known to carry one-row bits, copies of the first real
row elsewhere, whose outputs are dropped.
Half of the product is thrown away, and it is still about twice as fast as a sgemv a row.

Nothing of that pattern is assumed: ``measure`` finds, for a weight's shape, how many rows
a plain product may take and which positions of each candidate size carry one-row bits,
comparing outputs with one-row products bit for bit, on random rows by a random weight of
that shape (kernels are chosen by shape, never by values; a layer's own weight could be
one whose products round alike in any order, zeros say, and vouch for a wrong plan). A
shape where that does not pay (a tiny test model's, which OpenBLAS runs otherwise) gets
no plan, and its layer keeps ``each_row``. A planned row's bits are those of MLX's one-row
product, which is what a decode step of up to ``small`` agents computes anyway, in the
graph, without handing each projection to numpy (a sync per call).

Since 2026-12-05 the temperature-0 layers run ``kvshelf.model.skinny.invariant_blocked_product``
where numba is there (row-invariant by construction, no half-empty product, as fast as one
sgemm for a prefill chunk): plans are built only without it (numba missing, or
``with_fast_linears(skinny=False)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import mlx.core as mx
import numpy as np

# Candidate product sizes are multiples of this (24 rows for each of two threads).
GROUP = 48
# The most rows a prefill call gives one projection (the engine's default chunk, 256), with
# room: sizes are measured up to the one that holds this many.
MAX_ROWS = 256
# A plain product of more rows than this is not measured (a decode batch is at most 16).
MAX_SMALL = 16
# Below this many one-row positions in a size, a plan does not pay for its copies.
MIN_SHARE = 0.25


@dataclass(frozen=True, eq=False)  # arrays inside: compared by identity
class RowPlan:
    """How a weight shape's products of any number of rows run with one-row bits.

    ``small``: products of at most this many rows give every row its one-row bits.
    ``sizes``: (C, positions), room growing with C: a C-row product's positions with one-row
    bits (the last has the most room, more than ``small``: ``measure`` keeps no other)."""

    small: int
    sizes: tuple[tuple[int, np.ndarray], ...]
    _indices: dict[tuple[int, int], tuple[mx.array, mx.array]] = field(default_factory=dict, repr=False)

    @property
    def room(self) -> int:
        """The most rows one product takes."""
        return len(self.sizes[-1][1])

    def matmul(self, x: mx.array, weight: mx.array) -> mx.array:
        """``x @ weight.T`` (``x``: rows × k) with every row's bits its one-row product's."""
        rows, room = x.shape[0], self.room
        if rows <= self.small:  # a decode step (and an empty call)
            return x @ weight.T
        parts = [self._piece(x[lo : lo + room], weight) for lo in range(0, rows, room)]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)

    def _piece(self, x: mx.array, weight: mx.array) -> mx.array:
        rows = x.shape[0]
        if rows <= self.small:
            return x @ weight.T
        size, positions = next((c, p) for c, p in self.sizes if len(p) >= rows)
        spread, picked = self._index(size, positions, rows)
        return mx.take(mx.take(x, spread, axis=0) @ weight.T, picked, axis=0)

    def _index(self, size: int, positions: np.ndarray, rows: int) -> tuple[mx.array, mx.array]:
        """Which input row each of the product's ``size`` rows copies (row i at ``positions[i]``,
        row 0 at the rest), and where the outputs of the ``rows`` real ones lie."""
        key = (size, rows)
        known = self._indices.get(key)
        if known is None:
            spread = np.zeros(size, dtype=np.int32)
            spread[positions[:rows]] = np.arange(rows, dtype=np.int32)
            known = (mx.array(spread), mx.array(positions[:rows].astype(np.int32)))
            self._indices[key] = known
        return known


def measure(weight: mx.array, max_rows: int = MAX_ROWS) -> RowPlan | None:
    """The plan for an fp32 ``weight``'s shape (see the module's docstring), or None where
    plain products of at least 8 rows or sizes with room for ``max_rows`` are not found."""
    if weight.ndim != 2 or weight.dtype != mx.float32:
        return None
    n, k = weight.shape
    return _measured(n, k, max_rows)


@cache  # once a process per shape
def _measured(n: int, k: int, max_rows: int) -> RowPlan | None:
    top = GROUP * -(-2 * max_rows // GROUP)  # a size with room for max_rows at half its positions
    x = _probe(top, k, seed=1)
    weight = _probe(n, k, seed=2)
    alone = np.concatenate([_rows(x[i : i + 1], weight) for i in range(MAX_SMALL)])
    small = 0
    for m in range(1, MAX_SMALL + 1):
        if not np.array_equal(_rows(x[:m], weight), alone[:m]):
            break
        small = m
    if small < 8:
        return None
    # the rows beyond the first MAX_SMALL: by products of ``small`` rows (their bits are one-row bits)
    reference = np.concatenate([alone, *(_rows(x[i : i + small], weight) for i in range(MAX_SMALL, top, small))])
    sizes = []
    for size in range(GROUP, top + 1, GROUP):
        same = np.flatnonzero((_rows(x[:size], weight) == reference[:size]).all(axis=1))
        if len(same) >= MIN_SHARE * size and len(same) > small:
            sizes.append((size, same))
    if not sizes or max(len(p) for _, p in sizes) < max_rows:
        return None
    # keep a size only if no smaller one has at least as much room
    kept: list[tuple[int, np.ndarray]] = []
    for size, positions in sizes:
        if not kept or len(positions) > len(kept[-1][1]):
            kept.append((size, positions))
    return RowPlan(small, tuple(kept))


def _rows(x: mx.array, weight: mx.array) -> np.ndarray:
    return np.array(x @ weight.T)


def _probe(rows: int, k: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32))
