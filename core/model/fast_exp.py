"""``exp`` for the row-invariant attention's weights, through numpy's SIMD loop.

MLX 0.32's CPU ``exp`` takes 15-25 ns an element, 2-5x numpy's (``benchmarks/mlx_exp_repro.py``),
and a prefill chunk's attention weights are millions of elements a layer: the largest single
piece of ``kvshelf.model.attention``'s prefill. numpy's float32 ``exp`` runs one vector loop
over a contiguous array, a partial vector at its end, so an element's bits are its own
whatever the array's length or where the element lies in it; ``numpy_exp_invariant`` checks
that once a process (lengths 1..67 and longer ones, at every offset within a vector) and
``exp`` falls back to MLX's own where it does not hold. Each call makes MLX evaluate the
graph up to it (one sync per attention call), which costs far less than the exp saves.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np


def exp(x: mx.array) -> mx.array:
    """``e ** x`` elementwise, each element's bits independent of the rest of ``x``."""
    if x.dtype != mx.float32 or not numpy_exp_invariant():
        return mx.exp(x)
    out = np.array(x)  # a contiguous copy, numpy's own
    np.exp(out, out=out)
    return mx.array(out)


@cache
def numpy_exp_invariant() -> bool:
    """Whether numpy's float32 ``exp`` of an element is the same bits in arrays of any length
    and at any offset, over what attention weights take: scores minus their row's maximum
    (0 and below, down to underflow) and -inf."""
    rng = np.random.default_rng(17)
    values = -np.abs(rng.standard_normal(5000) * 40).astype(np.float32)
    values[::97] = -np.inf
    values[1::89] = 0.0
    whole = np.exp(values)
    for length in [*range(1, 68), 255, 256, 1000, 4099]:
        for offset in range(17):
            part = values[offset : offset + length].copy()
            if not np.array_equal(np.exp(part), whole[offset : offset + length]):
                return False
    return bool(np.all(whole[::97] == 0.0))
