"""Shape-invariant kernels (``kvshelf.model.gemv.SHAPE_INVARIANT``): with every projection's
rows through BLIS, a row's result does not depend on how many rows were computed with it
(a decode batch of any size, a prefill chunk of any length), bit for bit; MLX's own
matmul (OpenBLAS) is the counter-example it fixes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.model.few_rows import system_gemm
from kvshelf.model.gemv import GemvLinear, with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load

pytestmark = pytest.mark.skipif(system_gemm() is None, reason="BLIS (libblis4-pthread) is not installed")

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


def test_mlx_matmul_rows_depend_on_the_row_count(tiny_dirs):
    """Why the switch exists: OpenBLAS picks its kernel by shape, so a row of a many-row
    product differs from the same row alone (here, in some row count up to 300)."""
    rng = np.random.default_rng(4)
    w = mx.array(rng.standard_normal((256, 640)).astype(np.float32))
    x = mx.array(rng.standard_normal((300, 640)).astype(np.float32))
    one = np.array(x[:1] @ w.T)[0]
    assert any(not np.array_equal(np.array(x[:n] @ w.T)[0], one) for n in (16, 32, 48, 300))


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
