"""The small operations of a temperature-0 decode step on numpy rows, with MLX's own bits.

Why: a temperature-0 step must give its token the bits a prefill gives it, and prefill runs
its norms, RoPE and activations in MLX's graph. Run there in a decode step too, MLX's graph
is evaluated five or six times a layer around the row-invariant products (each evaluation
about 50 us here plus a few us an operation): about a third of the embedded Gemma 3's step
at 1K context. These compute the same functions on numpy rows, operation by operation as
MLX 0.32's CPU backend does, so that the native step (``kvshelf.model.native_decode``) can
run temperature 0 too:

- ``rms_norm``: mlx/fast.cpp's fallback (the CPU has no fused kernel): the squares rounded,
  summed one after the other (the CPU reduction's vector width on x86 is 1), times fp32
  ``1/n``, plus ``eps``, ``1 / sqrt`` (two roundings), times ``x``, then times the weight;
- ``gelu_approx``: ``nn.gelu_approx``'s formula with libm's ``powf`` and ``tanhf``;
- ``silu``: ``x * sigmoid(x)``, MLX's sigmoid ``1 / (1 + exp(|x|))`` (mirrored for ``x >= 0``)
  over MLX's own ``exp`` (a Cephes polynomial in fused multiply-adds);
- RoPE's cosines and sines computed by MLX itself (``tables``), the rotation by
  ``kvshelf.model.native_ops.Rope`` (each product rounded apart, as the fallback does).

Whether each one has MLX's bits depends on more than this code (MLX's build, the libm, the
compiler MLX's ``mx.compile`` calls for activations): ``agree()`` compares every one with
MLX's on a probe once a process, and the temperature-0 native step is only built where all
do (and where its own probe gives the module path's bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvshelf.model.jit import njit
from kvshelf.model.native_ops import F32, Rope

_GELU_C = F32(math.sqrt(2 / math.pi))  # the Python floats nn.gelu_approx multiplies by, as MLX takes them
_GELU_K = F32(0.044715)


def _fma_typing(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """numba's typing of ``fma``: LLVM's ``llvm.fma.f32``, one rounding (MLX's ``std::fma``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(function, list(args))

    return types.float32(types.float32, types.float32, types.float32), codegen


# ``a * b + c`` rounded once, for fp32; inside numba loops only.
fma = cast(Callable[[Any, Any, Any], Any], intrinsic(_fma_typing))


@njit(cache=True, boundscheck=False)
def exp_of_magnitude(v: Any) -> Any:
    """MLX's ``exp`` of ``v >= 0``; inside numba loops only. At module level, so that a loop
    calling it (``silu``) keys numba's disk cache by this module's name: held in a loop's
    closure, a compiled function pickles differently in every process, and the loop was
    compiled again (and its cache index grew by one entry) at every start."""
    # MLX's exp of v >= 0 (what its sigmoid takes): 2**whole, which MLX builds in an
    # fp32's exponent bits and multiplies by the polynomial, is an exact scaling for
    # 0 <= whole <= 127, as ldexp is.
    scaled = v * np.float32(1.442695)
    whole = np.floor(scaled + np.float32(0.5))
    part = scaled - whole
    p = np.float32(1.535336188319500e-4)
    p = fma(p, part, np.float32(1.339887440266574e-3))
    p = fma(p, part, np.float32(9.618437357674640e-3))
    p = fma(p, part, np.float32(5.550332471162809e-2))
    p = fma(p, part, np.float32(2.402264791363012e-1))
    p = fma(p, part, np.float32(6.931472028550421e-1))
    p = fma(p, part, np.float32(1.0))
    if v > np.float32(88.0):
        return np.float32(np.inf)
    if not v >= np.float32(0.0):  # NaN: MLX hands it on
        return v
    return np.float32(math.ldexp(p, int(whole)))


@cache
def _kernels() -> Any:
    """The compiled loops (numba, cached on disk). No fast-math anywhere: every operation
    rounds where MLX's does, in MLX's order."""
    from kvshelf.model import exact_ops  # a module attribute, so numba's disk cache finds ``exp_of_magnitude``
    from kvshelf.model.jit import prange

    @njit(cache=True, boundscheck=False)
    def rms_rows(x, weight, eps, inverse_n, out):
        rows, n = x.shape
        for r in range(rows):
            total = np.float32(0.0)
            for i in range(n):
                square = x[r, i] * x[r, i]
                total = total + square
            scale = np.float32(1.0) / np.sqrt(total * inverse_n + eps)
            for i in range(n):
                out[r, i] = (x[r, i] * scale) * weight[i]

    # The activations are elementwise (an element's bits its own), so the cores share them:
    # libm's powf and tanhf, a scalar call each, take about 27 ns an element here.
    @njit(parallel=True, cache=True, boundscheck=False)
    def gelu(x, out):
        for i in prange(x.shape[0]):
            v = x[i]
            inner = _GELU_C * (v + _GELU_K * math.pow(v, np.float32(3.0)))
            out[i] = (np.float32(0.5) * v) * (np.float32(1.0) + math.tanh(inner))

    @njit(parallel=True, cache=True, boundscheck=False)
    def silu(x, out):
        for i in prange(x.shape[0]):
            v = x[i]
            y = np.float32(1.0) / (np.float32(1.0) + exact_ops.exp_of_magnitude(abs(v)))
            out[i] = v * (y if v < np.float32(0.0) else np.float32(1.0) - y)

    return rms_rows, gelu, silu


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``mx.fast.rms_norm(x, weight, eps)`` over the last axis, with MLX's CPU bits."""
    rows = np.ascontiguousarray(x, dtype=F32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    _kernels()[0](rows, np.ascontiguousarray(weight, dtype=F32), F32(eps), F32(1.0 / x.shape[-1]), out)
    return out.reshape(x.shape)


def _elementwise(kernel: Any, x: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(x, dtype=F32).reshape(-1)
    out = np.empty_like(flat)
    kernel(flat, out)
    return out.reshape(x.shape)


def gelu_approx(x: np.ndarray) -> np.ndarray:
    """``nn.gelu_approx(x)`` with MLX's CPU bits."""
    return _elementwise(_kernels()[1], x)


def silu(x: np.ndarray) -> np.ndarray:
    """``nn.silu(x)`` with MLX's CPU bits."""
    return _elementwise(_kernels()[2], x)


def gelu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``nn.gelu_approx(gate) * up`` with MLX's CPU bits (two operations there too)."""
    return gelu_approx(gate) * up


def silu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``nn.silu(gate) * up`` with MLX's CPU bits."""
    return silu(gate) * up


def tables(rope: Rope, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rope.tables`` with MLX's cosines and sines of the same fp32 angles (MLX's CPU
    ``cos``/``sin`` are its own polynomials, not numpy's)."""
    angles = mx.array(rope.angles(positions))
    cos, sin = mx.cos(angles), mx.sin(angles)
    mx.eval(cos, sin)
    return np.array(cos), np.array(sin)


def _same(mine: np.ndarray, theirs: mx.array) -> bool:
    return bool(np.array_equal(mine, np.array(theirs)))


@cache
def agree() -> bool:
    """Whether every operation here gives MLX's bits on this machine, over a probe of the
    values a decode step takes (rows of several scales, activations over [-30, 30] and
    beyond, angles of positions up to 40K); checked once a process."""
    rng = np.random.default_rng(23)
    try:
        x = (rng.standard_normal((64, 640)) * rng.choice([1e-3, 1.0, 40.0, 900.0], (64, 1))).astype(F32)
        weight = (rng.standard_normal(640) * 0.4).astype(F32)
        heads = rng.standard_normal((8, 4, 256)).astype(F32)
        for rows, w, eps in ((x, weight, 1e-6), (heads, weight[:256], 1e-5)):
            if not _same(rms_norm(rows, w, eps), mx.fast.rms_norm(mx.array(rows), mx.array(w), eps)):
                return False
        special = [0.0, -0.0, 88.5, -88.5, 200.0, -200.0]
        a = np.concatenate([rng.standard_normal(20000) * 4, rng.uniform(-30, 30, 20000), special]).astype(F32)
        if not (_same(gelu_approx(a), nn.gelu_approx(mx.array(a))) and _same(silu(a), nn.silu(mx.array(a)))):
            return False
        rope = nn.RoPE(64, base=10000.0)
        mirrored = Rope.of(rope)
        if mirrored is None:
            return False
        q = rng.standard_normal((3, 4, 64)).astype(F32)
        positions = np.array([5, 1027, 39999])
        got = mirrored(q, *tables(mirrored, positions))
        return all(_same(got[i], rope(mx.array(q[i, :, None]), offset=int(p))[:, 0]) for i, p in enumerate(positions))
    except Exception:  # numba or MLX missing a piece here: keep MLX's graph
        return False
