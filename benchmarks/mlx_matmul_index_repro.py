"""MLX CPU: a batched matmul whose broadcast operand passes 2**31 logical elements reads the wrong memory.

A minimal reproduction for an upstream report (plain MLX, numpy only to count). MLX's CPU
backend runs a batch of products as one ``cblas_sgemm`` per product (mlx/backend/cpu/gemms/
cblas.cpp) and finds product ``i``'s right-hand side at ``elem_to_loc(K * N * i, shape,
strides)``; ``elem_to_loc`` takes the index as an ``int`` (mlx/backend/common/utils.h). With
``b`` broadcast over a batch axis, ``K * N * i`` is a logical index, so it passes 2**31 while
every real offset is small, wraps negative, and the products from there on read memory
before ``b``: wrong values, often NaN. kvshelf's row-invariant attention (one product per
8-row tile of queries by each 256-key block, keys broadcast over the tiles) hit it on a
2,905-token prefill in one call of Gemma 3 270M; ``kvshelf.model.attention`` now keeps every
call below the index (``MLX_INDEX_LIMIT``).

Measured with mlx 0.32.4 (mlx[cpu], Linux x86-64, Debian's OpenBLAS): 651 of 33,419 products
wrong, the first at product 32,768 (= 2**31 / (256 * 256)); 476 non-finite elements with 1-row
products and 5,541 with 8-row ones (whatever lay in that memory). The same products in smaller
batches are right. The BLAS does not matter: the index is computed before it is called.

    python benchmarks/mlx_matmul_index_repro.py [--rows 1]
"""

import argparse
from importlib.metadata import version

import mlx.core as mx
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, default=1, help="rows of each left-hand product (kvshelf's tiles: 8)")
args = p.parse_args()

# 1453 x 23 products of (rows x 256) @ (256 x 256): b holds 23 right-hand sides, broadcast over
# the first axis, so b's logical index 256 * 256 * i passes 2**31 at product 32,768.
tiles, blocks, k = 1453, 23, 256
a = mx.random.normal((tiles, blocks, args.rows, k), key=mx.random.key(0))
b = mx.random.normal((1, blocks, k, k), key=mx.random.key(1))
got = a @ b
want = mx.concatenate([a[i : i + 100] @ b for i in range(0, tiles, 100)])  # the same products, 100 tiles at a time
# a product is wrong where it is off by more than rounding, or not finite (NaN compares false)
wrong = ~(np.array(mx.abs(got - want).max(axis=(-1, -2))).reshape(-1) <= 1e-4)
first = int(np.argmax(wrong)) if wrong.any() else None
print(f"mlx {version('mlx')}: {int(wrong.sum())} of {tiles * blocks} products wrong, first at {first}")
print(f"  (2**31 / (256 * 256) = {2**31 // (k * k)}); non-finite elements: {int((~np.isfinite(np.array(got))).sum())}")
