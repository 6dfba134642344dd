"""A real ``kvshelf`` HTTP server inside a test: uvicorn on a loopback port, in a thread."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from tests.support import REPO_ROOT


class ServerThread:
    """uvicorn on a socket we bound ourselves (so the port is known and free), in a thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def wait_up(proc: subprocess.Popen, url: str, timeout: float = 60) -> None:
    """Wait until a ``kvshelf serve`` subprocess answers /health (failing if it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        assert time.monotonic() < deadline, "kvshelf serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


SHORT_DRAIN = ("--drain-seconds", "0.1")
"""For a ``kvshelf serve`` a test stops with SIGTERM without a load balancer to drain from:
the drain window still opens and closes (the same code path), in 0.1 s rather than the
default 3 s, which is only there for a balancer's health check (tests/test_cluster.py
covers that)."""


def start_node(model: Path, store: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """A ``kvshelf serve`` subprocess on a free port over ``store`` (a path or URL); (process, base URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "kvshelf.cli", "serve", "--model", str(model), "--store", store, *SHORT_DRAIN]
    command += extra
    proc = subprocess.Popen(
        [*command, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT
    )
    return proc, f"http://127.0.0.1:{port}"


def turn_here_then_there(a: str, b: str, agent: str, note: str) -> tuple[dict, dict]:
    """One agent's first turn on node ``a`` and its second on node ``b``: both replies' JSON.

    The first must have been saved (else ``b`` could not see it); the caller asserts what the
    second says about the cache."""
    messages = [{"role": "user", "content": note * 4}]
    body = {"model": "x", "messages": messages, "max_tokens": 4}
    first = httpx.post(a + "/v1/chat/completions", json=body, headers={"X-Agent-Id": agent}, timeout=60).json()
    assert first["kvshelf"]["saved"] is True
    reply = first["choices"][0]["message"]["content"]
    body["messages"] = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "When?"}]
    second = httpx.post(b + "/v1/chat/completions", json=body, headers={"X-Agent-Id": agent}, timeout=60).json()
    return first, second
