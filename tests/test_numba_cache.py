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

from tests.support.numba_warm import EVERY_LOOP


def test_a_second_process_compiles_nothing(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
    command = [sys.executable, "-c", EVERY_LOOP]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    first, second = (r.stdout + r.stderr for r in runs)
    loops = ("rows_by_weight_in_blocks", "quantize_rows", "gate_times_up", "grouped_decode", "halve", "coded_decode")
    for loop in (*loops, "key_scores", "value_sums", "weigh", "merge", "rms_rows", "rotate", "attend", "silu", "gelu"):
        assert loop in first and "data saved" in first, loop
    saved = [line for line in second.splitlines() if "data saved" in line]
    assert "data loaded" in second and not saved, saved
