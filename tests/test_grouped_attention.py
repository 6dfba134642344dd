"""Decode attention with each KV head's query heads as one product
(``kvshelf.model.grouped_attention``): MLX's attention to fp32 rounding, in the engine's
default forward for decode steps only, and as exact through the decode working set as
the module's own attention was."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.grouped_attention import GroupedDecodeAttention, grouped_decode_attention
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load

KINDS = ["llama", "gemma3_text", "deepseek_v2"]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load(tiny_dirs[kind], progress=False) for kind in KINDS}


@pytest.mark.parametrize(("heads", "kv", "d"), [(4, 1, 256), (9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_grouped_attention_is_mlx_attention_to_fp32_rounding(heads, kv, d, mask_kind):
    batch, t = 3, 300
    ks = mx.random.split(mx.random.key(heads * d), 3)
    q = mx.random.normal((batch, heads, 1, d), key=ks[0])
    keys = mx.random.normal((batch, kv, t + 50, d), key=ks[1])[
        :, :, 20 : 20 + t
    ]  # a view, as the working set hands over
    values = mx.random.normal((batch, kv, t, d), key=ks[2])
    mask = None
    if mask_kind is not None:  # members of other lengths, left-padded
        seen = (mx.arange(t)[None] >= mx.array([0, 40, 177])[:, None])[:, None, None, :]
        mask = seen if mask_kind == "bool" else mx.where(seen, 0.0, -1e9)
    scale = d**-0.5
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    got = grouped_decode_attention(q, keys, values, scale, mask)
    assert got.shape == want.shape == (batch, heads, 1, d)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    # a left-padded column weighs nothing: changing what padding holds changes no bit
    if mask is not None:
        noisy = mx.where(mx.arange(t)[None, None, :, None] < 177, 1e3, values)
        assert not mx.array_equal(noisy, values).item()
        row = grouped_decode_attention(q[2:], keys[2:], noisy[2:], scale, mask[2:])
        assert mx.array_equal(row, got[2:]).item()


def test_grouped_attention_takes_only_decode_steps():
    q = mx.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="one query per member"):
        grouped_decode_attention(q, mx.zeros((1, 1, 5, 8)), mx.zeros((1, 1, 5, 8)), 1.0, None)


def prefilled(loaded, tokens: list[int]) -> tuple[AgentCache, int]:
    cache = AgentCache.empty(loaded.spec, SCHEMES[DEFAULT_SCHEME])
    logits = loaded.model(mx.array(tokens)[None], cache=cache.layers)[0, -1]
    mx.eval(logits, cache.arrays())
    return cache, int(np.array(mx.argmax(logits)))


def greedy(forward, cache: AgentCache, first: int, steps: int, working: WorkingSets | None) -> list[np.ndarray]:
    token, out = first, []
    for _ in range(steps):
        caches = working.caches([0], [cache.layers]) if working is not None else cache.layers
        logits = forward(mx.array([[token]]), cache=caches)[0, -1]
        mx.eval(logits, cache.arrays(), *([working.arrays()] if working is not None else []))
        out.append(np.array(logits))
        token = int(out[-1].argmax())
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_forward_decodes_through_grouped_attention_as_mlx_does(models, kind):
    loaded = models[kind]
    forward = loaded.forward
    assert isinstance(forward, ProjectedModel)
    attention = [m for _, m in forward.body.named_modules() if isinstance(m, GroupedDecodeAttention)]
    assert len(attention) == len(loaded.model.model.layers)
    own = with_fast_linears(loaded.model, grouped=False)
    assert not any(isinstance(m, GroupedDecodeAttention) for _, m in own.body.named_modules())
    tokens = np.random.default_rng(5).integers(0, 128, 300).tolist()
    # a prefill is the module's own attention: bit for bit
    assert mx.array_equal(forward(mx.array(tokens)[None]), own(mx.array(tokens)[None])).item()
    ref, first = prefilled(loaded, tokens)
    mine = ref.fork()
    want = greedy(own, ref, first, 12, WorkingSets())
    got = greedy(forward, mine, first, 12, WorkingSets())
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in want]
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_decode_is_bit_identical_through_the_working_set(models, kind):
    # 500 tokens and 40 steps cross a 256-token block (a KIVI key block closes) and,
    # for gemma3_text's 16-token window, move the sliding layers' start
    loaded = models[kind]
    ref, first = prefilled(loaded, np.random.default_rng(6).integers(0, 128, 500).tolist())
    mine = ref.fork()
    want = greedy(loaded.forward, ref, first, 40, None)
    got = greedy(loaded.forward, mine, first, 40, WorkingSets())
    for i, (x, y) in enumerate(zip(got, want)):
        assert np.array_equal(x, y), f"step {i}: max diff {np.abs(x - y).max()}"
