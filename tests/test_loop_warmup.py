"""``kvshelf.runtime.loop_warmup``: the first engine after an install runs loops that a
child compiled, so its agents get the bits that every later engine gives them.

Without the child (``KVSHELF_NO_LOOP_WARMUP=1``, the same two processes, scratch,
2026-12-07), the first engine on a fresh numba cache compiled 53 loop variants itself and
its agents' logits hashed otherwise than the next engine's over the same cache."""

from __future__ import annotations

import pytest

from kvshelf.runtime.loop_warmup import STAMPS
from tests.support.first_engine import agents_in_a_process


@pytest.mark.embedded
def test_the_first_engine_on_a_fresh_cache_gives_agents_the_bits_the_next_one_gives(tmp_path):
    first = agents_in_a_process(tmp_path)  # a fresh cache: the child compiles every loop
    assert first["compiled"] == []  # the engine's process loaded them all
    assert len(list((tmp_path / STAMPS).iterdir())) == 1  # the next engine needs no child
    second = agents_in_a_process(tmp_path)
    assert second["compiled"] == []
    assert second["logits"] == first["logits"]


def test_a_stamp_that_cannot_be_written_costs_the_engine_nothing(tiny_dirs, tmp_path, monkeypatch):
    """Where the stamp's directory cannot be made (here a path under a file), the child
    still runs and the engine starts and answers; the next engine runs the child again."""
    from kvshelf import Engine
    from kvshelf.runtime.loop_warmup import compile_in_child, stamp_path

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSHELF_HOME", str(blocker / "home"))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.delenv("KVSHELF_NO_LOOP_WARMUP", raising=False)
    model = tiny_dirs["llama"]
    fingerprint = "not-a-model-fingerprint"  # a stamp no run has written
    assert compile_in_child(model, fingerprint, progress=False)  # the child ran; no stamp
    assert not stamp_path(model, fingerprint).exists()
    with Engine(model=model, cache_dir=tmp_path / "store", progress=False) as engine:
        reply = engine.chat("a", [{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0)
    assert reply.usage.completion_tokens >= 1
