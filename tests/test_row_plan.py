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


@pytest.mark.parametrize("shape", [(1024, 640), (640, 2048), (2048, 640), (192, 576)])
def test_a_planned_product_gives_every_row_its_one_row_bits_and_no_plan_means_it_cannot(shape):
    """Which shapes get a plan depends on the CPU: OpenBLAS picks its kernels by it. With its
    Zen (AVX2) kernels a product of up to 12 rows keeps one-row bits and larger ones do at
    some positions; with its Cooperlake (AVX-512) kernels on a Zen 4 EPYC some shapes keep
    them at every row count and others not even at 2. So each verdict is checked against
    the definition: a plan's rows are each row alone, and a shape without one has a plain
    product of at most 8 rows that is not."""
    rng = np.random.default_rng(21)
    w = mx.array(rng.standard_normal(shape).astype(np.float32))
    plan = measure(w)
    x = mx.array(rng.standard_normal((max(ROWS) + 5, shape[1])).astype(np.float32))
    alone = _alone(x, w)
    if plan is None:
        assert any(not np.array_equal(np.array(x[:m] @ w.T), alone[:m]) for m in range(2, 9)), shape
        return
    assert plan.small >= 8 and plan.room >= MAX_ROWS
    assert all(size % GROUP == 0 and len(p) <= size for size, p in plan.sizes)
    for n in ROWS:
        for start in (0, 5):
            got = np.array(plan.matmul(x[start : start + n], w))
            assert got.shape == (n, shape[0])
            assert np.array_equal(got, alone[start : start + n]), (shape, n, start)


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
    """A llama with Gemma 3 270M's widths (hidden 640, MLP 2048, 4 heads of 256, one KV head):
    its planned layers (and any left to sgemv) compute every row as that row alone, and the
    whole body stays the model's function. Plans serve where the skinny products are off
    (without numba, or ``skinny=False``); with them, ``invariant_blocked_product`` runs."""
    path = make_tiny_model_dir(
        tmp_path / "wide", "llama", hidden_size=640, intermediate_size=2048, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, num_hidden_layers=1,
    )  # fmt: skip
    model = load(path, progress=False).model
    fast = with_fast_linears(model, all_rows=True, skinny=False)
    assert isinstance(fast, ProjectedModel) and fast._all_rows
    layers = [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]
    planned = [layer for layer in layers if layer._plan is not None]
    assert planned  # the MLP's shapes have plans with OpenBLAS's Zen and Cooperlake kernels alike
    rng = np.random.default_rng(22)
    for layer in layers:
        cols = layer.linear["weight"].shape[1]
        x = mx.array(rng.standard_normal((300, cols)).astype(np.float32))
        alone = np.concatenate([np.array(layer(x[i : i + 1][None]))[0] for i in range(0, 300, 23)])
        for n in (2, 13, 64, 300):
            got = np.array(layer(x[:n][None]))[0]
            assert np.array_equal(got[::23], alone[: len(got[::23])]), n
