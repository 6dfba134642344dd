"""Row-invariant attention over kvshelf's caches, each KV head read once for all its query heads.

Why: a greedy reply must not depend on what happened to the cache (issue 21). MLX's
``scaled_dot_product_attention`` (its CPU fallback: matmul, softmax, matmul) gives a
query row bits that depend on how many key columns come with it: the softmax sums and
the ``P @ V`` product reduce over every column the cache handed over, so the same
visible keys at other columns (a sliding buffer that starts elsewhere, blocks shown
twice in a prefill chunk, a batch's left padding, a longer one-call prefill) round
differently, and a 4-bit bin edge turns that into a different token several layers on.

``invariant_attention`` computes each row so that its bits depend only on its own query
and the keys/values it may see, by construction:

- the keys are laid out in 256-token blocks aligned to absolute positions (each batch
  member's columns shifted by zero padding so that column ``c`` is position
  ``origin + c`` and every block starts at a multiple of ``BLOCK_TOKENS``);
- scores are one product per KV head, the query heads that share it as its rows
  (grouped-query attention reads each KV head once), cut into products of a fixed
  shape: tiles of ``tile_rows()`` query rows by one block of keys, whose bits do not
  depend on a row's place in the tile (checked at first use);
- masked scores get exactly zero weight; the maximum is exact in any order;
- the softmax denominator and ``P @ V`` are summed per absolute block (256 columns,
  a fixed shape) and the blocks are added one after the other from the first
  (``cumsum`` along the blocks). A block no query sees adds an exact zero, so neither
  a block before the window, nor padding, nor a longer buffer changes a bit;
- the normalization comes last (``numerator / denominator``).

So a row computed alone, inside a 256-row chunk, at batch 1 or among 7 other agents,
from a buffer that starts at 0 or at its window gives the same bits, and grouped-head
attention equals per-head attention bit for bit (a head is a row like any other).
It is not MLX's function bit for bit (normalizing last, another summation order): it
agrees with it to fp32 rounding (``tests/test_invariance.py``).

Cost: a decode step's products are few (one tile of rows per KV head), but a prefill
chunk's are many small ones (a 256-token chunk of Gemma 3: 128 tiles by each key block,
twice), which OpenBLAS runs far below its speed on one large product. Measured per layer
for such a chunk at 1K context (embedded Gemma 3 shapes, load ~2): 58 ms against 26 for
MLX's own attention, of which the scores 17, ``P @ V`` 17.5 and the mask, maximum and
exponentials 25; the exponentials now go through numpy's SIMD loop
(``kvshelf.model.fast_exp``, 2-5x MLX's CPU exp). Scores as one row-planned product per
KV head (``kvshelf.model.row_plan``) gave the same bits and no measurable gain (tried
2026-12-03), and 16-row tiles (row-invariant here for 128- and 256-dim heads) none
beyond noise.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from kvshelf.model.arrays import buffer_view
from kvshelf.model.attention_mask import full_mask
from kvshelf.model.fast_exp import exp
from kvshelf.model.module_tree import with_children
from kvshelf.model.ordered_attention import ordered_attention, ordered_attention_available, ordered_rows
from kvshelf.model.spec import BLOCK_TOKENS

# Row tiles tried, largest first: a product of this many query rows by one key block.
TILE_CANDIDATES = (8, 4, 2)

# MLX's CPU matmul (0.32.4: mlx/backend/cpu/gemms/cblas.cpp) finds each product of a batch
# by the logical index of its first element, passed through an ``int`` (``elem_to_loc`` in
# mlx/backend/common/utils.h). For an operand broadcast over the batch, whose logical size is
# the batch times each product's, that index passes 2**31 on long calls, and the products after
# it read memory outside the operand: wrong rows, sometimes NaN (a 2,905-token prefill in one
# call of Gemma 3 270M's 4 query heads of 256 dims hit it). ``benchmarks/mlx_matmul_index_repro.py``
# shows it in a few lines, for upstream. So no product here passes this many logical elements.
MLX_INDEX_LIMIT = 2**31 - 1


@cache
def tile_rows() -> int:
    """The largest row tile whose products give a row the same bits in any of its places.

    MLX's CPU matmul is OpenBLAS's sgemm, which picks its kernel by shape: a row of a
    256-row product differs from that row alone in the last bits, and so does a column of
    a 4-column product. A product of a fixed shape is one kernel, though, and up to 8 rows
    it holds every row in lanes of the same vector registers (measured with OpenBLAS
    0.3.21 on x86-64: rows permuted within an 8-row tile keep their bits; 16 and 32 do
    not). So attention multiplies tiles of exactly this many rows by blocks of exactly
    ``BLOCK_TOKENS`` keys. Checked here on both products' shapes; 1 where nothing passes."""
    key = mx.random.key(11)
    for rows in TILE_CANDIDATES:
        if all(_tile_invariant(rows, inner, cols, key) for d in (64, 128, 256) for inner, cols in ((d, 256), (256, d))):
            return rows
    return 1


