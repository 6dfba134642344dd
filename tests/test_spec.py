"""ModelCacheSpec read from tiny random-weight models of three cache geometries."""

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from kvshelf.kv.blocks import QuantizedLayerCache
from kvshelf.model.spec import LayerSpec, ModelCacheSpec


def spec_of(path):
    model, _ = load_model(path)
    return ModelCacheSpec.from_model(model)


def test_llama_is_all_full_attention_gqa(tiny_dirs):
    spec = spec_of(tiny_dirs["llama"])
    assert spec.layers == (LayerSpec(None, 2, 64, 64),) * 2
    assert spec.sliding_layers() == []


def test_gemma3_mixes_sliding_and_global_layers(tiny_dirs):
    spec = spec_of(tiny_dirs["gemma3_text"])
    # sliding_window_pattern=2: every 2nd layer is global
    assert [layer.window for layer in spec.layers] == [16, None, 16, None]
    assert spec.sliding_layers() == [0, 2]


def test_deepseek_v2_mla_has_asymmetric_head_dims(tiny_dirs):
    spec = spec_of(tiny_dirs["deepseek_v2"])
    # mlx-lm caches MLA as per-head keys of nope+rope dims (48+16) and values of v_head_dim
    assert {(layer.kv_heads, layer.k_head_dim, layer.v_head_dim) for layer in spec.layers} == {(2, 64, 32)}


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "deepseek_v2"])
def test_bytes_per_token_matches_the_real_cache(kind, tiny_dirs):
    """The formula agrees with the bytes a QuantizedLayerCache really allocates."""
    model, _ = load_model(tiny_dirs[kind])
    spec = ModelCacheSpec.from_model(model)
    caches = [QuantizedLayerCache(layer) for layer in spec.layers]
    model(mx.array([list(range(256))]), cache=caches)  # exactly one full block
    for layer, cache in zip(spec.layers, caches):
        assert cache.nbytes == layer.bytes_per_token(4, cache.group_size) * 256
        assert layer.bytes_per_token(None) == layer.kv_heads * (layer.k_head_dim + layer.v_head_dim) * 2
    assert spec.to_json() and ModelCacheSpec.from_json(spec.to_json()) == spec
