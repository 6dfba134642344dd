"""A real ``kvshelf`` HTTP server inside a test: uvicorn on a loopback port, in a thread."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import uvicorn


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
