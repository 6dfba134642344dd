"""One agent's attention state: a quantized cache per layer plus the token ids it holds.

The token ids are the key to prefix reuse: a new prompt is matched against them
token by token, and the cache is cut back to the common prefix (or rebuilt when a
sliding-window layer cannot rewind that far). They include the tokens the model
generated, so a growing conversation only prefills what is new.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import mlx.core as mx

from .kvschemes import DEFAULT_SCHEME, SCHEMES, KVScheme
from .qcache import QuantizedLayerCache
from .spec import ModelCacheSpec


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class AgentCache:
    """An agent's per-layer Q4 caches and the tokens they encode."""

    spec: ModelCacheSpec
    scheme: KVScheme = field(default_factory=lambda: SCHEMES[DEFAULT_SCHEME])
    layers: list[QuantizedLayerCache] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, spec: ModelCacheSpec, scheme: KVScheme | None = None) -> "AgentCache":
        scheme = scheme or SCHEMES[DEFAULT_SCHEME]
        return cls(spec, scheme, [scheme.make(layer) for layer in spec.layers], [])

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def reuse_prefix(self, prompt: list[int]) -> int:
        """Cut the cache back to the longest reusable prefix of ``prompt``; return its length.

        At least one prompt token is always left to compute, because the next-token
        logits come from running the last prompt token.
        """
        keep = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1)
        if keep < len(self.tokens):
            if all(c.can_rewind_to(keep) for c in self.layers):
                for c in self.layers:
                    c.rewind_to(keep)
            else:
                self.layers = [self.scheme.make(layer) for layer in self.spec.layers]
                keep = 0
            self.tokens = self.tokens[:keep]
        return keep

    def arrays(self) -> list[mx.array]:
        """Every array the caches hold (to evaluate after a forward pass)."""
        out = []
        for c in self.layers:
            if c.keys is not None:
                out.extend((*c.keys, *c.values))
            out.extend(x for x in (getattr(c, "k_tail", None), getattr(c, "sink_k", None),
                                   getattr(c, "sink_v", None)) if x is not None)
        return out

    # -- records ---------------------------------------------------------------------
    def to_record_parts(self) -> tuple[dict[str, mx.array], dict]:
        tensors: dict[str, mx.array] = {}
        layout = []
        for i, c in enumerate(self.layers):
            for name, x in c.export().items():
                tensors[f"l{i}.{name}"] = x
            layout.append({"start": c.start, "offset": c.offset, "group_size": c.group_size})
        meta = {"scheme": self.scheme.name, "spec": self.spec.to_json(), "layers": json.dumps(layout)}
        return tensors, meta

    @classmethod
    def from_record_parts(
        cls, spec: ModelCacheSpec, tokens: list[int], tensors: dict[str, mx.array], meta: dict
    ) -> "AgentCache":
        """Rebuild from a record; raise ValueError if it does not fit this model.

        A record keeps the KV scheme it was written with (any scheme this build knows is
        read as that scheme, and the agent goes on in it); an unknown scheme is refused,
        so the record is quarantined rather than misread.
        """
        name = meta.get("scheme")
        if name not in SCHEMES:
            raise ValueError(f"record uses KV scheme {name!r}, which this build does not know")
        if ModelCacheSpec.from_json(meta["spec"]) != spec:
            raise ValueError("record was written for a different cache geometry")
        layout = json.loads(meta["layers"])
        if len(layout) != len(spec.layers):
            raise ValueError("record layer count does not match the model")
        cache = cls.empty(spec, SCHEMES[name])
        for i, (c, lay) in enumerate(zip(cache.layers, layout)):
            if lay["offset"] != len(tokens) or lay["group_size"] != c.group_size:
                raise ValueError(f"layer {i} layout does not match the record's tokens")
            prefix = f"l{i}."
            arrays = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            c.load(arrays, lay["start"], lay["offset"])
        cache.tokens = list(tokens)
        return cache
