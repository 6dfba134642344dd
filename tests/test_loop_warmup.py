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
