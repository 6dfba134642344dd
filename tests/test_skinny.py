"""The decode step's few-row products (kvshelf.model.skinny): in the row-invariant one every
row has the bits of that row alone whatever rows come with it; in the blocked one a row alone
has those bits and rows together are summed in register blocks; every element of both lies
within the fp32 dot-product bound of the exact product, the weight is read where MLX keeps it
(read-only views included, never copied), and the default kernels send a decode step's rows
(layers and head) through the blocked one (a layer up to MAX_LAYER_ROWS rows) while prefill
rows stay MLX's own."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.model.dot_bound import dot_error_bound
from kvshelf.model.few_rows import MAX_FEW_ROWS
from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.head import ProjectedModel, buffer_view
from kvshelf.model.loader import load
from kvshelf.model.skinny import (
    BLOCK_WEIGHT_ROWS,
    MAX_LAYER_ROWS,
    MIN_LAYER_BYTES,
    PREFETCH_ROWS,
    blocked_product,
    blocked_without_prefetch,
    invariant_blocked_product,
    skinny_product,
)
from tests.support.tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def product():
    got = skinny_product()
    assert got is not None, "numba is a dependency: the skinny product must be there"
    return got


@pytest.fixture(scope="module")
def blocked():
    got = blocked_product()
    assert got is not None and got is not skinny_product(), "the blocked product must pass its check"
    return got


@pytest.mark.parametrize(("n", "k"), [(1024, 640), (4099, 576), (640, 2048), (7, 3)])
def test_blocked_rows_lie_within_the_bound_and_a_row_alone_is_the_invariant_ones(product, blocked, n, k):
    """Every row count a decode step or the head sends (1..MAX_FEW_ROWS, odd ones padded to
    a block): within the bound of the exact product; one row is the row-invariant loop's."""
    rng = np.random.default_rng(n * k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    weight.flags.writeable = False
    x = rng.standard_normal((MAX_FEW_ROWS, k)).astype(np.float32)
    exact = x.astype(np.float64) @ weight.T.astype(np.float64)
    for m in range(1, MAX_FEW_ROWS + 1):
        got = blocked(x[:m], weight)
        assert got.shape == (m, n) and got.dtype == np.float32
        for row, g, e in zip(x, got, exact):
            assert np.all(np.abs(g - e) <= dot_error_bound(weight, row)), m
        assert np.array_equal(got, blocked(x[:m], weight)), m
    assert np.array_equal(blocked(x[3:4], weight), product(x[3:4], weight))


@pytest.mark.parametrize(("n", "k"), [(1024, 640), (4099, 576), (PREFETCH_ROWS + 1, 640), (7, 3), (1, 9)])
def test_asking_for_the_weight_ahead_changes_no_sum(blocked, n, k):
    """The blocks' prefetch is a hint: every row count gives the bits of the same blocks
    without it, the last weight rows included (the rows asked for stop at the weight's end)."""
    rng = np.random.default_rng(n + k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((MAX_FEW_ROWS, k)).astype(np.float32)
    unprefetched = blocked_without_prefetch(eights=BLOCK_WEIGHT_ROWS, fours=BLOCK_WEIGHT_ROWS)
    for m in range(1, MAX_FEW_ROWS + 1):
        assert np.array_equal(blocked(x[:m], weight), unprefetched(x[:m], weight)), m


@pytest.mark.parametrize(("n", "k"), [(1024, 640), (4099, 576), (PREFETCH_ROWS + 1, 640), (7, 3)])
def test_the_row_invariant_blocks_ask_ahead_without_changing_a_sum(n, k):
    """The row-invariant product's blocks prefetch their weight too: every row count gets
    the bits of the same loop without the hint (the last weight rows included)."""
    from kvshelf.model.skinny import INVARIANT_BLOCK, WEIGHT_ROWS, _loop_for

    invariant = invariant_blocked_product()
    assert invariant is not None
    rng = np.random.default_rng(n * k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((12, k)).astype(np.float32)
    for m in (2, 4, 5, 12):
        padded = np.zeros((-(-m // INVARIANT_BLOCK) * INVARIANT_BLOCK, k), dtype=np.float32)
        padded[:m] = x[:m]
        without = np.empty((padded.shape[0], n), dtype=np.float32)
        _loop_for(INVARIANT_BLOCK, WEIGHT_ROWS, weight)(padded, weight, without)
        assert np.array_equal(invariant(x[:m], weight), without[:m]), m


def test_the_prefetch_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KVSHELF_NO_PREFETCH", "1")
    blocked_product.cache_clear()
    try:
        without = blocked_product()
    finally:
        monkeypatch.delenv("KVSHELF_NO_PREFETCH")
        blocked_product.cache_clear()
    with_it = blocked_product()
    assert without is not None and with_it is not None and without is not with_it
    rng = np.random.default_rng(8)
    weight, x = rng.standard_normal((1003, 640), dtype=np.float32), rng.standard_normal((8, 640), dtype=np.float32)
    # eight rows: before the prefetch, blocks of eight took four weight rows at once
    assert np.array_equal(without(x, weight), blocked_without_prefetch()(x, weight))


@pytest.mark.parametrize(("n", "k"), [(1024, 640), (256, 640), (640, 2048), (4099, 576), (7, 3)])
def test_a_row_has_the_same_bits_alone_and_among_others(product, n, k):
    rng = np.random.default_rng(n + k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((MAX_FEW_ROWS, k)).astype(np.float32)
    full = product(x, weight)
    for i in range(MAX_FEW_ROWS):
        assert np.array_equal(product(x[i : i + 1], weight)[0], full[i]), i
    for lo, hi in ((0, 2), (3, 7), (5, 16), (15, 16)):
        assert np.array_equal(product(x[lo:hi], weight), full[lo:hi]), (lo, hi)
    for row, got in zip(x, full):
        bound = dot_error_bound(weight, row)
        assert np.all(np.abs(got.astype(np.float64) - weight.astype(np.float64) @ row.astype(np.float64)) <= bound)


@pytest.mark.parametrize(
    ("n", "k"), [(1024, 640), (1003, 640), (257, 2051), (640, 2048), (192, 576), (96, 33), (7, 64), (3, 5)]
)
def test_the_invariant_blocks_give_a_row_its_bits_in_a_decode_step_and_in_a_prefill_chunk(n, k):
    """What the temperature-0 layers run: a row alone (a decode step), among 2..8 (a batch)
    and in a 256-row chunk at any position has the same bits, within the bound of the exact
    product; weight row counts that are not a multiple of the tile (whose last tile moves
    back) and fewer weight rows than a tile included. A lone row runs its own loop
    (``ALONE_WEIGHT_ROWS``) where that keeps its bits: this is the check that it does."""
    invariant = invariant_blocked_product()
    assert invariant is not None, "numba is a dependency: the invariant blocks must pass their check"
    rng = np.random.default_rng(n + 7 * k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    weight.flags.writeable = False
    x = rng.standard_normal((256, k)).astype(np.float32)
    full = invariant(x, weight)
    exact = x.astype(np.float64) @ weight.T.astype(np.float64)
    for row, got, e in zip(x, full, exact):
        assert np.all(np.abs(got - e) <= dot_error_bound(weight, row))
    for i in (0, 3, 4, 7, 8, 130, 255):
        assert np.array_equal(invariant(x[i : i + 1], weight)[0], full[i]), i
    for lo, hi in ((0, 2), (3, 7), (5, 13), (100, 256)):
        assert np.array_equal(invariant(x[lo:hi], weight), full[lo:hi]), (lo, hi)


def test_the_temperature_zero_layers_run_the_invariant_blocks(tmp_path):
    """``with_fast_linears(all_rows=True)`` (what ``greedy_forward`` builds) sends every row
    count of a layer through ``invariant_blocked_product``, not a row plan: a row's output
    is the same alone and in a 300-row call."""
    path = make_tiny_model_dir(
        tmp_path / "wide", "llama", hidden_size=640, intermediate_size=2048, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, num_hidden_layers=1,
    )  # fmt: skip
    model = load(path, progress=False).model
    fast = with_fast_linears(model, all_rows=True)
    assert isinstance(fast, ProjectedModel) and fast._all_rows
    layers = [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]
    assert layers and all(layer._gemm is invariant_blocked_product() and layer._plan is None for layer in layers)
    rng = np.random.default_rng(23)
    for layer in layers:
        cols = layer.linear["weight"].shape[1]
        x = mx.array(rng.standard_normal((300, cols)).astype(np.float32))
        many = np.array(layer(x[None]))[0]
        for i in (0, 5, 299):
            assert np.array_equal(np.array(layer(x[i : i + 1][None]))[0, 0], many[i]), i


def test_the_weight_is_used_in_place_and_bad_shapes_are_refused(product):
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((300, 64)).astype(np.float32)
    weight.flags.writeable = False  # the head's view of MLX's buffer is read-only
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(product(x, weight), np.stack([product(r[None], weight)[0] for r in x]))
    with pytest.raises(ValueError, match="C-contiguous"):
        product(x, np.asfortranarray(weight))
    with pytest.raises(ValueError, match="skinny"):
        product(x[:, :10], weight)
    with pytest.raises(ValueError, match="skinny"):
        product(x, weight.astype(np.float64))


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KVSHELF_NO_SKINNY", "1")
    skinny_product.cache_clear()
    try:
        assert skinny_product() is None
    finally:
        monkeypatch.delenv("KVSHELF_NO_SKINNY")
        skinny_product.cache_clear()
    assert skinny_product() is not None


def test_the_blocks_can_be_turned_off_and_then_every_product_is_row_invariant(monkeypatch):
    monkeypatch.setenv("KVSHELF_NO_ROW_BLOCKS", "1")
    blocked_product.cache_clear()
    try:
        assert blocked_product() is skinny_product()
    finally:
        monkeypatch.delenv("KVSHELF_NO_ROW_BLOCKS")
        blocked_product.cache_clear()
    assert blocked_product() not in (None, skinny_product())


def test_decode_rows_go_through_it_and_prefill_rows_stay_mlxs(blocked, tmp_path):
    """The default kernels' wrapped layers (a llama wide enough for it): 1..MAX_LAYER_ROWS
    rows are the blocked product's (within the bound of MLX's and of each row alone), more
    are MLX's own, bit for bit; the head's decode rows are the blocked product's too."""
    path = make_tiny_model_dir(
        tmp_path / "wide", "llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
        num_key_value_heads=2, num_hidden_layers=1,
    )  # fmt: skip
    fast = with_fast_linears(load(path, progress=False).model)
    assert isinstance(fast, ProjectedModel)
    layers = [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]
    assert len(layers) == 7 and all(layer._skinny for layer in layers)
    rng = np.random.default_rng(7)
    for layer in layers:
        weight = buffer_view(layer.linear["weight"])
        rows = rng.standard_normal((5, 1, weight.shape[1])).astype(np.float32)
        got = np.asarray(layer(mx.array(rows)))
        assert np.array_equal(got.reshape(5, -1), blocked(rows.reshape(5, -1), weight))
        alone = np.asarray(layer(mx.array(rows[2:3]))).reshape(-1)
        assert np.all(np.abs(alone.astype(np.float64) - got[2].reshape(-1)) <= 2 * dot_error_bound(weight, rows[2, 0]))
        own = np.asarray(layer.linear(mx.array(rows))).reshape(5, -1)
        for g, o, r in zip(got.reshape(5, -1), own, rows.reshape(5, -1)):
            assert np.all(np.abs(g.astype(np.float64) - o) <= 2 * dot_error_bound(weight, r))
        for n in (MAX_LAYER_ROWS + 1, 2 * MAX_FEW_ROWS):
            many = mx.array(rng.standard_normal((1, n, weight.shape[1])).astype(np.float32))
            assert mx.array_equal(layer(many), layer.linear(many)).item()
    hidden = rng.standard_normal((3, 1, fast.weight_view().shape[1])).astype(np.float32)
    logits = np.asarray(fast.project(mx.array(hidden)))
    assert np.array_equal(logits.reshape(3, -1), blocked(hidden.reshape(3, -1), fast.weight_view()))


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_layers_too_small_for_it_keep_mlxs_own_call(blocked, tiny_dirs, kind):
    """A tiny model's weights (under MIN_LAYER_BYTES) keep MLX's product for a decode row,
    bit for bit; its head's rows are still the blocked product's."""
    fast = with_fast_linears(load(tiny_dirs[kind], progress=False).model)
    assert isinstance(fast, ProjectedModel)
    layers = [m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear)]
    assert layers and all(m.linear["weight"].nbytes < MIN_LAYER_BYTES and not m._skinny for m in layers)
    rng = np.random.default_rng(9)
    for layer in layers:
        for n in (1, 3):
            rows = mx.array(rng.standard_normal((n, 1, layer.linear["weight"].shape[1])).astype(np.float32))
            assert mx.array_equal(layer(rows), layer.linear(rows)).item()
    hidden = rng.standard_normal((2, 1, fast.weight_view().shape[1])).astype(np.float32)
    assert np.array_equal(
        np.asarray(fast.project(mx.array(hidden))).reshape(2, -1), blocked(hidden.reshape(2, -1), fast.weight_view())
    )


def test_without_it_the_default_kernels_are_as_before(tiny_dirs):
    """``skinny=False``: a decode row keeps MLX's own call (bit for bit) and the head sgemv."""
    loaded = load(tiny_dirs["llama"], progress=False)
    fast = with_fast_linears(loaded.model, skinny=False)
    assert isinstance(fast, ProjectedModel)
    layer = next(m for _, m in fast.body.named_modules() if isinstance(m, GemvLinear))
    row = mx.array(np.random.default_rng(8).standard_normal((1, 1, layer.linear["weight"].shape[1])), mx.float32)
    assert mx.array_equal(layer(row), layer.linear(row)).item()
