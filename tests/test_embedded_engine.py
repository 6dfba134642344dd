"""The engine on the real embedded Gemma 3 270M: spec, restart exactness, reuse."""

from __future__ import annotations

import numpy as np
import pytest

from kvshelf.runtime.engine import Engine
from tests.support.subprocesses import continue_in_new_process

pytestmark = pytest.mark.embedded

MESSAGES = [
    {"role": "system", "content": "You are a helpful geography tutor."},
    {"role": "user", "content": "Name the capital of France and one river that flows through it."},
]


def test_embedded_spec(embedded_loaded):
    spec = embedded_loaded.spec
    assert len(spec.layers) == 18
    assert [i for i, layer in enumerate(spec.layers) if not layer.sliding] == [5, 11, 17]
    assert all(layer.window == 512 for layer in spec.layers if layer.sliding)
    assert {(layer.kv_heads, layer.k_head_dim, layer.v_head_dim) for layer in spec.layers} == {(1, 256, 256)}
    # 4-bit packed K+V (256 B) plus fp16 scales and biases per 64 channels (32 B), per layer
    assert spec.layers[0].bytes_per_token(4, 64) == 288
    assert spec.bytes_per_token(None) == 18 * 1024  # fp16: 0.281x of this is Q4


def test_embedded_restore_after_restart_is_bit_identical(embedded_loaded, tmp_path):
    engine = Engine(model=embedded_loaded, cache_dir=tmp_path)
    first = engine.chat("tutor", MESSAGES, max_tokens=12)
    assert first.text.strip()
    follow = [*MESSAGES, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And Germany?"}]
    restored = continue_in_new_process("embedded", tmp_path, "tutor", follow, 12)
    logits = engine.prefill("tutor", follow)
    in_ram = engine.chat("tutor", follow, max_tokens=12)
    assert np.array_equal(restored["logits"], logits)
    assert restored["tokens"] == in_ram.token_ids
    assert restored["cached"] == in_ram.usage.cached_tokens == in_ram.usage.prompt_tokens - 1


def test_embedded_reuses_generated_tokens(embedded_loaded, tmp_path):
    engine = Engine(model=embedded_loaded, cache_dir=tmp_path)
    r1 = engine.chat("geo", MESSAGES, max_tokens=10)
    r2 = engine.chat(
        "geo",
        [*MESSAGES, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "Thanks."}],
        max_tokens=4,
    )
    # Gemma's tokenizer re-encodes the reply to the same ids, so all fed tokens are reused
    assert r2.usage.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens - (
        1 if r1.finish_reason == "length" else 0
    )
