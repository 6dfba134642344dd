"""``kvshelf.kv.coded_working_set``: the native step over layers kept in codes gives the
logits of the fp32 working set to fp32 rounding, through a key block that fills, a window
that moves, batch members that join and leave, a restore and a fork; it gives the same
bits every time from the same blocks; it holds a fraction of the fp32 rows' bytes; and
where it cannot serve (a temperature-0 step, a layer it cannot read) the fp32 layers do.

The tiny models' heads are 64 floats, which coded attention does not take by default
(``coded_attention.worth_reading``: on this machine only longer heads gain), so the tests
lower that bound to read them in codes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv import coded_working_set
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.coded_working_set import CodedDecodeLayer, reads_codes
from kvshelf.kv.record import agent_cache_from_record, agent_record
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.kv.working_set import DecodeLayer, WorkingSets
from kvshelf.model import coded_attention
from kvshelf.model.loader import load
from kvshelf.model.skinny import MAX_LAYER_ROWS

KINDS = ["llama", "gemma3_text"]
STEPS = 40  # from 500 tokens: a per-channel key block fills at 512, gemma3_text's window moves


@pytest.fixture(autouse=True)
def coded(monkeypatch):
    monkeypatch.setattr(coded_working_set, "CODED", True)
    monkeypatch.setattr(coded_attention, "CODED_FROM_HEAD_DIM", 64)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {kind: load(tiny_dirs[kind], progress=False) for kind in [*KINDS, "deepseek_v2"]}


def prefilled(loaded, n: int, seed: int, scheme: str = DEFAULT_SCHEME) -> AgentCache:
    tokens = np.random.default_rng(seed).integers(0, 128, n).tolist()
    cache = AgentCache.empty(loaded.spec, SCHEMES[scheme])
    mx.eval(loaded.model(mx.array(tokens)[None], cache=cache.layers), cache.arrays())
    cache.tokens = tokens
    return cache


def decode(loaded, agents, tokens, working: WorkingSets, in_codes: bool, schedule=None):
    """Steps of the default kernels' forward; step i feeds ``tokens[i][b]`` to the members
    ``schedule(i)`` (default: all). Every member's logits, step by step."""
    out: list[list[np.ndarray]] = [[] for _ in agents]
    for i, row in enumerate(tokens):
        members = schedule(i) if schedule else list(range(len(agents)))
        caches = working.caches(members, [agents[b].layers for b in members], in_codes=in_codes)
        logits = loaded.forward(mx.array([[row[b]] for b in members]), cache=caches)[:, -1]
        mx.eval(logits, [a for b in members for a in agents[b].arrays()], working.arrays())
        for b, x in zip(members, np.array(logits)):
            out[b].append(x)
            agents[b].tokens.append(row[b])
    return out


def tokens_for(n_agents: int, steps: int = STEPS) -> list[list[int]]:
    return np.random.default_rng(9).integers(0, 128, (steps, n_agents)).tolist()


# The first step reads the same state both ways: fp32 rounding only (measured up to 2e-6 of
# the largest logit). Later steps read states that parted in their last bits, which the
# tiny Gemma 3's norms amplify (up to 1.3e-4 over 40 steps, 2026-12-08); a code read from
# the wrong column or with another group's scale is off by tenths.
FIRST_STEP, LATER_STEPS = 1e-5, 1e-3


def assert_close(got, want) -> None:
    for xs, ys in zip(got, want):
        assert len(xs) == len(ys)
        for i, (x, y) in enumerate(zip(xs, ys)):
            tolerance = FIRST_STEP if i == 0 else LATER_STEPS
            np.testing.assert_allclose(x, y, rtol=0, atol=tolerance * np.abs(y).max())


