"""Boundary checkpoints (kvshelf.kv.checkpoints) on the tiny gemma3, whose sliding layers
have a 16-token window: once a conversation has passed it, a new conversation with the
same system prompt resumes from the checkpoint at the end of that prompt, bit-identical to
a fresh computation, in RAM, after a restart and in a fork.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.checkpoints import MAX_CHECKPOINTS
from kvshelf.model.spec import BLOCK_TOKENS
from kvshelf.runtime.boundaries import message_boundaries
from kvshelf.runtime.engine import Engine
from kvshelf.runtime.scheduler import forward_plan, prefill_plan
from tests.support.subprocesses import run_in_subprocess
from tests.support.tiny import make_tiny_model_dir

SYSTEM = {"role": "system", "content": "You are the manager of a crew of careful researchers. " * 6}
TASK_ONE = [SYSTEM, {"role": "user", "content": "Task one: " + "describe the sky on each day of the trip. " * 12}]
TASK_TWO = [SYSTEM, {"role": "user", "content": "Task two: plan the picnic."}]


def resident(engine: Engine, aid: str) -> AgentCache:
    cache = engine._shelf.pool.get(aid)
    assert cache is not None
    return cache


def system_end(engine: Engine, messages: list[dict]) -> int:
    prompt = engine.loaded.tokenizer.encode_prompt(engine.loaded.template.render(messages))
    return message_boundaries(engine.loaded, messages, prompt)[0]


@pytest.fixture
def engines(tiny_dirs, tmp_path):
    warm = Engine(tiny_dirs["gemma3_text"], tmp_path / "warm", progress=False)
    fresh = Engine(tiny_dirs["gemma3_text"], tmp_path / "fresh", progress=False)
    yield warm, fresh
    warm.close()
    fresh.close()


def test_a_new_conversation_after_the_window_passed_reuses_the_system_prompt(engines):
    warm, fresh = engines
    first = warm.chat("boss", TASK_ONE, max_tokens=16)
    end = system_end(warm, TASK_TWO)
    cache = resident(warm, "boss")
    sliding = [c for c in cache.layers if c.window is not None]
    assert sliding and all(not c.can_rewind_to(end) for c in sliding)  # the window has moved past it
    assert [c.position for c in cache.checkpoints] == [end]

    second = warm.chat("boss", TASK_TWO, max_tokens=16)
    reference = fresh.chat("ref", TASK_TWO, max_tokens=16)
    assert second.cache == "hot" and second.usage.cached_tokens == end > 300
    assert reference.usage.cached_tokens == 0 and second.token_ids == reference.token_ids
    assert np.array_equal(warm.prefill("boss", TASK_TWO), fresh.prefill("ref", TASK_TWO))  # down to the bit
    # back to task one, after task two (short: its windows can rewind into "Task "): from there
    again = warm.chat("boss", [*TASK_ONE, {"role": "assistant", "content": first.text}], max_tokens=4)
    assert again.usage.cached_tokens >= end


def test_checkpoints_survive_a_restart(tiny_dirs, tmp_path):
    model, cache_dir = str(tiny_dirs["gemma3_text"]), tmp_path / "cache"
    with Engine(model, cache_dir, progress=False) as engine:
        engine.chat("boss", TASK_ONE, max_tokens=16)
        end = system_end(engine, TASK_TWO)
    code = f"""
