"""The decode working set is exact: a step through it gives bit-identical logits to the
per-step path (each cache's own ``update_and_fetch``, or ``BatchLayerView`` for a batch),
across a per-channel key block filling, a window eviction, a shared base, a restore from
a record and batch membership changes; batched greedy decode equals one-by-one."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv import blocks
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.batch import batch_views
from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.loader import load
from kvshelf.model.spec import BLOCK_TOKENS
from kvshelf.runtime.pool import BlockPool

KINDS = ["llama", "gemma3_text", "deepseek_v2"]
# Plain Q4 decodes on dense rows on the CPU, and on its packed rows through
# quantized_matmul where that pays (a GPU: ``blocks.packed_decode``); PACKED forces the
# latter here, so both paths stay covered.
PACKED = "q4-g64-per-token-v1 packed"
SCHEME_NAMES = [DEFAULT_SCHEME, "q4-g64-per-token-v1", PACKED]
# Prompts end shortly before a 256-token block fills; decoding STEPS tokens crosses
# the boundary (a KIVI key block is quantized) and, for gemma3_text's 16-token window,
# the sliding layers' start moves a block on (at 527 tokens).
PROMPT_LENGTHS = [500, 230]
STEPS = 40


@pytest.fixture(autouse=True)
def packed_decode(request, monkeypatch):
    """The PACKED case: plain Q4's packed decode path, forced on the CPU."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("scheme") == PACKED:
        monkeypatch.setattr(blocks, "PACKED_DECODE", True)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load(tiny_dirs[kind], progress=False) for kind in KINDS}


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


def prefilled(loaded, scheme: str, tokens: list[int]) -> tuple[AgentCache, int]:
    cache = AgentCache.empty(loaded.spec, SCHEMES[scheme.removesuffix(" packed")])
    logits = loaded.model(mx.array(tokens)[None], cache=cache.layers)[0, -1]
    mx.eval(logits, cache.arrays())
    cache.tokens = list(tokens)
    return cache, int(np.array(mx.argmax(logits)))


def step(loaded, agents: list[AgentCache], tokens: list[int], caches) -> list[np.ndarray]:
    """One decode step; every agent's next-token logits (their greedy tokens are appended)."""
    logits = loaded.model(mx.array([[t] for t in tokens]), cache=caches)[:, -1]
    mx.eval(logits, [a for c in agents for a in c.arrays()])
    for c, t in zip(agents, tokens):
        c.tokens.append(t)
    return [np.array(row) for row in logits]


def old_caches(agents: list[AgentCache]):
    return agents[0].layers if len(agents) == 1 else batch_views([a.layers for a in agents])


def decode(loaded, agents, first, steps, working: WorkingSets | None, schedule=None):
    """Greedy decode; ``schedule(i)`` picks the members of step i (default: all)."""
    tokens = list(first)
    out: list[list[np.ndarray]] = [[] for _ in agents]
    for i in range(steps):
        members = schedule(i) if schedule else list(range(len(agents)))
        group = [agents[b] for b in members]
        caches = working.caches(members, [a.layers for a in group]) if working is not None else old_caches(group)
        rows = step(loaded, group, [tokens[b] for b in members], caches)
        if working is not None:
            mx.eval(working.arrays())
        for b, row in zip(members, rows):
            out[b].append(row)
            tokens[b] = int(row.argmax())
    return tokens, out


