"""A product of a few rows by a weight matrix at BLIS's speed, for batched decode.

A decode step of B agents multiplies B rows (B = 2..16) by every weight matrix. OpenBLAS
0.3.21 (Debian's, the BLAS MLX's CPU matmuls use here) runs such a skinny product as a
full sgemm that packs the weight first; on the embedded Gemma 3 (2 cores, measured
under the benchmark lock, load 2.6-4) 4 rows through the 126 layer projections took
58-69 ms and through the 262K-row head 116-119 ms. BLIS has kernels for exactly this
shape ("sup": small/unpacked), and its typed API ``bli_sgemm`` takes strides, so the
weight is read where MLX keeps it, transposed by its strides, never copied: 39-42 ms and
46-48 ms on the same shapes.

BLIS is optional, like OpenBLAS: Debian's ``libblis4-pthread`` (``apt install
libblis4-pthread``) or any ``libblis.so.4`` named by ``KVSHELF_BLIS``. It is opened
with ``RTLD_LOCAL`` and called by its ``bli_`` names only, so none of its symbols can
stand in for OpenBLAS's (which MLX resolves globally) nor OpenBLAS's for its own. It
runs one thread per core this process may use (``blas.usable_cpus``: its affinity, so
a node under ``taskset -c 0`` runs one; ``BLIS_NUM_THREADS`` overrides), as OpenBLAS
does, one pool at a time since the step loop calls them in turn.
Set ``KVSHELF_NO_BLIS=1`` to keep MLX's own matmuls everywhere.

A decode batch's rows go through BLIS only when asked (``KVSHELF_BLIS_BATCHES=1``, or
``with_fast_linears(..., batches=True)``); by default they stay MLX's own matmuls.
Decided by whole batched steps measured with and without it side by side, in three runs
(embedded Gemma 3 and the 30-layer llama at 1K, default scheme, ms a step):

- ``benchmarks/decode.py``, ``results/decode-20261201-145852.json`` (load 1.6 -> 1.9),
  batch 2/4/8: Gemma 3 233/435/456 with BLIS against 250/336/510 without, the llama
  250/358/497 against 245/341/419 (plain Q4: 239/348/550 and 260/393/601 against
  276/437/607 and 215/393/621);
- ``benchmarks/decode_batch_profile.py``, ``results/decode-batch-profile-20261201-143143.json``
  (load 3.3 -> 2.4), batch 4/8: 306/469 and 479/442 with BLIS against 354/418 and 350/438;
- the session before (load 1.3), batch 4/8: 282/296 and 232/333 against 262/330 and 209/311.

Every comparison goes either way by up to 30% from one batch size to the next (the noise
of this 2-core machine), and the sums show no gain: the default scheme 2229 ms with BLIS
against 2101 without in the first run, 1696 against 1560 and 1143 against 1112 in the
others (plain Q4, the one case in its favour: 2391 against 2549).
Alone BLIS's kernels are faster (4 rows through the embedded model's 126 projections
73 against 133 ms, its head 94 against 153 ms at 8 rows), but each call hands a numpy
view to BLIS, so MLX must evaluate the step's graph up to it: 126-210 syncs a step,
which cost about what the kernels save. (What grows with the batch is attention, not
the projections: see the README.) The shape-invariant kernels
(``kvshelf.model.gemv.SHAPE_INVARIANT``) used BLIS for every row until 2026-12-02; they now
run each row as its own sgemv (``kvshelf.model.sgemv.each_row``), which is faster for the
1-8 rows of a decode step: BLIS computes up to six rows as slowly as six.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np

from kvshelf.model.blas import usable_cpus
from kvshelf.switches import env_on

BLIS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
    "/usr/lib/aarch64-linux-gnu/blis-pthread/libblis.so.4",
    "/usr/lib/x86_64-linux-gnu/libblis.so.4",
    "/usr/lib/aarch64-linux-gnu/libblis.so.4",
)
BLIS_NO_TRANSPOSE = 0
# Products with more rows than this are left to MLX (OpenBLAS's sgemm is fast there).
MAX_FEW_ROWS = 16
# Row counts one BLIS call may take, largest first: ``slice_rows`` keeps the largest that
# this machine's BLIS computes with every row's bits independent of the others.
SLICE_CANDIDATES = (256, 192, 128, 64, 32, 16, 8)

Gemm = Callable[[np.ndarray, np.ndarray], np.ndarray]


def batches_through_blis() -> bool:
    """Whether a decode batch's 2..MAX_FEW_ROWS rows go through BLIS (off unless
    ``KVSHELF_BLIS_BATCHES=1``; read when a model's wrappers are built; see above)."""
    return env_on("KVSHELF_BLIS_BATCHES")


