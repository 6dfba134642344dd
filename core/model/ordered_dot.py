"""The one reassociated sum of temperature-0 attention (``kvshelf.model.ordered_attention``):
a query row's dot product with a key row, whose lanes depend on the head's dims alone.

Why a module of its own: numba's on-disk cache keys a compiled loop by the pickled values
of its closure, and a compiled function held in a closure pickles differently in every
process, so the attention loop that called ``dot`` from its closure was compiled again at
every start. The loop calls ``ordered_dot.dot``, a module attribute that numba resolves when
it compiles. Importing this module imports numba.
"""

from __future__ import annotations

import numpy as np
from numba import njit


# Reassociation only inside one dot product (fastmath), whose lanes depend on its length.
@njit(fastmath=True, cache=True, boundscheck=False)
def dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    """``a . b`` in fp32, its terms summed in lanes that depend on ``a``'s length alone."""
    total = np.float32(0.0)
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total
