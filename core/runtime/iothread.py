"""One background thread for record reads and writes, so the step loop never waits on a disk."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import mlx.core as mx


def release_mlx_thread() -> None:
    """MLX streams belong to threads; a thread must drain and drop its own before it ends."""
    mx.synchronize()
    mx.clear_streams()


class IOThread:
    """One background thread for record reads and writes (a tiny executor).

    Not a ``ThreadPoolExecutor``: its thread must release its MLX streams on the way
    out, or the process aborts at exit.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
                mx.synchronize()
            # Drop the finished job now, not when the next one comes: its arguments (a
            # save's snapshot of an agent's blocks) must not outlive it, e.g. an erasure.
            del job, fut, fn, args
        release_mlx_thread()
