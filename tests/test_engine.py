"""Engine behaviour on tiny random-weight models: exactness, reuse, isolation, budget, bad input."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from kvshelf.errors import InvalidAgentId
from kvshelf.runtime.engine import Engine
from kvshelf.runtime.results import ChatResult
from tests.support.subprocesses import continue_in_new_process, run_in_subprocess

KINDS = ["llama", "gemma3_text", "deepseek_v2"]
LONG = " ".join(f"fact {i}: the sky was {['blue', 'grey', 'red'][i % 3]} on day {i}." for i in range(30))


def convo(extra: str = "") -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful note taker."},
        {"role": "user", "content": LONG + extra},
    ]


def convo_of(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def follow_up(msgs: list[dict], reply: str, question: str) -> list[dict]:
    return [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


@pytest.mark.parametrize("kind", KINDS)
def test_restore_in_new_process_is_bit_identical(kind, tiny_dirs, tmp_path):
    """An agent restored from disk by a new process continues exactly as the one still in RAM."""
    engine = Engine(model=tiny_dirs[kind], cache_dir=tmp_path)
    first = engine.chat("alice", convo(), max_tokens=12)
    msgs2 = follow_up(convo(), first.text, "And on day 7?")
    restored = continue_in_new_process(str(tiny_dirs[kind]), tmp_path, "alice", msgs2, 12)
    logits_ram = engine.prefill("alice", msgs2)
    in_ram = engine.chat("alice", msgs2, max_tokens=12)
    assert np.array_equal(restored["logits"], logits_ram)
    assert restored["tokens"] == in_ram.token_ids
    assert in_ram.cache == "hot"
    # the new process found alice on disk and reused everything but the last prompt token
    assert restored["cached"] == in_ram.usage.cached_tokens == in_ram.usage.prompt_tokens - 1


@pytest.mark.parametrize("kind", KINDS)
def test_growing_conversation_prefills_only_new_tokens(kind, tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs[kind], cache_dir=tmp_path)
    r1 = engine.chat("bob", convo(), max_tokens=10)
    assert r1.cache == "cold" and r1.usage.cached_tokens == 0
    r2 = engine.chat("bob", follow_up(convo(), r1.text, "Summarise."), max_tokens=10)
    assert r2.cache == "hot"
    # everything the model has seen is reused, generated tokens included (the last
    # generated token was sampled but never fed back, so it is the first new one)
    assert r2.usage.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens - 1


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_cuts_back_and_matches_fresh_computation(kind, tiny_dirs, tmp_path):
    """State is a pure function of the tokens (whatever the prefill chunks), so reuse must be exact."""
    warm = Engine(model=tiny_dirs[kind], cache_dir=tmp_path / "a")
    fresh = Engine(model=tiny_dirs[kind], cache_dir=tmp_path / "b")
    first = [convo()[0], {"role": "user", "content": LONG[:300] + " First version of the question?"}]
    edited = [convo()[0], {"role": "user", "content": LONG[:300] + " Second, edited question!"}]
    warm.chat("carol", first, max_tokens=6)
    r = warm.chat("carol", edited, max_tokens=8)
    ref = fresh.chat("carol", edited, max_tokens=8)
    encode = lambda m: warm.loaded.tokenizer.encode_prompt(warm.loaded.template.render(m))  # noqa: E731
    first_ids, edited_ids = encode(first), encode(edited)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, edited_ids)) if a != b)
    assert r.usage.cached_tokens == common
    assert ref.usage.cached_tokens == 0
    assert r.token_ids == ref.token_ids
    assert np.array_equal(warm.prefill("carol", edited), fresh.prefill("carol", edited))


def test_sliding_window_rewind_and_recompute(tiny_dirs, tmp_path):
    """Window-16 layers hold only window + one slack block; a deep rewind is recomputed."""
    warm = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path / "a")
    fresh = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path / "b")
    text = LONG[:560]
    warm.chat("dan", convo_of(text), max_tokens=4)
    cache = warm._shelf.pool.get("dan")
    assert cache is not None
    for layer in cache.layers:
        if layer.window is not None:  # bounded: the window, one slack block, block rounding
            assert layer.offset > 600 and layer.start > 0 and layer.used <= layer.window + 2 * 256
    # a shallow edit near the end: sliding layers can rewind, so most tokens are reused
    near = convo_of(text[:-20] + " changed ending.")
    r = warm.chat("dan", near, max_tokens=6)
    assert r.usage.cached_tokens > 550
    assert r.token_ids == fresh.chat("dan", near, max_tokens=6).token_ids
    # a deep edit far beyond the window: nothing stale may be reused, so it is recomputed
    far = convo_of("changed at the start " + text)
    r = warm.chat("dan", far, max_tokens=6)
    assert r.usage.cached_tokens == 0
    assert r.token_ids == fresh.chat("dan", far, max_tokens=6).token_ids


def test_agents_are_isolated(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    engine.chat("erin", convo(), max_tokens=8)
    # frank's prompt shares a long prefix with erin's, but never touches her cache
    r = engine.chat("frank", convo(" plus one more line."), max_tokens=8)
    assert r.cache == "cold" and r.usage.cached_tokens == 0
    anonymous = engine.chat(None, convo(), max_tokens=8)
    assert anonymous.usage.cached_tokens == 0 and anonymous.cache == "none"
    assert {a.agent_id for a in engine.agents()} == {"erin", "frank"}
    fresh = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "other")
    assert r.token_ids == fresh.chat("frank", convo(" plus one more line."), max_tokens=8).token_ids


def test_budget_spills_lru_agents_and_restores_them(tiny_dirs, tmp_path):
    unbounded = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "u")
    unbounded.chat("g0", convo(" agent 0"), max_tokens=5)
    g0 = unbounded._shelf.pool.get("g0")
    assert g0 is not None
    per_agent = g0.nbytes
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "b", budget=int(per_agent * 2.5))
    budget = engine._shelf.pool.budget
    assert budget is not None
    replies = {}
    for i in range(4):
        replies[f"g{i}"] = engine.chat(f"g{i}", convo(f" agent {i}"), max_tokens=5)
        assert engine._shelf.pool.resident_bytes <= budget
    assert "g0" not in engine._shelf.pool and "g3" in engine._shelf.pool
    msgs = follow_up(convo(" agent 0"), replies["g0"].text, "next?")
    r = engine.chat("g0", msgs, max_tokens=5)
    assert r.cache == "warm" and r.usage.cached_tokens > 0
    ref = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "r")
    ref.chat("g0", convo(" agent 0"), max_tokens=5)
    assert r.token_ids == ref.chat("g0", msgs, max_tokens=5).token_ids
    assert engine._shelf.pool.resident_bytes <= budget


@pytest.mark.parametrize("bad", ["", "../etc/passwd", "a/b", "x" * 300, "naïve", None, 5])
def test_bad_agent_ids_are_rejected(bad, tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    if bad is None:
        assert engine.chat(None, convo(), max_tokens=2).cache == "none"
        return
    with pytest.raises(InvalidAgentId):
        engine.chat(bad, convo(), max_tokens=2)
    assert not any(tmp_path.rglob("*.safetensors"))


def test_corrupt_and_foreign_records_are_quarantined_and_recomputed(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    first = engine.chat("hana", convo(), max_tokens=6)
    engine.flush()  # saves are written behind; wait for the record
    path = engine._shelf.store.path_for("hana")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    r = restarted.chat("hana", convo(), max_tokens=6)
    assert r.cache == "cold" and r.token_ids == first.token_ids
    assert len(list(restarted._shelf.store.quarantine_dir.glob("*.safetensors"))) == 1
    # a record written by another model (same geometry, other weights) is never used
    other = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path)
    other.chat("ivan", convo(), max_tokens=3)
    other.flush()
    foreign = other._shelf.store.path_for("ivan")
    (restarted._shelf.store.path_for("ivan")).write_bytes(foreign.read_bytes())
    r = restarted.chat("ivan", convo(), max_tokens=3)
    assert r.cache == "cold"
    assert len(list(restarted._shelf.store.quarantine_dir.glob("*.safetensors"))) == 2


def test_forget_erases_ram_and_disk(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    engine.chat("jo", convo(), max_tokens=3)
    engine.chat("kim", convo(), max_tokens=3)
    engine.flush()
    removed = engine.forget("jo")
    assert removed.ram_bytes_freed > 0 and removed.files_removed
    assert not engine._shelf.store.path_for("jo").exists() and engine._shelf.store.path_for("kim").exists()
    assert [a.agent_id for a in engine.agents()] == ["kim"]
    assert engine.chat("jo", convo(), max_tokens=3).cache == "cold"


def test_two_processes_on_one_cache_dir(tiny_dirs, tmp_path):
    code = textwrap.dedent(
        f"""
        import json, sys, kvshelf
        from kvshelf.runtime.engine import Engine
        e = Engine(model={str(tiny_dirs["llama"])!r}, cache_dir={str(tmp_path)!r})
        tag = sys.argv[1] if len(sys.argv) > 1 else "x"
        for i in range(6):
            for aid in ("shared-1", "shared-2"):
                e.chat(aid, [{{"role": "user", "content": "round " + str(i) + " " * i}}], max_tokens=3)
        e.close()
        print(json.dumps({{"ok": True}}))
        """
    )
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_in_subprocess(code), range(2)))
    assert all(r["ok"] for r in results)
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    for aid in ("shared-1", "shared-2"):
        assert engine.chat(aid, [{"role": "user", "content": "round 5     "}], max_tokens=3).cache == "warm"
    assert not list(engine._shelf.store.quarantine_dir.glob("*.safetensors"))


def test_stop_strings_and_streaming(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    full = engine.chat("lee", convo(), max_tokens=20)
    assert full.finish_reason == "length" and full.usage.completion_tokens == 20
    stop = full.text[5:8]
    r = engine.chat("lee", convo(), max_tokens=20, stop=[stop])
    assert r.finish_reason == "stop" and stop not in r.text and full.text.startswith(r.text)
    chunks = list(engine.stream("lee", convo(), max_tokens=20))
    assert "".join(c for c in chunks if isinstance(c, str)) == full.text
    last = chunks[-1]
    assert isinstance(last, ChatResult) and last.text == full.text


def test_async_twins_match_sync(tiny_dirs, tmp_path):
    import asyncio

    engine = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path)
    ref = Engine(model=tiny_dirs["llama"], cache_dir=tmp_path / "ref").chat("m", convo(), max_tokens=8)

    async def main():
        r = await engine.achat("m", convo(), max_tokens=8)
        chunks = [c async for c in engine.astream("n", convo(), max_tokens=8)]
        return r, chunks

    r, chunks = asyncio.run(main())
    assert r.token_ids == ref.token_ids
    assert "".join(c for c in chunks if isinstance(c, str)) == ref.text and chunks[-1].token_ids == ref.token_ids


def test_records_name_their_kv_scheme(tiny_dirs, tmp_path):
    """A record written under another known scheme is read as that scheme; an unknown one
    is quarantined, never misread."""
    from kvshelf.kv.record import CacheRecord

    plain = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path, kv_scheme="q4-g64-per-token-v1")
    first = plain.chat("olga", convo(), max_tokens=6)
    plain.close()
    follow = follow_up(convo(), first.text, "More?")
    ref = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path / "ref", kv_scheme="q4-g64-per-token-v1")
    ref.chat("olga", convo(), max_tokens=6)
    expected = ref.chat("olga", follow, max_tokens=6)
    default = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path)
    assert default.kv_scheme.name != "q4-g64-per-token-v1"
    r = default.chat("olga", follow, max_tokens=6)
    assert r.cache == "warm" and r.token_ids == expected.token_ids
    # forge a record that claims a scheme this build does not know
    default.flush()
    record = default._shelf.store.load("olga")
    assert record is not None
    record.meta["scheme"] = "q3-future-scheme"
    default._shelf.store.save("olga", CacheRecord(record.tokens, record.tensors, record.meta))
    default.evict("olga")
    again = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path)
    assert again.chat("olga", follow, max_tokens=6).cache == "cold"
    reasons = [p.read_text() for p in again._shelf.store.quarantine_dir.glob("*.reason")]
    assert any("q3-future-scheme" in text for text in reasons)