import json, numpy as np, kvshelf
from kvshelf.runtime.engine import Engine
e = Engine({model!r}, {str(cache_dir)!r}, progress=False)
r = e.chat("boss", {TASK_TWO!r}, max_tokens=16)
np.save({str(tmp_path / "logits.npy")!r}, e.prefill("boss", {TASK_TWO!r}))
e.close()
print(json.dumps({{"cache": r.cache, "cached": r.usage.cached_tokens, "tokens": r.token_ids}}))
"""
    restored = run_in_subprocess(code)
    with Engine(model, tmp_path / "fresh", progress=False) as fresh:
        reference = fresh.chat("ref", TASK_TWO, max_tokens=16)
        logits = fresh.prefill("ref", TASK_TWO)
    assert restored["cache"] == "warm" and restored["cached"] == end
    assert restored["tokens"] == reference.token_ids
    assert np.array_equal(np.load(tmp_path / "logits.npy"), logits)
    assert not list(cache_dir.rglob("*.reason"))  # nothing quarantined


def test_a_fork_of_an_agent_past_its_window_starts_from_the_checkpoint(engines):
    warm, fresh = engines
    warm.chat("lead", TASK_ONE, max_tokens=16)
    warm.fork("lead", "deputy")
    mine = warm.chat("deputy", TASK_TWO, max_tokens=16)
    reference = fresh.chat("ref", TASK_TWO, max_tokens=16)
    assert mine.usage.cached_tokens == system_end(warm, TASK_TWO) and mine.token_ids == reference.token_ids
    assert np.array_equal(warm.prefill("deputy", TASK_TWO), fresh.prefill("ref", TASK_TWO))
    # the source is untouched: it still continues its own conversation
    assert len(resident(warm, "lead").tokens) > len(resident(warm, "deputy").tokens)


def test_a_preamble_prefilled_alone_gets_a_checkpoint_its_forks_resume_from(engines):
    warm, fresh = engines
    warm.prefill("brief", [SYSTEM])  # all system text, as before forking
    end = system_end(warm, TASK_TWO)
    assert [c.position for c in resident(warm, "brief").checkpoints] == [end]
    warm.fork("brief", "agent")
    warm.chat("agent", TASK_ONE, max_tokens=16)  # passes the window
    mine = warm.chat("agent", TASK_TWO, max_tokens=16)
    assert mine.usage.cached_tokens == end
    assert mine.token_ids == fresh.chat("ref", TASK_TWO, max_tokens=16).token_ids


def test_checkpoints_are_bounded_counted_and_dropped_when_their_tokens_change(engines):
    warm, _ = engines
    messages = list(TASK_ONE)
    for turn in range(5):  # a long conversation: the first boundary is kept, and the latest turn end
        reply = warm.chat("talker", messages, max_tokens=12)
        more = f"Go on ({turn}): " + "and the next day, what was the sky like? " * 16  # past window and slack block
        messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": more}]
    cache = resident(warm, "talker")
    positions = [c.position for c in cache.checkpoints]
    assert len(positions) == MAX_CHECKPOINTS and positions[0] == system_end(warm, TASK_TWO)
    assert positions == sorted(positions) and len(cache.tokens) > 1000
    for checkpoint in cache.checkpoints:  # at most a window plus one block of rows per sliding layer
        for layer, saved in zip(cache.layers, checkpoint.layers):
            if layer.window is not None:
                assert saved is not None and saved.start is not None
                assert checkpoint.position - saved.start < layer.window + BLOCK_TOKENS
    own = sum(c.nbytes for c in cache.layers)
    assert cache.nbytes == own + cache.checkpoint_bytes and cache.checkpoint_bytes > 0
    assert warm._shelf.pool.resident_bytes >= cache.nbytes  # counted in the budget
    # another system prompt: every checkpoint saw other tokens, so none is left
    warm.chat("talker", [{"role": "system", "content": "Other."}, {"role": "user", "content": "Hi."}], max_tokens=2)
    assert [c.position for c in resident(warm, "talker").checkpoints] == [
        system_end(warm, [{"role": "system", "content": "Other."}, {"role": "user", "content": "Hi."}])
    ]


def test_a_turn_end_the_layers_can_still_rewind_to_is_not_kept(tmp_path):
    """With a 128-token window, short turns stay within reach: only the first boundary is
    kept; a turn longer than the window keeps its end."""
    model = make_tiny_model_dir(tmp_path / "m", "gemma3_text", sliding_window=128)
    with Engine(model, tmp_path / "cache", progress=False) as engine:
        messages = [SYSTEM, {"role": "user", "content": "Hi."}]
        reply = engine.chat("short", messages, max_tokens=4)
        messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "More."}]
        engine.chat("short", messages, max_tokens=4)
        assert [c.position for c in resident(engine, "short").checkpoints] == [system_end(engine, TASK_TWO)]
        long_turn = [*messages[:3], TASK_ONE[1]]  # the newest message alone is longer than the window
        engine.chat("long", messages[:2], max_tokens=4)
        engine.chat("long", long_turn, max_tokens=4)
        kept = [c.position for c in resident(engine, "long").checkpoints]
        assert len(kept) == 2 and kept[0] == system_end(engine, TASK_TWO) and kept[1] > kept[0]


def test_a_model_without_sliding_layers_keeps_no_checkpoints(tiny_dirs, tmp_path):
    with Engine(tiny_dirs["llama"], tmp_path, progress=False) as engine:
        prompt = engine.loaded.tokenizer.encode_prompt(engine.loaded.template.render(TASK_ONE))
        assert message_boundaries(engine.loaded, TASK_ONE, prompt) == ()
        engine.chat("plain", TASK_ONE, max_tokens=4)
        assert resident(engine, "plain").checkpoints == []
        engine.flush()
        (record,) = [p for p in tmp_path.rglob("plain.safetensors")]
        assert b"checkpoints" not in record.read_bytes()[:4096]


def test_prefill_plans_end_a_call_at_each_boundary():
    assert prefill_plan(10, 4) == forward_plan(10, 4) == [10]
    assert prefill_plan(600, 256) == forward_plan(600, 256)
    assert prefill_plan(600, 256, [300]) == [256, 44, 256, 43, 1]
    assert prefill_plan(600, 256, [300, 0, 600, 700]) == [256, 44, 256, 43, 1]  # only stops inside count
    assert prefill_plan(600, 256, [300], logits=False) == [256, 44, 256, 44]
    assert json.dumps(prefill_plan(40, 256, [20])) == "[20, 20]"
