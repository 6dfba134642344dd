"""Tiny random-weight mlx-lm models, saved as real model directories.

They load through the same path as any user model (``Engine(model=path)``), build
in milliseconds, and cover the three cache geometries kvshelf must handle: plain
GQA (llama), sliding-window plus global layers (gemma3_text) and MLA with different
K and V head dims (deepseek_v2).
"""

from __future__ import annotations

import json
from pathlib import Path

import kvshelf  # noqa: F401  (OpenBLAS before mlx: imported alone, e.g. by benchmarks/crash.py)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VOCAB = 130  # 128 ASCII bytes + <s> + </s>: every generated id decodes to valid text

CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        sliding_window=16,
        sliding_window_pattern=2,
        query_pre_attn_scalar=64,
        max_position_embeddings=4096,
    ),
    "deepseek_v2": dict(
        model_type="deepseek_v2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=48,
        v_head_dim=32,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096},
    ),
}


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest above 255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> Tokenizer:
    """Every ASCII byte is one token (id = byte value); ``<s>`` is 128 and ``</s>`` 129.

    With only ASCII in the vocabulary, whatever a random model generates decodes to
    valid text and re-encodes to the same ids, as a real tokenizer's output does.
    """
    chars = _byte_to_char()
    vocab = {chars[b]: b for b in range(128)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Added as plain (not "special") tokens so that decoding keeps them as text: a
    # random model may emit <s>, and its reply must still re-encode to the same ids.
    tok.add_tokens([AddedToken("<s>", special=False), AddedToken("</s>", special=False)])
    return tok


def make_tiny_model_dir(path: Path, kind: str, seed: int = 0, eos: bool = True, **overrides) -> Path:
    """Build a random-weight model of ``kind`` and save it as an mlx-lm directory.

    ``eos=False`` declares no end-of-sequence token, so replies run to ``max_tokens``
    (for tests that need a long generation to interrupt).
    """
    config = {**CONFIGS[kind], **overrides}
    path.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(
        json.dumps({**config, "bos_token_id": 128, **({"eos_token_id": 129} if eos else {})})
    )
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", **({"eos_token": "</s>"} if eos else {})})
    )
    return path
