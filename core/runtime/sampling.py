"""Choosing the next token: greedy at temperature 0, else temperature and nucleus (top-p).

A ``seed`` gives each request its own random key, so a seeded request samples the
same tokens however many other requests ran before or beside it.
"""

from __future__ import annotations

import mlx.core as mx


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
        if not 0 <= temperature < float("inf"):  # also refuses NaN
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        self.temperature = temperature
        self.top_p = top_p
        # MLX keys take a seed in [0, 2**64); any int is folded into that range here, in
        # the caller's thread, so a seed of -1 or 10**30 cannot fail on the scheduler
        # thread later (where it would fail every request of that step).
        self._seed = None if seed is None else int(seed) % 2**64
        self._key: mx.array | None = None  # made on first use, on the scheduler's thread

    def __call__(self, logits: mx.array) -> mx.array:
        """``logits``: (vocab,) for one position. Returns a scalar token id array."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        logits = logits.astype(mx.float32) / self.temperature
        if self.top_p < 1.0:
            order = mx.argsort(-logits, axis=-1)
            sorted_logits = mx.take(logits, order, axis=-1)
            probs = mx.softmax(sorted_logits, axis=-1)
            cumulative = mx.cumsum(probs, axis=-1)
            keep = (cumulative - probs) < self.top_p  # always keeps the most likely token
            sorted_logits = mx.where(keep, sorted_logits, -mx.inf)
            choice = self._categorical(sorted_logits)
            return mx.take(order, choice, axis=-1)
        return self._categorical(logits)

    def _categorical(self, logits: mx.array) -> mx.array:
        if self._seed is None:
            return mx.random.categorical(logits)
        if self._key is None:
            self._key = mx.random.key(self._seed)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logits, key=sub)
