"""Shape-invariant kernels (``kvshelf.model.gemv.SHAPE_INVARIANT``): with each row of every
projection its own sgemv (``kvshelf.model.sgemv.each_row``), a row's result does not depend
on how many rows were computed with it (a decode batch of any size, a prefill chunk of any
length), bit for bit; MLX's own matmul (OpenBLAS's sgemm) is the counter-example it fixes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.model.few_rows import system_gemm
from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load
from kvshelf.model.sgemv import block_rows, each_row, system_sgemv

pytestmark = pytest.mark.skipif(system_sgemv() is None, reason="no OpenBLAS loaded (libopenblas0-pthread)")

ROWS = [1, 2, 3, 8, 16, 17, 48, 256, 300, 600]


def _linears(module) -> list[GemvLinear]:
    return [m for _, m in module.named_modules() if isinstance(m, GemvLinear)]


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_a_row_is_the_same_in_any_number_of_rows(tiny_dirs, kind):
    model = load(tiny_dirs[kind], progress=False).model
    fast = with_fast_linears(model, all_rows=True)
    assert isinstance(fast, ProjectedModel) and fast._all_rows
    layers = _linears(fast.body)
    assert layers and all(layer._all_rows for layer in layers)
    rng = np.random.default_rng(3)
    for layer in layers[:4]:  # q/k/v/o of the first layer
        cols = layer.linear["weight"].shape[1]
        x = mx.array(rng.standard_normal((max(ROWS), cols)).astype(np.float32))
        alone = np.concatenate([np.array(layer(x[i : i + 1][None]))[0] for i in range(0, max(ROWS), 29)])
        for n in ROWS:
            picked = np.array(layer(x[:n][None]))[0][::29]  # rows 0, 29, 58... of an n-row product
            assert np.array_equal(picked, alone[: picked.shape[0]]), (kind, n)
    hidden = mx.array(rng.standard_normal((8, 1, model.args.hidden_size)).astype(np.float32))
    batch = np.array(fast.project(hidden))
    for b in range(8):
        assert np.array_equal(np.array(fast.project(hidden[b : b + 1])), batch[b : b + 1])
        # each row of the head is its own sgemv: the very logits a batch-1 decode step gets
        assert np.array_equal(np.array(fast.project_row(hidden[b, 0])), batch[b, 0])


def test_mlx_matmul_rows_depend_on_the_row_count(tiny_dirs):
    """Why the switch exists: OpenBLAS picks its kernel by shape, so a row of a many-row
    product differs from the same row alone (here, in some row count up to 300)."""
    rng = np.random.default_rng(4)
    w = mx.array(rng.standard_normal((256, 640)).astype(np.float32))
    x = mx.array(rng.standard_normal((300, 640)).astype(np.float32))
    one = np.array(x[:1] @ w.T)[0]
    assert any(not np.array_equal(np.array(x[:n] @ w.T)[0], one) for n in (16, 32, 48, 300))


def test_each_rows_product_is_one_sgemv_a_row_wherever_the_row_lies():
    """``each_row`` gives every row sgemv's bits for that row alone, also for rows that lie at
    addresses no multiple of the vector width (a view one float into a buffer)."""
    sgemv = system_sgemv()
    assert sgemv is not None
    rng = np.random.default_rng(12)
    for n, k in ((2048, 640), (576, 1536), (300, 100)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        buffer = rng.standard_normal(5 * k + 1).astype(np.float32)
        shifted = buffer[1:].reshape(5, k)  # rows 4 bytes past an allocation's alignment
        got = each_row(sgemv, shifted, w)
        assert got.shape == (5, n)
        for i in range(5):
            assert np.array_equal(got[i], sgemv(w, np.ascontiguousarray(shifted[i]))), (n, k, i)
            assert np.array_equal(got[i], each_row(sgemv, shifted[i : i + 1], w)[0])
    assert each_row(sgemv, shifted[:0], w).shape == (0, 300)
    with pytest.raises(ValueError, match="each_row"):
        each_row(sgemv, shifted, rng.standard_normal((8, 7)).astype(np.float32))


def test_a_weight_larger_than_a_block_gives_each_row_the_bits_of_one_sgemv():
    """A weight of more rows than ``block_rows`` (a head) is multiplied block by block where
    that was measured to give one sgemv's bits; with a whole number of blocks and with a
    ragged last one, every row equals that row's sgemv over the whole weight."""
    sgemv = system_sgemv()
    assert sgemv is not None
    rng = np.random.default_rng(13)
    k = 640
    for n in (4 * block_rows(k), 3 * block_rows(k) + 100):
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((6, k)).astype(np.float32)
        got = each_row(sgemv, x, w)
        for i in range(6):
            assert np.array_equal(got[i], sgemv(w, x[i])), (n, i)


@pytest.mark.skipif(system_gemm() is None, reason="BLIS (libblis4-pthread) is not installed")
def test_a_product_cut_into_column_parts_is_one_blis_call():
    """A large product runs in column parts, one per core, each a single-threaded BLIS call:
    its bits are those of one uncut call (cuts on multiples of 64 columns, shapes below and
    above the size that is cut, a column count that is no multiple of 64, a 257-row call)."""
    from kvshelf.model.few_rows import _column_cuts, gemm_uncut

    gemm = system_gemm()
    assert gemm is not None
    rng = np.random.default_rng(6)
    for m, n, k in ((1, 640, 2048), (1, 40000, 640), (8, 1000, 640), (257, 2048, 640), (256, 200, 576)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        assert np.array_equal(gemm(x, w), gemm_uncut(x, w)), (m, n, k)
        cuts = _column_cuts(n, 2)
        assert all(c % 64 == 0 for c in cuts[:-1]) and cuts[-1] == n and (len(cuts) > 2) == (n > 64)
    assert _column_cuts(200, 2) == [0, 128, 200] and _column_cuts(64, 4) == [0, 64]
