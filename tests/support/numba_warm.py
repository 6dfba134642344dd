"""Every compiled loop of kvshelf, run once: what a second process must load from numba's
cache (``tests/test_numba_cache.py``), and what the suite compiles before its workers start.

Why before: numba's on-disk cache is not safe for processes that write it at once
(numba/numba#10128). A loop's index file maps each variant (signature, closure values) to a
numbered data file, and two processes that compile different variants of one loop at the
same moment can both take the same number: a later process then loads one variant's code
for the other. A fresh checkout's first full run, two workers compiling the blocked
products' variants in different orders, once ran a block loop that summed in another order
(two bit-for-bit tests failed by 1e-7; the next run passed). ``kvshelf.model.jit`` now
serializes every compile across processes, which closes that race for users too; compiled
once by the controller, every variant the workers ask for is already there to load, and
no worker waits on the lock for another's compiles.
"""

from __future__ import annotations

import subprocess
import sys

# Runs every compiled loop of kvshelf once, on small real inputs.
EVERY_LOOP = """
import kvshelf  # first: it preloads OpenBLAS before mlx
import mlx.core as mx
import numpy as np

from kvshelf.kv import row_coding
from kvshelf.model import coded_attention, exact_ops, half_weights, native_ops, skinny
from kvshelf.model.ordered_attention import ordered_attention

assert skinny.blocked_product() is not None and skinny.invariant_blocked_product() is not None
assert skinny.reads_halves(skinny.blocked_product()) and skinny.reads_halves(skinny.invariant_blocked_product())
assert half_weights.half_copy(np.ones((4, 64), dtype=np.float32)) is not None
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 256), dtype=np.float32)
row_coding.quantize(row_coding.hadamard(x), 64, 4)
row_coding.quantize_rotated(x, 64, 4)
native_ops.gelu_gate(x, x)
exact_ops.silu_gate(x, x)
exact_ops.gelu_gate(x, x)
exact_ops.rms_norm(x, np.ones(256, dtype=np.float32), 1e-6)
native_ops.rms_norm(x, np.ones(256, dtype=np.float32), 1e-6)
rope = native_ops.Rope(64, False, np.ones(32, dtype=np.float32), 1.0)
rope(x.reshape(3, 4, 64), *rope.tables(np.arange(3)))
q = rng.standard_normal((2, 4, 64), dtype=np.float32)
kv = rng.standard_normal((2, 1, 300, 64), dtype=np.float32)
native_ops.attend(q, kv, kv, None, 0.125)
codes, ones = np.full((2, 1, 300, 32), 0x5A, np.uint8), np.ones((2, 1, 300, 1), np.float32)
zeros = np.zeros(2, np.int64)
groups = rng.standard_normal((2, 1, 5, 64), dtype=np.float32)
layer = coded_attention.CodedLayer(codes, groups, groups, kv[:, :, :1], codes, ones, ones, zeros, zeros + 299, True)
coded_attention.attend_coded(q, layer, None, 0.125)
mq, mk = mx.array(q[:, :, None, :]), mx.array(kv)
mx.eval(ordered_attention(mq, mk, mk, 0.125, None))
"""


def warm() -> None:
    """Run ``EVERY_LOOP`` in a child process (so the controller imports no MLX), which saves
    every loop to numba's cache; its failure fails the run, as the workers would."""
    done = subprocess.run([sys.executable, "-c", EVERY_LOOP], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling kvshelf's loops failed:\n{done.stderr[-3000:]}")
