"""Crash harness: SIGKILL a kvshelf process at random points of its saves, evictions and
erasures, then check every record on disk. Used by tests/test_faults.py (a few rounds)
and benchmarks/crash.py (50+).

**What "acknowledged" means.** The child runs a *durable* engine
(``Engine(durable=True)``, as ``kvshelf serve`` does): ``chat`` returns only once the
turn's save has ended, and ``ChatResult.saved`` says whether it reached the disk. The
child prints ``ack chat`` only for a result with ``saved=True``; that line is the
acknowledgement a caller gets. ``ack evict`` follows ``evict`` returning True (the agent
left RAM because its record was on disk), ``ack forget`` follows ``forget``
returning (files unlinked, directory fsynced) and ``ack fork`` follows ``fork`` and a
``flush()`` that left nothing unsaved (both records, the shared prefix and its user
markers on disk). Before each operation the child prints
``begin``, so the parent knows which one was in flight when the kill came.

**What is checked after each kill**, with a fresh engine on the same directory:
* no record is corrupt: every one loads, passes its checksums and fits the model (so
  none is quarantined), and no temp file left by a killed writer is ever read;
* each agent's record is exactly its last acknowledged version, or, only for the agents
  whose operation was in flight, the new version that operation was writing (a record
  whose tokens start with the in-flight prompt, or a fork's copy of its source) or, for
  an erasure, no record at all; a record on a shared prefix loads only if the prefix
  does, so a fork's crash ordering (prefix, marker, record) is checked too;
* an acknowledged erasure stays erased; an acknowledged turn is restorable (it loads).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import REPO_ROOT

AGENTS = ["crash-a", "crash-b", "crash-c", "crash-d"]
KILL_MODES = ("random", "mid-write", "mid-erase")

CHILD = r"""
import json, random, sys
import kvshelf
from kvshelf.errors import UnknownAgent
from kvshelf.runtime.engine import Engine

model, cache_dir, ledger_path, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ledger = json.load(open(ledger_path))
agents = sorted(ledger)
rng = random.Random(seed)
engine = Engine(model=model, cache_dir=cache_dir, budget="{budget}", durable=True, progress=False)

def out(*parts):
    print(" ".join(parts), flush=True)

def digest(tokens):
    import hashlib
    return hashlib.blake2b(json.dumps(tokens).encode(), digest_size=8).hexdigest()

out("ready")
n = 0
while True:
    aid = rng.choice(agents)
    op = rng.choices(["chat", "evict", "forget", "fork"], weights=[6, 2, 1, 1])[0]
    n += 1
    if op == "chat":
        messages = ledger[aid]["messages"] or [{{"role": "system", "content": aid + " " + "remember this. " * 60}}]
        messages = messages + [{{"role": "user", "content": "turn %d, say more about %s" % (n, aid)}}]
        prompt = engine._encode(messages)
        out("begin", op, aid, str(len(prompt)), digest(prompt))
        r = engine.chat(aid, messages, max_tokens=rng.randint(2, 12))
        if r.saved:
            ledger[aid]["messages"] = messages + [{{"role": "assistant", "content": r.text}}]
            tokens = list(engine._shelf.pool.get(aid).tokens)
            out("ack", op, aid, json.dumps({{"messages": ledger[aid]["messages"], "tokens": tokens}}))
        else:
            out("nack", op, aid)
    elif op == "evict":
        out("begin", op, aid)
        out("ack" if engine.evict(aid) else "noop", op, aid)
    elif op == "forget":
        out("begin", op, aid)
        engine.forget(aid)
        ledger[aid]["messages"] = []
        out("ack", op, aid)
    else:
        dst = rng.choice([a for a in agents if a != aid])
        out("begin", op, aid, dst)
        engine.forget(dst)  # a fork never overwrites an agent: erase it first
        ledger[dst]["messages"] = []
        out("ack", "forget", dst)
        out("begin", op, aid, dst)
        try:
            engine.fork(aid, dst)
        except UnknownAgent:
            out("noop", op, aid, dst)
            continue
        if engine.flush():
            out("nack", op, aid)
            continue
        ledger[dst]["messages"] = list(ledger[aid]["messages"])
        tokens = list(engine._shelf.pool.get(dst).tokens)
        out("ack", op, aid, json.dumps({{"dst": dst, "messages": ledger[dst]["messages"], "tokens": tokens}}))
