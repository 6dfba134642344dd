"""``kvshelf.kv.coded_view``: an agent's layer as coded attention reads it is what its next
token reads, taken from the blocks: attention over it equals the default kernels' attention
over the fp32 rows the next token's own fetch returns (to fp32 rounding), with an open key
block, a block the last token closed, a view that starts past the first block, and a
forked agent's shared base blocks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv.blocks import SharedLayer
from kvshelf.kv.coded_view import codable, coded_view
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.model.coded_attention import attend_coded
from kvshelf.model.native_ops import attend
from kvshelf.model.spec import LayerSpec

F32 = np.float32
SPEC = LayerSpec(None, 1, 256, 256)


def _cache(n: int, spec: LayerSpec = SPEC, scheme: str = DEFAULT_SCHEME):
    cache = SCHEMES[scheme].make(spec)
    rng = np.random.default_rng(n)
    shape = (1, spec.kv_heads, n, spec.k_head_dim)
    cache.update_and_fetch(*(mx.array(rng.standard_normal(shape).astype(F32) * 3) for _ in range(2)))
    return cache


def _next_tokens_rows(cache, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """The fp32 rows of positions lo..offset that the cache's next token reads (its own fetch)."""
    probe = cache.clone()
    spec = cache.layer
    token = mx.array(np.ones((1, spec.kv_heads, 1, spec.k_head_dim), F32))
    probe.update_and_fetch(token, token)
    k, v = (np.array(x)[..., :-1, :] for x in probe.attention_rows(lo, probe.offset, mx.float32, dense=True))
    return k, v


def _same_attention(cache, lo: int) -> None:
    """Attention over the coded view and over the next token's fp32 rows agree to fp32
    rounding (relative to the largest output; a code read wrongly is off by whole units)."""
    spec = cache.layer
    k, v = _next_tokens_rows(cache, lo)
    q = np.random.default_rng(5).standard_normal((1, 4 * spec.kv_heads, spec.k_head_dim)).astype(F32)
    scale = spec.k_head_dim**-0.5
    want = attend(q, k, v, None, scale)
    got = attend_coded(q, coded_view(cache, lo), None, scale)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("n", [300, 512, 700])
@pytest.mark.parametrize("lo", [0, 256])
def test_a_coded_view_is_what_the_next_token_reads(n, lo):
    _same_attention(_cache(n), lo)


def test_values_kept_unrotated_are_read_as_they_are():
    _same_attention(_cache(700, scheme="q4-g64-kivi"), 0)


def test_a_coded_view_reads_a_forked_agents_shared_base():
    cache = _cache(700, LayerSpec(None, 2, 128, 128))
    keys, values = cache.keys, cache.values
    assert keys is not None and values is not None
    block = lambda q: (q[0][..., :512, :], q[1][..., :512, :], q[2][..., :512, :])  # noqa: E731
    base = SharedLayer(block(keys), block(values), cache.start)
    cache.attach_base(base)
    assert cache.base is base and cache.base_rows == 512
    _same_attention(cache, 0)


def test_only_the_layouts_it_reads_are_codable():
    assert codable(_cache(10))
    assert codable(_cache(10, scheme="q4-g64-kivi"))  # values not rotated
    for other in ("q4-g64-per-token-v1", "q4-g64-kivi-rotv-sink4", "q4-g64-rot", "q4-g32-kivi-rotv"):
        assert not codable(_cache(10, scheme=other))
        with pytest.raises(ValueError, match="per-channel key blocks"):
            coded_view(_cache(10, scheme=other), 0)
    with pytest.raises(ValueError, match="starts on a key block"):
        coded_view(_cache(300), 64)
