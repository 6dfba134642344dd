"""Ctrl-C in the demo: the SIGINT handler, and the flag that outlives a swallowed interrupt.

Its own module, not ``kvshelf.cli``: run as ``python -m kvshelf.cli`` that file is
``__main__``, and ``kvshelf.demo``'s import of ``kvshelf.cli`` made a second copy of it with
a second flag, which the handler never set; so a Ctrl-C whose exception was lost during the
model's load let the demo talk on to its end (seen once in a full test run under load).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_ctrl_c_pressed = threading.Event()


def on_ctrl_c(signum: int, frame: object) -> None:
    """SIGINT: remembered, then raised as KeyboardInterrupt. Remembered because the
    exception can be lost on its way up (for instance raised while a C extension runs
    Python code whose errors it clears): a Ctrl-C during the model's load was once
    ignored so in about a dozen test runs, and the demo talked on. The demo checks the
    flag after the load and at every streamed piece."""
    _ctrl_c_pressed.set()
    raise KeyboardInterrupt


def quiet_lost_ctrl_c(unraisable: Any) -> None:
    """``sys.unraisablehook``: a Ctrl-C whose KeyboardInterrupt Python could not raise (the
    handler ran inside a weakref callback, such as importlib's module lock's while the model's
    modules load) is carried by the flag, so it prints nothing; before, Python printed
    "Exception ignored ... Traceback" for it (seen in a full test run). Anything else goes
    to Python's own hook."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _ctrl_c_pressed.is_set():
        return
    sys.__unraisablehook__(unraisable)


def raise_if_ctrl_c_was_pressed() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came, even if something swallowed its exception."""
    if _ctrl_c_pressed.is_set():
        raise KeyboardInterrupt


def from_ctrl_c(exc: BaseException) -> bool:
    """Whether ``exc`` is a KeyboardInterrupt, or was raised while handling one or because of one."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
