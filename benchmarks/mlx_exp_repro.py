"""MLX CPU: ``mx.exp`` and ``mx.softmax`` on float32 take 15-25 ns an element, 2-5x numpy's exp.

A minimal reproduction for an upstream report (plain MLX, numpy only for the comparison).
Attention's exponentials are a large part of a CPU prefill: one layer's scores for a 256-token
chunk of Gemma 3 270M at 1K context are 4 heads x 256 x 1024 = 1M floats. Measured on a 2-core
AMD EPYC VM (MLX 0.32.4, numpy 2.4.6), this script's inputs (load 0.75): ``mx.exp`` 15.8 ms,
``mx.softmax`` 16.6 ms, numpy's ``np.exp`` 7.6 ms including the copies out of and back into
MLX; a subtraction 0.26 ms and a max 1.2 ms over the same array, so memory is not what limits
it. On standard-normal inputs (load 2): 24.3, 24.7 and 4.5 ms. The results differ by up to 25
ulp. kvshelf's row-invariant attention spends about 40% of a 1K prefill chunk's attention in
this exp (``kvshelf.model.attention``), and MLX's own ``scaled_dot_product_attention`` (its
CPU fallback's softmax) about as much.

    python benchmarks/mlx_exp_repro.py [--shape 4,256,1024]
"""

import argparse
import os
import platform
import statistics
import timeit
from importlib.metadata import version

import mlx.core as mx
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--shape", default="4,256,1024")
args = p.parse_args()
shape = tuple(int(n) for n in args.shape.split(","))


def median_ms(f, n: int = 9) -> float:
    f()  # warm up
    return 1000 * statistics.median(timeit.repeat(f, number=1, repeat=n))


x = mx.random.normal(shape) * 4 - 8  # scores minus their row maximum lie mostly below 0
mx.eval(x)
n = x.size
timings = {
    "mx.exp": median_ms(lambda: mx.eval(mx.exp(x))),
    "mx.softmax": median_ms(lambda: mx.eval(mx.softmax(x, axis=-1))),
    "x - 1 (mlx)": median_ms(lambda: mx.eval(x - 1)),
    "x.max(-1) (mlx)": median_ms(lambda: mx.eval(x.max(axis=-1))),
    "np.exp, with copies": median_ms(lambda: mx.eval(mx.array(np.exp(np.array(x))))),
}
ours, theirs = np.array(mx.exp(x)), np.exp(np.array(x))
ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32).astype(np.int64)).max()
print(f"mlx {version('mlx')}, numpy {np.__version__}, {platform.machine()}, {os.cpu_count()} CPUs")
print(f"x {shape} float32 ({n / 1e6:.2f}M elements), load average {os.getloadavg()[0]:.2f}")
for name, ms in timings.items():
    print(f"{name:22s} {ms:7.2f} ms  ({ms * 1e6 / n:5.1f} ns an element)")
print(f"mx.exp / np.exp: {timings['mx.exp'] / timings['np.exp, with copies']:.1f}x; largest difference {ulps} ulp")
