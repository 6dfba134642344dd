"""MLX CPU: a 1-row matmul ``x @ W.T`` runs as sgemm, 1.7-2.4x slower than sgemv on the same memory.

A minimal reproduction for an upstream report (plain MLX, numpy only for the comparison).
MLX's CPU backend sends every float32 matmul to ``cblas_sgemm`` (mlx/backend/cpu/gemms/
cblas.cpp), also when one side is a single row; OpenBLAS then (presumably) packs the matrix for
a product that ``cblas_sgemv`` does in one streaming pass. For an LLM's output projection
(here Gemma 3 270M's shape, 262144x640 fp32 = 671 MB) that is the batch-1 decode step's
single largest matmul. Measured on a 2-core AMD EPYC (Zen 4) VM with Debian's OpenBLAS
0.3.21, load average 1.6: MLX 1-row 59 ms, MLX 8-row 70 ms, that OpenBLAS's own sgemv on
the same buffer (a zero-copy numpy view) 34 ms, numpy's bundled OpenBLAS 0.3.31 38 ms.

    python benchmarks/mlx_gemv_repro.py [--vocab 262144] [--hidden 640] [--blas PATH|none]

On Linux the mlx[cpu] wheel links the reference BLAS; like kvshelf, this preloads the
system OpenBLAS (``--blas``) before importing mlx so that MLX's sgemm is OpenBLAS's.
"""

import argparse
import ctypes
import os
import platform
import time
from importlib.metadata import version

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=262144)
p.add_argument("--hidden", type=int, default=640)
p.add_argument("--blas", default="/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
args = p.parse_args()
preloaded = None
if args.blas != "none" and os.path.exists(args.blas):
    preloaded = ctypes.CDLL(args.blas, mode=ctypes.RTLD_GLOBAL)  # must precede the first mlx import

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def median_ms(f, n: int = 10) -> float:
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[n // 2]


W = mx.random.normal((args.vocab, args.hidden))  # float32, row-major, like a tied embedding
x1, x8 = mx.random.normal((1, args.hidden)), mx.random.normal((8, args.hidden))
mx.eval(W, x1, x8)
Wn, xn = np.asarray(memoryview(W)), np.asarray(x1)[0]  # type: ignore[arg-type]  # Wn: MLX's buffer, no copy

mlx_1 = median_ms(lambda: mx.eval(x1 @ W.T))
mlx_8 = median_ms(lambda: mx.eval(x8 @ W.T))
np_gemv = median_ms(lambda: Wn @ xn)
diff = np.abs(np.asarray(x1 @ W.T)[0] - Wn @ xn).max()
sys_gemv = None
if preloaded:  # the sgemv of the very OpenBLAS whose sgemm MLX calls
    fn = preloaded.cblas_sgemv
    i, f, p_ = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes, fn.restype = [i, i, i, i, f, p_, i, p_, i, f, p_, i], None  # cblas_sgemv(order, trans, M, N, ...)
    y = np.empty(args.vocab, np.float32)
    rows, cols = Wn.shape
    sys_gemv = median_ms(
        lambda: fn(101, 111, rows, cols, 1.0, Wn.ctypes.data, cols, xn.ctypes.data, 1, 0.0, y.ctypes.data, 1)
    )

print(f"mlx {version('mlx')}, numpy {np.__version__}, {platform.machine()}, {os.cpu_count()} CPUs")
for line in sorted({line.split()[-1] for line in open("/proc/self/maps") if "blas" in line.lower()}):
    try:
        get_config = ctypes.CDLL(line).openblas_get_config
        get_config.restype = ctypes.c_char_p
        print(f"  loaded {line}: {get_config().decode()}")
    except (OSError, AttributeError):
        print(f"  loaded {line}")
numpy_blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
print(f"  numpy's BLAS: {numpy_blas.get('name')} {numpy_blas.get('version')}")
print(f"W {args.vocab}x{args.hidden} float32 = {Wn.nbytes / 1e6:.0f} MB, load average {os.getloadavg()[0]:.2f}")
print(f"mlx   x @ W.T, x 1 row (sgemm)   {mlx_1:7.1f} ms  ({Wn.nbytes / mlx_1 / 1e6:5.1f} GB/s)")
print(f"mlx   x @ W.T, x 8 rows (sgemm)  {mlx_8:7.1f} ms")
if sys_gemv is not None:
    print(f"cblas_sgemv, same OpenBLAS       {sys_gemv:7.1f} ms  ({Wn.nbytes / sys_gemv / 1e6:5.1f} GB/s)")
print(f"numpy W @ x (its own sgemv)      {np_gemv:7.1f} ms  ({Wn.nbytes / np_gemv / 1e6:5.1f} GB/s)")
print(f"1-row matmul / sgemv             {mlx_1 / (sys_gemv or np_gemv):7.2f}x  (max |difference| {diff:.1e})")
