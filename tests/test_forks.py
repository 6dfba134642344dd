"""Shared-prefix forks, cross-phase append and prefill ahead (tiny random-weight models).

A fork must be indistinguishable from an agent that prefilled the same prefix itself,
down to the bit; its shared blocks must exist once in RAM and once on disk; erasing an
agent removes only what is its own, and a prefix goes with its last user.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from kvshelf.errors import AgentExists, UnknownAgent
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.runtime.engine import Engine
from tests.support.subprocesses import continue_agents_in_new_process

PREAMBLE = [{"role": "system", "content": "You are one of four careful planners sharing this brief. " * 12}]
ASK = PREAMBLE + [{"role": "user", "content": "What should we do first?"}]
LATER = ASK + [{"role": "assistant", "content": "Survey."}, {"role": "user", "content": "And then?"}]


def resident(engine: Engine, aid: str) -> AgentCache:
    """The agent's cache in RAM, where the test has just put it."""
    cache = engine._shelf.pool.get(aid)
    assert cache is not None
    return cache


def shared_dir(engine: Engine):
    return engine._shelf.shared.directory


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "deepseek_v2"])
def test_a_fork_is_bit_identical_to_prefilling_the_prefix_itself(tiny_dirs, tmp_path, kind):
    engine = Engine(tiny_dirs[kind], tmp_path, prefill_chunk=64, progress=False)
    engine.prefill("seed", PREAMBLE)
    info = engine.fork("seed", "forked")
    assert info.shared_tokens >= 256 and info.shared_tokens % 256 == 0
    engine.prefill("self", PREAMBLE)  # the same prefix, computed the same way, unshared
    assert np.array_equal(engine.prefill("forked", ASK), engine.prefill("self", ASK))
    forked, alone = engine.chat("forked", LATER, max_tokens=12), engine.chat("self", LATER, max_tokens=12)
    assert forked.token_ids == alone.token_ids and forked.usage == alone.usage
    engine.close()
    # after a restart the fork is rebuilt from its own record plus the shared prefix file
    after = continue_agents_in_new_process(
        str(tiny_dirs[kind]), tmp_path, ["forked", "self"], LATER + [{"role": "user", "content": "Go."}], 8
    )
    restored, reference = after["forked"], after["self"]
    assert restored["cached"] > 0 and not list(tmp_path.rglob("*.reason"))  # restored, nothing quarantined
    assert np.array_equal(restored["logits"], reference["logits"]) and restored["tokens"] == reference["tokens"]


def test_shared_blocks_are_stored_once_in_ram_and_on_disk(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["llama"], tmp_path, prefill_chunk=64, progress=False)
    engine.prefill("seed", PREAMBLE)
    for name in ("a", "b", "c"):
        engine.fork("seed", name)
    engine.prefill("alone", PREAMBLE)
    engine.flush()
    caches = [resident(engine, n) for n in ("seed", "a", "b", "c")]
    prefix = caches[0].shared
    assert prefix is not None and all(c.shared is prefix for c in caches)
    for layer in range(len(caches[0].layers)):
        assert len({id(c.layers[layer].base) for c in caches}) == 1
    alone = resident(engine, "alone").nbytes
    assert all(c.nbytes < alone for c in caches)  # each holds only its own, partial block
    assert engine._shelf.pool.resident_bytes == alone + sum(c.nbytes for c in caches) + prefix.nbytes
    files = sorted(p.name for p in shared_dir(engine).glob("*.safetensors"))
    assert files == [f"{prefix.id}.safetensors"]
    assert engine._shelf.shared.users(prefix.id) == ["a", "b", "c", "seed"]
    assert engine.shared_prefixes() == {prefix.id: ["a", "b", "c", "seed"]}  # the same, through the public API
    disk = {a.agent_id: a.disk_bytes for a in engine.agents()}
    assert all(disk[n] < disk["alone"] for n in ("seed", "a", "b", "c"))
    engine.close()