def _tile_invariant(rows: int, inner: int, cols: int, key: mx.array) -> bool:
    """Rows permuted within their tiles keep their bits, in products laid out as the
    kernel lays them out: (tiles, 1, rows, inner) @ (1, blocks, inner, cols)."""
    ka, kb, kp = mx.random.split(key, 3)
    a = mx.random.normal((1, 1, 5, 1, rows, inner), key=ka)
    b = mx.random.normal((1, 1, 1, 3, inner, cols), key=kb)
    base = a @ b
    for t in range(3):
        perm = mx.random.permutation(rows, key=mx.random.split(kp, 3)[t])
        if not mx.array_equal(a[..., perm, :] @ b, base[..., perm, :]).item():
            return False
    return True


def _blocked_scores(q: mx.array, keys: mx.array, blocks: int) -> mx.array:
    """Tiles of query rows (B, kv, tiles, 1, tile, d) by each block of keys (B, kv, width, d):
    one product of a fixed shape (tile × BLOCK_TOKENS) per tile and block; (B, kv, rows, width)."""
    b, kv, tiles, _, tile, d = q.shape
    k_blocks = keys.reshape(b, kv, 1, blocks, BLOCK_TOKENS, d).swapaxes(-1, -2)
    return (q @ k_blocks).swapaxes(3, 4).reshape(b, kv, tiles * tile, blocks * BLOCK_TOKENS)


def _wide_scores(q: mx.array, keys: mx.array) -> mx.array:
    """The same scores as one product per tile by all the keys at once (tile × width): no
    per-block calls and no copy back into rows."""
    b, kv, tiles, _, tile, _ = q.shape
    return (q @ keys.swapaxes(-1, -2)[:, :, None, None]).reshape(b, kv, tiles * tile, keys.shape[2])


