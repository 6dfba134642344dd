"""The layers' batch-1 projections through sgemv (kvshelf.model.gemv): each wrapped layer
is the same function as its ``nn.Linear`` (bit-identical for several rows, within the
fp32 dot-product bound for one), the model itself is left as it was and shares its
weights with the copy, an agent restored from its record continues bit-identically to
one in RAM, and batched greedy decoding equals one-by-one decoding token for token."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.schemes import DEFAULT_SCHEME
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.head import ProjectedModel, buffer_view, dot_error_bound
from kvshelf.model.loader import load
from tests.test_decode_working_set import assert_identical, decode, prefilled, prompt

KINDS = ["llama", "gemma3_text", "deepseek_v2"]
PROMPT = [128, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load(tiny_dirs[kind], progress=False) for kind in KINDS}


def fast_of(loaded) -> ProjectedModel:
    fast = loaded.forward
    assert isinstance(fast, ProjectedModel) and fast.body is not loaded.model.model
    return fast


def wrapped(fast: ProjectedModel) -> list[GemvLinear]:
    return [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_plain_projection_is_wrapped_and_the_model_is_left_alone(kind, models):
    loaded = models[kind]
    fast = fast_of(loaded)
    layers = wrapped(fast)
    plain = [m for _, m in loaded.model.model.named_modules() if type(m) is nn.Linear and "bias" not in m]
    assert layers and len(layers) == len(plain)
    assert not any(isinstance(m, GemvLinear) for _, m in loaded.model.named_modules())
    ids = {id(m) for m in plain}
    for layer in layers:  # the model's own layers, shared: same arrays, no copy
        assert id(layer.linear) in ids


@pytest.mark.parametrize("kind", KINDS)
def test_one_row_is_within_the_bound_and_several_rows_are_bit_identical(kind, models):
    fast = fast_of(models[kind])
    rng = np.random.default_rng(1)
    for layer in wrapped(fast):
        cols = layer.linear["weight"].shape[1]
        row = mx.array(rng.standard_normal((1, 1, cols)).astype(np.float32))
        rows = mx.array(rng.standard_normal((3, 1, cols)).astype(np.float32))
        assert mx.array_equal(layer(rows), layer.linear(rows)).item()
        got, own = np.asarray(layer(row)).reshape(-1), np.asarray(layer.linear(row)).reshape(-1)
        bound = dot_error_bound(buffer_view(layer.linear["weight"]), np.asarray(row).reshape(-1))
        assert got.shape == own.shape and np.all(np.abs(got.astype(np.float64) - own) <= 2 * bound)


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_and_batches_match_the_model_bit_for_bit(kind, models):
    """Several rows never take sgemv: a prompt's positions before the last, and a batch."""
    loaded = models[kind]
    fast = fast_of(loaded)
    x = mx.array([PROMPT])
    assert mx.array_equal(fast(x)[:, :-1], loaded.model(x)[:, :-1]).item()
    batch = mx.array([[t] for t in PROMPT[:5]])
    assert mx.array_equal(fast(batch), loaded.model(batch)).item()


def test_weights_loaded_later_are_the_ones_used(tiny_dirs):
    loaded = load(tiny_dirs["llama"], progress=False)
    fast = fast_of(loaded)
    layer = wrapped(fast)[0]
    w = layer.linear["weight"]
    layer.linear.update({"weight": mx.zeros_like(w)})
    assert not mx.any(layer(mx.ones((1, 1, w.shape[1])))).item()


def test_a_quantized_model_keeps_its_own_layers(tiny_dirs):
    loaded = load(tiny_dirs["llama"], progress=False)
    nn.quantize(loaded.model, group_size=64, bits=4)
    fast = with_fast_linears(loaded.model)
    assert fast is loaded.model


def test_a_layer_with_a_bias_keeps_its_own_call():
    from kvshelf.model.gemv import gemv_body
    from kvshelf.model.head import system_sgemv

    sgemv = system_sgemv()
    assert sgemv is not None  # as every test of the fast head, this needs the system OpenBLAS
    block = nn.Sequential(nn.Linear(8, 8, bias=True), nn.Linear(8, 8, bias=False))
    mx.eval(block.parameters())
    copied = gemv_body(block, sgemv)
    assert type(copied.layers[0]) is nn.Linear and isinstance(copied.layers[1], GemvLinear)
    assert copied.layers[0] is block.layers[0]


@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_decode_equals_one_by_one_through_sgemv(models, kind):
    """One agent alone runs sgemv rows; three together run sgemm rows: same tokens."""
    loaded = models[kind]
    fast = SimpleNamespace(model=fast_of(loaded), spec=loaded.spec)
    agents, firsts = zip(*(prefilled(fast, DEFAULT_SCHEME, prompt(n, 40 + i)) for i, n in enumerate([300, 120, 60])))
    alone = [decode(fast, [a.fork()], [f], 24, WorkingSets())[0][0] for a, f in zip(agents, firsts)]
    together, _ = decode(fast, [a.fork() for a in agents], list(firsts), 24, WorkingSets())
    assert together == alone


@pytest.mark.parametrize("kind", KINDS)
def test_a_restored_agent_continues_bit_identically_through_sgemv(models, kind):
    loaded = models[kind]
    fast = SimpleNamespace(model=fast_of(loaded), spec=loaded.spec)
    ram, first = prefilled(fast, DEFAULT_SCHEME, prompt(250, 50))
    token, _ = decode(fast, [ram], [first], 3, WorkingSets())
    restored = agent_cache_from_record(loaded.spec, agent_record(ram), None)
    _, want = decode(fast, [ram], token, 12, WorkingSets())
    _, got = decode(fast, [restored], token, 12, WorkingSets())
    assert_identical(got, want)
