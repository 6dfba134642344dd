"""Temperature 0's native decode step (``kvshelf.model.native_decode`` with
``kvshelf.model.exact_ops``) has the bits of the module path it replaces: every numpy
operation has MLX's own bits, every step over a decode working set gives the logits the
module path gives from the same state (a batch whose members join and leave, through a key
block's closing and a sliding window's move), a restored agent continues bit-identically,
and it steps aside for the caches it does not run. The phases and invariance suites then
hold through it: a decoded token's bits are a prefill's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.schemes import DEFAULT_SCHEME
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model import exact_ops
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load
from kvshelf.model.native_decode import FAST, NativeDecoder, probe_gap
from kvshelf.model.native_ops import Rope
from tests.support.agents import prefilled

KINDS = ["llama", "gemma3_text", "deepseek_v2"]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load(tiny_dirs[kind], progress=False) for kind in KINDS}


def logits(forward, agents: list[AgentCache], tokens: list[int], keys: list, working: WorkingSets) -> np.ndarray:
    caches = working.caches(keys, [a.layers for a in agents])
    out = forward(mx.array([[t] for t in tokens]), cache=caches)[:, -1]
    mx.eval(out, [a for c in agents for a in c.arrays()], working.arrays())
    return np.array(out)


def test_every_operation_has_mlx_bits():
    rng = np.random.default_rng(3)
    assert exact_ops.agree()
    for width, eps in ((640, 1e-6), (256, 1e-5), (64, 1e-6), (2048, 1e-5)):
        x = (rng.standard_normal((6, 3, width)) * rng.choice([1e-3, 1.0, 50.0], (6, 1, 1))).astype(np.float32)
        w = rng.standard_normal(width).astype(np.float32)
        want = np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), eps))
        assert np.array_equal(exact_ops.rms_norm(x, w, eps), want), width
    a = (rng.standard_normal((5, 1, 777)) * 6).astype(np.float32)
    assert np.array_equal(exact_ops.gelu_approx(a), np.array(nn.gelu_approx(mx.array(a))))
    assert np.array_equal(exact_ops.silu(a), np.array(nn.silu(mx.array(a))))
    # the fast operations differ from MLX's bits somewhere on the same inputs: the probe can tell
    up = rng.standard_normal(a.shape).astype(np.float32)
    assert np.array_equal(exact_ops.gelu_gate(a, up), np.array(nn.gelu_approx(mx.array(a)) * mx.array(up)))
    assert np.array_equal(exact_ops.silu_gate(a, up), np.array(nn.silu(mx.array(a)) * mx.array(up)))
    assert not np.array_equal(FAST.gelu_gate(a, up), exact_ops.gelu_gate(a, up)) or not np.array_equal(
        FAST.silu_gate(a, up), exact_ops.silu_gate(a, up)
    )
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    positions = np.array([0, 4099, 31000])
    ropes = [
        nn.RoPE(64, traditional=False, base=10000.0),
        nn.RoPE(64, traditional=True, base=500.0, scale=0.25),
        nn.RoPE(32, traditional=False, base=1e6),
        Llama3RoPE(64, max_position_embeddings=8192, base=500000.0, scaling_config={"factor": 8.0}),
    ]
    for module in ropes:
        rope = Rope.of(module)
        assert rope is not None
        got = rope(q, *exact_ops.tables(rope, positions))
        for b, p in enumerate(positions):
            want = np.array(module(mx.array(q[b : b + 1, :, None, :]), offset=int(p)))[0, :, 0]
            assert np.array_equal(got[b], want), (type(module).__name__, p)


@pytest.mark.parametrize("kind", KINDS)
def test_the_exact_step_is_built_and_its_probe_finds_any_difference(models, kind):
    loaded = models[kind]
    greedy = loaded.greedy_forward
    assert isinstance(greedy, ProjectedModel) and isinstance(greedy.native, NativeDecoder)
    assert greedy.native.exact and greedy.native.kind == kind
    assert probe_gap(loaded.model, greedy.native, greedy.body) == 0.0
    wrong = with_fast_linears(loaded.model, all_rows=True, attention=True).native
    assert wrong is not None and wrong is not greedy.native
    wrong._ops = FAST  # fp32-exact operations, not MLX's bits
    assert probe_gap(loaded.model, wrong, greedy.body) > 0.0
    assert with_fast_linears(loaded.model, all_rows=True, attention=True, native=False).native is None


@pytest.mark.parametrize("scheme", [DEFAULT_SCHEME, "q4-g64-per-token-v1"])  # plain Q4: dense rows on the CPU
@pytest.mark.parametrize("kind", KINDS)
def test_every_step_has_the_module_paths_bits(models, kind, scheme):
    """Three agents, one joining late and one leaving (prompts end just before a 256-token
    key block fills; gemma's 16-token window moves): every step twice from the same state,
    the exact step on one working set and the module path on another."""
    loaded = models[kind]
    module = with_fast_linears(loaded.model, all_rows=True, attention=True, native=False)
    agents = [prefilled(loaded.greedy_forward, loaded.spec, n, 10 + i, scheme) for i, n in enumerate([250, 230, 40])]
    forks = [a.fork() for a in agents]
    mine, theirs = WorkingSets(), WorkingSets()
    tokens = [1, 2, 3]
    for i in range(24):
        members = [0, 1] if i < 4 else [0, 1, 2] if i < 16 else [0, 2]
        step = [tokens[b] for b in members]
        caches = mine.caches(members, [forks[b].layers for b in members])
        assert loaded.greedy_forward.native.takes(mx.array([[t] for t in step]), caches)
        got = logits(loaded.greedy_forward, [forks[b] for b in members], step, members, mine)
        want = logits(module, [agents[b] for b in members], step, members, theirs)
        assert np.array_equal(got, want), f"step {i}: {np.abs(got - want).max()}"
        for b, row in zip(members, want):
            agents[b].tokens.append(tokens[b])
            forks[b].tokens.append(tokens[b])
            tokens[b] = int(row.argmax())


@pytest.mark.parametrize("kind", KINDS)
def test_a_restored_agent_continues_bit_identically(models, kind):
    loaded = models[kind]
    kept = prefilled(loaded.greedy_forward, loaded.spec, 250, 30)
    working = WorkingSets()
    token = 7
    for _ in range(8):  # across the 256-token block's closing
        token = int(logits(loaded.greedy_forward, [kept], [token], ["kept"], working)[0].argmax())
        kept.tokens.append(token)
    working.clear()
    restored = agent_cache_from_record(loaded.spec, agent_record(kept), None)
    a, b = WorkingSets(), WorkingSets()
    ta = tb = token
    for _ in range(6):
        ra = logits(loaded.greedy_forward, [kept], [ta], ["kept"], a)[0]
        rb = logits(loaded.greedy_forward, [restored], [tb], ["restored"], b)[0]
        assert np.array_equal(ra, rb)
        ta, tb = int(ra.argmax()), int(rb.argmax())


def test_it_steps_aside_for_caches_it_does_not_run(models):
    loaded = models["llama"]
    native = loaded.greedy_forward.native
    dense = prefilled(loaded.greedy_forward, loaded.spec, 20, 40)
    one = mx.array([[1]])
    assert native.takes(one, WorkingSets().caches(["d"], [dense.layers]))
    assert not native.takes(one, dense.layers)  # per-step caches: the module path
    assert not native.takes(mx.array([[1, 2]]), WorkingSets().caches(["d"], [dense.layers]))  # a prefill
