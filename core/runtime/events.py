"""What a request tells its caller, one typed event at a time.

The step loop runs on its own thread and hands each request's progress to a callback
(``Request.emit``); the engine turns these events back into what its public calls
return (text chunks then a ``ChatResult``, prefill logits, a ``Usage``). One small
frozen class per kind of news, so neither side has to guess from a value's type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvshelf.runtime.results import ChatResult


@dataclass(frozen=True)
class Text:
    """More reply text, safe to show (no stop string can still begin in it)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The reply is complete: the request's last event."""

    result: ChatResult


@dataclass(frozen=True)
class Failed:
    """The request failed: the request's last event."""

    error: BaseException


@dataclass(frozen=True, eq=False)
class Prefilled:
    """A prefill-only request is done: next-token logits (float32) and the tokens reused."""

    logits: np.ndarray
    cached: int
    saved: bool | None = None  # as ChatResult.saved: durable shelves only


@dataclass(frozen=True)
class Stopped:
    """Prefill ahead ended (done, superseded or cancelled): its cache keeps what it computed."""


Event = Text | Finished | Failed | Prefilled | Stopped
