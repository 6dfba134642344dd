"""Rounding to fp16 inside numba loops, which have no fp16 type (``kvshelf.kv.row_coding``).

Why a module of its own: numba's on-disk cache keys a compiled loop by the pickled values
of its closure, and a compiled function held in a closure pickles differently in every
process, so a loop that called one from its closure was compiled again at every start
(``quantize_rows``: about 0.4 s of the first decode step). Loops call ``fp16_rounding.fp16``,
a module attribute that numba resolves when it compiles. Importing this module imports
numba.
"""

from __future__ import annotations

import math

import numpy as np

from kvshelf.model.jit import njit


@njit(cache=True)
def fp16(x: np.float32) -> np.float32:
    """``x`` rounded to the nearest fp16 value (ties to even), as fp32: the rounding is done
    at fp16's spacing, in exact power-of-two steps."""
    if x == 0 or not math.isfinite(x):
        return x
    _, e = math.frexp(x)  # |x| in [2 ** (e - 1), 2 ** e)
    step = -24 if e < -13 else e - 11  # fp16's spacing there: subnormals below 2 ** -14
    r = np.rint(np.float64(x) * 2.0**-step) * 2.0**step
    if abs(r) > 65504.0:
        return np.float32(math.copysign(math.inf, x))
    return np.float32(r)
