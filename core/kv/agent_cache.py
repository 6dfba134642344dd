"""One agent's attention state: a quantized cache per layer plus the token ids it holds.

The token ids are the key to prefix reuse: a new prompt is matched against them
token by token, and the cache is cut back to the common prefix. Where a sliding-window
layer cannot rewind that far, the cache resumes from its latest boundary checkpoint
within the common prefix (``kvshelf.kv.checkpoints``), else it is rebuilt. The ids
include the tokens the model generated, so a growing conversation only prefills what
is new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from kvshelf.kv import checkpoints as ckpt
from kvshelf.kv.blocks import QTriple, QuantizedLayerCache, SharedLayer
from kvshelf.kv.checkpoints import Checkpoint
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES, KVScheme
from kvshelf.kv.shared import SharedPrefix, prefix_id
from kvshelf.model.spec import BLOCK_TOKENS, ModelCacheSpec


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
    shared: SharedPrefix | None = None  # the prefix its layers start on, if forked
    checkpoints: list[Checkpoint] = field(default_factory=list)  # by position; see kvshelf.kv.checkpoints

    @classmethod
    def empty(cls, spec: ModelCacheSpec, scheme: KVScheme | None = None) -> AgentCache:
        scheme = scheme or SCHEMES[DEFAULT_SCHEME]
        return cls(spec, scheme, [scheme.make(layer) for layer in spec.layers], [])

    @property
    def nbytes(self) -> int:
        """Bytes this agent holds alone, checkpoints included; its shared prefix
        (``shared.nbytes``) is extra."""
        return sum(c.nbytes for c in self.layers) + self.checkpoint_bytes

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)

    # -- boundary checkpoints ----------------------------------------------------------
    def checkpoint(self) -> None:
        """Keep the layers' state here, at a message boundary the prefill just reached, so
        a later conversation that shares the tokens so far can resume from it once the
        sliding windows have moved on. Nothing to keep for a model without sliding layers."""
        if not self.tokens or not ckpt.needs_checkpoints(self.layers):
            return
        if any(c.position == len(self.tokens) for c in self.checkpoints):
            return
        self.checkpoints = ckpt.retained(self.checkpoints, ckpt.take(self.layers))

    def prune_checkpoints(self) -> None:
        """At the end of a request: keep only the checkpoints still useful (``still_useful``)."""
        if len(self.checkpoints) > 1:
            self.checkpoints = ckpt.still_useful(self.checkpoints, self.layers)

    def _resume(self, checkpoint: Checkpoint) -> None:
        self.layers = ckpt.resume(self.layers, checkpoint, lambda i: self.scheme.make(self.spec.layers[i]))

    # -- forks ------------------------------------------------------------------------
    def share_prefix(self) -> SharedPrefix | None:
        """Turn this cache's whole blocks into a shared prefix that it starts on.

        Already shared up to the last whole block: the same prefix. Too short for a
        whole block: None (a fork then copies, which costs less than a block).
        """
        length = len(self.tokens) // BLOCK_TOKENS * BLOCK_TOKENS
        if length == 0:
            return None
        if self.shared is not None and len(self.shared.tokens) == length:
            return self.shared
        layers: list[SharedLayer | None] = []
        for c in self.layers:
            c.unshare()
            rows = length - c.start
            if rows <= 0 or c.keys is None:
                layers.append(None)
                continue
            assert c.values is not None  # set together with keys

            def block(q: QTriple, rows: int = rows) -> QTriple:
                w, scales, biases = (mx.contiguous(x[..., :rows, :]) for x in q)
                return w, scales, biases

            base = SharedLayer(block(c.keys), block(c.values), c.start)
            mx.eval(*base.keys, *base.values)
            c.attach_base(base)
            layers.append(base)
        tokens = self.tokens[:length]
        self.shared = SharedPrefix(prefix_id(self.scheme.name, tokens, layers), self.scheme.name, tokens, layers)
        return self.shared

    def adopt(self, prefix: SharedPrefix) -> None:
        """Use ``prefix``'s blocks (an equal, already interned copy) in place of our own."""
        if prefix is self.shared:
            return
        for c, base in zip(self.layers, prefix.layers):
            c.base = base
        self.shared = prefix

    def fork(self) -> AgentCache:
        """A copy that shares every block with this one; either side's writes stay its own."""
        layers = [c.clone() for c in self.layers]
        return AgentCache(self.spec, self.scheme, layers, list(self.tokens), self.shared, list(self.checkpoints))

    def drop_unused_share(self) -> None:
        """Forget the shared prefix once no layer starts on it any more."""
        if self.shared is not None and all(c.base is None for c in self.layers):
            self.shared = None

    def reuse_prefix(self, prompt: list[int]) -> int:
        """Cut the cache back to the longest reusable prefix of ``prompt``; return its length.

        At least one prompt token is always left to compute, because the next-token
        logits come from running the last prompt token.
        """
        keep = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1)
        if keep < len(self.tokens):
            self.checkpoints = [c for c in self.checkpoints if c.position <= keep]  # the rest saw other tokens
            # Where a cut would leave other values than a prefill up to there (inside a
            # quantized per-channel key block), cut back to the block's start instead: the
            # prefill recomputes the rest. A later checkpoint resumes exactly, so it wins.
            exact = min([keep, *(c.exact_rewind_point(keep) for c in self.layers)])
            latest = self.checkpoints[-1].position if self.checkpoints else -1
            if all(c.can_rewind_to(exact) for c in self.layers) and exact >= latest:
                for c in self.layers:
                    c.rewind_to(exact)
                keep = exact
            elif self.checkpoints:  # a sliding window has moved past ``keep``: the nearest boundary before it
                self._resume(self.checkpoints[-1])
                keep = latest
            else:
                self.layers = [self.scheme.make(layer) for layer in self.spec.layers]
                keep = 0
            self.tokens = self.tokens[:keep]
            self.drop_unused_share()
        return keep

    def settle(self) -> None:
        """Write every layer's staged tokens (``QuantizedLayerCache.stage``): a cache at rest
        holds none, so its bytes, listed when it is put back, stay what they are."""
        for c in self.layers:
            c.settle()

    def arrays(self) -> list[mx.array]:
        """Every array the caches hold alone (to evaluate after a forward pass)."""
        return [x for c in self.layers for x in c.arrays()]
