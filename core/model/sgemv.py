"""The BLAS's matrix-vector product, and the row-invariant product made of it.

``system_sgemv`` calls ``cblas_sgemv`` of the OpenBLAS that MLX's own matmuls use
(``kvshelf.model.blas`` preloads it) through ctypes, on zero-copy numpy views of MLX's
weights: one row at the BLAS's real speed, where MLX's CPU backend runs every matmul as
``sgemm`` (``kvshelf.model.head`` says what that costs the output projection).

``each_row`` is the shape-invariant kernels' product (``kvshelf.model.gemv.SHAPE_INVARIANT``)
for the head and for layer shapes without a ``kvshelf.model.row_plan``: ``x @ weight.T`` as
one sgemv per row of ``x``, so each row's bits are sgemv's of that row alone, whatever the
number of rows.

Why not one product of all rows: OpenBLAS's sgemm rounds a row by the product's shape
(``tests/test_shape_invariant.py``), and BLIS's small-matrix product, whose rows are
invariant too, computes 1-6 rows as slowly as six (its register tile). Measured side by
side (``benchmarks/head_rows.py``, ``results/head-rows-20261202-135012.json``, 2-core AMD
EPYC, load 1.5), 1 / 4 / 8 rows by Gemma 3's 2048x640 up-projection took 0.69 / 0.76 /
1.04 ms through BLIS and 0.07 / 0.22 / 0.41 ms as sgemv per row (MLX's matmul: 0.25 / 0.50
/ 0.54), and by its 262144x640 head 55 / 52 / 72 ms against 16 / 64 / 129 ms. A decode step
is 1-8 rows, so it gains; a prefill chunk of 256 rows reads each layer weight 256 times
(from the cache: a layer's weights fit in it), which costs a greedy prefill of 1K tokens
6-9% more than BLIS did. A weight larger than the cache (a head) is multiplied in blocks
of rows (``BLOCK_BYTES``), every row by one block before the next, so that B rows read it
from memory about once rather than B times, where that was shown to give the unblocked
product's bits (``_blocks_agree``, once per weight shape).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

from kvshelf.model import blas

Sgemv = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (weight n × k, x of k) -> weight @ x

CBLAS_ROW_MAJOR, CBLAS_NO_TRANS = 101, 111

ROW_ALIGNMENT = 64  # bytes: every row handed to sgemv starts on a cache line

# Rows of a weight multiplied by every row of ``x`` before the next block: the most rows, a
# power of two, whose bytes stay within this (well inside a 16-32 MiB last-level cache, and
# what measured fastest: 8 rows by Gemma 3's head in 2048-row blocks of 5.2 MB, 59 ms
# against 137 ms unblocked; 8192-row blocks 76 ms).
BLOCK_BYTES = 8 << 20

# Whether blocks of a weight's rows give the unblocked product's bits, by (shape, block rows,
# the weight's address modulo ROW_ALIGNMENT): ``_blocks_agree``'s verdicts, one per process.
_BLOCK_VERDICTS: dict[tuple, bool] = {}


@cache
def _cblas_sgemv(path: str) -> Any:
    fn = ctypes.CDLL(path).cblas_sgemv
    fn.restype = None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    return fn


def system_sgemv() -> Sgemv | None:
    """``y = weight @ x`` through the OpenBLAS MLX's matmuls use, or None if it is not loaded.

    ctypes releases the GIL for the call, as MLX does for its own work.
    """
    if blas.loaded_path is None:
        return None
    fn = _cblas_sgemv(blas.loaded_path)

    def sgemv(weight: np.ndarray, x: np.ndarray) -> np.ndarray:
        weight = np.ascontiguousarray(weight, dtype=np.float32)  # a view already, never copied in practice
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, cols = weight.shape
        if x.shape != (cols,):
            raise ValueError(f"sgemv: {weight.shape} @ {x.shape}")
        y = np.empty(rows, dtype=np.float32)
        fn(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, rows, cols, 1.0, weight.ctypes.data, cols, x.ctypes.data, 1, 0.0,
           y.ctypes.data, 1)  # fmt: skip
        return y

    return sgemv


def _aligned_copy(x: np.ndarray) -> np.ndarray:
    """``x`` (rows × k, fp32) copied so that every row starts on a ``ROW_ALIGNMENT`` boundary:
    nothing about where the caller's rows lay (a kernel's unaligned head or tail) reaches the bits."""
    rows, k = x.shape
    stride = -(-k * 4 // ROW_ALIGNMENT) * ROW_ALIGNMENT  # bytes from one row's start to the next
    raw = np.empty(rows * stride + ROW_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ROW_ALIGNMENT
    aligned = raw[start : start + rows * stride].view(np.float32).reshape(rows, stride // 4)[:, :k]
    aligned[...] = x
    return aligned


def block_rows(k: int) -> int:
    """Rows of a ``k``-wide fp32 weight in one block (``BLOCK_BYTES``): a power of two, at least 64."""
    rows = 64
    while rows * 2 * k * 4 <= BLOCK_BYTES:
        rows *= 2
    return rows


def each_row(sgemv: Sgemv, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``x @ weight.T`` (``x``: rows × k, ``weight``: n × k, fp32) as one sgemv per row of ``x``:
    each row's bits are those of that row alone (see the module's docstring)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"each_row: {x.shape} @ {weight.shape}.T")
    if rows == 0:
        return np.empty((0, n), dtype=np.float32)
    aligned = _aligned_copy(x)
    block = block_rows(k)
    if rows == 1 or n <= block or not _blocks_agree(sgemv, weight, block):
        return np.stack([sgemv(weight, aligned[i]) for i in range(rows)])
    out = np.empty((rows, n), dtype=np.float32)
    for lo in range(0, n, block):
        part = weight[lo : lo + block]
        for i in range(rows):
            out[i, lo : lo + block] = sgemv(part, aligned[i])
    return out


def _blocks_agree(sgemv: Sgemv, weight: np.ndarray, block: int) -> bool:
    """Whether sgemv over ``weight``'s rows in blocks of ``block`` gives the bits of one sgemv
    over all of them. It need not: OpenBLAS splits the rows between its threads and into
    groups its kernels take together, and a row's product can round otherwise in another
    group (measured: sub-blocks at odd offsets, or of odd sizes, differ). So it is measured
    on the weight itself with a probe row, once per shape and address alignment."""
    key = (weight.shape, block, weight.ctypes.data % ROW_ALIGNMENT)
    known = _BLOCK_VERDICTS.get(key)
    if known is None:
        k = weight.shape[1]
        probe = _aligned_copy(np.sin(np.arange(k, dtype=np.float32) * 0.61)[None])[0]
        whole = sgemv(weight, probe)
        parts = np.concatenate([sgemv(weight[lo : lo + block], probe) for lo in range(0, weight.shape[0], block)])
        known = _BLOCK_VERDICTS[key] = bool(np.array_equal(parts, whole))
    return known
