"""A decode step's few-row products (rows by a weight matrix) reading each weight once.

Why: a decode step of B agents multiplies B rows by every weight, and its time should be
the weights' bytes over the memory's bandwidth whatever B is. MLX's CPU matmul is
OpenBLAS 0.3.21's sgemm, which packs the whole weight before using it B times: on the
embedded Gemma 3 (2-core AMD EPYC, 19-23 GB/s) its 126 layer projections took 42 / 76 /
79 ms at 1 / 4 / 8 rows, against a floor near 20 ms, and a profile of a 4-agent step
spent a third of its sgemm time in ``sgemm_incopy`` (the packing). One ``cblas_sgemv``
per row reads the weight once per row (the head of 671 MB: 29 ms a row).

Here one compiled loop (numba, LLVM) takes each weight row once into the cache and dots
it with every one of the B rows there: ``out[b, j] = x[b] . w[j]``, weight rows split
between the cores. Measured alone (``benchmarks/head_rows.py``,
``results/head-rows-20261203-145218.json``), Gemma 3's 2048x640 gate projection takes
0.15 / 0.42 / 0.76 ms at 1 / 4 / 8 rows (MLX 0.51 / 0.96 / 1.00) and its 262144x640 head
26 / 60 / 105 ms (one sgemv per row in cache-sized blocks: 29 / 86 / 151). In whole decode
steps (``benchmarks/decode.py --paths default,no-skinny``, ``results/decode-20261203-145550.json``,
1K context) the embedded Gemma 3 takes 107 / 203 / 344 ms at batch 1 / 4 / 8 against 119 /
260 / 384 without it, the 30-layer llama 117 / 215 / 353 against 135 / 251 / 372.

Row-invariant by construction: every output element is the same compiled dot-product loop
over the same ``k`` terms (vectorized over ``k``; fastmath lets LLVM choose the lanes
once, at compile time), so its bits depend on its own row and weight row only, never on
how many rows came with it or where it lay. ``skinny_product`` checks that once per
process, with the fp32 error bound against a float64 product, before anything uses it.
Not the bits of OpenBLAS's sgemm or sgemv (another summation order): within the same
``dot_error_bound`` of the exact product as they are. So the temperature-0 kernels take
only the head's rows here (logits are never stored); their layer projections keep the bits
of OpenBLAS's one-row product (``kvshelf.model.row_plan``), which a prefill chunk's rows
share, so that a token's K/V do not depend on whether it was prefilled or decoded.

``KVSHELF_NO_SKINNY=1`` keeps MLX's own matmuls (and sgemv for the head).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import numpy as np

from kvshelf.model.blas import usable_cpus
from kvshelf.model.dot_bound import dot_error_bound
from kvshelf.model.few_rows import MAX_FEW_ROWS, Gemm
from kvshelf.switches import env_on

# The most rows a layer projection sends here. Beyond it the loop is bound by its loads (x's
# rows are read again for every weight row), not by memory, and MLX's blocked sgemm is
# faster: 16 rows by Gemma 3's 2048x640 up-projection took 2.83 ms here against 1.79, 8 rows
# 1.57 against 1.93 (``benchmarks/head_rows.py``, ``results/head-rows-20261203-145218.json``).
# The head takes every row here (its rows' bits must be their own; the other row-invariant
# product, one sgemv per row, is slower still: 16 rows 198 against 274 ms).
MAX_LAYER_ROWS = 8

# The smallest layer weight sent here. Each call makes MLX evaluate the step up to it (the
# product runs on numpy views), a fixed cost of tens of microseconds that a product this
# small (a test's tiny model) cannot win back; MLX's own product stays in the graph. The
# smallest real shapes are far above it (the 30-layer llama's 192x576 k/v projection, 442
# KB: 0.05 ms here against MLX's 0.12). Three decode-heavy test files took 142.6 s with
# every layer through it, 139.3 s with this floor and 132.5 s without the skinny product
# (one run each, so within the noise).
MIN_LAYER_BYTES = 1 << 18


@cache
def _kernel() -> Any:
    """The compiled loop (compiled once per process, cached on disk by numba)."""
    from numba import njit, prange, types

    # The weight may be a read-only view (``ProjectedModel.weight_view``): numba types those apart.
    rows, out = types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "C")
    weights = (types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "C", readonly=True))
    signatures = [types.void(rows, w, out) for w in weights]

    @njit(signatures, parallel=True, fastmath=True, cache=True, boundscheck=False)
    def rows_by_weight(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        rows, k = x.shape
        for j in prange(weight.shape[0]):
            for b in range(rows):
                total = np.float32(0.0)
                for i in range(k):
                    total += x[b, i] * weight[j, i]
                out[b, j] = total

    return rows_by_weight


def _product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x @ weight.T`` for ``x`` (m, k) and ``weight`` (n, k), fp32, C-contiguous."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or weight.dtype != np.float32:
        raise ValueError(f"skinny product: {x.shape} by {weight.shape} ({weight.dtype})")
    if not weight.flags.c_contiguous:
        raise ValueError("skinny product: the weight must be C-contiguous (a view of MLX's buffer, never copied)")
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    _kernel()(x, weight, out)
    return out


def _invariant_and_exact(product: Gemm) -> bool:
    """Every row of a product of 1..MAX_FEW_ROWS+1 rows has the bits of that row alone, and every
    element lies within the fp32 dot-product error bound of a float64 product (weight row
    counts that are not multiples of the threads' split, ``k`` not a multiple of the lanes,
    read-only and writable weights)."""
    rng = np.random.default_rng(3)
    for n, k, read_only in ((1003, 640, True), (257, 2051, False), (64, 9, False)):
        weight = rng.standard_normal((n, k)).astype(np.float32)
        weight.flags.writeable = not read_only  # both kinds of view: the head's is read-only
        x = rng.standard_normal((MAX_FEW_ROWS + 1, k)).astype(np.float32)
        full = product(x, weight)
        exact = x.astype(np.float64) @ weight.T.astype(np.float64)
        if not all(np.all(np.abs(f - e) <= dot_error_bound(weight, r)) for f, e, r in zip(full, exact, x)):
            return False
        for m in range(1, MAX_FEW_ROWS + 2):
            if not np.array_equal(product(x[-m:], weight), full[-m:]):
                return False
        if not np.array_equal(product(x[5:6], weight), full[5:6]):
            return False
    return True


@cache
def skinny_product() -> Gemm | None:
    """``x @ weight.T`` for a few rows ``x``, each row's bits its own, reading ``weight``
    once; None if numba is missing, ``KVSHELF_NO_SKINNY`` is set or the check fails."""
    if env_on("KVSHELF_NO_SKINNY"):
        return None
    # Numba's OpenMP workers sleep between calls rather than spin (libgomp's default spins):
    # a step calls this between MLX's work, which spinning workers would take cores from
    # (embedded Gemma 3, batch 4: 222 ms a step against 395, benchmarks/decode.py). Read
    # when libgomp loads, so only if nothing loaded it before.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import numba
    except ImportError:
        return None
    # Numba's own worker threads, one per core this process may use (its affinity), as the
    # BLAS does: more would only take turns on the same cores.
    if "NUMBA_NUM_THREADS" not in os.environ:
        numba.set_num_threads(max(1, min(usable_cpus(), numba.get_num_threads())))
    return _product if _invariant_and_exact(_product) else None