@cache
def wide_scores_agree(tile: int, d: int, width: int) -> bool:
    """Whether ``_wide_scores`` gives ``_blocked_scores``'s bits for these shapes.

    Each output element is one dot product of ``d`` terms either way, but OpenBLAS picks its
    kernel and its threads' split by the product's shape (a product of 1024 key columns by
    64-wide heads splits otherwise than 256 columns do, and rounds otherwise), so this is
    measured per shape, once per process, on products laid out as the kernel lays them out."""
    ka, kb = mx.random.split(mx.random.key(7 + width))
    q = mx.random.normal((1, 2, 3, 1, tile, d), key=ka)
    keys = mx.random.normal((1, 2, width, d), key=kb)
    return bool(mx.array_equal(_wide_scores(q, keys), _blocked_scores(q, keys, width // BLOCK_TOKENS)).item())


def _scores(q: mx.array, keys: mx.array, blocks: int) -> mx.array:
    """Scores of every (padded) query row against every key column, (B, kv, rows, width):
    the blocked products' bits, through the wide product where that was shown to be them."""
    if blocks > 1 and wide_scores_agree(q.shape[4], q.shape[5], keys.shape[2]):
        return _wide_scores(q, keys)
    return _blocked_scores(q, keys, blocks)


def _aligned(x: mx.array, lead: list[int], width: int, axis: int = 2) -> mx.array:
    """Member ``b``'s columns (``axis``) shifted right by ``lead[b]`` zero (False) columns,
    ``width`` in all."""

    def pad(y: mx.array, left: int) -> mx.array:
        right = width - left - y.shape[axis]
        if not left and not right:
            return y
        widths = [(0, 0)] * y.ndim
        widths[axis] = (left, right)
        return mx.pad(y, widths)

    if len(set(lead)) == 1:
        return pad(x, lead[0])
    return mx.concatenate([pad(x[b : b + 1], left) for b, left in enumerate(lead)], axis=0)


def _width(origins: list[int], t: int) -> int:
    """Key columns once every member's are shifted onto absolute blocks (``_aligned``)."""
    return -(-(max(o % BLOCK_TOKENS for o in origins) + t) // BLOCK_TOKENS) * BLOCK_TOKENS


def positions_per_call(
    batch: int, kv: int, group: int, width: int, d: int, dv: int, limit: int = MLX_INDEX_LIMIT
) -> int:
    """The most query positions one call of the kernel below may take so that no product's
    operand passes ``limit`` logical elements; 0 if not even one position fits.

    A call's products broadcast the keys and the values over its tiles of query rows, which
    comes to batch × kv × tiles × width × max(d, dv) logical elements (the query and weight
    tiles are smaller: a tile has fewer rows than a head has dims)."""
    tile = tile_rows()
    tiles = limit // (batch * kv * width * max(d, dv, tile))
    return tiles * tile // group


def invariant_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any,
    origins: list[int],
    limit: int = MLX_INDEX_LIMIT,
) -> mx.array:
    """Attention whose rows do not depend on the other rows, columns or batch members.

    queries (B, heads, L, d); keys (B, kv_heads, T, d); values (B, kv_heads, T, dv);
    ``mask``: None, ``"causal"`` or booleans broadcastable to (B, 1, L, T); ``origins``:
    the absolute position of key column 0, one per batch member (or one for all).

    A call too large for MLX's matmul (``MLX_INDEX_LIMIT``) runs in pieces of query
    positions (and of batch members, if one position of all of them is too large): each
    row is the same bits in any piece, so the pieces are the whole call's rows."""
    b, heads, length, d = queries.shape
    kv, t, dv = keys.shape[1], keys.shape[2], values.shape[3]
    full = full_mask(mask, b, length, t)
    origins = origins * b if len(origins) == 1 else origins
    step = positions_per_call(b, kv, heads // kv, _width(origins, t), d, dv, limit)
    if step >= length:
        return _attention(queries, keys, values, scale, full, origins)
    if step == 0 and b > 1:
        members = []
        for m, o in enumerate(origins):
            q, k, v, f = (x[m : m + 1] for x in (queries, keys, values, full))
            members.append(invariant_attention(q, k, v, scale, f, [o], limit))
        return mx.concatenate(members, axis=0)
    if step == 0:
        raise ValueError(f"attention over {t} keys of {kv} heads passes MLX's matmul index limit even for one query")
    pieces = [
        _attention(queries[:, :, p : p + step], keys, values, scale, full[:, :, p : p + step], origins)
        for p in range(0, length, step)
    ]
    return mx.concatenate(pieces, axis=2)


def _attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, full: mx.array, origins: list[int]
) -> mx.array:
    """``invariant_attention`` in one call: ``full`` is the mask as (B, 1, L, T) booleans,
    ``origins`` one per member."""
    b, heads, length, d = queries.shape
    kv, t, dv = keys.shape[1], keys.shape[2], values.shape[3]
    group, tile, block = heads // kv, tile_rows(), BLOCK_TOKENS
    lead = [o % block for o in origins]
    width = _width(origins, t)
    blocks = width // block
    keys, values, full = _aligned(keys, lead, width), _aligned(values, lead, width), _aligned(full, lead, width, 3)
    # The query heads of one KV head are the rows of one product, in tiles of ``tile`` rows.
    rows = group * length
    tiles = -(-rows // tile)
    q = (queries * scale).reshape(b, kv, rows, d)
    if tiles * tile != rows:
        q = mx.pad(q, [(0, 0), (0, 0), (0, tiles * tile - rows), (0, 0)])
    q = q.reshape(b, kv, tiles, 1, tile, d)
    scores = _scores(q, keys, blocks)[:, :, :rows]
    seen = full[:, :, None]  # (B, 1, 1, L, width) against scores (B, kv, group, L, width)
    scores = mx.where(seen, scores.reshape(b, kv, group, length, width), -mx.inf)
    top = scores.max(axis=-1, keepdims=True)
    # exp(-inf - top) is exactly 0 where top is finite, which is what masking the exponentials
    # again would give; a row that sees no key (top -inf) subtracts 0 instead, for the same 0s.
    top = mx.where(top == -mx.inf, 0.0, top)
    weights = exp(scores - top).reshape(b, kv, rows, blocks, block)
    # Per absolute block, then block after block from the first: a block adds an exact 0
    # where its keys are not seen.
    den = mx.cumsum(weights.sum(axis=-1), axis=-1)[..., -1:]
    if tiles * tile != rows:
        weights = mx.pad(weights, [(0, 0), (0, 0), (0, tiles * tile - rows), (0, 0), (0, 0)])
    w_tiles = weights.reshape(b, kv, tiles, tile, blocks, block).swapaxes(3, 4)
    parts = w_tiles @ values.reshape(b, kv, 1, blocks, block, dv)  # (B, kv, tiles, blocks, tile, dv)
    num = mx.cumsum(parts, axis=3)[:, :, :, -1].reshape(b, kv, tiles * tile, dv)[:, :, :rows]
    return (num / den).reshape(b, heads, length, dv)


def knows_origins(cache: Any) -> bool:
    """Whether ``key_origins`` knows the layout of what this cache fetches (a decode batch
    of kvshelf's, a kvshelf layer cache, mlx-lm's ``KVCache``), asked without reading the
    cache's buffer fields, which would write a decode step's staged tokens every layer."""
    return getattr(cache, "members", None) is not None or hasattr(cache, "start_after") or type(cache) is KVCache


def key_origins(cache: Any, keys: int, length: int) -> list[int] | None:
    """The absolute position of key column 0 of what ``cache`` just fetched, per batch
    member; None for a cache whose layout is not known here (its own attention runs)."""
    if not knows_origins(cache):
        return None
    members = getattr(cache, "members", None)
    if members is not None:  # a decode batch (kvshelf.kv.batch/working_set): newest key last
        if length != 1:
            return None
        if len(members) == 1:
            return [members[0].start]
        return [m.offset - keys for m in members]
    if hasattr(cache, "start_after"):  # a kvshelf layer cache: its buffer starts at ``start``
        return [cache.start]
    return [0]  # mlx-lm's KVCache


def _dense(x: Any, cache: Any, dtype: mx.Dtype) -> mx.array:
    if not isinstance(x, tuple):
        return x
    w, s, bias = x
    return mx.dequantize(w, s.astype(dtype), bias.astype(dtype), group_size=cache.group_size, bits=cache._bits)


def working_set_step(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: Any, cache: Any
) -> np.ndarray | None:
    """Ordered attention of a decode step over a decode working set (``kvshelf.kv.working_set``)
    whose scheme codes rows in numpy: the step's rows (``k``, ``v``: (B, kv_heads, d)) coded
    as the cache codes them and written into the buffer's next column, attention reading the
    buffer in place, then the tokens staged. The same columns and bits as
    ``update_and_fetch`` without its dozen MLX operations a layer to build and evaluate.
    ``q``: (B, heads, 1, d). None where the rows cannot be coded here (``read_back``), and
    nothing changed: the caller takes the cache's own update."""
    coded = cache.read_back(k, v)
    if coded is None:
        return None
    keys, values, lo, end = cache.columns_with(coded)
    out = ordered_rows(q, buffer_view(keys[0])[..., lo:end, :], buffer_view(values[0])[..., lo:end, :], scale, mask)
    cache.advance(k, v, coded)
    return out


def ordered_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: Any, cache: Any) -> np.ndarray:
    """What ``InvariantAttention`` computes for a decode step given its rows as numpy (q:
    (B, heads, 1, d); k, v: (B, kv_heads, d)), with its bits: over a working set
    ``working_set_step``, else the cache's own update and ordered attention over what it
    fetches (a cache whose layout ``knows_origins``)."""
    if hasattr(cache, "columns_with"):
        out = working_set_step(q, k, v, scale, mask, cache)
        if out is not None:
            return out
    keys, values = cache.update_and_fetch(mx.array(k[:, :, None, :]), mx.array(v[:, :, None, :]))
    return ordered_rows(q, _dense(keys, cache, mx.float32), _dense(values, cache, mx.float32), scale, mask)


class InvariantAttention(nn.Module):
    """An mlx-lm attention module of a known shape whose attention is row-invariant on
    kvshelf's caches and mlx-lm's ``KVCache`` (any other cache runs the module's own):
    ``kvshelf.model.ordered_attention`` where numba is, else ``invariant_attention``."""

    def __init__(self, attention: nn.Module, head_norms: bool):
        super().__init__()
        self.attention = attention
        self._head_norms = head_norms
        # One attention for every call of this module (and so of the model): a row's bits
        # must not depend on which of the two computed it.
        self._ordered = ordered_attention_available()

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        a = self.attention
        if cache is None or not knows_origins(cache) or (mask is not None and _additive(mask)):
            return a(x, mask, cache)
        b, length, _ = x.shape
        q, k, v = self.project(x, cache.offset)
        if self._ordered and length == 1 and q.dtype == mx.float32 and hasattr(cache, "columns_with"):
            out = self._in_working_set(q, k, v, mask, cache)
            if out is not None:
                return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))
        keys, values = cache.update_and_fetch(k, v)
        keys, values = _dense(keys, cache, q.dtype), _dense(values, cache, q.dtype)
        origins = key_origins(cache, keys.shape[2], length)
        if origins is None:
            out = scaled_dot_product_attention(q, keys, values, cache=None, scale=a.scale, mask=mask)
        elif self._ordered:
            out = ordered_attention(q, keys, values, a.scale, mask)
        else:
            out = invariant_attention(q, keys, values, a.scale, mask, origins)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def _in_working_set(self, q: mx.array, k: mx.array, v: mx.array, mask: Any, cache: Any) -> mx.array | None:
        """A decode step over a decode working set (``working_set_step``); None where its
        rows cannot be coded here, which then takes the cache's own update."""
        mx.eval(q, k, v)  # one evaluation for the three (each view would make its own)
        k_rows, v_rows = (np.ascontiguousarray(buffer_view(t)[:, :, 0, :]) for t in (k, v))
        out = working_set_step(buffer_view(q), k_rows, v_rows, self.attention.scale, mask, cache)
        return None if out is None else mx.array(out)

    def project(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values by head, (B, heads, L, d), RoPE applied at ``offset``:
        what the module itself hands its cache and its attention."""
        a = self.attention
        b, length, _ = x.shape
        q = a.q_proj(x).reshape(b, length, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(b, length, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(b, length, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self._head_norms:
            q, k = a.q_norm(q), a.k_norm(k)
        return a.rope(q, offset=offset), a.rope(k, offset=offset), v


class InvariantLatentAttention(InvariantAttention):
    """DeepSeek-V2's multi-head latent attention (mlx-lm 0.32's ``DeepseekV2Attention``).

    Its keys and values come from a low-rank latent through ``kv_b_proj``, and only part of
    each query/key head is rotated, but what reaches the cache is plain per-head keys
    (unrotated part, then rotated part: one head dim) and values (another head dim), as
    mlx-lm's own module caches them. So it is the same invariant attention over the same
    cache; only the projections differ."""

    def project(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array, mx.array]:
        a = self.attention
        b, length, _ = x.shape
        q = a.q_proj(x) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
        q_nope, q_pe = mx.split(q.reshape(b, length, a.num_heads, -1).transpose(0, 2, 1, 3), [a.qk_nope_head_dim], -1)
        latent, k_pe = mx.split(a.kv_a_proj_with_mqa(x), [a.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(b, length, 1, a.qk_rope_head_dim).transpose(0, 2, 1, 3)
        kv = a.kv_b_proj(a.kv_a_layernorm(latent)).reshape(b, length, a.num_heads, -1).transpose(0, 2, 1, 3)
        k_nope, values = mx.split(kv, [a.qk_nope_head_dim], axis=-1)
        q_pe, k_pe = a.rope(q_pe, offset), mx.repeat(a.rope(k_pe, offset), a.num_heads, axis=1)
        return mx.concatenate([q_nope, q_pe], axis=-1), mx.concatenate([k_nope, k_pe], axis=-1), values


# Attention classes whose __call__ is: q/k/v projections, per-head reshape, (per-head q/k
# norms), RoPE at the cache offset, ``update_and_fetch``, attention, ``o_proj``: the wrapper
# that recomputes it, and whether the per-head norms are there. DeepSeek-V2's latent
# attention differs only in its projections (``InvariantLatentAttention``).
KNOWN: dict[tuple[str, str], tuple[type[InvariantAttention], bool]] = {
    ("mlx_lm.models.llama", "Attention"): (InvariantAttention, False),
    ("mlx_lm.models.qwen2", "Attention"): (InvariantAttention, False),
    ("mlx_lm.models.qwen3", "Attention"): (InvariantAttention, True),
    ("mlx_lm.models.gemma3_text", "Attention"): (InvariantAttention, True),
    ("mlx_lm.models.deepseek_v2", "DeepseekV2Attention"): (InvariantLatentAttention, False),
}


def _additive(mask: Any) -> bool:
    return isinstance(mask, mx.array) and mask.dtype != mx.bool_


def _agrees(wrapper: nn.Module) -> bool:
    """The wrapper's prefill and decode on an mlx-lm ``KVCache`` agree with the module's own
    (its ``attention``) to fp32 rounding (another summation order, so not bit for bit)."""
    a = wrapper.attention
    first = next((a[name] for name in ("q_proj", "q_a_proj") if name in a), None)  # the input's width
    weights = [] if first is None else [m["weight"] for _, m in first.named_modules() if "weight" in m]
    dim = int(weights[0].shape[1]) if weights else None
    if dim is None:
        return False
    x = mx.sin(mx.arange(40 * dim, dtype=mx.float32) * 0.31).reshape(1, 40, dim)
    try:
        own, mine = KVCache(), KVCache()
        for mask, part in (("causal", x[:, :39]), (None, x[:, 39:])):
            want, got = a(part, mask, own), wrapper(part, mask, mine)
            if not mx.allclose(got, want, rtol=1e-4, atol=1e-5).item():
                return False
        return True
    except Exception:  # an attention the wrapper cannot call as it expects
        return False


def _shape_key(a: nn.Module) -> tuple:
    """What the probe's verdict depends on: the class, its head layout and scale, its RoPE's
    kind, and its weights' shapes (not their values)."""
    shapes = tuple((name, tuple(m["weight"].shape)) for name, m in a.named_modules() if "weight" in m)
    heads = tuple(getattr(a, name, None) for name in ("n_heads", "n_kv_heads", "num_heads"))
    return (type(a), heads, float(a.scale), type(a.rope), shapes)


def invariant_attention_body(
    module: nn.Module, wrapped: list[InvariantAttention] | None = None, checked: dict[tuple, bool] | None = None
) -> nn.Module:
    """A copy of ``module``'s tree over the same arrays with every known attention module
    that passes the probe wrapped in ``InvariantAttention`` (``wrapped`` collects them)."""
    return known_attention_body(module, lambda wrapper: wrapper, wrapped, checked)


def known_attention_body(
    module: nn.Module,
    make: Callable[[InvariantAttention], nn.Module],
    wrapped: list | None = None,
    checked: dict[tuple, bool] | None = None,
) -> nn.Module:
    """A copy of ``module``'s tree over the same arrays with every known attention module
    (``KNOWN``) replaced by ``make(its wrapper)``, where that agrees with the module's own
    (``_agrees``; ``wrapped`` collects them). The probe runs once per kind of layer
    (``_shape_key``): a model's 18 or 30 attention layers are one or two kinds."""
    checked = {} if checked is None else checked
    known = KNOWN.get((type(module).__module__, type(module).__name__))
    if known is not None:
        wrapper_class, head_norms = known
        made = make(wrapper_class(module, head_norms))
        try:
            key: tuple | None = _shape_key(module)
        except (AttributeError, KeyError, TypeError):  # not the layout KNOWN promises: probe it alone
            key = None
        if key is None or key not in checked:
            agrees = _agrees(made)
            if key is not None:
                checked[key] = agrees
        else:
            agrees = checked[key]
        if agrees:
            if wrapped is not None:
                wrapped.append(made)
            return made
        return module
    if not module.children():
        return module
    return with_children(module, lambda m: known_attention_body(m, make, wrapped, checked))
