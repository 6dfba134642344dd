"""kvshelf's compiled loops come from here: numba's ``njit`` and ``prange``, with numba's
compiles serialized across processes.

Why: numba's on-disk cache is not safe for processes that write it at once
(numba/numba#10128, open). A loop's index file maps each compiled variant to a numbered
data file; two processes that compile variants of one loop at the same moment can both
read the index, both take the same number, and each write its own code there, so that a
later process loads one variant's code for another. Two kvshelf processes started together
on a fresh install (cluster nodes on one machine, a server beside a benchmark) can do that.

numba holds its compiler lock (an in-process lock) around a dispatcher's whole compile:
the cache lookup, the compile and the cache write. This module listens to that lock's
``numba:compiler_lock`` events (numba's public event API) and holds an exclusive ``flock``
on one lock file for as long as any thread of this process holds it, so that a second
process's compile starts only once the first's cache write is done, and loads it. A
child forked in the middle of a compile lets its copy of the locked descriptor go, so that
it cannot hold every other process's compiles for as long as it lives.

The lock file lies in ``$NUMBA_CACHE_DIR`` when that is set (one lock per cache), else in
the temp directory (one lock per machine, whatever cache directory numba picked). It only
serializes processes on one machine: ``flock`` is not a lock over a network filesystem.

Where a loop was compiled shows in its last bits: numba's ``parallel`` fast-math loops (the
default kernels' attention and products) round their sums otherwise in the process that
compiled them than in the processes that load them from numba's cache afterwards (the
attention loop by up to 6e-8 on random inputs; the embedded Gemma 3's logits over four
steps of a batch of two hashed otherwise in the compiling process and alike in the two
after it; the same loop without ``parallel`` does not differ; 2026-12-07, numba 0.68).
Loading the loop again in the compiling process does not help: its code is already
linked there. So an engine loads every loop a child compiled for it
(``kvshelf.runtime.loop_warmup``; ``compiled_here`` names any a process compiled itself),
and a loop takes one type of each argument where it can (``native_ops.attend``): two
variants need not agree when one was compiled here and the other loaded. Temperature 0's
loops give the same bits either way (``benchmarks/invariant_bitcheck.py``, a fresh
``NUMBA_CACHE_DIR`` and then from it).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from numba import njit, prange
from numba.core import event

__all__ = ["LISTENER", "LOCK_NAME", "compiled_here", "lock_path", "njit", "prange"]

LOCK_NAME = "kvshelf-numba.lock"


def lock_path() -> Path:
    """The file whose ``flock`` every kvshelf process's compiles hold."""
    return Path(os.environ.get("NUMBA_CACHE_DIR") or tempfile.gettempdir()) / LOCK_NAME


class _CrossProcessCompileLock(event.Listener):
    """Holds the file's ``flock`` while this process holds numba's compiler lock.

    numba broadcasts the event's start before its (reentrant) lock is taken and its end
    after it is let go, once per acquisition, from whichever thread; the count of open
    acquisitions says when the first begins and the last ends."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._open = 0
        self._fd: int | None = None

    def on_start(self, event: Any) -> None:
        with self._mutex:
            self._open += 1
            if self._open == 1:
                self._fd = _locked(lock_path())

    def on_end(self, event: Any) -> None:
        with self._mutex:
            self._open -= 1
            if self._open == 0 and self._fd is not None:
                os.close(self._fd)  # closing the only descriptor lets the flock go
                self._fd = None

    def forget_in_child(self) -> None:
        """After a fork: the child has none of the parent's threads, so none of its
        acquisitions will end there, but it holds a copy of the locked descriptor, which
        would keep every other process's compiles waiting for as long as the child lives."""
        self._mutex = threading.Lock()
        self._open = 0
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _locked(path: Path) -> int | None:
    """An exclusively ``flock``ed descriptor of ``path``, or None where the file cannot be
    opened (a read-only temp directory): the compile then goes on unserialized, as numba's
    own would. Opened read-only, so that a lock file another user made serves as well."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


class _CompiledHere(event.Listener):
    """Names every kvshelf loop variant this process compiles (numba's ``numba:compile``
    event comes only where its cache had no code to load)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_start(self, event: Any) -> None:
        func = getattr((event.data or {}).get("dispatcher"), "py_func", None)
        if func is not None and func.__module__.startswith("kvshelf."):
            self.names.append(func.__qualname__)

    def on_end(self, event: Any) -> None:
        pass


def compiled_here() -> list[str]:
    """kvshelf's loop variants that this process compiled rather than loaded from numba's
    cache, in order: each may round otherwise here than in every process after it
    (``kvshelf.runtime.loop_warmup`` keeps an engine's list empty)."""
    return list(_COMPILED.names)


LISTENER = _CrossProcessCompileLock()
event.register("numba:compiler_lock", LISTENER)
os.register_at_fork(after_in_child=LISTENER.forget_in_child)
_COMPILED = _CompiledHere()
event.register("numba:compile", _COMPILED)
