"""The two vector loops of temperature-0 attention (``kvshelf.model.ordered_attention``): a
query row's dot product with a key row, whose lanes depend on the head's dims alone (its
one reassociated sum), and a row's attention weights from its scores.

Why a module of its own: numba's on-disk cache keys a compiled loop by the pickled values
of its closure, and a compiled function held in a closure pickles differently in every
process, so the attention loop that called ``dot`` from its closure was compiled again at
every start. The loop calls ``ordered_dot.dot`` and ``ordered_dot.weights``, module
attributes that numba resolves when it compiles. Importing this module imports numba.
"""

from __future__ import annotations

import numpy as np

from kvshelf.model import vector_exp
from kvshelf.model.jit import njit


# Reassociation only inside one dot product (fastmath), whose lanes depend on its length.
@njit(fastmath=True, cache=True, boundscheck=False)
def dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    """``a . b`` in fp32, its terms summed in lanes that depend on ``a``'s length alone."""
    total = np.float32(0.0)
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total


# No fast-math: every element rounds alike wherever it lies (no fused multiply-adds chosen
# by context), and the loops need none to run as vectors.
@njit(cache=True, boundscheck=False)
def weights(scores: np.ndarray, top: np.float32, seen: np.ndarray, out: np.ndarray) -> None:
    """``exp(score - top)`` of every column a row sees, 0 for the others (and for a score
    ``top`` - 87 or lower), in two vector loops (``kvshelf.model.vector_exp``; libm's
    ``expf``, which the loop called before, is a scalar call a column). An element's bits
    depend on its score and ``top`` alone."""
    n = scores.shape[0]
    powers = np.empty(n, dtype=np.int32)
    for c in range(n):
        out[c], powers[c] = vector_exp.parts(max(scores[c] - top, vector_exp.FLOOR))
    scales = powers.view(np.float32)
    for c in range(n):
        visible = seen[c] != 0 and scores[c] - top > vector_exp.FLOOR
        out[c] = out[c] * scales[c] if visible else np.float32(0.0)
