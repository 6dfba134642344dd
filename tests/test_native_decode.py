"""The native decode step (``kvshelf.model.native_decode``) computes the model's own decode
step: its numpy operations match MLX's, a step from any cache state matches the module
path's to fp32 rounding (a batch of agents at other positions, through a key block's
closing and a window's move), the decode working set and the per-step caches give it the
same bits, a restored agent continues bit-identically, and it steps aside for calls it does
not run (plain Q4's packed rows, prefill, architectures it does not know)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from kvshelf.kv import blocks
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.batch import batch_views
from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.schemes import DEFAULT_SCHEME
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.blas import usable_cpus
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load
from kvshelf.model.native_decode import PROBE_TOLERANCE, LatentLayer, NativeDecoder, probe_gap
from kvshelf.model.native_ops import (
    SPLIT_COLUMNS,
    Rope,
    _attention_kernel,
    attend,
    column_splits,
    gelu_gate,
    mask_bias,
    rms_norm,
    silu_gate,
)
from kvshelf.model.skinny import MAX_LAYER_ROWS
from tests.support.agents import prefilled
from tests.support.tiny import VOCAB, make_tiny_model_dir

KINDS = ["llama", "gemma3_text", "deepseek_v2"]
# A dense scheme with rotated keys and fp16 sinks beside the default (KIVI keys, rotated values).
# plain Q4 among them: on the CPU it decodes on dense rows too (``blocks.packed_decode``)
DENSE_SCHEMES = [DEFAULT_SCHEME, "q4-g64-rot-sink4", "q4-g64-per-token-v1"]
STEPS = 30
# One step from the same state, native against the module path: fp32 rounding only.
STEP_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load(tiny_dirs[kind], progress=False) for kind in KINDS}


def close(got: np.ndarray, want: np.ndarray, tolerance: float) -> bool:
    return float(np.max(np.abs(got - want))) <= tolerance * float(np.max(np.abs(want)))


def per_step(agents: list[AgentCache]):
    return agents[0].layers if len(agents) == 1 else batch_views([a.layers for a in agents])


def logits(forward, agents: list[AgentCache], tokens: list[int], caches, working: WorkingSets | None = None):
    out = forward(mx.array([[t] for t in tokens]), cache=caches)[:, -1]
    mx.eval(out, [a for c in agents for a in c.arrays()], working.arrays() if working is not None else [])
    return np.array(out)


# -- the operations ---------------------------------------------------------------------------


def test_the_operations_match_mlx():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    assert close(rms_norm(x, w, 1e-6), np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-6)), 1e-6)
    up = rng.standard_normal((3, 4, 64)).astype(np.float32)
    ends = np.broadcast_to(np.array([-1e4, -200.0, -90.0, 0.0, 90.0, 200.0, 1e4], np.float32), (3, 4, 7))
    wide = np.concatenate([x * 30.0, ends], axis=-1)
    ups = np.concatenate([up, np.ones((3, 4, 7), np.float32)], axis=-1)
    for gate, u in ((x, up), (wide, ups)):  # and far out, where the sigmoid is 0 or 1
        theirs = nn.gelu_approx(mx.array(gate)) * mx.array(u)
        assert close(gelu_gate(gate, u), np.array(theirs), 1e-6)
        assert close(silu_gate(gate, u), np.array(nn.silu(mx.array(gate)) * mx.array(u)), 1e-6)
    positions = np.array([0, 7, 3000])
    ropes = [
        nn.RoPE(64, traditional=False, base=10000.0),
        nn.RoPE(64, traditional=True, base=500.0, scale=0.25),
        nn.RoPE(32, traditional=False, base=1e6),  # partial rotary: the rest passes through
        Llama3RoPE(64, max_position_embeddings=8192, base=500000.0, scaling_config={"factor": 8.0}),
    ]
    for module in ropes:
        rope = Rope.of(module)
        assert rope is not None
        got = rope(x, *rope.tables(positions))
        for b, p in enumerate(positions):
            want = np.array(module(mx.array(x[b : b + 1, :, None, :]), offset=int(p)))[0, :, 0]
            assert close(got[b], want, 1e-5), type(module).__name__
        # the compiled rotation rounds as numpy's products and sums of the same pairs do
        cos, sin = (t[:, None, :] for t in rope.tables(positions))
        d, plain = rope.dims, x.copy()
        first, second = (slice(0, d, 2), slice(1, d, 2)) if rope.traditional else (slice(0, d // 2), slice(d // 2, d))
        a, b_ = x[..., first], x[..., second]
        plain[..., first], plain[..., second] = a * cos - b_ * sin, a * sin + b_ * cos
        assert np.array_equal(got, plain), type(module).__name__
    assert Rope.of(nn.Linear(2, 2)) is None


@pytest.mark.parametrize("layout", ["working set", "contiguous", "transposed"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("shape", [(3, 8, 2, 37, 64), (1, 4, 1, 1100, 256)])
def test_attention_matches_mlx_with_grouped_heads_and_masks(mask_kind, layout, shape):
    """Several agents and KV heads; and one agent's one KV head on a long context, its
    columns cut into ranges for the cores (merged by their maxima), in 1, 2 or 3 ranges."""
    rng = np.random.default_rng(1)
    b, heads, kv, width, d = shape
    q = rng.standard_normal((b, heads, d)).astype(np.float32)
    buffers = [rng.standard_normal((b, kv, width + 9, d)).astype(np.float32) for _ in range(2)]
    if layout == "working set":  # the last columns of a larger buffer, read in place
        keys, values = (x[:, :, 9:] for x in buffers)
    elif layout == "contiguous":
        keys, values = (np.ascontiguousarray(x[:, :, 9:]) for x in buffers)
    else:  # heads outermost: laid out otherwise, so copied
        keys, values = (np.ascontiguousarray(x[:, :, 9:].transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3) for x in buffers)
    mask: np.ndarray | None = None
    if mask_kind == "bool":  # each agent sees its own last columns
        mask = np.arange(width)[None, None, None, :] >= np.array([0, 10, 30])[:b, None, None, None]
    elif mask_kind == "additive":
        mask = np.where(np.arange(width) % 3 == 0, -np.inf, 0.0).astype(np.float32)[None, None, None, :]
    given = None if mask is None else mx.array(mask)
    want = mx.fast.scaled_dot_product_attention(
        mx.array(q[:, :, None, :]), mx.array(keys), mx.array(values), scale=0.125, mask=given
    )
    for splits in (None, 1, 2, 3):
        got = attend(q, keys, values, mask_bias(mask), 0.125, splits)
        assert close(got, np.array(want).reshape(b, heads * d), 1e-5), splits
        if layout == "working set":  # the whole buffers and the columns read: the same bits
            whole = attend(q, buffers[0], buffers[1], mask_bias(mask), 0.125, splits, span=(9, width + 9))
            assert np.array_equal(whole, got), splits
    if width >= 2 * SPLIT_COLUMNS:
        assert column_splits(b * kv, width) == min(2, usable_cpus())
    for pairs in (1, 2, 3, 4, 9):  # every core gets as many jobs as the others on a long context
        assert pairs * column_splits(pairs, 1 << 14) % usable_cpus() == 0
    with pytest.raises(ValueError, match="decode mask"):
        attend(q, keys, values, np.zeros((b, width + 1), dtype=np.float32), 0.125)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_columns_the_mask_hides_are_never_read(splits):
    """A sliding window's rows kept back to a block boundary and a batch's left padding:
    their keys and values are not read (NaN there changes nothing), and the result has the
    bits of the same call over finite rows there. An odd prefix puts a hidden column and a
    visible one in one of the pairs the kernel reads at once."""
    rng = np.random.default_rng(5)
    b, heads, kv, width, d = 2, 4, 1, 700, 64
    q = rng.standard_normal((b, heads, d)).astype(np.float32)
    keys, values = (rng.standard_normal((b, kv, width, d)).astype(np.float32) for _ in range(2))
    hidden = np.arange(width)[None, :] < np.array([255, 300])[:, None]  # each agent's own hidden prefix
    bias = mask_bias(mx.array(~hidden[:, None, None, :]))
    assert bias is not None
    clean = attend(q, keys, values, bias, 0.125, splits)
    poisoned_keys, poisoned_values = keys.copy(), values.copy()
    for x in (poisoned_keys, poisoned_values):
        x[np.broadcast_to(hidden[:, None, :], x.shape[:3])] = np.nan
    got = attend(q, poisoned_keys, poisoned_values, bias, 0.125, splits)
    assert np.all(np.isfinite(got)) and np.array_equal(got, clean)
    visible = [
        attend(q[i : i + 1], keys[i : i + 1, :, n:], values[i : i + 1, :, n:], None, 0.125, 1)
        for i, n in enumerate((255, 300))
    ]
    assert close(clean, np.concatenate(visible), 1e-6)


def test_a_whole_buffer_and_its_rows_read_in_place_run_one_compiled_loop():
    """A working set's buffer read whole (writable) and its last columns read in place
    (read-only views) give the attention loop the same argument types: one compiled
    variant, so both ways round alike wherever the loop was compiled or loaded from
    (``kvshelf.model.jit``: a variant compiled in the process and another loaded from
    numba's cache once gave the two ways other bits)."""
    rng = np.random.default_rng(11)
    b, heads, kv, capacity, d = 2, 4, 2, 300, 64
    q = rng.standard_normal((b, heads, d)).astype(np.float32)
    keys, values = (rng.standard_normal((b, kv, capacity, d)).astype(np.float32) for _ in range(2))
    lo, end = 40, 260
    whole = attend(q, keys, values, None, 0.125, 1, span=(lo, end))
    in_place = attend(q, keys[:, :, lo:end], values[:, :, lo:end], None, 0.125, 1)
    assert np.array_equal(whole, in_place)
    assert len(_attention_kernel().signatures) == 1


@pytest.mark.parametrize("spread", [1.0, 40.0, 400.0])
def test_attention_weights_match_mlx_where_most_underflow(spread):
    """The kernel's own exp (a polynomial, 0 below exp(-87)): scores spread from a few units
    to hundreds apart, so that most weights lie far under the largest or underflow."""
    rng = np.random.default_rng(7)
    b, heads, kv, width, d = 2, 6, 2, 700, 64
    q = (rng.standard_normal((b, heads, d)) * spread / 8).astype(np.float32)
    keys = rng.standard_normal((b, kv, width, d)).astype(np.float32)
    values = rng.standard_normal((b, kv, width, d)).astype(np.float32)
    want = mx.fast.scaled_dot_product_attention(
        mx.array(q[:, :, None, :]), mx.array(keys), mx.array(values), scale=0.125
    )
    for splits in (1, 2):
        got = attend(q, keys, values, None, 0.125, splits)
        assert close(got, np.array(want).reshape(b, heads * d), 1e-5), (spread, splits)


# -- whole steps --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_native_step_is_built_and_its_probe_rejects_a_wrong_step(models, kind):
    loaded = models[kind]
    forward = loaded.forward
    assert isinstance(forward, ProjectedModel) and isinstance(forward.native, NativeDecoder)
    assert forward.native.kind == kind
    assert probe_gap(loaded.model, forward.native, loaded.model.model) <= PROBE_TOLERANCE
    wrong = with_fast_linears(loaded.model).native  # another decoder over the same weights
    assert wrong is not None and wrong is not forward.native
    wrong.layers[0].rope.scale *= 1.5  # a RoPE that rotates by the wrong angles
    assert probe_gap(loaded.model, wrong, loaded.model.model) > 100 * PROBE_TOLERANCE
    # the shape-invariant kernels (temperature 0) get their own, exact one; an opt-out keeps the module path
    assert not forward.native.exact and loaded.greedy_forward.native.exact
    assert with_fast_linears(loaded.model, native=False).native is None


def test_a_deepseek_v2_with_a_query_latent_gets_the_native_step(tmp_path):
    """DeepSeek-V2 proper (not -Lite) projects its queries through a latent and its norm first."""
    loaded = load(make_tiny_model_dir(tmp_path / "q-latent", "deepseek_v2", q_lora_rank=24), progress=False)
    native = loaded.forward.native
    assert native is not None and native.kind == "deepseek_v2"
    layer = native.layers[0]
    assert isinstance(layer, LatentLayer) and layer.q_a is not None and layer.q_a.shape == (24, 64)
    assert probe_gap(loaded.model, native, loaded.model.model) <= PROBE_TOLERANCE
    agent = prefilled(loaded.model, loaded.spec, 300, 90, DEFAULT_SCHEME)
    fork = agent.fork()
    got = logits(loaded.forward, [fork], [5], fork.layers)
    want = logits(loaded.model, [agent], [5], agent.layers)
    assert close(got, want, STEP_TOLERANCE), np.abs(got - want).max()


@pytest.mark.parametrize("scheme", DENSE_SCHEMES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_step_matches_the_module_path_through_a_block_and_a_window_move(models, kind, scheme):
    """Along a run of three agents (one joins late and leaves early; prompts end just before
    a 256-token block fills, and gemma's 16-token window moves), each step is taken twice
    from the same state: through the native step, on forks, and through the model's own call."""
    loaded = models[kind]
    agents = [prefilled(loaded.model, loaded.spec, n, 10 + i, scheme) for i, n in enumerate([500, 230, 40])]
    tokens = [1, 2, 3]
    assert loaded.forward.native is not None
    for i in range(STEPS):
        members = [0, 1] if i < 5 else [0, 1, 2] if i < 20 else [0, 2]
        group = [agents[b] for b in members]
        forks = [a.fork() for a in group]
        step = [tokens[b] for b in members]
        assert loaded.forward.native.takes(mx.array([[t] for t in step]), per_step(forks))
        got = logits(loaded.forward, forks, step, per_step(forks))
        want = logits(loaded.model, group, step, per_step(group))
        assert close(got, want, STEP_TOLERANCE), f"step {i}: {np.abs(got - want).max()}"
        for b, row in zip(members, want):
            agents[b].tokens.append(tokens[b])
            tokens[b] = int(row.argmax())


@pytest.mark.parametrize("kind", KINDS)
def test_the_working_set_and_per_step_caches_give_the_native_step_the_same_bits(models, kind):
    loaded = models[kind]
    agents = [prefilled(loaded.model, loaded.spec, n, 20 + i, DEFAULT_SCHEME) for i, n in enumerate([500, 230, 40])]
    forks = [a.fork() for a in agents]
    working = WorkingSets()
    tokens = [4, 5, 6]
    for i in range(STEPS):
        members = [0, 1, 2] if i < 12 else [0, 2]
        step = [tokens[b] for b in members]
        mine, ref = [forks[b] for b in members], [agents[b] for b in members]
        got = logits(loaded.forward, mine, step, working.caches(members, [a.layers for a in mine]), working)
        want = logits(loaded.forward, ref, step, per_step(ref))
        assert np.array_equal(got, want), f"step {i}"
        for b, row in zip(members, want):
            agents[b].tokens.append(tokens[b])
            forks[b].tokens.append(tokens[b])
            tokens[b] = int(row.argmax())
    assert working.nbytes > 0


@pytest.mark.parametrize("scheme", [DEFAULT_SCHEME, "q4-g64-per-token-v1"])
@pytest.mark.parametrize("kind", KINDS)
def test_deferring_the_working_set_update_changes_no_bit(models, kind, scheme):
    """The working set updated once after the last layer (attention reading the step's own
    rows from numpy) against inside each layer, through a key block's closing."""
    loaded = models[kind]
    native = loaded.forward.native
    agents = [prefilled(loaded.model, loaded.spec, n, 70 + i, scheme) for i, n in enumerate([250, 40])]
    forks = [a.fork() for a in agents]
    later, now = WorkingSets(), WorkingSets()
    tokens = [3, 4]
    try:
        for i in range(10):  # the first agent's block closes at its 6th step
            native.defer_updates = True
            caches = later.caches([0, 1], [a.layers for a in forks])
            got = logits(loaded.forward, forks, tokens, caches, later)
            native.defer_updates = False
            want = logits(loaded.forward, agents, tokens, now.caches([0, 1], [a.layers for a in agents]), now)
            assert np.array_equal(got, want), f"step {i}"
            for a, f, t in zip(agents, forks, tokens):
                a.tokens.append(t)
                f.tokens.append(t)
            tokens = [int(row.argmax()) for row in want]
    finally:
        del native.defer_updates  # back to the class's setting
    kv, d = loaded.spec.layers[0].kv_heads, loaded.spec.layers[0].k_head_dim
    row = np.zeros((2, kv, d), dtype=np.float32)
    assert caches[0].read_back(row, row) is not None  # the deferred path was the one taken


@pytest.mark.parametrize("kind", KINDS)
def test_a_restored_agent_continues_bit_identically(models, kind):
    loaded = models[kind]
    kept = prefilled(loaded.model, loaded.spec, 250, 30, DEFAULT_SCHEME)
    token = 7
    for _ in range(4):  # decode across the 256-token block's closing before the restore
        token = int(logits(loaded.forward, [kept], [token], kept.layers)[0].argmax())
        kept.tokens.append(token)
    restored = agent_cache_from_record(loaded.spec, agent_record(kept), None)
    a, b = WorkingSets(), WorkingSets()
    ta = tb = token
    for _ in range(10):
        ra = logits(loaded.forward, [kept], [ta], a.caches(["kept"], [kept.layers]), a)[0]
        rb = logits(loaded.forward, [restored], [tb], b.caches(["restored"], [restored.layers]), b)[0]
        assert np.array_equal(ra, rb)
        ta, tb = int(ra.argmax()), int(rb.argmax())


def test_it_steps_aside_for_calls_it_does_not_run(models, tmp_path, monkeypatch):
    loaded = models["llama"]
    native = loaded.forward.native
    assert native is not None
    dense = prefilled(loaded.model, loaded.spec, 20, 40, DEFAULT_SCHEME)
    packed = prefilled(loaded.model, loaded.spec, 20, 41, "q4-g64-per-token-v1")
    one = mx.array([[1]])
    assert native.takes(one, dense.layers)
    assert native.takes(one, packed.layers)  # plain Q4 on the CPU: dense rows too
    # where quantized_matmul pays (a GPU), plain Q4 hands it packed rows instead
    monkeypatch.setattr(blocks, "PACKED_DECODE", True)
    assert not native.takes(one, packed.layers)
    assert not native.takes(one, WorkingSets().caches(["p"], [packed.layers]))
    assert not native.takes(mx.array([[1, 2]]), dense.layers)  # a prefill call
    many = [prefilled(loaded.model, loaded.spec, 5, 50 + i, DEFAULT_SCHEME) for i in range(MAX_LAYER_ROWS + 1)]
    assert not native.takes(mx.array([[1]] * len(many)), batch_views([a.layers for a in many]))
    # the forward still runs them, through the module path
    got = logits(loaded.forward, [packed], [1], packed.layers)
    assert got.shape == (1, loaded.model.model.embed_tokens.weight.shape[0])
    # a layer it does not mirror: DeepSeek-V2 with routed experts keeps the module path
    experts = make_tiny_model_dir(tmp_path / "moe", "deepseek_v2", n_routed_experts=4, num_experts_per_tok=2)
    moe = load(experts, progress=False)
    assert getattr(moe.forward, "native", None) is None
    assert logits(moe.forward, [], [1], None).shape == (1, VOCAB)


def test_the_embedded_model_runs_the_native_step(embedded_loaded):
    loaded = embedded_loaded
    assert loaded.forward.native is not None and loaded.forward.native.kind == "gemma3_text"
    agents = [prefilled(loaded.model, loaded.spec, n, 60 + i, DEFAULT_SCHEME) for i, n in enumerate([520, 90])]
    forks = [a.fork() for a in agents]
    got = logits(loaded.forward, forks, [10, 11], per_step(forks))
    want = logits(loaded.model, agents, [10, 11], per_step(agents))
    assert close(got, want, STEP_TOLERANCE)
