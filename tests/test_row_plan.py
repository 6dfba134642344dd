"""``kvshelf.model.row_plan``: MLX's own matmul, every row with the bits of its one-row product.

The plan is measured on the weight's shape; what it must give is checked here against the
definition (each row alone, through MLX), for row counts on both sides of every size it
uses, at offsets that are no multiple of its tiles, and in the layers of a model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load
from kvshelf.model.row_plan import GROUP, MAX_ROWS, measure
from kvshelf.model.sgemv import system_sgemv
from tests.support.tiny import make_tiny_model_dir

pytestmark = pytest.mark.skipif(system_sgemv() is None, reason="no OpenBLAS loaded (libopenblas0-pthread)")

ROWS = [1, 7, 12, 13, 16, 24, 25, 47, 100, 256, 257, 531]


def _alone(x: mx.array, w: mx.array) -> np.ndarray:
    return np.concatenate([np.array(x[i : i + 1] @ w.T) for i in range(x.shape[0])])


@pytest.mark.parametrize("shape", [(1024, 640), (640, 2048), (192, 576)])
def test_every_row_of_a_planned_product_has_its_one_row_bits(shape):
    rng = np.random.default_rng(21)
    w = mx.array(rng.standard_normal(shape).astype(np.float32))
    plan = measure(w)
    assert plan is not None and plan.small >= 8 and plan.room >= MAX_ROWS
    assert all(size % GROUP == 0 and len(p) < size for size, p in plan.sizes)
    x = mx.array(rng.standard_normal((max(ROWS) + 5, shape[1])).astype(np.float32))
    alone = _alone(x, w)
    for n in ROWS:
        for start in (0, 5):
            got = np.array(plan.matmul(x[start : start + n], w))
            assert got.shape == (n, shape[0])
            assert np.array_equal(got, alone[start : start + n]), (shape, n, start)
    # MLX's own product of as many rows differs in some of them: what the plan is for
    assert not np.array_equal(np.array(x[:256] @ w.T), alone[:256])


def test_a_shape_without_a_plan_keeps_sgemv_rows(tiny_dirs):
    """A tiny model's weights (OpenBLAS runs them otherwise) get no plan, and their layers
    keep one sgemv a row."""
    assert measure(mx.zeros((128, 128))) is None
    model = load(tiny_dirs["llama"], progress=False).model
    fast = with_fast_linears(model, all_rows=True)
    assert isinstance(fast, ProjectedModel)
    layers = [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]
    assert layers and all(layer._all_rows and layer._plan is None for layer in layers)


def test_a_models_planned_layers_give_a_row_the_same_bits_in_any_number_of_rows(tmp_path):
    """A llama wide enough for plans: its planned layers (and any left to sgemv) compute
    every row as that row alone, and the whole body stays the model's function."""
    path = make_tiny_model_dir(
        tmp_path / "wide", "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
        num_key_value_heads=2, num_hidden_layers=1,
    )  # fmt: skip
    model = load(path, progress=False).model
    fast = with_fast_linears(model, all_rows=True)
    assert isinstance(fast, ProjectedModel) and fast._all_rows
    layers = [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]
    planned = [layer for layer in layers if layer._plan is not None]
    assert len(planned) >= 4  # q/o and the MLP's three (k/v, 128 rows, may have none)
    rng = np.random.default_rng(22)
    for layer in layers:
        cols = layer.linear["weight"].shape[1]
        x = mx.array(rng.standard_normal((300, cols)).astype(np.float32))
        alone = np.concatenate([np.array(layer(x[i : i + 1][None]))[0] for i in range(0, 300, 23)])
        for n in (2, 13, 64, 300):
            got = np.array(layer(x[:n][None]))[0]
            assert np.array_equal(got[::23], alone[: len(got[::23])]), n
