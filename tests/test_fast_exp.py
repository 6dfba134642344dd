"""``kvshelf.model.fast_exp``: the attention weights' exp, each element's bits its own."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvshelf.model.fast_exp import exp, numpy_exp_invariant


def test_an_elements_exp_does_not_depend_on_the_array_around_it():
    assert numpy_exp_invariant()  # numpy's loop, on this machine
    rng = np.random.default_rng(3)
    x = mx.array((rng.standard_normal((3, 7, 301)) * 10 - 5).astype(np.float32))
    whole = np.array(exp(x))
    assert whole.shape == (3, 7, 301) and whole.dtype == np.float32
    for a, b in ((0, 1), (5, 6), (1, 2)):
        assert np.array_equal(np.array(exp(x[a:b, 2:5, 13:250])), whole[a:b, 2:5, 13:250])
    assert np.array_equal(np.array(exp(x[1, 3, 17:18])), whole[1, 3, 17:18])
    # e**x to float32 rounding (numpy's and MLX's differ in the last bits, not more)
    assert np.allclose(whole, np.array(mx.exp(x)), rtol=1e-5, atol=0)


def test_minus_infinity_gives_exact_zeros_and_other_dtypes_stay_mlx_own():
    x = mx.array([-np.inf, 0.0, -np.inf, 1.0], dtype=mx.float32)
    got = np.array(exp(x))
    assert got[:3].tolist() == [0.0, 1.0, 0.0] and abs(got[3] - np.e) < 4e-7  # within 2 ulp of e
    half = mx.array([0.5, -2.0], dtype=mx.float16)
    halves = exp(half)
    assert halves.dtype == mx.float16 and mx.array_equal(halves, mx.exp(half)).item()
