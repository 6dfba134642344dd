"""How a reply is generated: one set of defaults for the engine, the server and the adapters.

The engine's ``chat``/``stream``, ``kvshelf serve`` (for fields a request leaves out)
and every adapter (in process or remote) build their requests from this one class, so
one ``ChatKVShelf`` answers alike whether it runs the engine itself or talks to a
server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvshelf.runtime.repetition import DEFAULT_BREAKERS

# OpenAI's own default is "until the context is full", which is minutes of CPU for a
# small model that loops; 2048 tokens is more than any agent turn we have seen.
DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and length settings for one reply.

    ``temperature`` 0 is greedy decoding: the same prompt gives the same reply, which
    is what agent pipelines rerun in CI expect (OpenAI's default of 1 is not used).
    ``stop`` strings end the reply and are never part of it; ``seed`` makes sampling
    at a temperature above 0 repeatable. ``top_p`` 0 is greedy, as at OpenAI.

    ``logit_bias`` (token id -> -100..100), ``frequency_penalty`` and
    ``presence_penalty`` (-2..2) adjust the logits before each choice, as OpenAI
    defines them (see ``kvshelf.runtime.sampling``); a dict given for ``logit_bias`` is
    kept as sorted ``(token id, bias)`` pairs, so the params stay hashable.

    ``dry_multiplier`` > 0 turns on DRY, a kvshelf (and llama.cpp) extension with
    llama.cpp's parameter names: a penalty on the token that would extend a repeat of
    the context, the prompt included, of ``dry_allowed_length`` tokens or more, growing
    by ``dry_base`` per token of the repeat, within the last ``dry_penalty_last_n`` tokens
    (-1: all), never across a ``dry_sequence_breakers`` string (see
    ``kvshelf.runtime.repetition``). 0 (the default) leaves it off.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer of at least 1")
        if not 0.0 <= float(self.temperature) <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 <= float(self.top_p) <= 1.0:
            raise ValueError("top_p must be between 0 and 1")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2")
        if not 0.0 <= float(self.dry_multiplier) <= 100.0:
            raise ValueError("dry_multiplier must be between 0 (off) and 100")
        if not 1.0 <= float(self.dry_base) <= 10.0:
            raise ValueError("dry_base must be between 1 and 10")
        for name, least in (("dry_allowed_length", 1), ("dry_penalty_last_n", -1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}")
        breakers = self.dry_sequence_breakers
        breakers = (breakers,) if isinstance(breakers, str) else tuple(breakers)
        if any(not isinstance(b, str) or not b for b in breakers):
            raise ValueError("dry_sequence_breakers must be non-empty strings")
        object.__setattr__(self, "dry_sequence_breakers", breakers)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple(sorted((int(t), float(b)) for t, b in pairs))
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
            raise ValueError("logit_bias maps token ids (>= 0) to a bias between -100 and 100")
        object.__setattr__(self, "logit_bias", bias)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)

    @classmethod
    def of(
        cls,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
    ) -> GenerationParams:
        """Build from optional fields (as an OpenAI body or an adapter call gives them):
        a field left as None takes the default."""
        d = cls()
        return cls(
            max_tokens=d.max_tokens if max_tokens is None else max_tokens,
            temperature=d.temperature if temperature is None else temperature,
            top_p=d.top_p if top_p is None else top_p,
            stop=() if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop)),
            seed=seed,
            logit_bias=tuple((logit_bias or {}).items()),
            frequency_penalty=frequency_penalty or 0.0,
            presence_penalty=presence_penalty or 0.0,
        )
