"""A store of many agents: saves beside 10,000 other files, paged listings while agents come
and go, an index that is lost or damaged, one agent's metadata without a listing, listing
while the scheduler is busy, bookkeeping that shrinks, and how ``kvshelf serve`` exits.

Timings are not asserted here (they live in benchmarks/store_scale.py); what is asserted
is what makes them flat: a save lists no directory, a page reads no more than a page.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from fastapi.testclient import TestClient

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from kvshelf.kv.record import CacheRecord
from kvshelf.runtime.engine import Engine
from kvshelf.serving.server import create_app
from kvshelf.storage import records as records_module
from kvshelf.storage.index import INDEX_NAME
from kvshelf.storage.records import RecordStore
from tests.support.servers import SHORT_DRAIN, wait_up
from tests.support.tiny import make_tiny_model_dir

FINGERPRINT = "3f" * 32
ASK = [{"role": "user", "content": "Say something about rivers."}]


def record(n_tokens: int) -> CacheRecord:
    return CacheRecord(tokens=list(range(n_tokens)), tensors={"k": mx.arange(8, dtype=mx.uint32)}, meta={})


def walk(store: RecordStore, limit: int) -> list[str]:
    ids: list[str] = []
    after = None
    while True:
        items, more = store.page(after, limit)
        ids += [i.agent_id for i in items]
        if not more:
            return ids
        after = items[-1].agent_id


class ScanCounter:
    """Counts directory listings (``os.scandir``/``os.listdir``) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        scandir, listdir = os.scandir, os.listdir

        def counting_scandir(path=".", *a, **k):
            self.calls.append(str(path))
            return scandir(path, *a, **k)

        def counting_listdir(path=".", *a, **k):
            self.calls.append(str(path))
            return listdir(path, *a, **k)

        monkeypatch.setattr(os, "scandir", counting_scandir)
        monkeypatch.setattr(os, "listdir", counting_listdir)


# -- saves beside many agents -----------------------------------------------------------------
def test_save_and_load_beside_ten_thousand_files_list_no_directory(tmp_path, monkeypatch):
    store = RecordStore(tmp_path, FINGERPRINT)
    store.save("me", record(5))
    for i in range(5000):  # plain files, as many other agents leave: a record and a lock each
        (store.directory / f"other-{i:05d}.safetensors").write_bytes(b"x")
        (store.directory / f"other-{i:05d}.lock").write_bytes(b"")
    store.close()
    store = RecordStore(tmp_path, FINGERPRINT)
    index = store.open_index()
    assert index is not None and index.wait_ready(60)

    counter = ScanCounter(monkeypatch)
    for n in (7, 300, 9):
        assert store.save("me", record(n)) == store.size_on_disk("me")
        loaded = store.load("me")
        assert loaded is not None and loaded.tokens == list(range(n))
        assert store.info("me") is not None and store.info("me").tokens == n  # type: ignore[union-attr]
    store.save("newcomer", record(3))
    assert counter.calls == []  # nothing listed a directory
    monkeypatch.undo()

    names = {e.name for e in os.scandir(store.directory)}
    assert not [n for n in names if n.endswith(".tmp")]
    assert {"other-00000.safetensors", "other-04999.lock", "me.safetensors", "newcomer.safetensors"} <= names
    assert store.page(None, 3)[0][0].agent_id == "me"  # "me" < "newcomer" < "other-..."
    listed = walk(store, 997)
    assert listed == sorted(["me", "newcomer", *(f"other-{i:05d}" for i in range(5000))])
    assert store.delete("me") and store.info("me") is None
    store.close()


def test_temp_files_of_dead_writers_are_swept_once_at_open(tmp_path):
    store = RecordStore(tmp_path, FINGERPRINT)
    store.save("ada", record(4))
    store.close()
    old = time.time() - 2 * records_module.STALE_TEMP_SECONDS
    dead = [store.directory / ".ada.tmp", store.directory / f".bo.{'a' * 32}.tmp"]  # this version's, an earlier one's
    young = store.directory / ".cy.tmp"  # a writer in another process may be busy with it
    for path in [*dead, young]:
        path.write_bytes(b"half a record")
    for path in dead:
        os.utime(path, (old, old))
    reopened = RecordStore(tmp_path, FINGERPRINT)
    index = reopened.open_index()
    assert index is not None and index.wait_ready(30)
    assert not any(p.exists() for p in dead) and young.exists()
    assert reopened.load("ada") is not None
    # a crashed save's temp goes with its agent, however young
    assert set(reopened.delete("cy")) == {young, reopened.directory / "cy.lock"}
    reopened.close()


