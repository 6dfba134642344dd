"""A decode step's new rows, coded on numpy rows with MLX's own bits.

Why: the native decode step (``kvshelf.model.native_decode``) runs each layer on numpy
rows, but attention must read the step's own token as the cache will hold it (its key
rounded to fp16 in the open block, its value quantized and read back). Asking MLX for
that made every layer evaluate MLX's graph in the middle of the step. Here the same
arithmetic runs in one compiled call, so the cache's own update (MLX) can wait until
every layer is done.

Bit for bit MLX's: ``mx.hadamard_transform``'s CPU butterfly (pairs 1, 2, 4, ... apart,
then one scale), ``mx.quantize``'s affine rule (the range's larger-magnitude end exact,
round half to even, clipped), scales and biases rounded to fp16 as the cache stores them,
and ``mx.dequantize``'s ``scale * code + bias`` in fp32. Compiled without fast-math, so
the compiler keeps that order. ``tests/test_row_coding.py`` checks the bits against MLX.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np

F32 = np.float32
NpTriple = tuple[np.ndarray, np.ndarray, np.ndarray]  # packed words, fp16 scales, fp16 biases


@cache
def _kernels() -> Any:
    from kvshelf.kv import fp16_rounding  # reached as a module attribute: see that module
    from kvshelf.model.jit import njit

    @njit(cache=True)
    def hadamard_rows(x, scale):
        """Each row's orthonormal Hadamard transform, in place (length a power of two)."""
        rows, n = x.shape
        for r in range(rows):
            h = 1
            while h < n:
                for i in range(0, n, 2 * h):
                    for j in range(i, i + h):
                        a = x[r, j]
                        b = x[r, j + h]
                        x[r, j] = a + b
                        x[r, j + h] = a - b
                h *= 2
            for j in range(n):
                x[r, j] = x[r, j] * scale

    @njit(cache=True)
    def quantize_rows(x, group, bits, words, scales, biases):
        """Each row's groups quantized as ``mx.quantize`` does: codes packed into ``words``
        (``32 // bits`` a word, the first in the low bits), scales and biases rounded to
        fp16 (as fp32) as the cache stores them; ``x`` becomes what ``mx.dequantize``
        reads back from those."""
        rows, n = x.shape
        levels = np.float32(2**bits - 1)
        per_word = 32 // bits
        eps = np.float32(1e-7)
        for r in range(rows):
            for w in range(n // per_word):
                words[r, w] = 0
            for g0 in range(0, n, group):
                top = x[r, g0]
                low = x[r, g0]
                for j in range(g0, g0 + group):
                    top = max(top, x[r, j])
                    low = min(low, x[r, j])
                scale = max((top - low) / levels, eps)
                if abs(low) > abs(top):
                    edge = low
                else:
                    edge = top
                    scale = -scale
                q0 = np.float32(np.rint(edge / scale))
                if q0 != 0:
                    scale = edge / q0
                    bias = edge
                else:
                    bias = np.float32(0.0)
                s16 = fp16_rounding.fp16(scale)
                b16 = fp16_rounding.fp16(bias)
                scales[r, g0 // group] = s16
                biases[r, g0 // group] = b16
                for j in range(g0, g0 + group):
                    code = np.float32(np.rint((x[r, j] - bias) / scale))
                    code = min(max(code, np.float32(0.0)), levels)
                    words[r, j // per_word] |= np.uint32(code) << np.uint32(bits * (j % per_word))
                    x[r, j] = s16 * code + b16

    return hadamard_rows, quantize_rows


def hadamard(x: np.ndarray) -> np.ndarray:
    """``mx.hadamard_transform`` of each row of ``x`` (fp32, a power-of-two length), bit for bit."""
    out = np.array(x, dtype=F32, copy=True).reshape(-1, x.shape[-1])
    n = out.shape[1]
    _kernels()[0](out, F32(1.0 / math.sqrt(n)))
    return out.reshape(x.shape)


def quantize(x: np.ndarray, group: int, bits: int) -> tuple[NpTriple, np.ndarray]:
    """Each row of ``x`` quantized in groups of ``group`` (``bits`` bits): the codes as the
    cache stores them (packed uint32 words, fp16 scales and biases; ``mx.quantize``'s bits)
    and the fp32 rows they read back as (the cache's ``_dequantize``)."""
    return _coded(x, group, bits, rotated=False)


def quantize_rotated(x: np.ndarray, group: int, bits: int) -> tuple[NpTriple, np.ndarray]:
    """``quantize(hadamard(x))``'s codes and ``hadamard`` of the rows they read back as (what
    a rotated scheme stores of ``x`` and what attention reads of it): the same bits, the
    three loops on one copy of the rows (a decode step codes a row a layer). Three calls,
    not one loop calling the others: a compiled loop holding others in its closure is
    compiled again in every process (``kvshelf.kv.fp16_rounding``)."""
    return _coded(x, group, bits, rotated=True)


def _coded(x: np.ndarray, group: int, bits: int, rotated: bool) -> tuple[NpTriple, np.ndarray]:
    shape = x.shape
    rows = np.array(x, dtype=F32, copy=True).reshape(-1, shape[-1])
    n = rows.shape[1]
    words = np.empty((rows.shape[0], n * bits // 32), dtype=np.uint32)
    scales = np.empty((rows.shape[0], n // group), dtype=F32)
    biases = np.empty_like(scales)
    rotate, quantize_rows = _kernels()
    scale = F32(1.0 / math.sqrt(n))
    if rotated:
        rotate(rows, scale)
    quantize_rows(rows, group, bits, words, scales, biases)
    if rotated:
        rotate(rows, scale)
    lead = shape[:-1]
    codes = (
        words.reshape(*lead, -1),
        scales.astype(np.float16).reshape(*lead, -1),  # already fp16 values: exact
        biases.astype(np.float16).reshape(*lead, -1),
    )
    return codes, rows.reshape(shape)


def fp16_rounded(x: np.ndarray) -> np.ndarray:
    """``x`` as an fp16 cache stores it, read back in fp32."""
    return np.asarray(x, dtype=np.float16).astype(F32)
