"""Choosing the next token: greedy at temperature 0 (or top_p 0), else temperature and nucleus (top-p).

Before the choice, OpenAI's logit adjustments are added to the logits, as OpenAI
defines them: ``logit_bias`` (a fixed amount per token id, -100 bans a token and 100
all but forces it) and the ``frequency_penalty`` / ``presence_penalty`` of the tokens
this reply has generated so far (``count * frequency + (count > 0) * presence`` is
subtracted). kvshelf adds DRY (``kvshelf.runtime.repetition``), llama.cpp's penalty on
the token that would extend a repeat of the *context*, prompt included: the one that
stops a small model from copying what it reads. Each is one small scatter-add over the
few token ids concerned, and a request that sets none of them samples exactly as before.

A ``seed`` gives each request its own random key, so a seeded request samples the
same tokens however many other requests ran before or beside it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import mlx.core as mx

from kvshelf.runtime.repetition import DryPenalty


class Sampler:
    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        logit_bias: Mapping[int, float] | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        dry: DryPenalty | None = None,
    ):
        if not 0 <= temperature < float("inf"):  # also refuses NaN
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 <= top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")
        self.temperature = temperature
        self.top_p = top_p
        # MLX keys take a seed in [0, 2**64); any int is folded into that range here, in
        # the caller's thread, so a seed of -1 or 10**30 cannot fail on the scheduler
        # thread later (where it would fail every request of that step).
        self._seed = None if seed is None else int(seed) % 2**64
        self._key: mx.array | None = None  # made on first use, on the scheduler's thread
        bias = {int(t): float(b) for t, b in (logit_bias or {}).items() if b}
        self._bias = (list(bias), list(bias.values())) if bias else None
        self.frequency_penalty, self.presence_penalty = float(frequency_penalty), float(presence_penalty)
        self._counts: Counter[int] | None = Counter() if frequency_penalty or presence_penalty else None
        self._dry = dry

    def __call__(self, logits: mx.array) -> mx.array:
        """``logits``: (vocab,) for one position. Returns a scalar token id array."""
        logits = self._adjusted(logits)
        token = self._choose(logits)
        if self._counts is not None:
            self._counts[int(token)] += 1
        if self._dry is not None:
            self._dry.append(int(token))
        return token

    def _adjusted(self, logits: mx.array) -> mx.array:
        """The logits with logit_bias added and the repetition penalties subtracted."""
        if self._bias is None and not self._counts and self._dry is None:
            return logits
        logits = logits.astype(mx.float32)
        if self._bias is not None:
            ids, amounts = self._bias
            logits = logits.at[mx.array(ids)].add(mx.array(amounts, dtype=mx.float32))
        if self._counts:
            ids = list(self._counts)
            counts = mx.array([self._counts[i] for i in ids], dtype=mx.float32)
            penalty = self.frequency_penalty * counts + self.presence_penalty
            logits = logits.at[mx.array(ids)].add(-penalty)
        if self._dry is not None:
            ids, amounts = self._dry.penalties()
            if ids:
                logits = logits.at[mx.array(ids)].add(-mx.array(amounts, dtype=mx.float32))
        return logits

    def _choose(self, logits: mx.array) -> mx.array:
        if self.temperature == 0 or self.top_p == 0:  # OpenAI's top_p 0 keeps the top token alone
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
