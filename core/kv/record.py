"""What a cache looks like as a record: token ids, named tensors and a JSON header.

The RAM caches (``kvshelf.kv``) produce and consume ``CacheRecord``s; the file store
(``kvshelf.storage``) encodes them to disk and back without knowing what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


@dataclass(eq=False)
class CacheRecord:
    """One agent's cache as stored: token ids, named tensors, JSON metadata.

    ``eq=False`` because ``==`` on MLX arrays is elementwise, which would make a
    generated ``__eq__`` raise; compare tensors explicitly instead.
    """

    tokens: list[int]
    """The token ids whose KV the tensors hold."""
    tensors: dict[str, mx.array] = field(default_factory=dict)
    """Tensor name -> array (packed uint32 data, float16/bfloat16 scales, ...)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable description (cache spec, quantization, layer layout)."""
