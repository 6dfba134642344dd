"""``ModelCacheSpec``: what an mlx-lm model's KV cache looks like, layer by layer.

Rather than parse every architecture's config (Gemma 3's window pattern, DeepSeek's
MLA head dims...), we ask the model itself: ``make_cache()`` says which layers are
sliding-window, and one forward pass over a single token shows each layer's real K/V
shapes. That works for any mlx-lm model whose attention caches are ``KVCache`` or
``RotatingKVCache``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

BLOCK_TOKENS = 256


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache geometry."""

    window: int | None  # None: full attention; otherwise the sliding-window size
    kv_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def bytes_per_token(self, bits: int | None = 4, group_size: int = 64, scale_bytes: int = 2) -> float:
        """Bytes one token costs in this layer: K and V, packed data plus scales and biases.

        ``bits=None`` means unquantized at ``scale_bytes`` bytes per element (fp16: 2).
        """
        dims = self.k_head_dim + self.v_head_dim
        if bits is None:
            return self.kv_heads * dims * scale_bytes
        return self.kv_heads * (dims * bits / 8 + 2 * scale_bytes * dims / group_size)


@dataclass(frozen=True)
class ModelCacheSpec:
    """Per-layer cache geometry of one model."""

    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_model(cls, model: Any) -> ModelCacheSpec:
        cache = make_prompt_cache(model)
        windows: list[int | None] = []
        for c in cache:
            if type(c) is KVCache:
                windows.append(None)
            elif type(c) is RotatingKVCache:
                windows.append(c.max_size)
            else:
                raise TypeError(
                    f"kvshelf supports attention caches only (KVCache, RotatingKVCache); "
                    f"this model uses {type(c).__name__}"
                )
        model(mx.array([[0]]), cache=cache)
        layers = []
        for window, c in zip(windows, cache):
            k, v = c.keys_and_values()
            layers.append(LayerSpec(window, k.shape[1], k.shape[-1], v.shape[-1]))
        return cls(tuple(layers))

    def bytes_per_token(self, bits: int | None = 4, group_size: int = 64) -> float:
        """Bytes per token over all layers, ignoring window bounds."""
        return sum(layer.bytes_per_token(bits, group_size) for layer in self.layers)

    def sliding_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.sliding]

    def to_json(self) -> str:
        return json.dumps([asdict(layer) for layer in self.layers], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ModelCacheSpec:
        return cls(tuple(LayerSpec(**d) for d in json.loads(text)))