"""


def digest(tokens: list[int]) -> str:
    return hashlib.blake2b(json.dumps(tokens).encode(), digest_size=8).hexdigest()


@dataclass
class Ledger:
    """What the caller was told, per agent: its acknowledged messages and record tokens."""

    messages: dict[str, list[dict]] = field(default_factory=lambda: {a: [] for a in AGENTS})
    tokens: dict[str, list[int] | None] = field(default_factory=lambda: {a: None for a in AGENTS})


@dataclass
class Outcome:
    mode: str
    ops_acked: int
    in_flight: str | None  # "chat crash-b", ...
    temp_files_left: int  # > 0: the kill landed inside a record write (the temp is never read)
    records: dict[str, str]  # agent -> "acked" / "new" / "erased" / "absent"
    failures: list[str]


class Child:
    """The child process and a thread that collects its lines as they come."""

    def __init__(self, model_dir: Path, cache_dir: Path, ledger: Ledger, seed: int, budget: str) -> None:
        path = cache_dir.parent / f"{cache_dir.name}-ledger.json"
        path.write_text(json.dumps({a: {"messages": ledger.messages[a]} for a in AGENTS}))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(budget=budget), str(model_dir), str(cache_dir), str(path), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO_ROOT,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.erasing = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line == "ready":
                self.ready.set()
            elif line.startswith("begin forget"):
                self.erasing.set()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.reader.join(10)


def temp_files(directory: Path) -> set[tuple[str, int]]:
    """The temp files there, by name and inode: a save reuses its agent's temp name, so a
    new write shows as a new inode under a name a crashed one left."""
    try:
        return {(e.name, e.inode()) for e in os.scandir(directory) if e.name.endswith(".tmp")}
    except FileNotFoundError:
        return set()


def kill_somewhere(child: Child, store_dir: Path, mode: str, rng: random.Random) -> None:
    """SIGKILL the child: at a random moment, inside a record write, or inside an erasure."""
    if not child.ready.wait(120):
        raise RuntimeError("the crash child did not start")
    if mode == "random":
        time.sleep(rng.uniform(0.05, 1.5))
    elif mode == "mid-write":
        before = temp_files(store_dir)
        deadline = time.monotonic() + 20
        while not (temp_files(store_dir) - before) and time.monotonic() < deadline:
            pass  # a new temp file: a save is being written right now
        time.sleep(rng.uniform(0, 0.002))
    else:
        child.erasing.wait(20)
        time.sleep(rng.uniform(0, 0.002))
    child.kill()


def crash_once(model_dir: Path, cache_dir: Path, ledger: Ledger, seed: int, mode: str, budget: str = "1MB") -> Outcome:
    """One child, one kill, one full check; updates ``ledger`` with what was acknowledged."""
    from kvshelf.runtime.engine import Engine
    from kvshelf.storage.agent_id import AgentId

    rng = random.Random(seed)
    probe = Engine(model=str(model_dir), cache_dir=cache_dir, progress=False)
    store_dir = probe._shelf.store.directory
    probe.close()
    temps_before = temp_files(store_dir)
    child = Child(model_dir, cache_dir, ledger, seed, budget)
    kill_somewhere(child, store_dir, mode, rng)

    in_flight: tuple[str, ...] | None = None
    acked = 0
    for line in child.lines:
        parts = line.split(" ", 3)  # the fourth part of an ack is JSON, spaces and all
        if parts[0] == "begin":
            in_flight = tuple(
                line.split(" ")[1:]
            )  # op, agent, then the prompt's length and digest or the fork's target
        elif parts[0] in ("ack", "nack", "noop"):
            op, aid = parts[1], parts[2]
            if parts[0] == "ack":
                acked += 1
                if op == "chat":
                    state = json.loads(parts[3])
                    ledger.messages[aid], ledger.tokens[aid] = state["messages"], state["tokens"]
                elif op == "forget":
                    ledger.messages[aid], ledger.tokens[aid] = [], None
                elif op == "fork":
                    state = json.loads(parts[3])
                    ledger.messages[state["dst"]], ledger.tokens[state["dst"]] = state["messages"], state["tokens"]
            in_flight = None

    temps = len(temp_files(store_dir) - temps_before)
    failures: list[str] = []
    records: dict[str, str] = {}
    engine = Engine(model=str(model_dir), cache_dir=cache_dir, progress=False)
    try:
        cut: tuple[str, ...] = in_flight or ()  # op, agent, ... of the operation cut short
        for aid in AGENTS:
            flying = in_flight is not None and in_flight[1] == aid
            forked_to = in_flight is not None and in_flight[0] == "fork" and in_flight[2] == aid
            expected = ledger.tokens[aid]
            if engine._shelf.store.path_for(aid).exists():
                cache = engine._shelf.load(AgentId(aid))  # checksums, header, fit: None (and quarantined) if bad
                if cache is None:
                    failures.append(f"{aid}: record is unusable")
                    continue
                tokens = list(cache.tokens)
            else:
                tokens = None
            if tokens == expected:
                records[aid] = "acked" if tokens is not None else "absent"
            elif flying and cut[0] == "forget" and tokens is None:
                records[aid] = "erased"
            elif forked_to and tokens is None:  # the fork had erased it first
                records[aid] = "erased"
            elif forked_to and tokens is not None and tokens == ledger.tokens[cut[1]]:
                records[aid] = "new"
            elif (
                flying
                and cut[0] == "chat"
                and tokens is not None
                and len(tokens) >= int(cut[2])
                and digest(tokens[: int(cut[2])]) == cut[3]
            ):
                records[aid] = "new"
            elif expected is not None and tokens is None:
                failures.append(f"{aid}: an acknowledged turn was lost ({len(expected)} tokens)")
            else:
                failures.append(f"{aid}: the record is neither the acknowledged version nor the one in flight")
            if records.get(aid) in ("new", "erased"):
                ledger.tokens[aid] = tokens  # what the next round starts from
                if tokens is None:
                    ledger.messages[aid] = []
        quarantined = [
            *engine._shelf.store.quarantine_dir.glob("*.safetensors"),
            *engine._shelf.shared.store.quarantine_dir.glob("*.safetensors"),
        ]
        if quarantined:
            failures.append(f"{len(quarantined)} record(s) were quarantined as corrupt")
    finally:
        engine.close()
    flight = " ".join(in_flight[:2]) if in_flight else None
    return Outcome(mode, acked, flight, temps, records, failures)


def warm_restore_check(model_dir: Path, cache_dir: Path, ledger: Ledger) -> dict[str, str]:
    """Continue every agent with an acknowledged turn in a new process: each must come back warm."""
    from kvshelf.runtime.engine import Engine

    engine = Engine(model=str(model_dir), cache_dir=cache_dir, progress=False)
    try:
        seen: dict[str, str] = {}
        for aid in AGENTS:
            if ledger.tokens[aid] is not None and ledger.messages[aid]:
                messages = ledger.messages[aid] + [{"role": "user", "content": "and after the crash?"}]
                seen[aid] = engine.chat(aid, messages, max_tokens=2).cache
        return seen
    finally:
        engine.close()
