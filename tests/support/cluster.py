"""A real cluster inside a test: ``kvshelf serve`` node processes behind HAProxy or nginx.

The balancers run the very configuration files shipped in ``deploy/``, with only their
loopback ports replaced (the shipped files use 8000 for clients and 8001-8003 for the
nodes), so a test of routing is a test of what an operator installs. HAProxy gets a
stats socket besides, so a test can wait for its health checks to see a node go down
or come back instead of sleeping.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support import REPO_ROOT
from tests.support.servers import wait_up

DEPLOY = REPO_ROOT / "deploy"
CLIENT_PORT, NODE_PORTS = 8000, (8001, 8002, 8003)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(binary: str) -> str | None:
    """Why a test that needs ``binary`` cannot run here (None when it can)."""
    if shutil.which(binary) or Path(f"/usr/sbin/{binary}").exists():
        return None
    return f"{binary} is not installed (.ci/run installs it from the OS packages: apt-get install {binary})"


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Node:
    """One ``kvshelf serve`` process on a loopback port (its output goes to a log file)."""

    def __init__(
        self,
        name: str,
        model: Path | str,
        store: Path,
        log_dir: Path,
        extra: tuple[str, ...] = (),
        *,
        prefix: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        shared: bool = False,
    ) -> None:
        """``store``: its own store directory, or with ``shared`` the store it shares with
        other nodes (``--store DIR --shared --node-id NAME``); ``extra``: more ``kvshelf
        serve`` options; ``prefix``: a command to run it under (``taskset -c 0`` pins it to
        a core); ``env``: variables added to this environment."""
        self.name, self.port = name, free_port()
        self.env = {**os.environ, **env} if env else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._args = [
            *prefix,
            sys.executable,
            *("-m", "kvshelf.cli", "serve", "--model", str(model)),
            *(("--store", str(store), "--shared", "--node-id", name) if shared else ("--cache-dir", str(store))),
            *("--port", str(self.port), "--log-level", "info", *extra),
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            self._args, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=self.env
        )
        log.close()
        return self

    def wait_up(self) -> Node:
        assert self.proc is not None
        wait_up(self.proc, self.url, timeout=120)
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        """Whatever state it is in (paused, running), end it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)


def _ported(text: str, client_port: int, node_ports: list[int]) -> str:
    """A shipped config with its loopback ports replaced by the test's."""
    for shipped, ours in zip(NODE_PORTS, node_ports, strict=True):
        text = text.replace(f"127.0.0.1:{shipped}", f"127.0.0.1:{ours}")
    return text.replace(f"127.0.0.1:{CLIENT_PORT}", f"127.0.0.1:{client_port}")


class HAProxy:
    """``deploy/haproxy.cfg`` run in the foreground, in front of ``nodes``."""

    def __init__(
        self, nodes: list[Node], run_dir: Path, *, round_robin: bool = False, log_requests: bool = False
    ) -> None:
        """``nodes``: one to three (the shipped file's server lines are kept for as many);
        ``round_robin``: spread requests in turn instead of by agent (to compare against);
        ``log_requests``: one line per request in the log (HAProxy's httplog, with the
        agent id), so a benchmark can see where a request's time went (``request_log``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats = run_dir / "haproxy.sock"
        text = (DEPLOY / "haproxy.cfg").read_text()
        for unused in range(len(nodes) + 1, len(NODE_PORTS) + 1):
            text = "".join(line for line in text.splitlines(keepends=True) if f"server node{unused} " not in line)
        ports = [n.port for n in nodes] + [0] * (len(NODE_PORTS) - len(nodes))
        text = _ported(text, self.port, ports)
        if round_robin:
            text = text.replace("balance hash var(txn.agent)", "balance roundrobin")
        text = text.replace("global\n", f"global\n    stats socket {self.stats} mode 600 level admin\n", 1)
        if log_requests:
            text = text.replace("global\n", "global\n    log stdout format raw local0\n", 1)
            text = text.replace("defaults\n", "defaults\n    log global\n    option httplog\n", 1)
            text = text.replace(
                "frontend kvshelf\n", "frontend kvshelf\n    http-request capture req.hdr(x-agent-id) len 128\n", 1
            )
        self.config = run_dir / "haproxy.cfg"
        self.config.write_text(text)
        self.log_path = run_dir / "haproxy.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen([_binary("haproxy"), "-db", "-f", str(self.config)], stdout=log, stderr=log)
        self.names = [f"node{i + 1}" for i in range(len(nodes))]

    def request_log(self) -> list[dict[str, str | int]]:
        """The requests logged so far (``log_requests``): when each was accepted (HAProxy's
        clock, ms), the agent, the node that answered, HAProxy's timers (ms: Tq waiting for
        the request, Tw queued, Tc connecting, Tr the node's answer, Ta in all), the status
        and how many times HAProxy retried it (a leading ``+``: redispatched)."""
        pattern = re.compile(
            r"\[(?P<accept>[^\]]+)\] \S+ \S+/(?P<node>\S+) (?P<Tq>-?\d+)/(?P<Tw>-?\d+)/(?P<Tc>-?\d+)/"
            r"(?P<Tr>-?\d+)/(?P<Ta>-?\d+) (?P<status>-?\d+) .*? \d+/\d+/\d+/\d+/(?P<retries>\+?\d+) "
            r"\d+/\d+ \{(?P<agent>[^}]*)\}"
        )
        rows: list[dict[str, str | int]] = []
        for line in self.log_path.read_text().splitlines():
            if (m := pattern.search(line)) is not None:
                row: dict[str, str | int] = {k: m[k] for k in ("accept", "node", "agent", "retries")}
                row.update({k: int(m[k]) for k in ("Tq", "Tw", "Tc", "Tr", "Ta", "status")})
                rows.append(row)
        return rows

    def states(self) -> dict[str, str]:
        """Each node's state as HAProxy's health checks see it (UP, DOWN, ...)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.stats))
            s.sendall(b"show stat\n")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        rows = csv.DictReader(raw.decode().lstrip("# ").splitlines())
        return {r["svname"]: r["status"] for r in rows if r["pxname"] == "kvshelf_nodes" and r["svname"] in self.names}

    def wait_for(self, wanted: dict[str, str], timeout: float = 30) -> None:
        """Wait until HAProxy sees each named node in the wanted state ("UP", "DOWN")."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                states = self.states()
            except OSError:
                states = {}
            if all(states.get(name, "").startswith(want) for name, want in wanted.items()):
                return
            assert time.monotonic() < deadline, f"HAProxy sees {states}, waited for {wanted}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class Nginx:
    """``deploy/nginx.conf`` run in the foreground (its relative paths under ``run_dir``)."""

    def __init__(self, nodes: list[Node], run_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
        config = run_dir / "nginx.conf"
        config.write_text(_ported((DEPLOY / "nginx.conf").read_text(), self.port, [n.port for n in nodes]))
        self.log_path = run_dir / "nginx.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [_binary("nginx"), "-p", str(run_dir), "-c", str(config)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                httpx.get(self.url + "/health", timeout=2)
                return
            except httpx.TransportError:
                assert time.monotonic() < deadline, "nginx did not come up"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # nginx's graceful stop
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_nodes(model: Path, stores: list[Path], log_dir: Path, *, shared: bool = False) -> list[Node]:
    """Start one node per store path (with ``shared``, the same path for all), all at once."""
    nodes = [Node(f"node{i + 1}", model, store, log_dir, shared=shared) for i, store in enumerate(stores)]
    for node in nodes:
        node.start()
    for node in nodes:
        node.wait_up()
    return nodes
