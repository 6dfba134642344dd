"""The attention mask as the row-invariant kernels read it: one boolean per query and key.

Both row-invariant attentions (``kvshelf.model.attention``'s fixed-shape blocks and
``kvshelf.model.ordered_attention``'s loop) take mlx-lm's masks (None, ``"causal"`` or
booleans) and must read them alike, so that a row sees the same keys in either.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def full_mask(mask: Any, batch: int, length: int, keys: int) -> mx.array:
    """The mask as booleans of shape (batch, 1, length, keys): True where a query sees a key.

    ``"causal"``: the queries are the last ``length`` key positions (as mlx-lm means it).
    One mask serves every head; a per-head mask is refused."""
    if mask is None:
        return mx.ones((batch, 1, length, keys), dtype=mx.bool_)
    if isinstance(mask, str):
        q = mx.arange(keys - length, keys)[:, None]
        mask = q >= mx.arange(keys)[None]
    if mask.dtype != mx.bool_:
        raise TypeError("row-invariant attention takes boolean masks")
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] != 1:
        raise ValueError(f"row-invariant attention takes one mask for all heads, not {mask.shape}")
    return mx.broadcast_to(mask, (batch, 1, length, keys))
