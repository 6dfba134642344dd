"""A decode step's few-row products (rows by a weight matrix) reading each weight once.

Why: a decode step of B agents multiplies B rows by every weight, and its time should be
the weights' bytes over the memory's bandwidth whatever B is. MLX's CPU matmul is
OpenBLAS 0.3.21's sgemm, which packs the whole weight before using it B times: on the
embedded Gemma 3 (2-core AMD EPYC, 19-23 GB/s) its 126 layer projections took 42 / 76 /
79 ms at 1 / 4 / 8 rows, against a floor near 20 ms, and a profile of a 4-agent step
spent a third of its sgemm time in ``sgemm_incopy`` (the packing). One ``cblas_sgemv``
per row reads the weight once per row (the head of 671 MB: 29 ms a row).

Two products here, both compiled loops (numba, LLVM) with weight rows split between the
cores, both within the fp32 ``dot_error_bound`` of the exact product (checked once per
process before anything uses them):

- ``skinny_product``, row-invariant: each weight row is taken once into the cache and
  dotted with every one of the B rows there, ``out[b, j] = x[b] . w[j]``. Every output
  element is the same compiled loop over the same ``k`` terms (vectorized over ``k``;
  fastmath lets LLVM choose the lanes once, at compile time), so its bits depend on its
  own row and weight row only, never on how many rows came with it or where it lay. Not
  the bits of OpenBLAS's sgemm or sgemv (another summation order). The temperature-0
  kernels' head rows run it.
- ``invariant_blocked_product``, row-invariant too, what the temperature-0 kernels' layer
  projections run, a prefill chunk's rows and a decode step's alike (so a token's K/V do
  not depend on whether it was prefilled or decoded): every row count in register blocks
  of four rows, whose loop sums an element in one order wherever its row lies, at the
  speed of MLX's own sgemm for a prefill chunk.
- ``blocked_product``, what the default kernels' decode steps run (layers and head): a
  row alone through the same loop, 2 rows by twos, 3-4 by fours, more by eights, each
  weight element loaded once into registers and multiplied into that many sums. The
  row-invariant loop reloads it for every row, so beyond one row it is bound by its
  loads, not by memory: Gemma 3's 262144x640 head at 2 / 4 / 8 / 16 rows took 37.6 / 61.4
  / 106.4 / 196.7 ms that way against 30.6 / 37.6 / 50.0 / 100.5 in blocks, where one row
  takes 27.1 and the floor is 31.6 (``benchmarks/head_rows.py``,
  ``results/head-rows-20261203-171824.json``; MLX's matmul 94 / 133 / 136 / 125). Its
  blocks ask for each weight row a few rows ahead (``PREFETCH_ROWS``), so that memory
  and arithmetic overlap. A row's bits then depend on the block it ran in, as a row of
  MLX's matmul depends on its row count; the default kernels never promised more (their
  attention rounds by the batch too).

``KVSHELF_NO_SKINNY=1`` keeps MLX's own matmuls (and sgemv for the head);
``KVSHELF_NO_ROW_BLOCKS=1`` runs the default kernels' rows row-invariant too;
``KVSHELF_NO_PREFETCH=1`` runs their blocks as before ``PREFETCH_ROWS``.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import numpy as np

from kvshelf.model import half_weights
from kvshelf.model.blas import usable_cpus
from kvshelf.model.dot_bound import dot_error_bound
from kvshelf.model.few_rows import MAX_FEW_ROWS, Gemm
from kvshelf.model.half_weights import BRAIN_CODES, CODES
from kvshelf.switches import env_on

# The most rows a layer projection sends here. Alone, each of Gemma 3's layer shapes is faster
# here than MLX's blocked sgemm up to 16 rows (its 2048x640 up-projection 0.42 / 0.85 ms at 8 /
# 16 rows against 2.00 / 1.84; ``benchmarks/head_rows.py``, ``results/head-rows-20261203-171824.json``),
# but at 16 rows a whole step of the 30-layer llama was slower so (651 ms against 586 with
# MLX's matmuls; at 8 rows 348 against 370: ``benchmarks/decode.py``,
# ``results/decode-20261203-172227.json``): sixteen rows are enough for sgemm's packing to pay.
MAX_LAYER_ROWS = 8

# The smallest layer weight sent here. Each call makes MLX evaluate the step up to it (the
# product runs on numpy views), a fixed cost of tens of microseconds that a product this
# small (a test's tiny model) cannot win back; MLX's own product stays in the graph. The
# smallest real shapes are far above it (the 30-layer llama's 192x576 k/v projection, 442
# KB: 0.05 ms here against MLX's 0.12). Three decode-heavy test files took 142.6 s with
# every layer through it, 139.3 s with this floor and 132.5 s without the skinny product
# (one run each, so within the noise).
MIN_LAYER_BYTES = 1 << 18


def _signatures() -> list[Any]:
    """A kernel's signatures: rows and out are writable, the weight may be a read-only view
    (``ProjectedModel.weight_view``), which numba types apart, of fp32 or of fp16 or bf16
    codes (``kvshelf.model.half_weights``)."""
    from numba import types

    rows, out = types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "C")
    kinds = (types.float32, types.uint16, types.int16)
    weights = [types.Array(t, 2, "C", readonly=r) for t in kinds for r in (False, True)]
    return [types.void(rows, w, out) for w in weights]


@cache
def _kernel() -> Any:
    """The row-invariant loop: each output element its own dot product (compiled once per
    process, cached on disk by numba)."""
    from kvshelf.model import half_floats
    from kvshelf.model.jit import njit, prange

    @njit(_signatures(), parallel=True, fastmath=True, cache=True, boundscheck=False)
    def rows_by_weight(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        rows, k = x.shape
        for j in prange(weight.shape[0]):
            for b in range(rows):
                total = np.float32(0.0)
                for i in range(k):
                    total += x[b, i] * half_floats.widen(weight[j, i])
                out[b, j] = total

    return rows_by_weight


# Weight rows the row-invariant blocked product's block of four x rows takes at once
# (``invariant_blocked_product``): each x element, loaded once, is multiplied into that many
# weight rows' sums, which a 256-row prefill chunk, bound by its arithmetic, needs.
WEIGHT_ROWS = 4

# How many weight rows ahead the default kernels' blocks ask for their weight
# (``kvshelf.model.prefetch``). A block of 2-8 rows computes long enough on each weight row
# that the hardware prefetcher falls behind and the loop waits for memory, then computes;
# asked for ahead, the two overlap. Then (with fp32 weights) one weight row at a time was
# fastest at every block (before, eights took four: ``blocked_without_prefetch``; since the
# 16-bit codes, ``BLOCK_WEIGHT_ROWS``). Every projection of a
# step, random weights of the models' shapes, medians of 9 interleaved rounds (scratch
# run, 2-core EPYC, 2026-12-06), ms before / with 4 rows ahead / with 8: Gemma 3 at 8
# rows 66.1 / 44.8 / 43.2 (its head 42.0 / 24.0 / 22.9), at 4 rows 41.4 / 38.5 / 36.3,
# at 2 rows 38.7 / 36.5 / 38.6; the 30-layer llama at 8 rows 34.9 / 22.6 / 23.0, at 4 rows
# 23.0 / 19.4 / 19.0. A single row (the row-invariant loop) gained nothing (Gemma 3 33.8
# ms without, 36.4-36.6 with), so it has none.
PREFETCH_ROWS = 8

# The smallest block that prefetches. Blocks of two rows compute little enough on each
# weight row for the hardware prefetcher to keep up, and the hint only cost them: whole
# steps at 1K, batch 2, two runs of ``benchmarks/decode.py --paths default,no-prefetch``
# (2026-12-06, load 0.7-1.1), ms with / without: Gemma 3 49.6 / 45.3 and 53.0 / 48.0, the
# llama 38.0 / 34.0 and 45.7 / 42.9.
PREFETCH_BLOCK = 4

# Weight rows the default kernels' prefetching blocks (four and eight x rows) take at once.
# Reading 16-bit codes (``kvshelf.model.half_weights``) halved what a block waits for from
# memory, so eight rows became bound by their loads and sums: against two weight rows, each
# x vector loaded serves two sums. Every projection of a step, 16-bit codes of random
# weights in the models' shapes, the best of 2-3 interleaved rounds of medians of 9
# (scratch, 2-core EPYC, 2026-12-07), ms against one weight row / two: Gemma 3's 18 layers
# at 8 rows 11.07 / 7.95 and 13.00 / 7.89, its head 15.67 / 10.31 and 20.68 / 14.57; at 4
# rows 6.07 / 6.62 and 7.91 / 7.90, its head 9.57 / 9.68 and 10.19 / 10.08; the 30-layer
# llama's layers and head (bf16 codes) at 8 rows 17.95 / 14.40, at 4 rows 11.93 / 10.41;
# fp32 weights, Gemma 3's layers, 19.75 / 17.37 at 8 rows, 15.18 / 13.34 at 4. Three weight
# rows were slower than two at 8 rows (Gemma 3's layers 11.61, its head 15.32). Blocks of
# two rows keep one (9.42 against 6.96 without a prefetch, 6.19 with one, but its head
# 9.85 against 8.06). Whole steps at 1K (``benchmarks/decode.py``, three interleaved pairs
# of processes, load 1.2-1.5), ms against one weight row / two at batch 8: Gemma 3 77.0 /
# 61.9, 59.4 / 46.3, 47.7 / 33.8, the llama (bf16) 41.6 / 33.6, 83.9 / 41.5, 49.5 / 32.6;
# at batch 4, Gemma 3 42.2 / 38.8, 37.3 / 29.5, 30.1 / 24.1 (batch 1, unchanged, drifted
# by 0.85-1.09 between the pairs).
BLOCK_WEIGHT_ROWS = 2


@cache
def _block_loop(block: int, tile: int, ahead: int = 0) -> Any:
    """The loop that takes ``block`` rows at once (``x``'s row count a multiple of it) against
    ``tile`` weight rows (at most the weight's): each element loaded once is multiplied into
    the sums it meets, which LLVM keeps in registers (both counts are compile-time
    constants, so the inner loops unroll). The last tile, short of weight rows, moves back
    to end at the last weight row and writes only the sums not written before, so every
    output element comes from the one loop body: blocks of 4 and 8 rows then sum in the same
    order (``invariant_blocked_product``). With ``ahead`` > 0, each tile first prefetches
    the weight rows ``ahead`` rows on (a hint: the sums do not change). Built once per
    (block, tile, ahead)."""
    from kvshelf.model import half_floats, prefetch
    from kvshelf.model.jit import njit, prange
    from kvshelf.model.prefetch import LINE_FLOATS

    prefetched = tile if ahead > 0 else 0  # weight rows each tile asks for (a constant here)

    @njit(_signatures(), parallel=True, fastmath=True, cache=True, boundscheck=False)
    def rows_by_weight_in_blocks(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        rows, k = x.shape
        n = weight.shape[0]
        for jt in prange(-(-n // tile)):
            first = jt * tile
            j = min(first, n - tile)
            coming = min(j + ahead, n - tile)
            for t in range(prefetched):
                for i in range(0, k, LINE_FLOATS):
                    prefetch.line(weight, coming + t, i)
            for b in range(0, rows, block):
                sums = np.zeros((tile, block), dtype=np.float32)
                for i in range(k):
                    for t in range(tile):
                        w = half_floats.widen(weight[j + t, i])
                        for r in range(block):
                            sums[t, r] += x[b + r, i] * w
                for t in range(first - j, tile):
                    for r in range(block):
                        out[b + r, j + t] = sums[t, r]

    return rows_by_weight_in_blocks


def _loop_for(block: int, tile: int, weight: np.ndarray, ahead: int = 0) -> Any:
    """``_block_loop(block, tile, ahead)``, the tile cut to the weight's rows where it has fewer."""
    return _block_loop(block, min(tile, weight.shape[0]), ahead)


# What the kernels read a weight as: fp32, or fp16 or bf16 codes (``kvshelf.model.half_weights``).
WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(CODES), np.dtype(BRAIN_CODES))


def _checked(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x`` as the kernels take it (fp32, C-contiguous), after checking both shapes."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"skinny product: {x.shape} by {weight.shape} ({weight.dtype})")
    if not weight.flags.c_contiguous:
        raise ValueError("skinny product: the weight must be C-contiguous (a view of MLX's buffer, never copied)")
    return x


# Rows the row-invariant loop takes in one call. It reloads each weight element for every
# row, so past a few rows its loads bind it, not memory: the embedded Gemma 3's 262144x640
# head (the temperature-0 kernels' decode step) at 3 / 4 / 5 / 6 / 7 / 8 rows took 20.3 /
# 21.4 / 22.9 / 34.0 / 58.4 / 67.1 ms, the llama's 49152x576 3.1 / 3.4 / 4.0 / 6.1 / 7.9 /
# 9.9 (random weights, scratch, 2-core EPYC, 2026-12-06). More rows go in even calls of at
# most ``SKINNY_CHUNK_ROWS`` (8 rows: two of four, 43 ms), each reading the weight again;
# every row's bits are its own either way.
SKINNY_ROWS = 6
SKINNY_CHUNK_ROWS = 5


def _product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x @ weight.T`` for ``x`` (m, k) and ``weight`` (n, k), fp32, C-contiguous; each row's
    bits its own (up to ``SKINNY_ROWS`` rows in one call of the loop, more in even calls of
    at most ``SKINNY_CHUNK_ROWS``)."""
    x = _checked(x, weight)
    rows = x.shape[0]
    out = np.empty((rows, weight.shape[0]), dtype=np.float32)
    calls = 1 if rows <= SKINNY_ROWS else -(-rows // SKINNY_CHUNK_ROWS)
    for c in range(calls):
        lo, hi = rows * c // calls, rows * (c + 1) // calls
        _kernel()(x[lo:hi], weight, out[lo:hi])
    return out


def _block_of(rows: int) -> int:
    """The block a product of ``rows`` rows runs in: 1 (the row-invariant loop), 2, 4 or 8."""
    return 1 if rows == 1 else 2 if rows == 2 else 4 if rows <= 4 else 8


def _blocked(
    x: np.ndarray,
    weight: np.ndarray,
    eights: int = BLOCK_WEIGHT_ROWS,
    fours: int = BLOCK_WEIGHT_ROWS,
    ahead: int = PREFETCH_ROWS,
) -> np.ndarray:
    """``x @ weight.T`` as ``_product``, a row alone through its loop, more rows in register
    blocks (zero rows added up to the block's multiple; their sums are dropped): blocks of
    two against one weight row at a time, of four against ``fours`` weight rows and of
    eight against ``eights``, those asking for the weight ``ahead`` rows on."""
    x = _checked(x, weight)
    rows = x.shape[0]
    block = _block_of(rows)
    if block == 1:
        return _product(x, weight)
    padded = -(-rows // block) * block
    if padded != rows:
        x = np.concatenate([x, np.zeros((padded - rows, x.shape[1]), dtype=np.float32)])
    out = np.empty((padded, weight.shape[0]), dtype=np.float32)
    tile = eights if block == 8 else fours if block == 4 else 1
    _loop_for(block, tile, weight, ahead if block >= PREFETCH_BLOCK else 0)(x, weight, out)
    return out[:rows]


# The block of x rows the row-invariant blocked product takes (against WEIGHT_ROWS weight
# rows). A 256-row prefill chunk of the embedded Gemma 3's 640x1024, 2048x640 and 640x2048
# projections (random weights, one process, 2-core EPYC; ms): 4 rows 1.71 / 3.46 / 3.57, 8
# rows 2.26 / 4.63 / 5.58 (its sums spill from the registers and the 2 MB of x rows of the
# last one leave the L2), 6 rows 1.77 / 3.44 / 3.18; MLX's own 256-row sgemm 1.68 / 3.33 /
# 3.57. Four is also the fewest rows whose loop sums in the same order as the larger
# blocks (blocks of one or two rows get other lanes from LLVM), so a decode row pays for
# three zero rows, which cost loads, not memory. Its blocks ask for their weight
# ``PREFETCH_ROWS`` rows ahead as the default kernels' do (a hint: the same bits with and
# without, which the tests check): once the weights were read as 16-bit codes, a decode
# step's few rows waited on memory. Gemma 3's 18 layers (codes of random weights, scratch,
# 2-core EPYC, 2026-12-07), ms without / with: 8.95 / 7.18 at 4 rows, 13.75 / 10.08 at 8;
# a 256-row prefill chunk unchanged (1.38 / 1.38, 2.89 / 2.87, 3.47 / 3.35 for the three
# shapes above, fp32). Whole temperature-0 steps at 1K, two interleaved pairs of
# ``benchmarks/decode.py`` processes, tokens/s as a share of the default kernels' in the
# same run (which this leaves alone): the llama at batch 4 0.84 / 0.82 before, 0.94 / 0.96
# after, at batch 8 0.74 / 0.79 before, 0.90 / 0.96 after; Gemma 3 (whose eight-row step
# is mostly its head, not read here) 0.78 / 0.83 and 0.83 / 0.84 at batch 4, 0.61 / 0.64
# and 0.62 / 0.65 at batch 8.
INVARIANT_BLOCK = 4


# Weight rows a lone row (a temperature-0 decode step of one agent) takes at once in the
# row-invariant blocked product, instead of riding in a block of four with three zero rows,
# which cost it the other rows' loads and sums. Against this many weight rows LLVM gives
# each sum one vector accumulator, as in the block of four, so the row keeps its bits
# (``_alone_agrees``; with a prefetch hint it did not). Every layer projection of the
# embedded Gemma 3, random weights, one row, medians of 12 interleaved rounds (scratch,
# 2-core EPYC, 2026-12-06), ms: in the block of four 19.8, alone against 8 weight rows
# 15.3, against 16 16.8 (against 8 with a prefetch hint 16.2, other bits); the default
# kernels' one-row loop 14.6.
ALONE_WEIGHT_ROWS = 8


@cache
def _alone_agrees() -> bool:
    """A lone row against ``ALONE_WEIGHT_ROWS`` weight rows gets the bits the same row gets in
    a block of ``INVARIANT_BLOCK`` (``k`` a multiple of the lanes and not)."""
    rng = np.random.default_rng(5)
    for n, k in ((1003, 640), (257, 2051), (64, 9), (24, 33)):
        weight = rng.standard_normal((n, k)).astype(np.float32)
        x = np.zeros((INVARIANT_BLOCK, k), dtype=np.float32)
        x[0] = rng.standard_normal(k).astype(np.float32)
        if not np.array_equal(_alone(x[:1], weight)[0], _invariant_blocked(x, weight)[0]):
            return False
    return True


def _alone(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x @ weight.T`` for one row against ``ALONE_WEIGHT_ROWS`` weight rows at a time."""
    out = np.empty((1, weight.shape[0]), dtype=np.float32)
    _block_loop(1, ALONE_WEIGHT_ROWS)(x, weight, out)
    return out


def _invariant_blocked(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x @ weight.T`` with each row's bits its own, in register blocks of
    ``INVARIANT_BLOCK`` rows against ``WEIGHT_ROWS`` weight rows (zero rows added up to the
    block's multiple), so a row computed alone, in a decode batch or in a 256-row prefill
    chunk gets the same bits. A lone row runs against ``ALONE_WEIGHT_ROWS`` weight rows
    where that gives it the same bits."""
    x = _checked(x, weight)
    rows = x.shape[0]
    if rows == 1 and weight.shape[0] >= ALONE_WEIGHT_ROWS and _alone_agrees():
        return _alone(x, weight)
    padded = max(1, -(-rows // INVARIANT_BLOCK)) * INVARIANT_BLOCK
    if padded != rows:
        x = np.concatenate([x, np.zeros((padded - rows, x.shape[1]), dtype=np.float32)])
    out = np.empty((padded, weight.shape[0]), dtype=np.float32)
    _loop_for(INVARIANT_BLOCK, WEIGHT_ROWS, weight, PREFETCH_ROWS)(x, weight, out)
    return out[:rows]


@cache
def invariant_blocked_product() -> Gemm | None:
    """``x @ weight.T`` for any number of rows, each row's bits its own (a decode row has the
    bits the same token gets in a prefill chunk), at a blocked product's speed: what the
    temperature-0 kernels' layer projections run. A 256-row prefill chunk as fast as MLX's
    own sgemm (``INVARIANT_BLOCK``), so about twice as fast as ``kvshelf.model.row_plan``'s
    half-empty one (the embedded Gemma 3's 640x1024 and 2048x640 projections: 3.4 / 6.7 ms
    that way), and a decode row reads each weight once without a sgemm's packing. Not the
    bits of ``skinny_product`` (another loop) or of OpenBLAS. None where ``skinny_product``
    is, or if its check fails."""
    if skinny_product() is None:
        return None
    return _invariant_blocked if _invariant_and_exact(_invariant_blocked, rows=40) else None


def blocked_without_prefetch(eights: int = WEIGHT_ROWS, fours: int = 1) -> Gemm:
    """``blocked_product``'s loops without asking for the weight ahead, the blocks of eight
    and of four rows against ``eights`` and ``fours`` weight rows (by default the form before
    ``PREFETCH_ROWS``). Unchecked: for ``benchmarks/head_rows.py`` to time both forms side by
    side, and for the tests to show the prefetch changes no sum."""
    return lambda x, weight: _blocked(x, weight, eights=eights, fours=fours, ahead=0)


def _invariant_and_exact(product: Gemm, rows: int = MAX_FEW_ROWS + 1) -> bool:
    """Every row of a product of 1..``rows`` rows has the bits of that row alone, and every
    element lies within the fp32 dot-product error bound of a float64 product (weight row
    counts that are not multiples of the threads' split, ``k`` not a multiple of the lanes,
    read-only and writable weights)."""
    rng = np.random.default_rng(3)
    for n, k, read_only in ((1003, 640, True), (257, 2051, False), (64, 9, False)):
        weight = rng.standard_normal((n, k)).astype(np.float32)
        weight.flags.writeable = not read_only  # both kinds of view: the head's is read-only
        x = rng.standard_normal((rows, k)).astype(np.float32)
        full = product(x, weight)
        exact = x.astype(np.float64) @ weight.T.astype(np.float64)
        if not all(np.all(np.abs(f - e) <= dot_error_bound(weight, r)) for f, e, r in zip(full, exact, x)):
            return False
        for m in range(1, rows + 1):
            if not np.array_equal(product(x[-m:], weight), full[-m:]):
                return False
        if not np.array_equal(product(x[5:6], weight), full[5:6]):
            return False
    return True


# Spins (libgomp's GOMP_SPINCOUNT) a Numba worker waits for the next parallel call before
# it sleeps: about 0.2 ms of one core on this 2-core EPYC (CPU time burned after a call).
# libgomp's default (300000, milliseconds) took the cores from MLX's work between a step's
# products (embedded Gemma 3, batch 4: 395 ms a step against 222 with none). With none
# (OMP_WAIT_POLICY=PASSIVE, the setting before this) every call woke a sleeping worker, about 40 us
# after a gap of Python work (scratch: a tiny product 54 us after a 100 us gap, 6 us with
# this), and a native decode step makes about 240 such calls. Whole native steps at 1K,
# separate processes run one after the other under the benchmark lock, passive / this:
# llama batch 1 36.8 / 28.2 ms, batch 8 87.0 / 76.8; Gemma 3 batch 1 50.6 / 40.3, batch 4
# 68.0 / 54.3 (100000 spins: 31.8, 73.2, 42.0, 58.4).
WORKER_SPIN = 10000


@cache
def skinny_product() -> Gemm | None:
    """``x @ weight.T`` for a few rows ``x``, each row's bits its own, reading ``weight``
    once; None if numba is missing, ``KVSHELF_NO_SKINNY`` is set or the check fails."""
    if env_on("KVSHELF_NO_SKINNY"):
        return None
    # How long Numba's OpenMP workers wait for the next call before they sleep
    # (``WORKER_SPIN``). Read when libgomp loads, so only if nothing loaded it before, and
    # only if the user set neither variable.
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(WORKER_SPIN)
    try:
        import numba
    except ImportError:
        return None
    # Numba's own worker threads, one per core this process may use (its affinity), as the
    # BLAS does: more would only take turns on the same cores.
    if "NUMBA_NUM_THREADS" not in os.environ:
        numba.set_num_threads(max(1, min(usable_cpus(), numba.get_num_threads())))
    return _product if _invariant_and_exact(_product) else None


def _exact(product: Gemm) -> bool:
    """Every element of a product of 1..MAX_FEW_ROWS+1 rows lies within the fp32 dot-product
    error bound of a float64 product, and the same call gives the same bits twice (odd weight
    row counts and ``k``, read-only and writable weights)."""
    rng = np.random.default_rng(4)
    for n, k, read_only in ((1003, 640, True), (257, 2051, False), (64, 9, False)):
        weight = rng.standard_normal((n, k)).astype(np.float32)
        weight.flags.writeable = not read_only
        x = rng.standard_normal((MAX_FEW_ROWS + 1, k)).astype(np.float32)
        exact = x.astype(np.float64) @ weight.T.astype(np.float64)
        for m in range(1, MAX_FEW_ROWS + 2):
            got = product(x[:m], weight)
            if got.shape != (m, n) or not np.array_equal(got, product(x[:m], weight)):
                return False
            if not all(np.all(np.abs(g - e) <= dot_error_bound(weight, r)) for g, e, r in zip(got, exact, x)):
                return False
    return True


@cache
def blocked_product() -> Gemm | None:
    """``x @ weight.T`` for a decode step's rows, fastest: one row through the row-invariant
    loop, 2 rows by twos against one weight row at a time, 3-4 by fours and 5 and more by
    eights against ``BLOCK_WEIGHT_ROWS``, those asking for the weight ahead
    (``PREFETCH_ROWS``). A row's bits then
    depend on the block its product ran in (the loops sum in other orders), as a row of
    MLX's matmul depends on its row count; each within the same fp32 bound. Where a row's
    bits must be its own (the temperature-0 kernels' head), ``skinny_product``.

    None where ``skinny_product`` is; ``skinny_product`` itself with ``KVSHELF_NO_ROW_BLOCKS``
    set or if the check fails."""
    if skinny_product() is None:
        return None
    if env_on("KVSHELF_NO_ROW_BLOCKS"):
        return skinny_product()
    product = blocked_without_prefetch() if env_on("KVSHELF_NO_PREFETCH") else _blocked
    return product if _exact(product) else skinny_product()


def takes_codes(product: Gemm) -> bool:
    """Whether a model built now gives ``product`` its weights' fp16 or bf16 codes where they
    hold them: the copies are on (``half_weights.enabled``) and ``product`` reads them with
    the fp32 bits (``reads_halves``). The one rule the head, the native step and the module
    path's layers follow."""
    return half_weights.enabled() and reads_halves(product)


@cache
def reads_halves(product: Gemm) -> bool:
    """Whether ``product`` of a weight's fp16 or bf16 codes (``kvshelf.model.half_weights``)
    has the bits of the same product of its fp32 values, for 1..MAX_FEW_ROWS+1 rows (the
    widened element is the same fp32, but LLVM compiles each signature apart: checked, not
    assumed). Only this module's products read codes at all: another (sgemv's, BLIS's)
    would read their bytes as fp32, so it is not even asked."""
    if getattr(product, "__module__", None) != __name__:
        return False
    rng = np.random.default_rng(6)
    for n, k in ((1003, 640), (257, 2051), (64, 9)):
        x = rng.standard_normal((MAX_FEW_ROWS + 1, k)).astype(np.float32)
        half = rng.standard_normal((n, k)).astype(np.float16)
        brain = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16
        if not _same_bits(product, x, half.view(CODES), half.astype(np.float32)):
            return False
        if not _same_bits(product, x, brain.astype(np.uint16).view(BRAIN_CODES), (brain << 16).view(np.float32)):
            return False
    return True


def _same_bits(product: Gemm, x: np.ndarray, codes: np.ndarray, weight: np.ndarray) -> bool:
    """``product`` of every leading slice of ``x`` by ``codes`` has the bits of the same by ``weight``."""
    return all(np.array_equal(product(x[:m], codes), product(x[:m], weight)) for m in range(1, len(x) + 1))
