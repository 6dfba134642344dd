"""An agent's cache prefilled with random tokens through a given forward, for decode tests."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES


def prefilled(forward: Any, spec: Any, n: int, seed: int, scheme: str = DEFAULT_SCHEME) -> AgentCache:
    """A fresh ``scheme`` cache after ``forward`` (a model or a ``ProjectedModel``) took ``n``
    random tokens below 128 (the tiny models' vocabulary) as one prefill call."""
    cache = AgentCache.empty(spec, SCHEMES[scheme])
    tokens = np.random.default_rng(seed).integers(0, 128, n).tolist()
    mx.eval(forward(mx.array(tokens)[None], cache=cache.layers), cache.arrays())
    cache.tokens = tokens
    return cache
