"""Starting, health-checking, stopping and timing OpenAI-compatible servers over HTTP.

Both kvshelf's server and the peer are driven the same way, as separate processes, so
the comparison measures what a client sees: time to the first streamed content token
and the whole request, plus how long a restart takes until ``/health`` answers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process; ``start`` returns once ``/health`` answers (the startup time)."""

    def __init__(self, name: str, command: list[str], port: int, log_path: Path, env: dict | None = None):
        self.name, self.command, self.port, self.log_path = name, command, port, log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> float:
        t = time.perf_counter()
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = t + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer /health within {timeout:.0f} s: {self.tail()}")

    def stop(self, timeout: float = 60) -> float:
        """SIGTERM (a graceful shutdown: kvshelf flushes its saves), SIGKILL if it hangs."""
        t = time.perf_counter()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        return time.perf_counter() - t

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def stream_chat(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> dict:
    """One streamed chat completion: time to the first content token, total time, the text."""
    t = time.perf_counter()
    ttft, parts = None, []
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers or {}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t
                    parts.append(content)
                elif choice.get("finish_reason") and ttft is None:
                    ttft = time.perf_counter() - t
    total = time.perf_counter() - t
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "text": "".join(parts)}
