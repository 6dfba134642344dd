"""Decode attention on the CPU with a KV head's query heads as the rows of one product.

Why: MLX's CPU ``scaled_dot_product_attention`` is its fallback (mlx/fast.cpp, 0.32.4):
scale, ``Q @ K.T``, softmax, ``@ V``. For grouped-query attention it unflattens the query
heads to (B, kv_heads, group, L, d) and broadcasts the keys over the group, so a decode
step (L = 1) runs ``group`` one-row products per KV head, and OpenBLAS packs the same
keys (and then the same values) once for each: Gemma 3 270M's 4 query heads read their
one KV head's 1K x 256 keys four times. Here the group's query heads are the rows of one
product per KV head (B, kv_heads, group, d) @ (B, kv_heads, d, T), the rest as MLX does
it (its bool-mask fill value, its precise softmax). Side by side
(``benchmarks/grouped_attention.py``, ``results/grouped-attention-20261202-190050.json``)
that took a step's attention from 21.9 to 9.2 ms (Gemma 3, 18 layers, 1K context, batch 1)
and from 96.7 to 62.1 ms (the 30-layer llama at 4K); whole steps are in the README.

The default kernels' decode steps that ``kvshelf.model.native_decode`` takes (up to 8
agents, a known architecture) run its numba attention instead; this serves the rest.
Only decode steps (one query per member) and only dense keys: a prefill runs the
module's own attention (its products have L rows already), and so do packed keys
(plain Q4's ``quantized_matmul``) and Metal, whose ``scaled_dot_product_attention`` is a
fused kernel. It is not shape-invariant (OpenBLAS rounds a row by the product's shape,
``kvshelf.model.attention``), and need not be: temperature-0 requests run the invariant
kernels; this is the default path's, which is checked against the module's own to fp32
rounding at load (``kvshelf.model.attention.known_attention_body``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from kvshelf.model.attention import InvariantAttention, known_attention_body


def grouped_decode_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """Attention of one query per member: queries (B, heads, 1, d), keys (B, kv_heads, T, d),
    values (B, kv_heads, T, dv), ``mask`` None or broadcastable to (B, 1, 1, T) (bool, or
    added to the scores); returns (B, heads, 1, dv)."""
    b, heads, length, d = queries.shape
    kv = keys.shape[1]
    if length != 1 or heads % kv:
        raise ValueError(f"grouped decode attention takes one query per member: {queries.shape} over {keys.shape}")
    q = (queries * mx.array(scale, dtype=queries.dtype)).reshape(b, kv, heads // kv, d)
    scores = q @ keys.swapaxes(-1, -2)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(b, heads, 1, values.shape[-1])


def _one_row_mask(mask: Any) -> bool:
    """Whether ``mask`` is one a decode step's scores (B, kv, group, T) can take as it is:
    None, or an array with one head row and one query row."""
    if mask is None:
        return True
    if not isinstance(mask, mx.array):
        return False
    return mask.ndim < 3 or (mask.shape[-2] == 1 and (mask.ndim < 4 or mask.shape[-3] == 1))


class GroupedDecodeAttention(nn.Module):
    """An mlx-lm attention module of a known shape whose decode steps run
    ``grouped_decode_attention`` over dense keys; everything else runs the module's own."""

    def __init__(self, projector: InvariantAttention):
        super().__init__()
        self.projector = projector  # the module's projections, recomputed as the module computes them

    @property
    def attention(self) -> nn.Module:
        return self.projector.attention

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        a = self.attention
        b, length, _ = x.shape
        if cache is None or length != 1 or not _one_row_mask(mask):
            return a(x, mask, cache)
        q, k, v = self.projector.project(x, cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        if hasattr(cache, "bits"):  # packed rows: mlx-lm's quantized attention, as the module decides
            out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=a.scale, mask=mask)
        else:
            out = grouped_decode_attention(q, keys, values, a.scale, mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def grouped_attention_body(module: nn.Module, wrapped: list | None = None) -> nn.Module:
    """A copy of ``module``'s tree over the same arrays whose known attention modules run
    their decode steps as ``GroupedDecodeAttention`` (on the CPU; on Metal ``module``)."""
    if mx.default_device() != mx.cpu:
        return module
    return known_attention_body(module, GroupedDecodeAttention, wrapped)
