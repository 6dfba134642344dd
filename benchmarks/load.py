"""Load: 16 concurrent clients against a real ``kvshelf serve`` process for 10 minutes.

The clients hold conversations with many agents (each client has its own agents and
all of them also talk to a few shared ones, so one agent gets concurrent requests),
stream or not at random, sometimes hang up mid-stream, sometimes send an ephemeral
request (no agent), and now and then erase an agent and start it over. A small RAM
budget makes the server spill agents to disk and restore them all the time.

Reported: requests served, errors (goal 0: any 5xx, unexpected 4xx, transport error,
stream without ``[DONE]`` that was not hung up on purpose, or a turn not saved), p50/p99
time to first token (client-side, streamed requests: first SSE chunk, which the server
sends with the first generated token; and server-side ``ttft_s`` for all), and the
server's peak RSS against its budget (sampled every second from /proc), with RSS per
minute to show it stays bounded. Finally the server is stopped with SIGTERM (it must
flush and exit cleanly), its log is searched for the prompts' text (there must be
none), and every record it left must load.

The fault mix (on unless ``--no-faults``): a quarter into the run the store goes
read-only for ``--readonly-s`` seconds (a read-only bind mount over the cache
directory, so it needs root and mount(2); without them it is reported as skipped) and
comes back, and one more client sends a 40 MB body with ``Transfer-Encoding: chunked``
every 30 s, which must be a 413 on a connection that then serves a small request.
While the store is read-only a turn is answered ``saved: false`` and an erasure 503
(counted apart, as honest answers); outside that window, and for a turn a little after
it (the server retries failed saves with backoff), either is an error. At the end,
every agent's last acknowledged turn must be restorable from its record (the agents
only one client talks to, whose last act is known), and an erased agent must have none.

    python benchmarks/load.py [--duration 600] [--clients 16] [--model embedded] [--budget 64MB]
                              [--readonly-s 60] [--no-faults]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from common import write_json

MARKER = "zq-load-marker"  # in every prompt; must never show up in the server's log
TOPICS = [
    "rivers",
    "glaciers",
    "compilers",
    "bread",
    "chess openings",
    "tides",
    "orchids",
    "bridges",
    "volcanoes",
    "jazz",
    "lichens",
    "satellites",
    "sourdough",
    "canals",
    "owls",
    "tax law",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class ReadOnlyWindow:
    """The store read-only for a while (a read-only bind mount over the cache directory)."""

    GRACE_S = 90.0  # failed saves are retried at 1, 2, 4, ... 60 s: a turn this soon after may still say false

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.began: float | None = None
        self.ended: float | None = None
        self.skipped: str | None = None

    def hold(self, start_in: float, seconds: float) -> None:
        time.sleep(start_in)
        d = str(self.directory)
        bind = subprocess.run(["mount", "--bind", d, d], capture_output=True, text=True)
        if bind.returncode != 0:
            self.skipped = f"mount --bind refused (needs root and mount(2)): {bind.stderr.strip()}"
            print("read-only fault skipped:", self.skipped, flush=True)
            return
        subprocess.run(["mount", "-o", "remount,ro,bind", d], check=True)
        self.began = time.monotonic()
        print(f"store read-only for {seconds:.0f}s", flush=True)
        time.sleep(seconds)
        if subprocess.run(["umount", d], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", d], check=True)  # a file was open on it: detach lazily
        self.ended = time.monotonic()
        print("store writable again", flush=True)

    def excuses(self, t_sent: float) -> bool:
        """Whether a request sent at ``t_sent`` and answered now may honestly be told
        saved: false / 503: it was in flight at some moment of the window (or of the grace after it)."""
        if self.began is None:
            return False
        end = (self.ended or time.monotonic()) + self.GRACE_S
        return t_sent <= end and time.monotonic() >= self.began

    def summary(self) -> dict:
        if self.skipped or self.began is None:
            return {"skipped": self.skipped or "never started"}
        return {"seconds": round((self.ended or time.monotonic()) - self.began, 1)}


class OversizedClient(threading.Thread):
    """Sends a chunked 40 MB body every 30 s; each must be a 413 on a connection that lives on."""

    BODY_MB = 40

    def __init__(self, url: str, deadline: float, stats: Stats) -> None:
        super().__init__(daemon=True)
        self.url, self.deadline, self.stats = url, deadline, stats

    @classmethod
    def body(cls):
        yield b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "padding": "'
        for _ in range(cls.BODY_MB):
            yield b"x" * (1 << 20)
        yield b'"}'

    def run(self) -> None:
        paths = ["/v1/chat/completions", "/v1/tokenize"]
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(600, connect=30)) as http:
            n = 0
            while time.monotonic() < self.deadline:
                path = paths[n % 2]
                n += 1
                try:
                    r = http.post(path, content=self.body(), headers={"Content-Type": "application/json"})
                    if r.status_code != 413:
                        self.stats.error(
                            f"chunked {self.BODY_MB} MB body on {path}: {r.status_code}, not 413", r.status_code
                        )
                    small = {"messages": [{"role": "user", "content": "hi"}]}
                    after = http.post("/v1/tokenize", json=small)
                    if after.status_code != 200:
                        self.stats.error(
                            f"the request after a 413: {after.status_code} {after.text[:200]}", after.status_code
                        )
                    with self.stats.lock:
                        self.stats.kinds[f"chunked {self.BODY_MB} MB body, refused (413)"] += 1
                except httpx.HTTPError as exc:
                    self.stats.error(f"chunked body on {path}: {type(exc).__name__}: {exc}")
                time.sleep(min(30.0, max(0.0, self.deadline - time.monotonic())))


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.window: ReadOnlyWindow | None = None
        self.last_act: dict[str, tuple[str, int]] = {}  # own agents: ("turn", tokens) or ("erased", 0)
        self.server_errors = 0  # 5xx answers that no fault excuses
        self.kinds: Counter = Counter()
        self.errors: list[str] = []
        self.ttft_client: list[float] = []
        self.ttft_server: list[float] = []
        self.cache_sources: Counter = Counter()

    def error(self, what: str, status: int | None = None) -> None:
        with self.lock:
            self.server_errors += status is not None and status >= 500
            self.errors.append(what)
            if len(self.errors) <= 20:
                print("ERROR", what, flush=True)


class Client(threading.Thread):
    """One client: conversations with its own two agents and the shared ones."""

    def __init__(self, n: int, url: str, deadline: float, stats: Stats, shared: list[str], seed: int) -> None:
        super().__init__(daemon=True)
        self.n, self.url, self.deadline, self.stats = n, url, deadline, stats
        self.rng = random.Random(seed)
        self.agents = [f"load-{n}-a", f"load-{n}-b", *shared]
        self.histories: dict[str, list[dict]] = {}

    def history(self, aid: str) -> list[dict]:
        if aid not in self.histories or len(self.histories[aid]) > 14:  # start over when it gets long
            topic = self.rng.choice(TOPICS)
            system = (
                f"You are agent {aid} ({MARKER}), a patient expert on {topic}. "
                + f"You answer in short, plain sentences and remember what was said about {topic}. " * 6
            )
            self.histories[aid] = [{"role": "system", "content": system}]
        return self.histories[aid]

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(600, connect=30)) as http:
            while time.monotonic() < self.deadline:
                roll = self.rng.random()
                try:
                    if roll < 0.03:
                        self.erase(http)
                    else:
                        self.turn(http, ephemeral=roll < 0.08)
                except httpx.HTTPError as exc:
                    self.stats.error(f"client {self.n}: {type(exc).__name__}: {exc}")

    def erase(self, http: httpx.Client) -> None:
        aid = self.rng.choice(self.agents[:2])  # only its own agents: a shared one may be mid-request (409)
        t_sent = time.monotonic()
        r = http.delete(f"/v1/agents/{aid}")
        self.histories.pop(aid, None)
        window = self.stats.window
        if r.status_code == 503 and window is not None and window.excuses(t_sent):
            with self.stats.lock:
                self.stats.kinds["delete, store read-only (503)"] += 1
            return
        with self.stats.lock:  # 409: still busy with a stream this client just hung up on
            self.stats.kinds["delete" if r.status_code != 409 else "delete, agent busy (409)"] += 1
            if r.status_code in (200, 404):
                self.stats.last_act[aid] = ("erased", 0)
            else:
                self.stats.last_act.pop(aid, None)  # unknown now
        if r.status_code not in (200, 404, 409):
            self.stats.error(f"DELETE {aid}: {r.status_code} {r.text[:200]}", r.status_code)

    def turn(self, http: httpx.Client, ephemeral: bool) -> None:
        aid = self.rng.choice(self.agents)
        messages = self.history(aid) + [
            {"role": "user", "content": f"({MARKER}) Tell me one more thing, number {self.rng.randint(1, 999)}."}
        ]
        body = {"model": "x", "messages": messages, "max_tokens": self.rng.randint(8, 40), "temperature": 0.7}
        headers = {} if ephemeral else {"X-Agent-Id": aid}
        stream = self.rng.random() < 0.5
        hang_up = stream and self.rng.random() < 0.2
        t0, t_sent, usage = time.perf_counter(), time.monotonic(), None
        own = not ephemeral and aid in self.agents[:2]
        if own:
            with self.stats.lock:
                self.stats.last_act.pop(aid, None)  # until this turn is acknowledged
        if not stream:
            r = http.post("/v1/chat/completions", json=body, headers=headers)
            if r.status_code != 200:
                return self.stats.error(f"{aid}: {r.status_code} {r.text[:200]}", r.status_code)
            data = r.json()
            reply, ext, usage = data["choices"][0]["message"]["content"] or "", data["kvshelf"], data["usage"]
            kind = "json"
        else:
            reply, ext, lines, done = "", None, 0, False
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/chat/completions", json=streamed, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                    return self.stats.error(f"{aid}: stream {r.status_code} {r.text[:200]}", r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if lines == 0:
                        with self.stats.lock:
                            self.stats.ttft_client.append(time.perf_counter() - t0)
                    lines += 1
                    if hang_up and lines >= 3:
                        break
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return self.stats.error(f"{aid}: error in stream: {chunk['error']['message'][:200]}")
                    if chunk["choices"]:
                        reply += chunk["choices"][0]["delta"].get("content") or ""
                        ext = chunk.get("kvshelf") or ext
                    usage = chunk.get("usage") or usage
            if hang_up:
                with self.stats.lock:
                    self.stats.kinds["stream, hung up"] += 1
                self.histories.pop(aid, None)  # how far the reply got is unknown here: start over
                return None
            if not done or ext is None:
                return self.stats.error(f"{aid}: stream ended without [DONE] or without its final chunk")
            kind = "stream"
        window = self.stats.window
        if not ephemeral and ext.get("saved") is not True:
            if ext.get("saved") is False and window is not None and window.excuses(t_sent):
                kind += ", saved: false (store read-only)"
            else:
                self.stats.error(f"{aid}: turn not saved ({ext})")
        with self.stats.lock:
            if own and usage is not None:
                self.stats.last_act[aid] = ("turn", usage["prompt_tokens"] + usage["completion_tokens"])
            self.stats.kinds[kind + (", ephemeral" if ephemeral else "")] += 1
            self.stats.ttft_server.append(ext["ttft_s"])
            self.stats.cache_sources[ext["cache"]] += 1
        if not ephemeral:
            messages.append({"role": "assistant", "content": reply})
            self.histories[aid] = messages
        return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--budget", default="64MB", help="the server's RAM budget for resident caches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--readonly-s", type=float, default=60.0, help="how long the store is read-only")
    parser.add_argument("--no-faults", action="store_true", help="no read-only store, no oversized bodies")
    args = parser.parse_args()

    from kvshelf.runtime.pool import parse_bytes

    budget = parse_bytes(args.budget)
    tmp = tempfile.TemporaryDirectory(prefix="kvshelf-load-")
    cache_dir, log_path = Path(tmp.name) / "cache", Path(tmp.name) / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = open(log_path, "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvshelf.cli",
            "serve",
            "--model",
            args.model,
            "--cache-dir",
            str(cache_dir),
            "--budget",
            args.budget,
            "--port",
            str(port),
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    t_start = time.monotonic()
    while True:
        if server.poll() is not None:
            sys.exit("the server died at startup:\n" + log_path.read_text())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    startup_s = time.monotonic() - t_start
    idle_rss = rss_kib(server.pid) * 1024
    print(
        f"server up in {startup_s:.1f}s, RSS {idle_rss / 1e6:.0f} MB; {args.clients} clients for {args.duration:.0f}s",
        flush=True,
    )

    stats = Stats()
    deadline = time.monotonic() + args.duration
    shared = ["load-shared-1", "load-shared-2", "load-shared-3"]
    clients: list[threading.Thread] = [
        Client(i, url, deadline, stats, shared, args.seed * 1000 + i) for i in range(args.clients)
    ]
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    window = None
    if not args.no_faults:
        cache_dir.mkdir(parents=True, exist_ok=True)
        window = stats.window = ReadOnlyWindow(cache_dir)
        readonly_s = min(args.readonly_s, args.duration / 2)
        threading.Thread(target=window.hold, args=(args.duration / 4, readonly_s), daemon=True).start()
        clients.append(OversizedClient(url, deadline, stats))
    for c in clients:
        c.start()
    while any(c.is_alive() for c in clients):
        samples.append((time.monotonic() - t0, rss_kib(server.pid) * 1024))
        if len(samples) % 30 == 0:
            served = sum(stats.kinds.values())
            print(
                f"{samples[-1][0]:6.0f}s  served {served:5d}  errors {len(stats.errors)}  "
                f"RSS {samples[-1][1] / 1e6:.0f} MB",
                flush=True,
            )
        time.sleep(1)
    wall = time.monotonic() - t0
    agents: list[dict] = []
    page: dict = {"has_more": True, "last_id": None}
    while page["has_more"]:  # the listing is paged (limit, after, has_more)
        after = {"after": page["last_id"]} if page["last_id"] else {}
        page = httpx.get(url + "/v1/agents", params={"limit": 100, **after}, timeout=60).json()
        agents += page["data"]

    server.send_signal(signal.SIGTERM)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()
    log_file.close()
    log = log_path.read_text()
    clean_exit = server.returncode == 0 and "Application shutdown complete" in log

    from kvshelf.runtime.engine import Engine

    check = Engine(model=args.model, cache_dir=cache_dir, progress=False)
    ids = check._shelf.store.agent_ids()
    unusable = [aid for aid in ids if check._shelf.load(aid) is None]
    # every acknowledged last turn is in its record (the last sampled token may not be fed yet)
    not_restorable = []
    for aid, (act, tokens) in sorted(stats.last_act.items()):
        held = check._shelf.store.token_count(aid)
        if (act == "turn" and held not in (tokens - 1, tokens)) or (act == "erased" and held):
            not_restorable.append(f"{aid}: last {act} ({tokens} tokens), record holds {held}")
    restorable = sum(1 for act, _ in stats.last_act.values() if act == "turn") - len(not_restorable)
    quarantined = len(list(check._shelf.store.quarantine_dir.glob("*.safetensors")))
    from mlx.utils import tree_flatten

    params = tree_flatten(check.loaded.model.parameters())
    assert isinstance(params, list)  # (name, array) pairs: a dict comes back only for a dict destination
    model_bytes = sum(v.nbytes for _, v in params)  # as held in RAM (fp32 on CPU)
    check.close()
    tmp.cleanup()

    peak = max(b for _, b in samples)
    per_minute = [
        max(b for t, b in samples if m * 60 <= t < (m + 1) * 60)
        for m in range(int(wall // 60) + 1)
        if any(m * 60 <= t < (m + 1) * 60 for t, _ in samples)
    ]
    served = sum(stats.kinds.values())
    result = {
        "model": args.model,
        "clients": args.clients,
        "duration_s": round(wall, 1),
        "requests_served": served,
        "requests_by_kind": dict(stats.kinds),
        "cache_sources": dict(stats.cache_sources),
        "errors": len(stats.errors),
        "error_samples": stats.errors[:20],
        "ttft_client_stream_s": {
            "p50": percentile(stats.ttft_client, 0.5),
            "p99": percentile(stats.ttft_client, 0.99),
            "n": len(stats.ttft_client),
        },
        "ttft_server_s": {
            "p50": percentile(stats.ttft_server, 0.5),
            "p99": percentile(stats.ttft_server, 0.99),
            "mean": statistics.fmean(stats.ttft_server) if stats.ttft_server else None,
        },
        "budget_bytes": budget,
        "rss_idle_bytes": idle_rss,
        "rss_peak_bytes": peak,
        "rss_peak_minus_idle_bytes": peak - idle_rss,
        "rss_per_minute_max_bytes": per_minute,
        "model_weight_bytes": model_bytes,
        "agents_at_end": len(agents),
        "resident_bytes_at_end": sum(a["ram_bytes"] for a in agents),
        "records_at_end": len(ids),
        "records_unusable": unusable,
        "acknowledged_last_turns_restorable": restorable,
        "acknowledged_last_turns_not_restorable": not_restorable,
        "faults": None
        if window is None
        else {
            "read_only_store": window.summary(),
            "oversized_chunked_bodies": stats.kinds.get(f"chunked {OversizedClient.BODY_MB} MB body, refused (413)", 0),
        },
        "server_errors_5xx": stats.server_errors,
        "records_quarantined": quarantined,
        "prompt_text_in_server_log": MARKER in log,
        "server_log_lines": len(log.splitlines()),
        "clean_shutdown": clean_exit,
        "startup_s": round(startup_s, 1),
        "cpus": os.cpu_count(),
    }
    print("\n".join(f"{k}: {v}" for k, v in result.items() if k != "error_samples"))
    print(f"wrote {write_json('load', result)}")


if __name__ == "__main__":
    main()
