"""Weights read at half width (``kvshelf.model.half_weights``): an fp32 weight that fp16 holds
exactly is copied as fp16 codes, the products read the codes with the fp32 weight's bits,
and the decode steps of the embedded model (whose weights are fp16 values) and of tiny
fp16-valued models read them, giving the bits the fp32 weights give, while a weight fp16
does not hold stays fp32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from numba import njit

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import SCHEMES
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model import half_floats, skinny
from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.half_weights import BRAIN_CODES, CODES, half_copy, half_of
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load
from tests.support.agents import prefilled


@njit(cache=False)
def _widened(codes: np.ndarray, out: np.ndarray) -> None:
    for i in range(codes.size):
        out[i] = half_floats.widen(codes[i])


@njit(cache=False)
def _narrowed(values: np.ndarray, out: np.ndarray) -> None:
    for i in range(values.size):
        out[i] = half_floats.narrow(values[i])


def test_widen_gives_every_finite_halfs_value_and_narrow_rounds_as_numpy():
    codes = np.arange(1 << 16, dtype=CODES)
    finite = np.isfinite(codes.view(np.float16))
    got = np.empty(codes.size, dtype=np.float32)
    _widened(codes, got)
    want = codes.view(np.float16).astype(np.float32)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # subnormals, -0.0 too
    values = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * np.float32(1e-3)
    values[:4] = [0.0, -0.0, 6e-8, -65504.0]
    narrowed = np.empty(values.size, dtype=CODES)
    _narrowed(values, narrowed)
    assert np.array_equal(narrowed, values.astype(np.float16).view(CODES))
    brains = np.arange(1 << 16, dtype=np.uint16).view(BRAIN_CODES)
    wide = (brains.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    got = np.empty(brains.size, dtype=np.float32)
    _widened(brains, got)
    finite = np.isfinite(wide)
    assert np.array_equal(got[finite].view(np.uint32), wide[finite].view(np.uint32))


def _bf16(values: np.ndarray) -> np.ndarray:
    """``values`` (fp32) with their low 16 bits cleared: bf16 values, as fp32."""
    return (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def test_a_copy_is_made_only_where_fp16_holds_every_bit():
    rng = np.random.default_rng(1)
    half = rng.standard_normal((300, 64)).astype(np.float16)
    half[7, 3], half[8, 4] = -0.0, np.float16(6e-8)  # a negative zero and a subnormal
    weight = half.astype(np.float32)
    copy = half_copy(weight)
    assert copy is not None and copy.dtype == CODES and np.array_equal(copy, half.view(CODES))
    for row in (0, 299):  # the first row (checked alone first) and a later one
        off = weight.copy()
        off[row, 5] = np.float32(1 / 3)
        assert half_copy(off) is None
    off = weight.copy()
    off[200, 0] = np.nan
    assert half_copy(off) is None
    assert half_copy(weight[:, ::2]) is None  # not C-contiguous
    assert half_copy(weight.astype(np.float64)) is None
    # bf16 values that fp16 does not hold (1e-8 is below its subnormals): bf16 codes
    brain = _bf16(rng.standard_normal((300, 64)).astype(np.float32))
    brain[5, 5], brain[250, 1] = _bf16(np.array([1e-8, -3e30], dtype=np.float32))
    copy = half_copy(brain)
    assert copy is not None and copy.dtype == BRAIN_CODES
    assert np.array_equal((copy.view(np.uint16).astype(np.uint32) << 16).view(np.float32), brain)
    brain[299, 63] = np.float32(1 / 3)
    assert half_copy(brain) is None


def test_one_copy_per_mlx_weight_while_it_lives():
    weight = mx.array(np.random.default_rng(2).standard_normal((64, 32)).astype(np.float16).astype(np.float32))
    first = half_of(weight)
    assert first is not None and half_of(weight) is first
    assert half_of(mx.random.normal((64, 32))) is None


@pytest.mark.parametrize("rows", range(1, 18))
def test_every_product_reads_codes_with_the_fp32_weights_bits(rows):
    rng = np.random.default_rng(rows)
    half = rng.standard_normal((1001, 640)).astype(np.float16)
    brain = _bf16(rng.standard_normal((1001, 640)).astype(np.float32))
    brain_codes = (brain.view(np.uint32) >> 16).astype(np.uint16).view(BRAIN_CODES)
    x = rng.standard_normal((rows, 640)).astype(np.float32)
    products = [skinny.blocked_product(), skinny.invariant_blocked_product(), skinny.skinny_product()]
    for product in products:
        assert product is not None and skinny.reads_halves(product)
        assert np.array_equal(product(x, half.view(CODES)), product(x, half.astype(np.float32)))
        assert np.array_equal(product(x, brain_codes), product(x, brain))


def _narrow_valued(loaded, codes: type):
    """``loaded``'s model with every parameter rounded to fp16 (``CODES``) or to bf16 with one
    element of each weight too small for fp16 (``BRAIN_CODES``): still fp32 arrays."""

    def rounded(p: mx.array) -> mx.array:
        if codes is CODES:
            return p.astype(mx.float16).astype(mx.float32)
        p = mx.array(_bf16(np.array(p, dtype=np.float32)))
        return p.at[(0,) * p.ndim].add(mx.array(1e-8, dtype=mx.bfloat16).astype(mx.float32) - p[(0,) * p.ndim])

    loaded.model.update(tree_map(rounded, loaded.model.parameters()))
    mx.eval(loaded.model.parameters())
    return loaded


def _steps(forward, agents: list[AgentCache], steps: int) -> list[np.ndarray]:
    """Greedy decode steps of ``agents`` together through ``forward`` over a working set."""
    working, tokens, out = WorkingSets(), [3 + i for i in range(len(agents))], []
    members = list(range(len(agents)))
    for _ in range(steps):
        caches = working.caches(members, [a.layers for a in agents])
        row = forward(mx.array([[t] for t in tokens]), cache=caches)[:, -1]
        mx.eval(row, [a for c in agents for a in c.arrays()], working.arrays())
        out.append(np.array(row))
        for a, t in zip(agents, tokens):
            a.tokens.append(t)
        tokens = [int(r.argmax()) for r in out[-1]]
    return out


def _reads_codes(forward: ProjectedModel, codes: type = CODES) -> bool:
    layers = forward.native.layers if forward.native is not None else []
    weights = [w for layer in layers for w in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)]
    return forward.rows_weight().dtype == codes and bool(weights) and all(w.dtype == codes for w in weights)


def _same_steps_both_ways(
    loaded, monkeypatch, all_rows: bool, lengths: list[int], steps: int, codes: type = CODES
) -> None:
    """The forward reading fp16 codes and one built with ``KVSHELF_NO_HALF_WEIGHTS`` (fp32) give
    every decode step the same bits, for a batch of agents and for one alone."""
    invariant = True if all_rows else None  # temperature 0's kernels, else the default ones
    halves = with_fast_linears(loaded.model, all_rows=invariant, attention=invariant)
    monkeypatch.setenv("KVSHELF_NO_HALF_WEIGHTS", "1")
    fp32 = with_fast_linears(loaded.model, all_rows=invariant, attention=invariant)
    monkeypatch.delenv("KVSHELF_NO_HALF_WEIGHTS")
    assert isinstance(halves, ProjectedModel) and isinstance(fp32, ProjectedModel)
    assert _reads_codes(halves, codes) and not _reads_codes(fp32, codes)
    assert fp32.rows_weight().dtype == np.float32
    for group in ([0, 1], [1]):
        agents = [prefilled(loaded.model, loaded.spec, lengths[i], 40 + i) for i in group]
        forks = [a.fork() for a in agents]
        for i, (got, want) in enumerate(zip(_steps(halves, forks, steps), _steps(fp32, agents, steps))):
            assert np.array_equal(got, want), f"agents {group}, step {i}"


@pytest.mark.parametrize("codes", [CODES, BRAIN_CODES], ids=["fp16", "bf16"])
@pytest.mark.parametrize("all_rows", [False, True], ids=["default", "temperature 0"])
@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_half_valued_tiny_models_read_codes_with_the_same_bits(tiny_dirs, monkeypatch, kind, all_rows, codes):
    loaded = _narrow_valued(load(tiny_dirs[kind], progress=False), codes)
    _same_steps_both_ways(loaded, monkeypatch, all_rows, [70, 25], steps=6, codes=codes)


def test_weights_fp16_does_not_hold_are_read_as_fp32(tiny_dirs):
    loaded = load(tiny_dirs["llama"], progress=False)  # random fp32 weights
    forward = with_fast_linears(loaded.model)
    assert isinstance(forward, ProjectedModel) and forward.native is not None
    assert forward.rows_weight().dtype == np.float32
    assert all(layer.q.dtype == np.float32 and layer.down.dtype == np.float32 for layer in forward.native.layers)


def test_the_embedded_model_reads_its_weights_at_half_width(embedded_loaded, monkeypatch):
    """Its converter stores fp16 values, so every layer and the head are read as codes; its
    default and temperature-0 steps keep the fp32 weights' bits."""
    assert isinstance(embedded_loaded.forward, ProjectedModel) and _reads_codes(embedded_loaded.forward)
    _same_steps_both_ways(embedded_loaded, monkeypatch, False, [530, 40], steps=3)
    _same_steps_both_ways(embedded_loaded, monkeypatch, True, [530, 40], steps=2)


