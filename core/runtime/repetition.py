"""DRY ("don't repeat yourself"): a penalty on the token that would extend a repeat of the context.

OpenAI's frequency and presence penalties count only the tokens a reply has generated,
so they cannot stop a model from copying its prompt: a small base model that reads
the minutes of a meeting happily writes the last speech out again, word for word. DRY
(p-e-w's sampler, in text-generation-webui, koboldcpp and llama.cpp, whose parameter
names kvshelf uses) looks at the whole context instead, prompt and reply alike. Where
the last ``n`` tokens also occur earlier in the context followed by token ``t``,
choosing ``t`` would make the repeat ``n + 1`` tokens long; so ``t``'s logit is lowered
by ``multiplier * base ** (n - allowed_length)`` once ``n`` reaches ``allowed_length``.
Short common phrases cost little or nothing; the penalty grows exponentially with the
length of the repeat (at the defaults, 0.8 x 1.75^6 = 22 at a repeat of 8 tokens, which
no logit survives), so a long copy is cut off and the model has to say something new.

A *sequence breaker* ends a match: a repeat is never followed across it, so the
structure a document repeats on purpose ("Name:" at each line, quotes, markdown) is
not penalized. A breaker is a token whose text contains one of the breaker strings
(llama.cpp's defaults: newline, colon, double quote, asterisk); each token's text is
looked at once, when the token is first seen (``Breakers``). ``penalty_last_n``
limits the context looked at to its last tokens (-1: all of it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable

import numpy as np

DEFAULT_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")

MAX_MATCH = 64
"""The longest repeat measured: its penalty is far past what any logit survives already,
and the cap bounds the work per token when a model loops on one token."""


PENALTY_CAP = 1e9
"""No logit survives this; a finite cap keeps ``base ** 60`` from overflowing float32."""


class DryPenalty:
    """The DRY penalty of one request: the context it has seen, and the penalty for the next token.

    ``context`` is the prompt's token ids; each token the request generates is added with
    ``append``, so the reply's own repeats count too."""

    def __init__(
        self,
        context: Iterable[int],
        *,
        multiplier: float,
        base: float = 1.75,
        allowed_length: int = 2,
        penalty_last_n: int = -1,
        breakers: Container[int] = frozenset(),
    ) -> None:
        if multiplier <= 0:
            raise ValueError("the DRY multiplier must be > 0 (0 turns DRY off)")
        if base < 1:
            raise ValueError("dry_base must be >= 1")
        if allowed_length < 1:
            raise ValueError("dry_allowed_length must be >= 1")
        self.multiplier, self.base, self.allowed_length = float(multiplier), float(base), int(allowed_length)
        self.penalty_last_n = int(penalty_last_n)
        self._breakers = breakers
        self._tokens: list[int] = []
        self._breaks: list[bool] = []  # whether each token of the context is a breaker
        for token in context:
            self.append(token)

    def append(self, token: int) -> None:
        self._tokens.append(int(token))
        self._breaks.append(int(token) in self._breakers)

    def penalties(self) -> tuple[list[int], list[float]]:
        """(token ids, the amount to subtract from each one's logit) for the next token."""
        start = 0 if self.penalty_last_n < 0 else max(0, len(self._tokens) - self.penalty_last_n)
        if self.penalty_last_n == 0 or len(self._tokens) - start < 2 or self._breaks[-1]:
            return [], []
        window = np.asarray(self._tokens[start:], dtype=np.int64)
        breaks = np.asarray(self._breaks[start:], dtype=bool)
        # every earlier place the last token occurs, and the token that followed it there
        ends = np.flatnonzero(window[:-1] == window[-1])
        ends = ends[~breaks[ends + 1]]
        following = window[ends + 1]
        if ends.size == 0:
            return [], []
        # how far back each of those places matches the context's end (1: the last token alone)
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for k in range(1, min(MAX_MATCH, window.size - 1)):
            previous = window[-1 - k]
            if breaks[-1 - k]:
                break
            back = ends - k
            alive &= back >= 0
            alive[alive] = window[back[alive]] == previous
            if not alive.any():
                break
            length += alive
        # a token that would extend several repeats is penalized for the longest
        best: dict[int, int] = {}
        for token, n in zip(following.tolist(), length.tolist(), strict=True):
            if n >= self.allowed_length and n > best.get(token, 0):
                best[token] = n
        ids = list(best)
        return ids, [min(PENALTY_CAP, self.multiplier * self.base ** (best[t] - self.allowed_length)) for t in ids]


class Breakers:
    """The sequence breakers of one model: the tokens whose text holds one of ``strings``.

    ``decode`` gives a token's text; each token is decoded once, the first time any
    request sees it (a model's whole vocabulary, 262k tokens for Gemma, would take a
    second to decode up front). Shared by the requests of one engine: a token's answer
    never changes, so two threads that race on one only compute it twice."""

    def __init__(self, decode: Callable[[int], str], strings: Iterable[str]) -> None:
        wanted = [re.escape(b) for b in strings if b]
        self._holds = re.compile("|".join(wanted)).search if wanted else None
        self._decode = decode
        self._known: dict[int, bool] = {}

    def __contains__(self, token: object) -> bool:
        if self._holds is None or not isinstance(token, int):
            return False
        known = self._known.get(token)
        if known is None:
            known = self._known[token] = self._holds(self._decode(token)) is not None
        return known
