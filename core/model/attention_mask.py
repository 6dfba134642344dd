"""The attention mask as the row-invariant kernels read it: one boolean per query and key.

Both row-invariant attentions (``kvshelf.model.attention``'s fixed-shape blocks and
``kvshelf.model.ordered_attention``'s loop) take mlx-lm's masks (None, ``"causal"`` or
booleans) and must read them alike, so that a row sees the same keys in either.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.model.arrays import buffer_view


def seen_keys(mask: Any, batch: int, length: int, keys: int) -> np.ndarray:
    """The mask as numpy booleans of shape (batch, length, keys): True where a query sees a
    key (a broadcast view; numpy, so that a decode step builds and evaluates no MLX array).

    ``"causal"``: the queries are the last ``length`` key positions (as mlx-lm means it).
    One mask serves every head; a per-head mask is refused."""
    if mask is None:
        return np.ones((batch, length, keys), dtype=np.bool_)
    if isinstance(mask, str):
        rows = np.arange(keys - length, keys)[:, None] >= np.arange(keys)[None]
        return np.broadcast_to(rows, (batch, length, keys))
    if mask.dtype != mx.bool_:
        raise TypeError("row-invariant attention takes boolean masks")
    given = buffer_view(mask)
    while given.ndim < 4:
        given = given[None]
    if given.shape[1] != 1:
        raise ValueError(f"row-invariant attention takes one mask for all heads, not {mask.shape}")
    return np.broadcast_to(given[:, 0], (batch, length, keys))


def full_mask(mask: Any, batch: int, length: int, keys: int) -> mx.array:
    """``seen_keys`` as an MLX array of shape (batch, 1, length, keys)."""
    return mx.array(np.ascontiguousarray(seen_keys(mask, batch, length, keys)))[:, None]
