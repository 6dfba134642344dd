"""Choosing the next token: greedy at temperature 0 (or top_p 0), else temperature and nucleus (top-p).

Before the choice, OpenAI's logit adjustments are added to the logits, as OpenAI
defines them: ``logit_bias`` (a fixed amount per token id, -100 bans a token and 100
all but forces it) and the ``frequency_penalty`` / ``presence_penalty`` of the tokens
this reply has generated so far (``count * frequency + (count > 0) * presence`` is
subtracted). kvshelf adds DRY (``kvshelf.runtime.repetition``), llama.cpp's penalty on
the token that would extend a repeat of the *context*, prompt included: the one that
stops a small model from copying what it reads. Each is one small scatter-add over the
few token ids concerned, and a request that sets none of them samples exactly as before.

The choice runs on the step's logits as a numpy row, once MLX has evaluated the step:
over Gemma 3's 262144-token vocabulary MLX's categorical took 3.4 ms a token (27 ms a
step for 8 agents) and its top-p argsort 41 ms, numpy's inverse CDF 0.4-0.8 ms, and the
nucleus is cut without sorting the whole vocabulary (``_nucleus``).

A ``seed`` gives each request its own generator, so a seeded request samples the
same tokens however many other requests ran before or beside it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np

from kvshelf.runtime.repetition import DryPenalty

# Tokens per chunk of ``Sampler._draw``'s two-level inverse CDF.
DRAW_CHUNK = 1024


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
        # Any int is folded into [0, 2**64) here, in the caller's thread, so a seed of -1
        # or 10**30 cannot fail on the scheduler thread later (where it would fail every
        # request of that step).
        self._seed = None if seed is None else int(seed) % 2**64
        self._rng = np.random.default_rng(self._seed)
        bias = {int(t): float(b) for t, b in (logit_bias or {}).items() if b}
        self._bias = (list(bias), list(bias.values())) if bias else None
        self.frequency_penalty, self.presence_penalty = float(frequency_penalty), float(presence_penalty)
        self._counts: Counter[int] | None = Counter() if frequency_penalty or presence_penalty else None
        self._dry = dry

    def __call__(self, logits: np.ndarray) -> int:
        """``logits``: (vocab,) fp32 for one position. Returns the token id."""
        token = self._choose(self._adjusted(logits))
        if self._counts is not None:
            self._counts[token] += 1
        if self._dry is not None:
            self._dry.append(token)
        return token

    def _adjusted(self, row: np.ndarray) -> np.ndarray:
        """The logits with logit_bias added and the repetition penalties subtracted (a copy
        where any applies: the row is a view of the step's logits)."""
        if self._bias is None and not self._counts and self._dry is None:
            return row
        row = row.copy()
        if self._bias is not None:
            ids, amounts = self._bias
            row[ids] += np.asarray(amounts, dtype=np.float32)
        if self._counts:
            ids = list(self._counts)
            counts = np.asarray([self._counts[i] for i in ids], dtype=np.float32)
            row[ids] -= np.float32(self.frequency_penalty) * counts + np.float32(self.presence_penalty)
        if self._dry is not None:
            ids, amounts = self._dry.penalties()
            if ids:
                row[ids] -= np.asarray(amounts, dtype=np.float32)
        return row

    def _choose(self, row: np.ndarray) -> int:
        if self.temperature == 0 or self.top_p == 0:  # OpenAI's top_p 0 keeps the top token alone
            return int(np.argmax(row))
        z = row / np.float32(self.temperature)
        top = z.max()
        if not np.isfinite(top):  # every token banned (-inf) or a NaN: nothing to weigh
            return int(np.argmax(row))
        weights = np.exp(z - top)
        if self.top_p < 1.0:
            kept = _nucleus(weights, self.top_p)
            return int(kept[self._draw(weights[kept])])
        return self._draw(weights)

    def _draw(self, weights: np.ndarray) -> int:
        """An index drawn with probability proportional to ``weights`` (inverse CDF; a
        weight of 0 is never drawn): first the ``DRAW_CHUNK``-wide chunk from the chunks'
        sums, then the index inside it (a float64 cumulative sum of the whole vocabulary
        took 2.6 ms, the chunks' sums 0.1)."""
        n = len(weights)
        full = n // DRAW_CHUNK * DRAW_CHUNK
        sums = weights[:full].reshape(-1, DRAW_CHUNK).sum(axis=1, dtype=np.float64)
        if full < n:
            sums = np.append(sums, weights[full:].sum(dtype=np.float64))
        bounds = np.cumsum(sums)
        u = self._rng.random() * bounds[-1]
        c = min(int(np.searchsorted(bounds, u, side="right")), len(sums) - 1)  # a chunk of weight > 0
        chunk = weights[c * DRAW_CHUNK : (c + 1) * DRAW_CHUNK]
        inside = np.cumsum(chunk, dtype=np.float64)
        i = int(np.searchsorted(inside, u - (bounds[c - 1] if c else 0.0), side="right"))
        if i >= len(chunk) or chunk[i] == 0:  # past the chunk's end by rounding: its last token of weight > 0
            i = int(np.flatnonzero(chunk)[-1])
        return c * DRAW_CHUNK + i


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """The most likely tokens, most likely first, up to and including the one whose
    cumulative probability reaches ``top_p`` (so never empty).

    Without sorting the whole vocabulary (262144 tokens: 41 ms a token through MLX's
    argsort): the tokens above a cut-off, if they hold ``top_p`` of the mass between them,
    hold the whole nucleus, since it takes tokens in order of probability. The cut-off
    falls a thousandfold until they do (at 0: every token)."""
    target = top_p * float(weights.sum(dtype=np.float64))
    cut = float(weights.max()) * 1e-3
    while True:
        candidates = np.flatnonzero(weights >= cut) if cut > 0 else np.arange(len(weights))
        if cut == 0 or float(weights[candidates].sum(dtype=np.float64)) >= target:
            break
        cut = cut * 1e-3 if cut > 1e-30 else 0.0
    order = candidates[np.argsort(-weights[candidates], kind="stable")]
    w = weights[order]
    before = np.cumsum(w, dtype=np.float64) - w  # the mass of the tokens more likely than each
    return order[: max(1, int(np.count_nonzero(before < target)))]
