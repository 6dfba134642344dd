"""The layers' projections through sgemv at batch 1 and BLIS for a decode batch
(kvshelf.model.gemv, kvshelf.model.few_rows): each wrapped layer is the same function as
its ``nn.Linear`` (within the fp32 dot-product bound for up to MAX_FEW_ROWS rows,
bit-identical beyond), the model itself is left as it was and shares its weights with
the copy, an agent restored from its record continues bit-identically to one in RAM,
and batched greedy decoding equals one-by-one decoding token for token."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.schemes import DEFAULT_SCHEME
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model import few_rows
from kvshelf.model.dot_bound import dot_error_bound
from kvshelf.model.few_rows import MAX_FEW_ROWS, system_gemm
from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.head import ProjectedModel, buffer_view
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


def within_bound(got: np.ndarray, own: np.ndarray, weight: np.ndarray, rows: np.ndarray) -> bool:
    """Every row of ``got`` lies within both fp32 evaluations' error bound of ``own``'s."""
    got, own, rows = got.reshape(len(rows), -1), own.reshape(len(rows), -1), rows.reshape(len(rows), -1)
    return all(
        bool(np.all(np.abs(g.astype(np.float64) - o) <= 2 * dot_error_bound(weight, r)))
        for g, o, r in zip(got, own, rows)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_few_rows_are_within_the_bound_and_more_are_bit_identical(kind, models):
    fast = with_fast_linears(models[kind].model, one_row=True, batches=True)  # both off by default
    assert isinstance(fast, ProjectedModel)
    rng = np.random.default_rng(1)
    for layer in wrapped(fast):
        weight = buffer_view(layer.linear["weight"])
        for n in (1, 3, MAX_FEW_ROWS):
            rows = mx.array(rng.standard_normal((n, 1, weight.shape[1])).astype(np.float32))
            got, own = np.asarray(layer(rows)), np.asarray(layer.linear(rows))
            assert got.shape == own.shape and within_bound(got, own, weight, np.asarray(rows))
        many = mx.array(rng.standard_normal((1, MAX_FEW_ROWS + 1, weight.shape[1])).astype(np.float32))
        assert mx.array_equal(layer(many), layer.linear(many)).item()


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_agents_gets_the_logits_each_would_get_alone(kind, models):
    """A decode step's head rows read the head once for the batch: an agent's logits in a batch
    of 14 lie within the fp32 bound of MLX's own product and of its batch-1 logits (the
    default kernels' blocks round by the batch), and the temperature-0 forward's are its
    batch-1 logits bit for bit."""
    loaded = models[kind]
    fast = fast_of(loaded)
    hidden = loaded.model.model(mx.array([PROMPT]))[0][:, None]  # 14 positions as 14 agents
    assert hidden.shape[0] <= MAX_FEW_ROWS
    got, own = np.asarray(fast.project(hidden)), np.asarray(fast._project(hidden))
    rows = np.asarray(hidden)
    assert got.shape == own.shape and within_bound(got, own, fast.weight_view(), rows)
    greedy = loaded.greedy_forward
    assert isinstance(greedy, ProjectedModel)
    invariant = np.asarray(greedy.project(hidden))
    for b in (0, 5, 13):
        alone = np.asarray(fast.project(hidden[b : b + 1]))
        assert within_bound(got[b : b + 1], alone, fast.weight_view(), rows[b : b + 1]), b
        assert np.array_equal(np.asarray(greedy.project(hidden[b : b + 1])), invariant[b : b + 1]), b


@pytest.mark.parametrize("kind", KINDS)
def test_long_prompts_match_the_model_bit_for_bit(kind, models):
    """More rows than MAX_FEW_ROWS never leave MLX: a long prompt's hidden rows are the
    model's own, bit for bit (gemma3_text's 16-token window included)."""
    loaded = models[kind]
    fast = fast_of(loaded)
    x = mx.array([PROMPT * 2])
    assert mx.array_equal(fast.body(x), loaded.model.model(x)).item()


def test_blis_multiplies_by_the_transposed_weight_without_a_copy():
    gemm = system_gemm()
    assert gemm is not None
    rng = np.random.default_rng(2)
    weight, x = rng.standard_normal((300, 70)).astype(np.float32), rng.standard_normal((5, 70)).astype(np.float32)
    assert within_bound(gemm(x, weight), x @ weight.T, weight, x)
    with pytest.raises(ValueError):
        gemm(x, weight.T.copy())


@pytest.mark.parametrize(("n", "k"), [(1024, 640), (640, 2048), (262144 // 64, 640)])
def test_a_row_through_blis_has_the_same_bits_alone_and_among_hundreds(n, k):
    """What the shape-invariant kernels stand on, on weights larger than BLIS's size
    thresholds: a 600-row product (a prefill chunk, cut into ``slice_rows()`` slices) gives
    each row the bits of that row alone (a decode step) and of a few rows (a decode batch).
    On a CPU where BLIS takes its packed kernels above 200 rows, 256-row slices broke this."""
    gemm = system_gemm()
    assert gemm is not None and few_rows.slice_rows() > 0
    rng = np.random.default_rng(n + k)
    weight, x = rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((600, k)).astype(np.float32)
    full = gemm(x, weight)
    for i in (0, 1, 199, 200, 201, 255, 256, 257, 599):
        assert np.array_equal(gemm(x[i : i + 1], weight)[0], full[i]), i
    for m in (3, 16, 201, 256, 300):
        assert np.array_equal(gemm(x[:m], weight), full[:m]), m


def test_blis_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KVSHELF_NO_BLIS", "1")
    assert few_rows._library() is None
    monkeypatch.delenv("KVSHELF_NO_BLIS")
    monkeypatch.setenv("KVSHELF_BLIS", "/nonexistent/libblis.so.4")
    assert few_rows._library() is None


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
    from kvshelf.model.sgemv import system_sgemv

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