# -- paged listing ----------------------------------------------------------------------------
def test_pages_cover_every_agent_exactly_once_while_agents_come_and_go(tmp_path):
    rng = random.Random(22)
    store = RecordStore(tmp_path, FINGERPRINT)
    present = {f"agent-{i:04d}" for i in rng.sample(range(10000), 300)}
    for aid in sorted(present):
        store.save(aid, record(len(aid) + rng.randrange(50)))
    stayed = set(present)  # present from the first page to the last
    seen: list[str] = []
    after = None
    while True:
        items, more = store.page(after, 13)
        assert len(items) == 13 if more else len(items) <= 13
        seen += [i.agent_id for i in items]
        for _ in range(4):  # between pages: agents erased and new ones saved, before and after the cursor
            victim = rng.choice(sorted(present))
            store.delete(victim)
            present.discard(victim)
            stayed.discard(victim)
            newcomer = f"agent-{rng.randrange(10000):04d}"
            if newcomer not in present:
                store.save(newcomer, record(3))
                present.add(newcomer)
        if not more:
            break
        after = items[-1].agent_id
    assert seen == sorted(seen) and len(seen) == len(set(seen))  # in order, never twice
    assert stayed <= set(seen)  # every agent that stayed was listed
    assert walk(store, 50) == sorted(present)  # and a fresh walk is exactly what is there
    store.close()


def test_engine_and_server_pages_include_agents_not_yet_on_disk(tiny_dirs, tmp_path):
    engine = Engine(tiny_dirs["llama"], tmp_path, progress=False)
    for name in ("b", "d", "f"):
        engine.prefill(name, ASK)
    engine.flush()
    engine.close()
    engine = Engine(tiny_dirs["llama"], tmp_path, progress=False)  # b, d, f on disk only
    for name in ("a", "c", "e", "g"):
        engine.prefill(name, ASK)  # resident; their saves are written behind
    pages = []
    page = engine.agents_page(limit=2)
    while True:
        pages.append([a.agent_id for a in page.data])
        if not page.has_more:
            break
        page = engine.agents_page(limit=2, after=page.last_id)
    assert pages == [["a", "b"], ["c", "d"], ["e", "f"], ["g"]]
    assert {a.agent_id: a.resident for a in engine.agents()} == dict.fromkeys("aceg", True) | dict.fromkeys(
        "bdf", False
    )
    assert all(a.tokens > 0 and a.last_used for a in engine.agents())

    client = TestClient(create_app(engine, close_engine=False))
    first = client.get("/v1/agents", params={"limit": 3}).json()
    assert [a["id"] for a in first["data"]] == ["a", "b", "c"]
    assert (first["object"], first["first_id"], first["last_id"], first["has_more"]) == ("list", "a", "c", True)
    rest = client.get("/v1/agents", params={"limit": 100, "after": "c"}).json()
    assert [a["id"] for a in rest["data"]] == ["d", "e", "f", "g"] and rest["has_more"] is False
    assert len(client.get("/v1/agents").json()["data"]) == 7  # default limit 20, as OpenAI's
    for bad in ({"limit": 0}, {"limit": 101}, {"limit": "many"}, {"after": "../x"}):
        r = client.get("/v1/agents", params=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)
    engine.close()


# -- the index ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["deleted", "garbage", "truncated", "foreign-schema"])
def test_an_index_deleted_or_damaged_is_rebuilt_and_loses_nothing(tmp_path, damage):
    store = RecordStore(tmp_path, FINGERPRINT)
    want = {f"a{i:03d}": 1 + i for i in range(120)}
    for aid, n in want.items():
        store.save(aid, record(n))
    store.close()
    path = store.directory / INDEX_NAME
    if damage == "deleted":
        for p in store.directory.glob(INDEX_NAME + "*"):
            p.unlink()
    elif damage == "garbage":
        path.write_bytes(os.urandom(8192))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        import sqlite3

        with sqlite3.connect(path) as db:
            db.execute("PRAGMA user_version = 99")

    reopened = RecordStore(tmp_path, FINGERPRINT)
    listed: dict[str, int] = {}
    after = None
    while True:
        items, more = reopened.page(after, 32)
        listed |= {i.agent_id: i.tokens for i in items}
        if not more:
            break
        after = items[-1].agent_id
    assert listed == want  # every agent, with its token count read back from its header
    assert reopened.open_index() is not None and not reopened.open_index().in_memory  # type: ignore[union-attr]
    assert not [p for p in reopened.directory.iterdir() if "damaged" in p.name]  # nothing kept that names agents
    reopened.close()