@pytest.mark.parametrize("kind", KINDS)
def test_coded_layers_give_the_fp32_working_sets_logits(models, kind):
    loaded = models[kind]
    ref = prefilled(loaded, 500, 1)
    mine = ref.fork()
    tokens = tokens_for(1)
    want = decode(loaded, [ref], tokens, WorkingSets(), in_codes=False)
    working = WorkingSets()
    got = decode(loaded, [mine], tokens, working, in_codes=True)
    assert working.run is not None and all(isinstance(x, CodedDecodeLayer) for x in working.run.layers)
    assert_close(got, want)
    if kind == "gemma3_text":  # the window moved during the run
        assert any(c.window and c.start > 0 for c in mine.layers)
    assert {c.offset for c in mine.layers} == {c.offset for c in ref.layers} == {500 + STEPS}


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_with_joins_and_leaves_gives_each_members_logits(models, kind):
    loaded = models[kind]
    agents = [prefilled(loaded, n, 10 + i) for i, n in enumerate([500, 230, 300])]
    copies = [a.fork() for a in agents]

    def schedule(i: int) -> list[int]:  # agent 2 joins late and leaves early; 1 leaves for good
        return [0, 1, 2] if 10 <= i < 25 else [0, 1] if i < 30 else [0]

    tokens = tokens_for(3)
    want = decode(loaded, agents, tokens, WorkingSets(), in_codes=False, schedule=schedule)
    got = decode(loaded, copies, tokens, WorkingSets(), in_codes=True, schedule=schedule)
    assert_close(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_restored_and_forked_agents_continue_with_the_same_bits(models, kind):
    loaded = models[kind]
    ram = prefilled(loaded, 500, 30)
    decode(loaded, [ram], tokens_for(1, 5), WorkingSets(), in_codes=True)
    restored = agent_cache_from_record(loaded.spec, agent_record(ram), None)
    assert ram.share_prefix() is not None
    forked = ram.fork()  # starts on a shared base
    tokens = tokens_for(1)
    want = decode(loaded, [ram], tokens, WorkingSets(), in_codes=True)
    for other in (restored, forked):
        got = decode(loaded, [other], tokens, WorkingSets(), in_codes=True)
        assert all(np.array_equal(x, y) for x, y in zip(got[0], want[0]))


def test_codes_hold_a_fraction_of_the_fp32_rows_bytes(models):
    loaded = models["gemma3_text"]
    agents = [prefilled(loaded, 700, 40 + i) for i in range(2)]
    fp32, codes = WorkingSets(), WorkingSets()
    decode(loaded, [a.fork() for a in agents], tokens_for(2, 2), fp32, in_codes=False)
    decode(loaded, [a.fork() for a in agents], tokens_for(2, 2), codes, in_codes=True)
    # a third here (the open key block's 256 fp32 rows weigh on 700-token agents of 64-float heads)
    assert 0 < codes.nbytes < fp32.nbytes / 2.5


def test_temperature_zero_and_unreadable_layers_keep_fp32_rows(models):
    loaded = models["gemma3_text"]
    # what the step loop asks: only the default kernels' native step reads codes
    assert reads_codes(loaded.forward, 1) and reads_codes(loaded.forward, MAX_LAYER_ROWS)
    assert not reads_codes(loaded.forward, MAX_LAYER_ROWS + 1)  # the module path's batch
    assert not reads_codes(loaded.greedy_forward, 1)  # temperature 0's kernels
    assert not reads_codes(loaded.model, 1)  # mlx-lm's module
    greedy = WorkingSets()
    decode(loaded, [prefilled(loaded, 100, 50)], tokens_for(1, 2), greedy, in_codes=False)
    assert greedy.run is not None and all(isinstance(x, DecodeLayer) for x in greedy.run.layers)
    sinks = WorkingSets()  # a scheme with sinks: its first tokens read an fp16 copy
    decode(loaded, [prefilled(loaded, 100, 51, "q4-g64-kivi-rotv-sink4")], tokens_for(1, 2), sinks, in_codes=True)
    assert sinks.run is not None and all(isinstance(x, DecodeLayer) for x in sinks.run.layers)
    mla = models["deepseek_v2"]  # values of 32 floats: not in whole groups of 64
    other = WorkingSets()
    decode(mla, [prefilled(mla, 100, 52)], tokens_for(1, 2), other, in_codes=True)
    assert other.run is not None and all(isinstance(x, DecodeLayer) for x in other.run.layers)
