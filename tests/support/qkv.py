"""Random queries, keys and values for the attention kernels' tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def random_qkv(seed: int, heads: int, kv: int, length: int, d: int) -> tuple[mx.array, mx.array, mx.array]:
    """fp32 normals, (1, heads, length, d) queries and (1, kv, length, d) keys and values."""
    rng = np.random.default_rng(seed)
    q, k, v = (mx.array(rng.standard_normal((1, h, length, d)).astype(np.float32)) for h in (heads, kv, kv))
    return q, k, v
