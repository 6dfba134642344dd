"""``kvshelf.model.coded_attention``: decode attention over the default scheme's codes, read
in place, is the default kernels' attention over the same values as fp32 rows (to fp32
rounding: the scales are folded into the query and the weights, the values' rotation is
undone once), for a batch of agents of different lengths (left-padded, each with its own
key groups and open block), a window that hides columns, and both head shapes we serve."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES, SchemeLayerCache
from kvshelf.model.coded_attention import CodedLayer, attend_coded, key_rows, value_rows, worth_reading
from kvshelf.model.native_ops import MASKED, attend
from kvshelf.model.spec import BLOCK_TOKENS, LayerSpec

F32 = np.float32


def _agent(spec: LayerSpec, n: int, seed: int):
    """A default-scheme cache of ``n`` random tokens: its dense rows and its codes."""
    cache = SCHEMES[DEFAULT_SCHEME].make(spec)
    rng = np.random.default_rng(seed)
    shape = (1, spec.kv_heads, n, spec.k_head_dim)
    k, v = (mx.array(rng.standard_normal(shape).astype(F32) * 3) for _ in range(2))
    cache.update_and_fetch(k, v)
    dense_k, dense_v = (np.array(x) for x in cache.attention_rows(0, n, mx.float32, dense=True))
    full = n // BLOCK_TOKENS * BLOCK_TOKENS
    kw, ks, kz = (np.array(x[..., :full, :]) for x in cache.packed_rows("keys", 0, n))
    vw, vs, vz = (np.array(x) for x in cache.packed_rows("values", 0, n))
    codes, scales, offsets = key_rows(kw, ks, kz, spec.k_head_dim)
    assert isinstance(cache, SchemeLayerCache) and cache.k_tail is not None  # the open key block, fp16
    open_keys = np.array(cache.k_tail.astype(mx.float32))
    assert open_keys.shape[2] == n - full
    return dense_k, dense_v, (codes, scales, offsets, open_keys, value_rows(vw), vs.astype(F32), vz.astype(F32)), full


def _batch(spec: LayerSpec, lengths: list[int]):
    """Agents of ``lengths`` left-padded into one buffer of max(lengths) columns: the fp32 rows,
    the coded layer and the mask that hides each agent's padding."""
    width = max(lengths)
    b, kv, d = len(lengths), spec.kv_heads, spec.k_head_dim
    dense_k, dense_v = (np.zeros((b, kv, width, d), F32) for _ in range(2))
    key_codes = np.zeros((b, kv, width, d // 2), np.uint8)
    groups = width // 64 + 1
    key_scales, key_offsets = (np.zeros((b, kv, groups, d), F32) for _ in range(2))
    open_keys = np.zeros((b, kv, BLOCK_TOKENS, d), F32)
    value_codes = np.zeros((b, kv, width, d // 2), np.uint8)
    value_scales, value_offsets = (np.zeros((b, kv, width, d // 64), F32) for _ in range(2))
    shift, closed = np.zeros(b, np.int64), np.zeros(b, np.int64)
    bias = np.zeros((b, width), F32)
    for i, n in enumerate(lengths):
        k, v, (kc, ks, kz, ok, vc, vs, vz), full = _agent(spec, n, seed=i)
        pad = width - n
        dense_k[i, :, pad:], dense_v[i, :, pad:] = k[0], v[0]
        key_codes[i, :, pad : pad + full] = kc[0]
        key_scales[i, :, : full // 64], key_offsets[i, :, : full // 64] = ks[0], kz[0]
        open_keys[i, :, : n - full] = ok[0]
        value_codes[i, :, pad:], value_scales[i, :, pad:], value_offsets[i, :, pad:] = vc[0], vs[0], vz[0]
        shift[i], closed[i] = -pad, pad + full
        bias[i, :pad] = MASKED
    coded = CodedLayer(
        key_codes, key_scales, key_offsets, open_keys, value_codes, value_scales, value_offsets, shift, closed, True
    )
    return dense_k, dense_v, coded, bias


@pytest.mark.parametrize(
    "spec, heads", [(LayerSpec(None, 1, 256, 256), 4), (LayerSpec(None, 2, 64, 64), 6)], ids=["gemma3", "llama"]
)
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_coded_attention_is_attention_over_the_same_values(spec, heads, splits):
    lengths = [700, 530, 256]  # open blocks of 188, 18 and 0 keys
    dense_k, dense_v, coded, bias = _batch(spec, lengths)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((len(lengths), heads, spec.k_head_dim)).astype(F32)
    scale = spec.k_head_dim**-0.5
    want = attend(q, dense_k, dense_v, bias, scale, splits)
    got = attend_coded(q, coded, bias, scale, splits=splits)
    assert np.abs(want).max() > 0.1  # not a sum of nothing
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_window_and_a_span_hide_columns_as_they_do_for_fp32_rows():
    spec = LayerSpec(None, 1, 256, 256)
    dense_k, dense_v, coded, bias = _batch(spec, [700, 600])
    window = bias.copy()
    window[:, :300] = MASKED  # a sliding window that has left the first 300 columns
    q = np.random.default_rng(3).standard_normal((2, 4, 256)).astype(F32)
    want = attend(q, dense_k, dense_v, window[:, 100:], 1 / 16, span=(100, 700))
    got = attend_coded(q, coded, window[:, 100:], 1 / 16, span=(100, 700))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    everything = attend_coded(q, coded, bias, 1 / 16)
    assert np.abs(everything - got).max() > 1e-3  # the hidden columns counted there


def test_an_agent_that_sees_no_column_gets_zeros_and_a_bad_mask_is_refused():
    spec = LayerSpec(None, 1, 256, 256)
    _, _, coded, bias = _batch(spec, [300, 300])
    bias[1, :] = MASKED
    q = np.ones((2, 4, 256), F32)
    out = attend_coded(q, coded, bias, 1 / 16)
    assert np.all(out[1] == 0) and np.abs(out[0]).max() > 0
    with pytest.raises(ValueError, match="decode mask"):
        attend_coded(q, coded, bias[:, 1:], 1 / 16)


def test_only_long_heads_are_worth_reading_in_codes():
    assert worth_reading(256) and worth_reading(128)
    assert not worth_reading(64) and not worth_reading(96)