def _library() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or env_on("KVSHELF_NO_BLIS"):
        return None
    named = os.environ.get("KVSHELF_BLIS")
    for path in (named,) if named else BLIS_CANDIDATES:
        if path and os.path.exists(path):
            try:
                return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            except OSError:
                continue
    return None


# A product of at least this much work (rows × columns × inner) is cut by its output columns
# into one part per thread, each part one single-threaded BLIS call (measured under the
# benchmark lock, benchmarks/invariant_profile.py: BLIS's own two threads ran a 256-row
# slice of the embedded model's gate projection at 14 ms, two such parts at 9 ms; a decode
# row's projections are too small to gain from a second thread). Each output element is
# the same sum whatever the cut: BLIS's small-matrix kernels reduce each one over the
# inner dimension alone, and the cuts fall on multiples of ``SPLIT_COLUMNS`` columns, so
# every part starts on a kernel tile (checked at load: ``kvshelf.model.gemv``).
SPLIT_WORK = 1 << 22
SPLIT_COLUMNS = 64


def _column_cuts(n: int, parts: int) -> list[int]:
    """Cut points of ``n`` columns into at most ``parts`` parts, on multiples of SPLIT_COLUMNS."""
    tiles = -(-n // SPLIT_COLUMNS)
    parts = max(1, min(parts, tiles))
    return sorted({min(n, (tiles * i // parts) * SPLIT_COLUMNS) for i in range(parts + 1)})


@cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvshelf-blis")


Product = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


Columns = Callable[[np.ndarray, np.ndarray, np.ndarray, int, int, int], None]


@cache
def _columns() -> Columns | None:
    """``(x, weight, y, lo, hi, step)``: columns ``lo..hi`` of ``y = x @ weight.T`` through
    ``bli_sgemm`` on this thread, ``step`` rows a call; None if no BLIS is installed."""
    lib = _library()
    if lib is None:
        return None
    lib.bli_thread_set_num_threads.argtypes = [ctypes.c_int64]
    lib.bli_thread_set_num_threads(1)  # the threads are the column parts' (SPLIT_WORK)
    fn = lib.bli_sgemm
    fn.restype = None
    dim, ptr, trans = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [trans, trans, dim, dim, dim, ptr, ptr, dim, dim, ptr, dim, dim, ptr, ptr, dim, dim]
    one, zero = np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.float32)

    def columns(x: np.ndarray, weight: np.ndarray, y: np.ndarray, lo: int, hi: int, step: int) -> None:
        (m, k), n = x.shape, y.shape[1]
        # C (m×(hi-lo), row stride n) = A (m×k, row stride k) · B (k×(hi-lo): the weight's
        # rows lo..hi, its rows and columns swapped by its strides: row stride 1, column stride k).
        for i in range(0, m, step):
            rows = min(step, m - i)
            fn(
                BLIS_NO_TRANSPOSE,
                BLIS_NO_TRANSPOSE,
                rows,
                hi - lo,
                k,
                one.ctypes.data,
                x.ctypes.data + i * k * 4,
                k,
                1,
                weight.ctypes.data + lo * k * 4,
                1,
                k,
                zero.ctypes.data,
                y.ctypes.data + (i * n + lo) * 4,
                n,
                1,
            )

    return columns


@cache
def slice_rows() -> int:
    """The most rows one BLIS call takes here with each row's bits independent of the others;
    0 if no BLIS is installed or not even ``SLICE_CANDIDATES``' smallest holds (then BLIS is
    not used: ``system_gemm`` is None).

    Why measured: BLIS reduces each element over the inner dimension alone, the same for
    any row count, only in its small-matrix ("sup") kernels, and it takes them only below a
    size threshold of the sub-configuration it picks for the CPU at run time. On an AMD EPYC
    (``zen3``) a 256-row product still ran them; on an AVX-512 Xeon, where BLIS 0.9 picks
    ``haswell``, products of more than 200 rows by weights of 201 or more rows take its
    packed kernels, whose rows round otherwise (a prefill row then differs from the same
    row decoded alone). So a product goes in slices of the largest candidate whose rows,
    on weights above every such threshold, equal each row computed alone and with fewer."""
    columns = _columns()
    if columns is None:
        return 0

    def one_call(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        y = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        columns(np.ascontiguousarray(x), weight, y, 0, weight.shape[0], x.shape[0])
        return y

    rng = np.random.default_rng(3)
    for rows in SLICE_CANDIDATES:
        if all(_rows_independent(one_call, rows, n, k, rng) for n, k in ((1024, 640), (640, 2048))):
            return rows
    return 0


def _rows_independent(
    call: Callable[[np.ndarray, np.ndarray], np.ndarray], rows: int, n: int, k: int, rng: np.random.Generator
) -> bool:
    """An ``rows``-row product by an ``n × k`` weight gives each row the bits it has alone,
    and the first ``m`` rows the bits of an ``m``-row product."""
    x = rng.standard_normal((rows, k), dtype=np.float32)
    weight = rng.standard_normal((n, k), dtype=np.float32)
    full = call(x, weight)
    picks = sorted({0, rows // 3, rows - 1})
    if not all(np.array_equal(call(x[i : i + 1], weight)[0], full[i]) for i in picks):
        return False
    return all(
        np.array_equal(call(x[:m], weight), full[:m]) for m in sorted({2, 7, rows // 2 + 1, rows - 1}) if 1 < m < rows
    )


@cache
def _product() -> Product | None:
    """``(x, weight, parts) -> x @ weight.T`` through BLIS, in at most ``parts`` column parts
    run side by side, ``slice_rows()`` rows a call; None if BLIS is not installed or keeps
    no row's bits (``slice_rows`` 0)."""
    columns, step = _columns(), slice_rows()
    if columns is None or step == 0:
        return None

    def product(x: np.ndarray, weight: np.ndarray, parts: int) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        weight = np.ascontiguousarray(weight, dtype=np.float32)  # a view already, never copied in practice
        (m, k), n = x.shape, weight.shape[0]
        if weight.shape != (n, k):
            raise ValueError(f"gemm: {x.shape} @ {weight.shape}.T")
        y = np.empty((m, n), dtype=np.float32)
        cuts = _column_cuts(n, parts)
        if len(cuts) <= 2:
            columns(x, weight, y, 0, n, step)
        else:
            spans = list(zip(cuts, cuts[1:]))
            done = [_pool(parts).submit(columns, x, weight, y, lo, hi, step) for lo, hi in spans[1:]]
            columns(x, weight, y, *spans[0], step)
            for f in done:
                f.result()
        return y

    return product


@cache
def system_gemm() -> Gemm | None:
    """``y = x @ weight.T`` (``x``: rows × k, ``weight``: n × k, both fp32 C-contiguous)
    through BLIS's ``bli_sgemm``, or None if no BLIS is installed (or it keeps no row's bits:
    ``slice_rows``). A large product runs in
    column parts, one per thread (``SPLIT_WORK``)."""
    product = _product()
    if product is None:
        return None
    threads = gemm_threads()

    def gemm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        work = x.shape[0] * weight.shape[0] * weight.shape[1]
        return product(x, weight, threads if work >= SPLIT_WORK else 1)

    return gemm


def gemm_uncut(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``system_gemm``'s product as one BLIS call on this thread (what the cut one must equal)."""
    product = _product()
    if product is None:
        raise RuntimeError("BLIS is not installed, or keeps no row's bits (slice_rows)")
    return product(x, weight, 1)


def gemm_threads() -> int:
    """The threads a large product runs on: one per core this process may use
    (``blas.usable_cpus``), or ``BLIS_NUM_THREADS``."""
    return int(os.environ.get("BLIS_NUM_THREADS") or usable_cpus())


def blis_threads() -> int | None:
    """The threads BLIS's products run on (None when BLIS is not in use)."""
    return gemm_threads() if system_gemm() is not None else None
