"""Row-invariant attention as one compiled loop: each query row sums its keys in position order.

Why: the temperature-0 kernels need a row's attention to have the same bits whatever came
with it (``kvshelf.model.attention`` says why). ``invariant_attention`` gets that from
MLX's products by giving them fixed shapes (tiles of query rows by 256-key blocks aligned
to absolute positions), which takes tens of MLX operations a layer: padding every member
onto the blocks, masking, a maximum, the exponentials, two products and two cumulative
sums. In a decode step each costs MLX's fixed price for one operation, and a profile of
the embedded Gemma 3 at temperature 0 and 1K context spent about 12 ms of an 85 ms step
there (py-spy, 2026-12-05).

Here every (member, query head, query row) is one job of a numba loop, and its bits
depend on nothing but its own query and the keys/values it may see, by construction:

- a score is one dot product over the head's dims (one compiled loop, vectorized the same
  way for every key);
- the maximum is exact in any order;
- the weights, their sum and the weighted sum of values run over the visible keys one
  after the other in column order, which is position order in every cache here (column
  ``c`` is position ``origin + c``), with no reassociation: a key the row may not see is
  skipped, so padding, a window that starts elsewhere or more columns change nothing;
- the normalization comes last (``numerator / denominator``).

So a decode row has the bits the same token gets inside a 256-row prefill chunk, at batch
1 or among other agents. It is not ``invariant_attention`` bit for bit (other sums), only
to fp32 rounding; the temperature-0 kernels use one or the other for every call, never
both (``InvariantAttention``). Without numba, or with ``KVSHELF_NO_ORDERED_ATTENTION=1``,
they keep ``invariant_attention``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.model.arrays import buffer_view
from kvshelf.model.attention_mask import full_mask
from kvshelf.switches import env_on


@cache
def _kernel() -> Any:
    """The compiled loop (numba, cached on disk); None without numba."""
    try:
        from numba import njit, prange
    except ImportError:
        return None

    from kvshelf.model import ordered_dot  # a module attribute, so numba's disk cache finds the loop

    # No reassociation here: the sums over keys run in column order.
    @njit(parallel=True, fastmath={"contract"}, cache=True, boundscheck=False)
    def attend(
        q: np.ndarray, keys: np.ndarray, values: np.ndarray, seen: np.ndarray, scale: np.float32, out: np.ndarray
    ) -> None:
        members, heads, rows, d = q.shape
        kv, columns, dv = keys.shape[1], keys.shape[2], values.shape[3]
        group = heads // kv
        for job in prange(members * heads * rows):
            b = job // (heads * rows)
            h = (job // rows) % heads
            r = job % rows
            g = h // group
            query = np.empty(d, dtype=np.float32)
            for i in range(d):
                query[i] = q[b, h, r, i] * scale
            scores = np.empty(columns, dtype=np.float32)
            top = np.float32(-np.inf)
            for c in range(columns):
                if seen[b, r, c]:
                    s = ordered_dot.dot(query, keys[b, g, c])
                    scores[c] = s
                    top = max(top, s)
            num = np.zeros(dv, dtype=np.float32)
            den = np.float32(0.0)
            if top > -np.inf:
                for c in range(columns):
                    if seen[b, r, c]:
                        w = np.float32(np.exp(scores[c] - top))
                        den += w
                        for e in range(dv):
                            num[e] += w * values[b, g, c, e]
                for e in range(dv):
                    out[b, h, r, e] = num[e] / den
            else:  # a row that sees no key (a padded one): zeros, not 0 / 0
                for e in range(dv):
                    out[b, h, r, e] = 0.0

    return attend


def ordered_attention_available() -> bool:
    """Whether ``ordered_attention`` runs here (numba, and not switched off)."""
    return not env_on("KVSHELF_NO_ORDERED_ATTENTION") and _kernel() is not None


def _seen(mask: Any, batch: int, length: int, keys: int) -> np.ndarray:
    """The mask as (batch, length, keys) bytes, 1 where a query sees a key."""
    return np.ascontiguousarray(buffer_view(full_mask(mask, batch, length, keys))[:, 0], dtype=np.uint8)


def _rows(x: mx.array) -> np.ndarray:
    """``x`` as a C-contiguous fp32 numpy array (a copy where MLX's layout is another)."""
    return np.ascontiguousarray(buffer_view(x.astype(mx.float32)))


def ordered_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention whose rows do not depend on the other rows, columns or batch members.

    queries (B, heads, L, d); keys (B, kv_heads, T, d); values (B, kv_heads, T, dv), column
    order being position order; ``mask``: None, ``"causal"`` or booleans broadcastable to
    (B, 1, L, T). Out: (B, heads, L, dv), computed in fp32, in the queries' dtype."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("ordered attention needs numba")
    b, heads, length, d = queries.shape
    kv, t, dv = keys.shape[1], keys.shape[2], values.shape[3]
    if heads % kv or keys.shape[0] != b or values.shape[:3] != keys.shape[:3] or keys.shape[3] != d:
        raise ValueError(f"attention shapes: queries {queries.shape}, keys {keys.shape}, values {values.shape}")
    out = np.empty((b, heads, length, dv), dtype=np.float32)
    kernel(_rows(queries), _rows(keys), _rows(values), _seen(mask, b, length, t), np.float32(scale), out)
    return mx.array(out).astype(queries.dtype)
