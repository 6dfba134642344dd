"""``exp`` inside compiled loops that must run as vectors: Cephes' single-precision expf.

Why: numba's ``np.exp`` is a scalar libm call a lane (2.4 ns an element on this 2-core EPYC
against 0.31 this way, a million elements, scratch), and decode attention takes millions of
exps a step (4.4 million an agent for the 30-layer llama at 16K). Cephes' polynomial is
within 3e-7 of the exact exp (relative). A loop takes ``parts(x)`` for each element and
multiplies the two parts in a second loop: ``exp(x) = 2**k * exp(r)``, ``r = x - k ln 2``
in [-ln2/2, ln2/2], ``exp(r)`` by the polynomial, ``2**k`` as an int32's fp32 exponent
bits (viewed as fp32 in the second loop, so neither loop makes a scalar call).

Who: the default kernels' attention weights and MLP gate (``kvshelf.model.native_ops``)
and temperature-0 attention's weights (``kvshelf.model.ordered_dot``). Inlined into the
caller, which compiles it with its own flags (the temperature-0 loop without fast-math,
so every element rounds alike). A module of its own, reached as a module attribute, as
``kvshelf.model.ordered_dot`` says why. Importing it imports numba.
"""

from __future__ import annotations

import numpy as np

from kvshelf.model.jit import njit

LOG2E = np.float32(1.4426950408889634)
LN2_HIGH, LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
P5, P4, P3 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
P2, P1, P0 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
# The range ``parts`` takes: exp(-87) is 1.6e-38, under fp32's smallest normal (callers
# treat anything at or below it as exactly 0); exp(88) is 1.7e38, under fp32's largest.
FLOOR = np.float32(-87.0)
CEILING = np.float32(88.0)


@njit(inline="always")
def parts(x: np.float32) -> tuple[np.float32, np.int32]:
    """``exp(x)`` for ``x`` in [FLOOR, CEILING] as ``exp(r)`` and ``2**k``'s fp32 bits."""
    power = np.floor(x * LOG2E + np.float32(0.5))
    r = x - power * LN2_HIGH - power * LN2_LOW
    e = ((((P5 * r + P4) * r + P3) * r + P2) * r + P1) * r + P0
    return e * r * r + r + np.float32(1.0), (np.int32(power) + np.int32(127)) << np.int32(23)