def test_the_index_catches_up_with_records_written_behind_its_back(tmp_path):
    store = RecordStore(tmp_path, FINGERPRINT)
    store.save("kept", record(4))
    store.save("gone", record(4))
    store.close()
    unindexed = RecordStore(tmp_path, FINGERPRINT, indexed=False)  # a writer that never updates the index
    unindexed.save("late", record(11))
    unindexed.save("kept", record(40))
    (unindexed.directory / "gone.safetensors").unlink()
    reopened = RecordStore(tmp_path, FINGERPRINT)
    assert {i.agent_id: i.tokens for i in reopened.page(None, 10)[0]} == {"kept": 40, "late": 11}
    assert reopened.info("gone") is None and reopened.info("late").tokens == 11  # type: ignore[union-attr]
    reopened.close()


# -- one agent, and listing off the scheduler -------------------------------------------------
def test_one_agent_and_every_listing_are_answered_while_the_scheduler_is_busy(tiny_dirs, tmp_path, monkeypatch):
    engine = Engine(tiny_dirs["llama"], tmp_path, durable=True, progress=False)
    for name in ("ann", "ben", "cat"):
        engine.chat(name, ASK, max_tokens=3)
    assert engine.evict("ben")
    client = TestClient(create_app(engine, close_engine=False))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(60)

    blocker = threading.Thread(target=engine._scheduler.call, args=(hold,))
    blocker.start()
    try:
        assert held.wait(30)  # the worker thread is busy until released
        counter = ScanCounter(monkeypatch)
        one = client.get("/v1/agents/ben")
        assert one.status_code == 200 and one.json()["resident"] is False and one.json()["tokens"] > 0
        assert client.get("/v1/agents/ann").json()["resident"] is True
        assert client.get("/v1/agents/zoe").status_code == 404
        assert counter.calls == []  # no listing of any directory for one agent
        monkeypatch.undo()
        assert [a["id"] for a in client.get("/v1/agents").json()["data"]] == ["ann", "ben", "cat"]
        assert [a.agent_id for a in engine.agents()] == ["ann", "ben", "cat"]
        assert blocker.is_alive()  # all of it answered while the scheduler was held
    finally:
        release.set()
        blocker.join(30)
    engine.close()


def test_bookkeeping_is_bounded_by_resident_and_pending_agents(tiny_dirs, tmp_path):
    probe = Engine(tiny_dirs["llama"], tmp_path / "probe", progress=False)
    probe.prefill("one", ASK)
    per_agent = probe._shelf.pool.resident_bytes
    probe.close()
    engine = Engine(tiny_dirs["llama"], tmp_path / "store", budget=int(per_agent * 3.5), progress=False)
    shelf = engine._shelf
    for i in range(40):
        engine.prefill(f"agent-{i:02d}", ASK)
    assert engine.flush() == []
    resident = set(shelf.pool)
    assert 0 < len(resident) <= 4
    engine.prefill("agent-39", ASK)  # one more step of the loop: ended saves leave the table
    assert set(shelf.pool.last_used) == set(shelf.pool.residents()) == set(shelf.pool)
    assert len(shelf._saves) <= 1 and not shelf.unsaved
    assert len(engine.agents()) == 40  # the others are still listed, from disk
    engine.close()


# -- kvshelf serve's exit ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("exit-model") / "llama", "llama")


def start_server(model: Path, cache_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "kvshelf.cli", "serve", "--model", str(model), "--cache-dir", str(cache_dir)]
    proc = subprocess.Popen(
        [*command, *SHORT_DRAIN, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, f"http://127.0.0.1:{port}"


def turn(url: str, agent: str) -> dict:
    body = {"model": "x", "messages": ASK, "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Agent-Id": agent}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_0_on_a_clean_stop_signal(llama, tmp_path, sig):
    proc, url = start_server(llama, tmp_path)
    try:
        wait_up(proc, url)
        assert turn(url, "sam")["kvshelf"]["saved"] is True
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "NOT saved" not in output


def test_serve_says_which_agents_were_not_saved_and_exits_1(llama, tmp_path):
    proc, url = start_server(llama, tmp_path)
    try:
        wait_up(proc, url)
        assert turn(url, "bo")["kvshelf"]["saved"] is True
        store_dir = next(tmp_path.glob("*/bo.safetensors")).parent
        (store_dir / ".ann.tmp").mkdir()  # where ann's save must write: every save of ann now fails
        assert turn(url, "ann")["kvshelf"]["saved"] is False
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output
    last = [line for line in output.splitlines() if "NOT saved" in line]
    assert len(last) == 1 and last[0].rstrip().endswith(": ann"), output
