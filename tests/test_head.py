"""The output projection through sgemv (kvshelf.model.head): bit-identical to the model's
own call where the rows go through MLX, within the fp32 dot-product error bound (with the
greedy token provably unchanged) at batch 1's last position, one projection for that
position whatever the call's length, and the model's own call wherever the wrapper could
not be proven to compute the same function."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from kvshelf.model.dot_bound import dot_error_bound, greedy_is_certain
from kvshelf.model.head import ProjectedModel, with_fast_head
from kvshelf.model.loader import load
from kvshelf.runtime.engine import Engine
from tests.support.subprocesses import run_in_subprocess
from tests.support.tiny import CONFIGS, make_tiny_model_dir

PROMPT = [128, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
KINDS = ["llama", "llama-untied", "gemma3_text", "gemma3_text-tied", "deepseek_v2"]


def tied_gemma_dir(path: Path) -> Path:
    """A tiny gemma3_text saved without ``lm_head``: tied, as the embedded Gemma 3 is."""
    make_tiny_model_dir(path, "gemma3_text")
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    mx.save_safetensors(str(path / "model.safetensors"), {k: v for k, v in weights.items() if k != "lm_head.weight"})
    return path


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory) -> dict[str, nn.Module]:
    root = tmp_path_factory.mktemp("head-models")
    loaded = {kind: load(path).model for kind, path in tiny_dirs.items()}
    loaded["llama-untied"] = load(make_tiny_model_dir(root / "untied", "llama", tie_word_embeddings=False)).model
    loaded["gemma3_text-tied"] = load(tied_gemma_dir(root / "gemma-tied")).model
    return loaded


def head_weight(model: nn.Module) -> np.ndarray:
    layer = model["lm_head"] if "lm_head" in model else model["model"]["embed_tokens"]
    return np.asarray(layer["weight"])


def fast_head(model: nn.Module) -> ProjectedModel:
    fast = with_fast_head(model)
    assert isinstance(fast, ProjectedModel)
    return fast


def test_both_head_shapes_are_covered(models):
    assert "lm_head" not in models["llama"] and "lm_head" in models["llama-untied"]
    assert "lm_head" in models["gemma3_text"] and "lm_head" not in models["gemma3_text-tied"]
    assert "lm_head" in models["deepseek_v2"]


@pytest.mark.parametrize("kind", KINDS)
def test_all_but_the_last_position_are_bit_identical_and_a_batch_row_is_its_agents_own(kind, models):
    """A long call's rows before the last are MLX's own; a decode batch's head rows go through
    the blocked product, within the fp32 bound of MLX's and of the logits the row gets alone
    (the default kernels' rows round by the batch, as MLX's body rows do; the temperature-0
    kernels' are each their own: tests/test_shape_invariant.py)."""
    model = models[kind]
    fast = fast_head(model)
    x = mx.array([PROMPT])
    own, got = model(x), fast(x)
    assert got.shape == own.shape and got.dtype == own.dtype
    assert mx.array_equal(got[:, :-1], own[:, :-1]).item()
    batch = mx.array([[t] for t in PROMPT[:5]])  # five agents decoding one token each
    hidden = model.model(batch)
    rows = np.asarray(fast(batch))
    assert np.array_equal(rows, np.asarray(fast.project(hidden)))
    own_rows = np.asarray(model(batch))
    for b in range(5):
        alone = np.asarray(fast.project(hidden[b : b + 1]))[0, 0]
        bound = dot_error_bound(head_weight(model), np.asarray(hidden[b, 0]))
        assert np.all(np.abs(rows[b, 0].astype(np.float64) - own_rows[b, 0]) <= 2 * bound)
        assert np.all(np.abs(rows[b, 0].astype(np.float64) - alone) <= 2 * bound), b


@pytest.mark.parametrize("kind", KINDS)
def test_batch_one_decode_is_within_the_bound_and_keeps_the_greedy_token(kind, models):
    """Token by token on a cache, as the scheduler decodes one agent: each gemv row lies
    within the fp32 dot-product bound of the model's own row, and its top logit wins by
    more than both evaluations' error, so the greedy token is provably the model's own."""
    model = models[kind]
    fast = fast_head(model)
    weight = head_weight(model)
    own_cache, fast_cache, body_cache = (make_prompt_cache(model) for _ in range(3))
    for t in PROMPT:
        x = mx.array([[t]])
        own = np.asarray(model(x, cache=own_cache)[0, -1])
        got = np.asarray(fast(x, cache=fast_cache)[0, -1])
        hidden = np.asarray(model.model(x, body_cache)[0, -1])
        bound = dot_error_bound(weight, hidden)
        assert np.all(np.abs(got.astype(np.float64) - own) <= 2 * bound)
        assert greedy_is_certain(got, bound) and got.argmax() == own.argmax()


@pytest.mark.parametrize("kind", ["llama", "gemma3_text-tied", "deepseek_v2"])
def test_one_agent_gets_one_projection_at_batch_1_and_the_same_greedy_token_in_a_batch(kind, models):
    """Prefill's last token (a short prompt in one call, a long one ending with a 1-token
    call) and decode at batch 1 see the same gemv, bit for bit. In a batch, an agent's row
    goes through MLX's sgemm (whose rows OpenBLAS may round differently for different batch
    sizes: that was so before this wrapper); it stays within the bound of the batch-1 row
    and keeps its greedy token, provably."""
    model = models[kind]
    fast = fast_head(model)
    hidden = model.model(mx.array([PROMPT]))
    mx.eval(hidden)
    whole, last_only = fast.project(hidden), fast.project(hidden[:, -1:])
    assert mx.array_equal(whole[0, -1], last_only[0, 0]).item()
    assert mx.array_equal(whole[0, -1], fast.project_row(hidden[0, -1])).item()
    weight = head_weight(model)
    rows = hidden[0][:, None]  # each position as one agent of a batch of 14
    for size in (2, 3, 14):
        batched = np.asarray(fast.project(rows[:size]))
        for b in range(size):
            alone = np.asarray(fast.project(rows[b : b + 1])[0, 0])
            bound = dot_error_bound(weight, np.asarray(rows[b, 0]))
            assert np.all(np.abs(batched[b, 0].astype(np.float64) - alone) <= 2 * bound)
            assert greedy_is_certain(alone, bound) and batched[b, 0].argmax() == alone.argmax()


def test_the_weights_are_viewed_not_copied(models):
    fast = fast_head(models["llama"])
    a, b = fast.weight_view(), fast.weight_view()
    assert not a.flags.owndata and not a.flags.writeable
    assert np.shares_memory(a, b)  # a copy per call would give two buffers
    assert np.array_equal(a, head_weight(models["llama"]))


def test_a_quantized_head_runs_through_mlx(tiny_dirs):
    model = load(tiny_dirs["llama"]).model
    nn.quantize(model, group_size=64, bits=4)
    assert type(model["model"]["embed_tokens"]) is nn.QuantizedEmbedding
    assert with_fast_head(model) is model


def test_half_precision_weights_run_through_mlx(tiny_dirs):
    model = load(tiny_dirs["llama"]).model
    model.set_dtype(mx.float16)
    assert with_fast_head(model) is model


class SoftCappedLlama(llama.Model):
    """A llama whose logits are soft-capped after the projection (as gemma2's are)."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return mx.tanh(super().__call__(inputs, cache, input_embeddings) / 30.0) * 30.0


def test_an_architecture_that_does_more_than_project_keeps_its_own_call():
    args = llama.ModelArgs.from_dict(CONFIGS["llama"])
    mx.random.seed(3)
    plain, capped = llama.Model(args), SoftCappedLlama(args)
    capped.update(plain.parameters())
    mx.eval(plain.parameters())
    assert isinstance(with_fast_head(plain), ProjectedModel)  # the control: same weights, plain call
    assert with_fast_head(capped) is capped


def test_the_engine_decodes_through_the_fast_head(tiny_dirs, tmp_path):
    engine = Engine(model=tiny_dirs["gemma3_text"], cache_dir=tmp_path)
    assert isinstance(engine.loaded.forward, ProjectedModel) and engine._scheduler._loaded is engine.loaded
    assert isinstance(engine.loaded.greedy_forward, ProjectedModel)  # temperature 0: the invariant kernels
    assert engine.loaded.model is engine.loaded.forward.inner  # spec and caches see the plain model


def test_without_the_system_openblas_the_model_keeps_its_own_call(tiny_dirs):
    """numpy's bundled BLAS is not used instead: its second thread pool would fight MLX's."""
    code = f"""
import json, os
os.environ["KVSHELF_NO_OPENBLAS"] = "1"
from kvshelf.model import blas
from kvshelf.model.loader import load
loaded = load({str(tiny_dirs["llama"])!r})
print(json.dumps({{"blas": blas.loaded_path, "own_call": loaded.forward is loaded.model}}))
"""
    assert run_in_subprocess(code) == {"blas": None, "own_call": True}


@pytest.mark.embedded
def test_embedded_gemma_real_rows_keep_the_greedy_token(embedded_loaded):
    """On the real 262144x640 tied head: a prompt's hidden rows through gemv stay within
    the bound of MLX's own logits and keep MLX's greedy token."""
    model = embedded_loaded.model
    fast = embedded_loaded.forward
    assert isinstance(fast, ProjectedModel)
    ids = embedded_loaded.tokenizer.encode_prompt("The river that runs past the old mill is called")
    hidden = model.model(mx.array([ids]))
    own = model.model.embed_tokens.as_linear(hidden)
    mx.eval(hidden, own)
    weight = fast.weight_view()
    for i in range(len(ids) - 4, len(ids)):
        got = np.asarray(fast.project_row(hidden[0, i]))
        ref = np.asarray(own[0, i])
        bound = dot_error_bound(weight, np.asarray(hidden[0, i]))
        assert np.all(np.abs(got.astype(np.float64) - ref) <= 2 * bound)
        assert got.argmax() == ref.argmax()
