"""Prompt token ids equal transformers' ``apply_chat_template`` for every kind of model
directory: with or without a chat template, with or without ``add_bos_token``, and where
the BOS is a ChatML marker (which used to come out twice)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from kvshelf.model.embedded import GEMMA_CHAT_TEMPLATE
from kvshelf.model.loader import load
from kvshelf.model.template import ChatMLTemplate, GemmaTemplate

# transformers' own former default (``default_chat_template``, ChatML): what kvshelf's
# ChatMLTemplate renders for a directory without a template.
CHATML_JINJA = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_FIRST = "{{ bos_token }}" + CHATML_JINJA

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
]


def model_dir(tiny: Path, tmp: Path, config: dict, im_tokens: bool = False) -> Path:
    """A copy of a tiny model directory with this ``tokenizer_config.json``."""
    out = tmp / "model"
    shutil.copytree(tiny, out)
    if im_tokens:  # a ChatML vocabulary: its markers are special tokens
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
        tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def reference_ids(path: Path, messages: list[dict], template: str) -> list[int]:
    """transformers' ids; a directory without a template renders the one kvshelf uses for it."""
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    ids = tok.apply_chat_template(messages, chat_template=tok.chat_template or template, add_generation_prompt=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def kvshelf_ids(path: Path, messages: list[dict]) -> list[int]:
    loaded = load(path, progress=False)
    return loaded.tokenizer.encode_prompt(loaded.template.render(messages))


Case = tuple[dict[str, object], bool, str, int]  # tokenizer_config, ChatML markers, reference template, BOS count

CASES: dict[str, Case] = {
    # the tiny llama as built: a bos_token, no add_bos_token, no template (HF: no BOS)
    "no template": ({"bos_token": "<s>", "eos_token": "</s>"}, False, CHATML_JINJA, 0),
    # the double-BOS case: a ChatML vocabulary whose bos_token is <|im_start|>
    "chatml bos": ({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, True, CHATML_JINJA, 0),
    # a template that writes no BOS, even though add_bos_token says so
    "template without bos": (
        {"bos_token": "<s>", "add_bos_token": True, "chat_template": CHATML_JINJA},
        True,
        CHATML_JINJA,
        0,
    ),
    # a template that writes the BOS, even though add_bos_token says not to
    "template with bos": (
        {"bos_token": "<s>", "add_bos_token": False, "chat_template": BOS_FIRST},
        True,
        BOS_FIRST,
        1,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_ids_equal_transformers(tiny_dirs, tmp_path, case):
    config, im_tokens, template, bos_count = CASES[case]
    path = model_dir(tiny_dirs["llama"], tmp_path, config, im_tokens)
    bos = 128 if config["bos_token"] == "<s>" else None
    for messages in CONVERSATIONS:
        ours = kvshelf_ids(path, messages)
        assert ours == reference_ids(path, messages, template), case
        if bos is not None:
            assert ours[:1].count(bos) == bos_count and ours.count(bos) == bos_count
        else:  # <|im_start|> opens every turn, and never twice in a row
            start = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_start|>")
            assert ours[0] == start and ours[1] != start
    assert isinstance(load(path, progress=False).template, ChatMLTemplate) == ("chat_template" not in config)


def test_gemma_directory_gets_one_bos(tiny_dirs, tmp_path):
    """A Gemma directory renders Gemma's turns, whose reference template writes the BOS."""
    path = model_dir(tiny_dirs["gemma3_text"], tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    assert isinstance(load(path, progress=False).template, GemmaTemplate)
    for messages in CONVERSATIONS:
        ours = kvshelf_ids(path, messages)
        assert ours == reference_ids(path, messages, GEMMA_CHAT_TEMPLATE)
        assert ours[0] == 128 and ours.count(128) == 1