def test_the_module_paths_decode_rows_read_codes_with_the_same_bits(embedded_loaded, monkeypatch):
    """Plain Q4's packed rows go through the module path, whose layer projections
    (``GemvLinear``; the tiny models' are below its size floor) read the codes for a decode
    step's rows, fp32 for a prefill's."""
    loaded = embedded_loaded
    halves = with_fast_linears(loaded.model)
    monkeypatch.setenv("KVSHELF_NO_HALF_WEIGHTS", "1")
    fp32 = with_fast_linears(loaded.model)
    monkeypatch.delenv("KVSHELF_NO_HALF_WEIGHTS")
    assert isinstance(halves, ProjectedModel) and isinstance(fp32, ProjectedModel)
    assert any(m._halves for m in halves.body.modules() if isinstance(m, GemvLinear))
    assert not any(m._halves for m in fp32.body.modules() if isinstance(m, GemvLinear))
    plain = SCHEMES["q4-g64-per-token-v1"]
    mine, theirs = (AgentCache.empty(loaded.spec, plain) for _ in range(2))
    prompt = mx.array(np.random.default_rng(9).integers(0, 128, 60).tolist())[None]
    for forward, cache in ((halves, mine), (fp32, theirs)):
        mx.eval(forward(prompt, cache=cache.layers), cache.arrays())
    token = mx.array([[5]])
    for i in range(3):
        got, want = halves(token, cache=mine.layers)[:, -1], fp32(token, cache=theirs.layers)[:, -1]
        mx.eval(got, want, mine.arrays(), theirs.arrays())
        assert np.array_equal(np.array(got), np.array(want)), f"step {i}"
        token = mx.array([[int(np.array(want)[0].argmax())]])
