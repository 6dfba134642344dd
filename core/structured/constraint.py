"""A per-request token mask: the grammar's allowed next tokens, applied before sampling.

Each constrained request carries a ``TokenConstraint`` (an llguidance matcher over the
model's vocabulary). The scheduler calls ``masked(logits)`` right before it samples a
request's next token, and ``advance(token)`` after: free and constrained requests share
one batched decode step, and a free request pays nothing.

The mask is computed off the critical path: as soon as a token is accepted, the next
mask is computed on a small thread pool (llguidance releases the GIL), while the model
runs the next decode step; ``masked`` only waits for it in the rare step where the
forward pass was faster. ``benchmarks/structured.py`` measures what is left.

A grammar that is not ``enforced`` is a validator only: ``masked`` returns the logits
untouched (no mask is computed), ``advance`` feeds the matcher the sampled token and ends
the reply at the first token the grammar refuses, recording why (``violation``).

The KV cache never sees any of this: a mask only narrows the choice of the next token,
and the tokens chosen are cached, saved and restored like any others.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
from tokenizers import Tokenizer

from kvshelf.errors import InvalidSchema
from kvshelf.model.loader import TextTokenizer
from kvshelf.structured.grammar import Grammar

log = logging.getLogger(__name__)

_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) - 1)), thread_name_prefix="kvshelf-mask")


class Vocabulary:
    """llguidance's view of one model's tokenizer: the bytes of every token, and which
    tokens end a reply. Built on first use (3-9 s for Gemma 3's 262k tokens) and shared
    by every request, and by every engine of the process on the same tokenizer (see
    ``shared_llg``): a second engine on one loaded model does not pay the build again."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def llg(self) -> llguidance.LLTokenizer:
        return shared_llg(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


# One built LLTokenizer per (tokenizers object, stop ids), for as long as that tokenizer
# lives: keyed weakly, so a model that is let go takes its vocabulary with it. An
# LLTokenizer is built from the tokenizer's JSON, so it keeps no reference to the key.
_Built = dict[frozenset[int], llguidance.LLTokenizer]
_BUILT: weakref.WeakKeyDictionary[Tokenizer, _Built] = weakref.WeakKeyDictionary()
_BUILT_LOCK = threading.Lock()


def shared_llg(tokenizer: TextTokenizer) -> llguidance.LLTokenizer:
    """The process's LLTokenizer for ``tokenizer`` (built on the first call, under a lock,
    so two engines starting at once build it once)."""
    with _BUILT_LOCK:
        per_stops = _BUILT.setdefault(tokenizer.tokenizer, {})
        built = per_stops.get(tokenizer.stop_ids)
        if built is None:
            stops = sorted(tokenizer.stop_ids)
            built = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=stops or None, slices=None)
            per_stops[tokenizer.stop_ids] = built
        return built


class TokenConstraint:
    """One request's grammar state: which tokens may come next, and whether it is done."""

    def __init__(self, grammar: Grammar, vocabulary: Vocabulary) -> None:
        vocab = vocabulary.llg
        self._matcher = llguidance.LLMatcher(vocab, grammar.source, log_level=0)
        if grammar.opening and not self._matcher.is_error():
            self._matcher.consume_tokens(vocabulary.encode(grammar.opening))
        if self._matcher.is_error():
            raise InvalidSchema(f"the grammar cannot be used: {self._matcher.get_error().splitlines()[0]}")
        self._size = vocab.vocab_size
        self.grammar = grammar
        self.steps = 0
        self.waited_s = 0.0  # time ``masked`` spent waiting for a mask (the cost left on the step)
        self.violation: str | None = None  # a validator's reason for ending the reply (its last token broke it)
        self._next: Future[bytes] | None = self._prefetch()

    def _prefetch(self) -> Future[bytes] | None:
        return _POOL.submit(self._matcher.compute_bitmask) if self.grammar.enforced else None

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (end the reply now)."""
        return self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """The next token's mask, one bool per token id (waits for the prefetch)."""
        t0 = time.perf_counter()
        bits = self._next.result() if self._next is not None else self._matcher.compute_bitmask()
        self.waited_s += time.perf_counter() - t0
        return np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[: self._size].astype(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (vocab,) with every token the grammar refuses set to -inf (a
        validator's: as they are)."""
        if not self.grammar.enforced:
            return logits
        allowed = self.allowed()
        width = logits.shape[-1]
        if width != allowed.shape[0]:  # a model's head may be padded past the tokenizer
            allowed = np.pad(allowed, (0, max(0, width - allowed.shape[0])))[:width]
        if not allowed.any():  # an error state: only the reply's end is left
            log.warning("constrained decoding: the grammar admits no token (%s)", self._matcher.get_error())
        return np.where(allowed, logits, logits.dtype.type(-np.inf))

    def advance(self, token: int) -> bool:
        """Accept the sampled ``token``; True when the reply is complete (or cannot go on).

        The next mask starts computing at once, beside the next decode step."""
        self.steps += 1
        if not self._matcher.consume_token(token):
            self.violation = self._matcher.get_error()
            if self.grammar.enforced:
                log.warning("constrained decoding: token %d refused (%s)", token, self.violation)
            return True
        if self._matcher.is_stopped():
            return True
        self._next = self._prefetch()
        return False