def test_erasing_removes_only_what_is_the_agents_own_and_the_prefix_goes_with_its_last_user(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path, prefill_chunk=64, progress=False)
    engine.prefill("seed", PREAMBLE)
    pid = engine.fork("seed", "a").shared_prefix
    assert pid is not None
    engine.fork("seed", "b")
    before = engine.prefill("b", ASK)
    prefix_file = shared_dir(engine) / f"{pid}.safetensors"

    removed = engine.forget("a")
    names = {p.split("/")[-1] for p in removed.files_removed}
    assert names == {"a.safetensors", "a.lock", "a"} and prefix_file.exists()
    engine.forget("seed")
    assert prefix_file.exists() and engine._shelf.shared.users(pid) == ["b"]
    engine.close()

    again = Engine(tiny_dirs["gemma3_text"], tmp_path, prefill_chunk=64, progress=False)
    assert np.array_equal(again.prefill("b", ASK), before)  # b still restores through the prefix
    with pytest.raises(UnknownAgent):
        again.fork("a", "z")
    removed_files = again.forget("b").files_removed
    assert str(prefix_file) in removed_files and not prefix_file.exists()
    assert not list(shared_dir(again).iterdir()) and again.agents() == []
    again.close()
    del again
    gc.collect()


def test_forks_refuse_to_overwrite_and_survive_a_rewind_into_the_prefix(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["llama"], tmp_path, prefill_chunk=64, progress=False)
    engine.prefill("seed", PREAMBLE)
    engine.fork("seed", "a")
    with pytest.raises(AgentExists):
        engine.fork("seed", "a")
    seed_before = engine.prefill("seed", ASK)
    # "a" goes back into the shared blocks: it copies them, and nobody else changes
    short = [{"role": "system", "content": "Different."}, {"role": "user", "content": "Hi"}]
    engine.chat("a", short, max_tokens=4)
    assert resident(engine, "a").shared is None
    assert np.array_equal(engine.prefill("seed", ASK), seed_before)
    engine.close()


def test_append_then_chat_equals_chat_with_the_full_history(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["llama"], tmp_path, prefill_chunk=64, progress=False)
    engine.chat("phased", ASK, max_tokens=6)
    engine.chat("direct", ASK, max_tokens=6)
    phase2 = LATER + [{"role": "user", "content": "Phase two: the others said to wait."}]
    usage = engine.append("phased", phase2)
    assert usage.cached_tokens > 0 and usage.prompt_tokens > usage.cached_tokens
    turn = phase2 + [{"role": "user", "content": "Your move."}]
    appended, direct = engine.chat("phased", turn, max_tokens=10), engine.chat("direct", turn, max_tokens=10)
    assert appended.token_ids == direct.token_ids
    assert appended.usage.cached_tokens > direct.usage.cached_tokens  # the phase was already in
    engine.close()


def test_prefill_ahead_gives_the_same_outputs_and_yields_to_waiting_agents(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["llama"], tmp_path, prefill_chunk=32, progress=False)
    long_history = [{"role": "system", "content": "Listen to the group. " * 60}, {"role": "user", "content": "bob: hi"}]
    ahead = engine.prefill_ahead("listener", long_history)
    start = engine.stats["background_calls"]
    seen: dict[str, int] = {}
    for item in engine.stream("speaker", ASK, max_tokens=4):
        seen.setdefault("first", engine.stats["background_calls"])
    assert seen["first"] <= start + 1  # at most the chunk that was running
    assert ahead.result(timeout=120).prompt_tokens > 0
    turn = long_history + [{"role": "user", "content": "carol: your turn"}]
    warm = engine.chat("listener", turn, max_tokens=8)
    engine.prefill("plain", long_history)
    plain = engine.chat("plain", turn, max_tokens=8)
    assert warm.token_ids == plain.token_ids and warm.usage.cached_tokens == plain.usage.cached_tokens

    # a later request for the same agent takes over from its background work
    superseded = engine.prefill_ahead("late", long_history)
    now = engine.chat("late", turn, max_tokens=8)
    assert superseded.result(timeout=120).prompt_tokens == len(engine._encode(long_history))
    assert now.token_ids == plain.token_ids
    engine.close()


def test_prefill_ahead_from_many_threads_keeps_agents_apart(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path, prefill_chunk=64, progress=False)
    histories = {f"agent{i}": [{"role": "system", "content": f"You are agent {i}. " * 20}] for i in range(4)}
    futures = {}

    def queue(name: str) -> None:
        futures[name] = engine.prefill_ahead(name, histories[name])

    threads = [threading.Thread(target=queue, args=(n,)) for n in histories]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, fut in futures.items():
        fut.result(timeout=120)
        assert resident(engine, name).tokens == engine._encode(histories[name])
    engine.close()
