"""Requests that name no agent: a token-exact prefix cache in RAM, never persisted, never
shared with named agents, within the byte budget (``kvshelf.runtime.anonymous``)."""

from __future__ import annotations

import numpy as np
import pytest

from kvshelf.runtime.engine import Engine

LONG = " ".join(f"line {i}: the tide came in at {i % 12} o'clock." for i in range(20))
SYSTEM = {"role": "system", "content": "You are a harbour master. " + LONG}
# Over one 256-token key block (a byte per token), so a second turn reuses a closed block
# and its open tail, at a third of SYSTEM's prefill.
SHORTER = {"role": "system", "content": "You are a harbour master. " + LONG[: LONG.index("line 8:")]}


def first_turn(question: str = "When is high tide?", system: dict = SYSTEM) -> list[dict]:
    return [system, {"role": "user", "content": question}]


def next_turn(messages: list[dict], reply: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def files_under(path) -> list:
    return sorted(p for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "deepseek_v2"])
def test_a_growing_anonymous_conversation_reuses_its_prefix_exactly(kind, tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs[kind], cache_dir=tmp_path / "a")
    fresh = Engine(model=tiny_dirs[kind], cache_dir=tmp_path / "b")
    r1 = engine.chat(None, first_turn(system=SHORTER), max_tokens=8)
    assert r1.cache == "none" and r1.usage.cached_tokens == 0 and r1.usage.prompt_tokens > 256
    msgs = next_turn(first_turn(system=SHORTER), r1.text, "And tomorrow?")
    r2 = engine.chat(None, msgs, max_tokens=8)
    # everything the model saw last turn is reused, up to where the reply's re-rendering differs
    assert r2.cache == "none" and r2.usage.cached_tokens >= r1.usage.prompt_tokens
    assert r2.agent_id is None
    # reuse is exact: the same tokens and logits as computing the whole prompt from nothing
    cold = fresh.chat(None, msgs, max_tokens=8)  # an engine that never saw turn 1
    assert cold.usage.cached_tokens == 0 and r2.token_ids == cold.token_ids
    other = Engine(model=tiny_dirs[kind], cache_dir=tmp_path / "c")
    assert np.array_equal(engine.prefill(None, msgs), other.prefill(None, msgs))
    # never persisted: no agent, no file
    assert engine.agents() == [] and files_under(tmp_path / "a") == []


def test_anonymous_and_named_caches_never_meet(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    named = engine.chat("alice", first_turn(), max_tokens=6)
    # an anonymous request with alice's exact conversation sees none of her cache
    anon = engine.chat(None, next_turn(first_turn(), named.text, "Again?"), max_tokens=6)
    assert anon.usage.cached_tokens == 0
    # and a new named agent never starts on an anonymous conversation's cache
    bob = engine.chat("bob", next_turn(first_turn(), named.text, "Again?"), max_tokens=6)
    assert bob.cache == "cold" and bob.usage.cached_tokens == 0
    # alice's own cache is untouched by either
    again = engine.chat("alice", next_turn(first_turn(), named.text, "Again?"), max_tokens=6)
    assert again.cache == "hot" and again.usage.cached_tokens >= named.usage.prompt_tokens
    assert {a.agent_id for a in engine.agents()} == {"alice", "bob"}


def test_two_anonymous_conversations_on_one_system_prompt_keep_their_own_prefixes(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    a1 = engine.chat(None, first_turn("Question A?"), max_tokens=6)
    b1 = engine.chat(None, first_turn("Question B, a different one?"), max_tokens=6)
    shared = b1.usage.cached_tokens
    assert 0 < shared < b1.usage.prompt_tokens  # B started on A's system prompt (a fork)...
    a2 = engine.chat(None, next_turn(first_turn("Question A?"), a1.text, "More A?"), max_tokens=6)
    assert a2.usage.cached_tokens >= a1.usage.prompt_tokens  # ...and A kept all of its own
    b2 = engine.chat(None, next_turn(first_turn("Question B, a different one?"), b1.text, "More B?"), max_tokens=6)
    assert b2.usage.cached_tokens >= b1.usage.prompt_tokens


def test_anonymous_prefixes_yield_to_named_agents_within_the_budget(tiny_dirs, tmp_path):
    probe = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "probe")
    probe.chat("x", first_turn(), max_tokens=6)
    per_conversation = probe._shelf.pool.resident_bytes
    # room for one named agent and nothing more: the anonymous cache is dropped for it
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "b", budget=int(per_conversation * 1.5))
    r1 = engine.chat(None, first_turn(), max_tokens=6)
    assert len(engine._shelf.anonymous) == 1  # kept while there is room
    engine.chat("alice", first_turn("Something else entirely, from alice."), max_tokens=6)
    shelf = engine._shelf
    assert shelf.pool.budget is not None
    assert shelf.pool.resident_bytes + shelf.anonymous.nbytes <= shelf.pool.budget
    assert "alice" in shelf.pool and len(shelf.anonymous) == 0
    r2 = engine.chat(None, next_turn(first_turn(), r1.text, "And then?"), max_tokens=6)
    assert r2.usage.cached_tokens == 0  # it was dropped, not spilled to disk
    assert {a.agent_id for a in engine.agents()} == {"alice"}


def test_anonymous_prefixes_can_be_turned_off(tiny_dirs, tmp_path):
    """``anonymous_prefixes=0``: a request that names no agent always starts cold (and
    answers as one that reuses does), and nothing stays in RAM after it."""
    keeping = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "a")
    off = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "b", anonymous_prefixes=0)
    first = first_turn(system=SHORTER)
    r1 = off.chat(None, first, max_tokens=8)
    assert len(off._shelf.anonymous) == 0
    msgs = next_turn(first, r1.text, "And tomorrow?")
    again = off.chat(None, msgs, max_tokens=8)
    assert again.usage.cached_tokens == 0 and len(off._shelf.anonymous) == 0
    keeping.chat(None, first, max_tokens=8)
    reused = keeping.chat(None, msgs, max_tokens=8)
    assert reused.usage.cached_tokens > 0 and reused.token_ids == again.token_ids
    with pytest.raises(ValueError, match="0 or more"):
        Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "c", anonymous_prefixes=-1)
