"""One agent's layer as coded attention reads it: its Q4 blocks, not fp32 rows.

``kvshelf.model.coded_attention`` reads the default scheme's codes in place, about a sixth
of the bytes of the fp32 rows a decode working set holds (``kvshelf.kv.working_set``).
This is what it reads of one agent's layer cache, taken from the cache's blocks (a
forked agent's shared base included): the closed key blocks turned from per-channel
blocks into one row a token (``key_rows``), the open block's fp16 keys as fp32 rows, and
the values' packed words as they are, with their scales widened to fp32.

What it shows is what the agent's next token reads of the positions before it (the rule of
``kvshelf.kv.schemes``: the key blocks closed before that token quantized, its own block's
keys in fp16), so it is the next step's view, bit for bit in every value: a block that the
last token closed is read quantized here, as the next token reads it.

Which caches: a scheme with per-channel keys (KIVI), unrotated keys and no sinks (the
default, ``q4-g64-kivi-rotv``), groups of 64, heads in whole groups (``codable``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvshelf.kv.blocks import QuantizedLayerCache
from kvshelf.kv.schemes import SchemeLayerCache
from kvshelf.model.coded_attention import GROUP, CodedLayer, key_rows, value_rows
from kvshelf.model.spec import BLOCK_TOKENS

F32 = np.float32


def codable(cache: QuantizedLayerCache) -> bool:
    """Whether ``cache``'s scheme keeps K/V in the layout coded attention reads."""
    if not isinstance(cache, SchemeLayerCache):
        return False
    s, layer = cache.scheme, cache.layer
    return (
        s.channel_keys
        and not s.rotate_keys
        and not s.sinks
        and s.group_size == GROUP
        and layer.k_head_dim % GROUP == 0
        and layer.v_head_dim % GROUP == 0
        and (not s.rotate_values or layer.v_head_dim & (layer.v_head_dim - 1) == 0)
    )


def coded_view(cache: QuantizedLayerCache, lo: int) -> CodedLayer:
    """Positions ``lo..offset`` of ``cache`` (``lo`` a key block's first position, not before
    the cache's start) as the next token's query reads them, one agent's (1, kv_heads, ...)
    arrays: column ``c`` is position ``lo + c``."""
    if not codable(cache):
        raise ValueError("coded attention reads per-channel key blocks without sinks or rotated keys")
    assert isinstance(cache, SchemeLayerCache)  # codable
    hi, closed = cache.offset, cache.stable_until
    if lo % BLOCK_TOKENS or not cache.start <= lo <= closed:
        raise ValueError(f"a coded view starts on a key block at or after {cache.start}, not at {lo}")
    spec = cache.layer
    kv, d, dv = spec.kv_heads, spec.k_head_dim, spec.v_head_dim
    key_codes = np.zeros((1, kv, hi - lo, d // 2), np.uint8)
    groups = -(-(hi - lo) // GROUP)
    key_scales, key_offsets = np.zeros((1, kv, groups, d), F32), np.zeros((1, kv, groups, d), F32)
    if closed > lo:
        words, scales, offsets = (np.array(x) for x in cache.packed_rows("keys", lo, closed))
        codes, key_scale_rows, key_offset_rows = key_rows(words, scales, offsets, d)
        key_codes[..., : closed - lo, :] = codes
        key_scales[..., : (closed - lo) // GROUP, :] = key_scale_rows
        key_offsets[..., : (closed - lo) // GROUP, :] = key_offset_rows
    tail = cache.k_tail
    open_keys = np.zeros((1, kv, max(hi - closed, 1), d), F32)
    if hi > closed:
        assert tail is not None and tail.shape[2] == hi - closed  # the open block's keys wait in fp16
        open_keys[...] = np.array(tail.astype(mx.float32))
    words, scales, offsets = (np.array(x) for x in cache.packed_rows("values", lo, hi))
    return CodedLayer(
        key_codes=key_codes,
        key_scales=key_scales,
        key_offsets=key_offsets,
        open_keys=open_keys,
        value_codes=value_rows(words).reshape(1, kv, hi - lo, dv // 2),
        value_scales=scales.astype(F32),
        value_offsets=offsets.astype(F32),
        shift=np.zeros(1, np.int64),
        closed=np.array([closed - lo], np.int64),
        rotated=cache.scheme.rotate_values,
    )
