"""A Ctrl-C that Python could not raise (its handler ran inside a weakref callback) is kept
by the flag and prints nothing; any other error lost that way is still printed."""

from __future__ import annotations

import gc
import sys
import weakref

from kvshelf import ctrl_c


class _Referent:
    pass


def _lost(error: BaseException) -> None:
    """Raise ``error`` inside a weakref callback, where Python can only report it."""

    def callback(_: object) -> None:
        raise error

    referent = _Referent()
    ref = weakref.ref(referent, callback)
    del referent
    gc.collect()
    assert ref() is None


def test_a_lost_ctrl_c_prints_nothing_and_other_lost_errors_still_do(monkeypatch, capsys):
    monkeypatch.setattr(sys, "unraisablehook", ctrl_c.quiet_lost_ctrl_c)
    try:
        ctrl_c._ctrl_c_pressed.set()
        _lost(KeyboardInterrupt())
        assert capsys.readouterr().err == ""
        _lost(ValueError("not a Ctrl-C"))
        assert "not a Ctrl-C" in capsys.readouterr().err
    finally:
        ctrl_c._ctrl_c_pressed.clear()
    _lost(KeyboardInterrupt())  # no Ctrl-C came: Python's own report
    assert "KeyboardInterrupt" in capsys.readouterr().err
