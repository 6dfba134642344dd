"""The numpy coding of a decode step's new rows (``kvshelf.kv.row_coding``) gives MLX's own
bits: the Hadamard rotation, the 4- and 8-bit group quantization read back through fp16
scales (tiny, constant and large groups included), and each dense scheme's ``read_back``
against its cache's ``coded_rows``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv import row_coding
from kvshelf.kv.schemes import SCHEMES
from kvshelf.model.spec import LayerSpec


def rows(n: int, width: int, seed: int) -> np.ndarray:
    """Rows of very different magnitudes, with constant, tiny and huge groups among them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, width)) * 10.0 ** rng.integers(-7, 4, (n, 1))
    x[0] = 0.0
    x[1] = 3.25
    x[2, : width // 2] = -1e-6
    x[3] *= 1e4
    return x.astype(np.float32)


@pytest.mark.parametrize("width", [64, 128, 256])
def test_the_rotation_has_mlx_bits(width):
    x = rows(600, width, width)
    assert np.array_equal(row_coding.hadamard(x), np.array(mx.hadamard_transform(mx.array(x))))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_quantized_rows_read_back_with_mlx_bits(group, bits):
    x = rows(800, 256, group + bits)
    w, s, z = mx.quantize(mx.array(x), group_size=group, bits=bits)
    wide = lambda a: a.astype(mx.float16).astype(mx.float32)  # noqa: E731  (the cache keeps fp16)
    want = np.array(mx.dequantize(w, wide(s), wide(z), group_size=group, bits=bits))
    assert np.array_equal(row_coding.quantize(x, group, bits)[1], want)


@pytest.mark.parametrize("width", [64, 256])
def test_rotated_rows_are_the_three_steps_bit_for_bit(width):
    x = rows(300, width, width + 1)
    codes, back = row_coding.quantize_rotated(x, 64, 4)
    want_codes, coded = row_coding.quantize(row_coding.hadamard(x), 64, 4)
    assert all(np.array_equal(a, b) for a, b in zip(codes, want_codes))
    assert np.array_equal(back, row_coding.hadamard(coded))
    w, s, z = mx.quantize(mx.hadamard_transform(mx.array(x)), group_size=64, bits=4)
    wide = lambda a: a.astype(mx.float16).astype(mx.float32)  # noqa: E731
    read = mx.hadamard_transform(mx.dequantize(w, wide(s), wide(z), group_size=64, bits=4))
    assert np.array_equal(back, np.array(read))  # and MLX's own three operations


def test_fp16_rounding_is_numpys():
    edges = np.array([65504, 65519, 65520, 2**-14, 2**-24, 3 * 2**-26], dtype=np.float32)
    x = np.concatenate([rows(300, 64, 7).reshape(-1), edges])
    assert np.array_equal(row_coding.fp16_rounded(x), x.astype(np.float16).astype(np.float32))


DENSE = [name for name, s in SCHEMES.items() if not s.plain]


@pytest.mark.parametrize("name", DENSE)
def test_a_scheme_codes_and_reads_back_its_rows_as_mlx_does(name):
    """``read_back``'s rows are ``coded_rows``'s and its codes ``code_rows``'s (NaN where an
    fp16 scale overflowed, on both sides alike)."""
    cache = SCHEMES[name].make(LayerSpec(None, 2, 64, 64))
    k, v = (rows(6, 64, seed).reshape(3, 2, 64) for seed in (1, 2))
    keys, values = mx.array(k[:, :, None, :]), mx.array(v[:, :, None, :])
    want_k, want_v = cache.coded_rows(keys, values, mx.float32, dense=True)
    want_codes = cache.code_rows(keys, values)
    got = cache.read_back(k, v)
    assert got is not None
    assert np.array_equal(got.keys, np.array(want_k)[:, :, 0, :], equal_nan=True)
    assert np.array_equal(got.values, np.array(want_v)[:, :, 0, :], equal_nan=True)
    for member in range(3):
        for mine, theirs in zip(got.member(member), want_codes):
            assert (mine is None) == (theirs is None)
            for a, b in zip(mine or (), theirs or ()):
                want = np.array(b)[member, :, 0, :]
                assert a.shape == want.shape and a.dtype == want.dtype
                assert np.array_equal(a, want, equal_nan=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_codes_are_mlxs(bits):
    x = rows(500, 128, 40 + bits)
    (words, scales, biases), _ = row_coding.quantize(x.reshape(250, 2, 128), 64, bits)
    w, s, z = mx.quantize(mx.array(x), group_size=64, bits=bits)
    assert np.array_equal(words.reshape(500, -1), np.array(w))
    assert np.array_equal(scales.reshape(500, -1), np.array(s.astype(mx.float16)), equal_nan=True)
    assert np.array_equal(biases.reshape(500, -1), np.array(z.astype(mx.float16)), equal_nan=True)
