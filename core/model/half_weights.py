"""Weights read at half width: an fp32 weight whose every value is an fp16 (or bf16) value, kept so.

Why: a decode step's time is its weights' bytes over the memory's bandwidth, and the
embedded Gemma 3's weights are fp16 values held as fp32 (its converter stores the GGUF's
dequantized tensors as fp16, and MLX's CPU kernels want fp32, which it loads them as), so
half of every byte a step reads is zeros. The compiled products
(``kvshelf.model.skinny``) take such a weight as its 16-bit codes and widen each element
as they load it: the same fp32 value, so the same terms in the same order and the same
bits (each loop is checked for that before it is used), from half the bytes. The
262144x640 head, one row, random x: 15.3 against 8.3 ms (scratch run, 2-core EPYC,
2026-12-07).

The loops widen an element with ``kvshelf.model.half_floats.widen``. ``half_copy`` makes the
copy only where it is exact, bit for bit, else None: those weights keep being read as fp32.

A bf16 checkpoint (most published llamas), loaded as fp32 for MLX's CPU kernels, is read
as its bf16 codes the same way.

The price is memory: the copy sits beside the fp32 weight, which MLX's own calls (a
prefill's matmuls) still read: 536 MB for the embedded model (the head 336 MB).
``KVSHELF_NO_HALF_WEIGHTS=1`` makes no copies.
"""

from __future__ import annotations

import weakref
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.model.arrays import buffer_view
from kvshelf.switches import env_on

# The dtypes a half-width weight's codes are held in: fp16's bits (numba has no float16 type),
# and bf16's (the high half of the fp32's), told apart by numba as by numpy by their dtype.
CODES = np.uint16
BRAIN_CODES = np.int16


@cache
def _halve() -> Any:
    """The compiled copy (both cores; numpy's float16 casts took 3.5 s for the embedded
    head): each row's fp16 codes, or (``brain``) bf16's, and how many elements they do not
    hold bit for bit."""
    from numba import types

    from kvshelf.model import half_floats
    from kvshelf.model.jit import njit, prange

    weights = types.Array(types.float32, 2, "C", readonly=True)
    bits = types.Array(types.uint32, 2, "C", readonly=True)

    @njit(types.int64(weights, bits, types.Array(types.uint16, 2, "C"), types.boolean), parallel=True, cache=True)
    def halve(weight: np.ndarray, bits: np.ndarray, out: np.ndarray, brain: bool) -> int:
        missed = 0
        for j in prange(weight.shape[0]):
            row = 0
            for i in range(weight.shape[1]):
                if brain:  # bf16: the high half of the bits, the low half zero
                    out[j, i] = bits[j, i] >> 16
                    row += (bits[j, i] & 0xFFFF) != 0
                else:  # fp16 keeps the sign bit (-0.0 stays -0.0): equal values are equal bits; NaN misses
                    code = half_floats.narrow(weight[j, i])
                    out[j, i] = code
                    row += half_floats.widen(code) != weight[j, i]
            missed += row
        return missed

    return halve


def enabled() -> bool:
    """Whether products built now read half-width copies (``KVSHELF_NO_HALF_WEIGHTS`` unset);
    asked when a model's products are built, so one process can build both kinds."""
    return not env_on("KVSHELF_NO_HALF_WEIGHTS")


def half_copy(weight: np.ndarray) -> np.ndarray | None:
    """``weight`` (fp32, 2-D, C-contiguous) as fp16 codes (``CODES``) if every element is an
    fp16 value, else as bf16 codes (``BRAIN_CODES``) if every one is a bf16 value (bit for
    bit: -0.0 stays -0.0), else None."""
    if weight.dtype != np.float32 or weight.ndim != 2 or not weight.flags.c_contiguous:
        return None
    view = weight.view()
    view.flags.writeable = False
    bits = view.view(np.uint32)
    out = np.empty(weight.shape, dtype=CODES)
    first = weight[:1]  # most fp32 weights fail both at once: no whole copy for them
    if np.array_equal(first.astype(np.float16).astype(np.float32).view(np.uint32), first.view(np.uint32)):
        if _halve()(view, bits, out, False) == 0:
            return out
    if not np.any(first.view(np.uint32) & 0xFFFF) and _halve()(view, bits, out, True) == 0:
        return out.view(BRAIN_CODES)
    return None


# Each MLX weight's copy (or None: neither fp16 nor bf16 holds it), made once however many products
# read it (the default kernels' step and temperature 0's share the model's weights), and
# dropped with the weight.
_copies: dict[int, np.ndarray | None] = {}


def half_of(weight: mx.array) -> np.ndarray | None:
    """``half_copy`` of an MLX weight, made on the first call and kept while ``weight`` lives."""
    key = id(weight)
    if key not in _copies:
        _copies[key] = half_copy(buffer_view(weight))
        weakref.finalize(weight, _copies.pop, key, None)
    return _copies[key]