def assert_identical(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> None:
    assert [len(x) for x in a] == [len(x) for x in b]
    for agent, (xs, ys) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert np.array_equal(x, y), f"agent {agent}, step {i}: max diff {np.abs(x - y).max()}"


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_one_agent_is_bit_identical_across_a_block_and_a_window_move(models, kind, scheme):
    loaded = models[kind]
    ref, first = prefilled(loaded, scheme, prompt(PROMPT_LENGTHS[0], 1))
    mine = ref.fork()
    _, want = decode(loaded, [ref], [first], STEPS, None)
    working = WorkingSets()
    _, got = decode(loaded, [mine], [first], STEPS, working)
    assert_identical(got, want)
    assert mine.tokens == ref.tokens
    # the Q4 blocks came out the same: both caches export the same bits
    a, b = agent_record(mine).tensors, agent_record(ref).tensors
    assert a.keys() == b.keys() and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    if kind == "gemma3_text":  # the window moved during the run
        assert any(c.window and c.start > 0 for c in mine.layers)
    # dense rows are held while decoding; plain Q4's one packed buffer is read in place
    assert (working.nbytes > 0) == (scheme != PACKED)
    working.clear()
    assert working.nbytes == 0


@pytest.mark.parametrize("scheme", sorted(set(SCHEMES) - set(SCHEME_NAMES)))
def test_every_scheme_is_bit_identical_through_sinks_rotations_and_a_window_move(models, scheme):
    loaded = models["gemma3_text"]
    ref, first = prefilled(loaded, scheme, prompt(500, 2))
    mine = ref.fork()
    _, want = decode(loaded, [ref], [first], STEPS, None)
    _, got = decode(loaded, [mine], [first], STEPS, WorkingSets())
    assert_identical(got, want)
    # and from the very first tokens, where a scheme's fp16 sinks replace quantized rows
    ref, first = prefilled(loaded, scheme, prompt(2, 3))
    mine = ref.fork()
    _, want = decode(loaded, [ref], [first], 8, None)
    _, got = decode(loaded, [mine], [first], 8, WorkingSets())
    assert_identical(got, want)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_is_bit_identical_to_batch_views_through_joins_and_leaves(models, kind, scheme):
    loaded = models[kind]
    agents, firsts = zip(*(prefilled(loaded, scheme, prompt(n, 10 + i)) for i, n in enumerate([500, 230, 40])))

    def schedule(i: int) -> list[int]:  # agent 2 joins late and leaves early; 1 leaves for good
        return [0, 1] if i < 5 else ([0, 1, 2] if i < 20 else [0, 2] if i < 30 else [0])

    forks = [a.fork() for a in agents]
    _, want = decode(loaded, list(agents), list(firsts), STEPS, None, schedule)
    working = WorkingSets()
    _, got = decode(loaded, forks, list(firsts), STEPS, working, schedule)
    assert_identical(got, want)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_temperature_zero_steps_code_their_rows_and_read_the_buffer_in_place(models, kind):
    """The temperature-0 kernels' step over a working set codes its rows in numpy, writes
    them into the buffer and attends to it in place (``InvariantAttention``,
    ``DecodeLayer.columns_with``), the tokens staged: the same bits as the per-step path
    through joins and leaves, a key block closing and a window move, and a row's bits are
    the same alone and beside another agent (what temperature 0 promises)."""
    fast = with_fast_linears(models[kind].model, all_rows=True, attention=True)
    loaded = SimpleNamespace(model=fast, spec=models[kind].spec)
    agents, firsts = zip(*(prefilled(loaded, DEFAULT_SCHEME, prompt(n, 40 + i)) for i, n in enumerate([500, 230])))

    def schedule(i: int) -> list[int]:  # agent 1 leaves for a while and comes back
        return [0, 1] if i < 10 or i >= 25 else [0]

    forks, alone = [a.fork() for a in agents], agents[0].fork()
    _, want = decode(loaded, list(agents), list(firsts), STEPS, None, schedule)
    _, got = decode(loaded, forks, list(firsts), STEPS, WorkingSets(), schedule)
    assert_identical(got, want)
    # the tokens since the key block closed at 512 are staged, not appended through MLX
    assert all(layer._staged for layer in forks[0].layers)
    _, by_itself = decode(loaded, [alone], [firsts[0]], STEPS, WorkingSets())
    assert_identical(by_itself, got[:1])


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_decode_equals_one_by_one(models, kind, scheme):
    loaded = models[kind]
    agents, firsts = zip(*(prefilled(loaded, scheme, prompt(n, 20 + i)) for i, n in enumerate([500, 230, 100])))
    alone = [a.fork() for a in agents]
    ends, logits = zip(*(decode(loaded, [a], [f], STEPS, WorkingSets()) for a, f in zip(alone, firsts)))
    together = [a.fork() for a in agents]
    end, batched = decode(loaded, together, list(firsts), STEPS, WorkingSets())
    assert end == [e[0] for e in ends]
    for b, (a, one) in enumerate(zip(together, alone)):
        assert a.tokens == one.tokens, b
        for x, y in zip(batched[b], logits[b][0]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_restored_and_forked_agents_continue_bit_identically(models, kind, scheme):
    loaded = models[kind]
    ram, first = prefilled(loaded, scheme, prompt(PROMPT_LENGTHS[0], 30))
    token, _ = decode(loaded, [ram], [first], 5, WorkingSets())  # mid-tail: 505 tokens
    # a restore from the agent's record, and a fork that starts on a shared base
    restored = agent_cache_from_record(loaded.spec, agent_record(ram), None)
    prefix = ram.share_prefix()
    assert prefix is not None and len(prefix.tokens) == BLOCK_TOKENS
    forked = ram.fork()
    _, want = decode(loaded, [ram], token, STEPS, None)
    for other in (restored, forked):
        _, got = decode(loaded, [other], token, STEPS, WorkingSets())
        assert_identical(got, want)


def test_the_pool_budget_counts_the_working_set(models):
    loaded = models["llama"]
    agents = [prefilled(loaded, DEFAULT_SCHEME, prompt(100, 40 + i))[0] for i in range(3)]
    working = WorkingSets()
    decode(loaded, agents[2:], [1], 3, working)
    pool = BlockPool(budget=sum(a.nbytes for a in agents))
    for i, a in enumerate(agents):
        pool.put(f"a{i}", a)
    assert pool.over_budget_victims() == []
    decoding = [0]  # decode() keys members by their index
    pool.working_bytes = lambda: working.nbytes_of(decoding)  # as the step loop does
    assert working.nbytes_of(decoding) == working.nbytes > agents[0].nbytes
    assert pool.over_budget_victims()[:1] == ["a0"]
    decoding.clear()  # the agent finished: its rows no longer count
    assert pool.over_budget_victims() == []


def test_embedded_model_is_bit_identical_across_a_block_and_a_window_move(embedded_loaded):
    # Gemma 3 270M: 1 KV head of 256, window 512; at 1023 tokens the sliding layers'
    # start moves a block on, at 1024 a per-channel key block fills: 10 steps from 1016
    # tokens cross both (steps 7 and 8) and go two past them
    ref, first = prefilled(embedded_loaded, DEFAULT_SCHEME, prompt(1016, 50))
    mine = ref.fork()
    steps = 10
    _, want = decode(embedded_loaded, [ref], [first], steps, None)
    working = WorkingSets()
    _, got = decode(embedded_loaded, [mine], [first], steps, working)
    assert_identical(got, want)
    assert any(c.window and c.start > 0 for c in mine.layers)


# every scheme on dense rows; the plain ones on their packed rows too (a GPU's path)
CODED = [(name, False) for name in SCHEMES] + [(name, True) for name, s in SCHEMES.items() if s.plain]


@pytest.mark.parametrize(("scheme", "packed"), CODED)
def test_coded_rows_of_a_batch_are_each_members_own_rows(models, scheme, packed, monkeypatch):
    """The working set codes all members' new rows in one call; each row is what that
    member's ``attention_rows`` reads back after its own append, bit for bit (sinks and
    a filled key block excepted, which the working set re-reads per member)."""
    monkeypatch.setattr(blocks, "PACKED_DECODE", packed)
    loaded = models["llama"]
    layer = loaded.spec.layers[0]
    members = []
    for n in (3, 40, 300):  # one inside the sinks, one mid-block, one past a block
        cache = AgentCache.empty(loaded.spec, SCHEMES[scheme]).layers[0]
        rng = np.random.default_rng(n)
        kv = [mx.array(rng.standard_normal((1, layer.kv_heads, n, d)).astype(np.float32)) for d in (64, 64)]
        cache.update_and_fetch(*kv)
        members.append(cache)
    keys, values = (mx.random.normal((3, layer.kv_heads, 1, 64), key=mx.random.key(s)) for s in (1, 2))
    dense = not all(m.quantized_decode for m in members)
    coded = [x if isinstance(x, tuple) else (x,) for x in members[0].coded_rows(keys, values, mx.float32, dense)]
    checked = 0
    for b, m in enumerate(members):
        at, stable = m.offset, m.stable_until
        m.append(keys[b : b + 1], values[b : b + 1])
        if m.own_rows_at(at) or stable < at < m.stable_until:  # a sink, or a key block filled
            continue
        own = [x if isinstance(x, tuple) else (x,) for x in m.attention_rows(at, m.offset, mx.float32, dense)]
        for mine, batch in zip(own, coded):
            assert all(mx.array_equal(x, y[b : b + 1]).item() for x, y in zip(mine, batch))
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_pipelined_steps_give_the_same_bits_as_unpipelined(models, kind, monkeypatch):
    """``PIPELINE`` (each layer starts MLX on the step so far) changes when MLX computes,
    not what: a batch through joins and leaves gives the same logits and Q4 blocks with
    it on and off (and, by the tests above, the same as the per-step path)."""
    from kvshelf.kv import working_set

    loaded = models[kind]
    agents, firsts = zip(*(prefilled(loaded, DEFAULT_SCHEME, prompt(n, 30 + i)) for i, n in enumerate([500, 230])))

    def schedule(i: int) -> list[int]:
        return [0] if i < 4 else [0, 1] if i < 16 else [1]

    runs = {}
    for on in (False, True):
        monkeypatch.setattr(working_set, "PIPELINE", on)
        forks = [a.fork() for a in agents]
        tokens, logits = decode(loaded, forks, list(firsts), 24, WorkingSets(), schedule)
        runs[on] = (tokens, logits, [agent_record(f).tensors for f in forks])
    assert runs[True][0] == runs[False][0]
    assert_identical(runs[True][1], runs[False][1])
    for a, b in zip(runs[True][2], runs[False][2]):
        assert a.keys() == b.keys() and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
