"""Every compiled loop of a decode or prefill step loads from numba's on-disk cache in a
second process, instead of compiling again at every start.

numba keys a cached loop by the pickled values of its closure: a loop that held a compiled
function or an intrinsic in its closure pickled differently in every process and was
compiled again each time (the blocked products: 6-7 s at every start; the row coding's
quantizer and temperature-0 attention's loop: the first step of every process). Two real
processes share one cache directory here; the second must save nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Runs every compiled loop of kvshelf once, on small real inputs.
EVERY_LOOP = """
import kvshelf  # first: it preloads OpenBLAS before mlx
import mlx.core as mx
import numpy as np

from kvshelf.kv import row_coding
from kvshelf.model import half_weights, native_ops, skinny
from kvshelf.model.ordered_attention import ordered_attention

assert skinny.blocked_product() is not None and skinny.invariant_blocked_product() is not None
assert skinny.reads_halves(skinny.blocked_product()) and skinny.reads_halves(skinny.invariant_blocked_product())
assert half_weights.half_copy(np.ones((4, 64), dtype=np.float32)) is not None
rng = np.random.default_rng(0)
x = rng.standard_normal((3, 256), dtype=np.float32)
row_coding.quantize(row_coding.hadamard(x), 64, 4)
row_coding.quantize_rotated(x, 64, 4)
native_ops.gelu_gate(x, x)
native_ops.rms_norm(x, np.ones(256, dtype=np.float32), 1e-6)
rope = native_ops.Rope(64, False, np.ones(32, dtype=np.float32), 1.0)
rope(x.reshape(3, 4, 64), *rope.tables(np.arange(3)))
q = rng.standard_normal((2, 4, 64), dtype=np.float32)
kv = rng.standard_normal((2, 1, 300, 64), dtype=np.float32)
native_ops.attend(q, kv, kv, None, 0.125)
mq, mk = mx.array(q[:, :, None, :]), mx.array(kv)
mx.eval(ordered_attention(mq, mk, mk, 0.125, None))
"""


def test_a_second_process_compiles_nothing(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
    command = [sys.executable, "-c", EVERY_LOOP]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    first, second = (r.stdout + r.stderr for r in runs)
    loops = ("rows_by_weight_in_blocks", "quantize_rows", "gate_times_up", "grouped_decode", "halve")
    for loop in (*loops, "rms_rows", "rotate", "attend"):
        assert loop in first and "data saved" in first, loop
    saved = [line for line in second.splitlines() if "data saved" in line]
    assert "data loaded" in second and not saved, saved
