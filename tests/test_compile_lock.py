"""numba's compiles are serialized across kvshelf processes (``kvshelf.model.jit``): a
process compiles (and writes numba's on-disk cache) only while it holds the lock file's
``flock``, so two processes cannot both write one loop's cache index at once
(numba/numba#10128)."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvshelf.model import jit

LOOP_MODULE = """
from kvshelf.model.jit import njit


@njit(cache=True)
def doubled(x):
    return 2 * x
"""

CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
import kvshelf.model.jit
print("ready", flush=True)
import doubled_loop
print(doubled_loop.doubled(21), time.time(), flush=True)
"""


def test_a_process_compiles_only_once_the_other_lets_the_lock_go(tmp_path):
    (tmp_path / "doubled_loop.py").write_text(LOOP_MODULE)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    lock = os.open(tmp_path / jit.LOCK_NAME, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # this test is the other process, mid-compile
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(3.0)  # without the lock, its compile (well under a second) would be done
        assert child.poll() is None
        released = time.time()
        os.close(lock)
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    value, compiled_at = out.split()
    assert int(value) == 42
    assert float(compiled_at) > released
    assert list(tmp_path.rglob("*doubled*.nbi")), "the compile wrote numba's cache"


def test_the_lock_is_let_go_when_the_compile_is_done(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))

    @jit.njit
    def tripled(x):
        return 3 * x

    assert tripled(np.int64(5)) == 15
    assert jit.lock_path() == tmp_path / jit.LOCK_NAME
    assert jit.lock_path().exists(), "the compile took the lock"
    probe = os.open(jit.lock_path(), os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while held
    finally:
        os.close(probe)


def test_every_compiled_loop_of_kvshelf_takes_njit_from_the_locked_module():
    core = Path(jit.__file__).parent.parent
    direct = re.compile(r"from numba import [^\n]*\b(njit|jit|prange|vectorize|guvectorize)\b|numba\.(njit|jit)\(")
    offenders = [
        str(path.relative_to(core))
        for path in core.rglob("*.py")
        if path != Path(jit.__file__) and direct.search(path.read_text())
    ]
    assert not offenders, f"compile through kvshelf.model.jit, not numba directly: {offenders}"


def test_a_forked_child_does_not_keep_the_parents_lock(tmp_path, monkeypatch):
    """A fork in the middle of a compile (another thread's, say) copies the locked
    descriptor into the child; the child lets its copy go, so the lock is free as soon as
    the parent's compile ends, however long the child lives."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    jit.LISTENER.on_start(None)  # as numba does when a compile takes its compiler lock
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # the child (past its fork hooks): say so, outlive the parent's compile, leave
        os.write(started, b"1")
        time.sleep(3.0)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        jit.LISTENER.on_end(None)
        probe = os.open(jit.lock_path(), os.O_RDONLY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while anyone holds it
        finally:
            os.close(probe)
    finally:
        os.waitpid(child, 0)
        os.close(ready)
        os.close(started)
