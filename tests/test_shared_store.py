"""A store shared by several nodes: one writer per agent, enforced by the store.

Two ``RecordStore``s (or two engines) on one directory stand for two nodes on one NFS or
SMB mount; a child process stands for a node that is paused (SIGSTOP) and comes back.
Every save is conditional on what the node last read or wrote, a delete leaves a
tombstone, and a node reuses its RAM copy of an agent only while the store still holds
the record that copy came from.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvshelf.errors import StaleWrite
from kvshelf.runtime.engine import Engine
from kvshelf.storage import codec
from kvshelf.storage.records import RecordStore
from tests.support import REPO_ROOT
from tests.test_store import FINGERPRINT, assert_same_record, make_record, rewrite_header


def node(root: Path, name: str, **kw: object) -> RecordStore:
    return RecordStore(root, FINGERPRINT, shared=True, node_id=name, **kw)  # type: ignore[arg-type]


def stamp_of(store: RecordStore, agent: str) -> codec.Stamp:
    with open(store.path_for(agent), "rb") as file:
        return codec.read_header(file, os.fstat(file.fileno()).st_size, store.model_fingerprint)[1]


# -- the store ----------------------------------------------------------------------------------
def test_a_save_is_refused_once_another_node_wrote_the_agent(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    first, second, stale = make_record(seed=1), make_record(seed=2), make_record(seed=3)
    a.save("alice", first)
    assert stamp_of(a, "alice") == codec.Stamp(1, "a", False)
    assert_same_record(b.load("alice"), first)  # b takes alice over from a
    assert b.counters.takeovers == 1
    b.save("alice", second)
    assert not a.is_current("alice") and b.is_current("alice")
    with pytest.raises(StaleWrite) as refused:
        a.save("alice", stale)  # a never saw b's record: it must not write over it
    assert "generation 2 by node 'b'" in str(refused.value) and refused.value.status == 409
    assert a.counters.refused_writes == 1 and a.counters.failures == 0
    assert stamp_of(a, "alice") == codec.Stamp(2, "b", False)
    assert_same_record(a.load("alice"), second)  # the newer record stands; a reads it...
    a.save("alice", stale)  # ...and may write on top of it now
    assert stamp_of(a, "alice") == codec.Stamp(3, "a", False)


def test_a_node_that_never_read_an_agent_cannot_overwrite_it(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    a.save("alice", make_record(seed=1))
    with pytest.raises(StaleWrite):
        b.save("alice", make_record(seed=2))  # b's state was not built on a's record
    assert stamp_of(a, "alice").node_id == "a"


def test_a_delete_leaves_a_tombstone_that_no_stale_writer_gets_past(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    a.save("alice", make_record(seed=1))
    a.save("alice", make_record(seed=2))
    assert b.load("alice") is not None
    assert b.delete("alice") == [b.path_for("alice")]
    assert stamp_of(b, "alice") == codec.Stamp(3, "b", True)  # above every earlier generation
    tomb = b.path_for("alice").read_bytes()
    assert b"__tokens__" in tomb and len(tomb) < 2048  # the id and a generation, nothing of the conversation
    with pytest.raises(StaleWrite, match="deleted at generation 3 by node 'b'"):
        a.save("alice", make_record(seed=3))
    assert a.load("alice") is None and b.load("alice") is None
    assert not a.has_record("alice")
    assert a.agent_ids() == [] and a.page() == ([], False) and a.info("alice") is None
    a.save("alice", make_record(seed=4))  # a fresh conversation under the same id, after reading the tombstone
    assert stamp_of(a, "alice") == codec.Stamp(4, "a", False)
    assert [i.agent_id for i in b.page()[0]] == ["alice"]


def test_a_tombstone_also_stops_a_node_that_never_saved_the_agent(tmp_path: Path) -> None:
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    assert a.load("bob") is None  # a starts bob cold: its first save would create the record
    b.delete("bob")  # deleted before any node saved it
    with pytest.raises(StaleWrite):
        a.save("bob", make_record())
    assert not b.has_record("bob")


def test_old_records_read_as_generation_zero(tmp_path: Path) -> None:
    old = RecordStore(tmp_path, FINGERPRINT)
    record = make_record()
    old.save("alice", record)
    rewrite_header(old.path_for("alice"), lambda meta, table: meta.pop("kvshelf.generation"))  # as written before
    a = node(tmp_path, "a")
    assert_same_record(a.load("alice"), record)
    assert a.version("alice") is not None and a.version("alice").generation == 0  # type: ignore[union-attr]
    a.save("alice", record)
    assert stamp_of(a, "alice") == codec.Stamp(1, "a", False)


def test_a_corrupt_record_is_quarantined_but_a_newer_one_is_not(tmp_path: Path) -> None:
    a = node(tmp_path, "a")
    a.save("alice", make_record())
    a.path_for("alice").write_bytes(b"garbage")
    assert a.load("alice") is None
    assert [p.suffix for p in sorted(a.quarantine_dir.iterdir())] == [".reason", ".safetensors"]
    assert not a.path_for("alice").exists()


def test_an_unshared_store_keeps_last_writer_wins(tmp_path: Path) -> None:
    """Without ``shared`` nothing changes: two stores on one directory (a server and a CLI)
    may both write, as before, and a delete removes every file."""
    one, two = RecordStore(tmp_path, FINGERPRINT), RecordStore(tmp_path, FINGERPRINT)
    one.save("alice", make_record(seed=1))
    two.save("alice", make_record(seed=2))
    one.save("alice", make_record(seed=3))
    assert stamp_of(one, "alice").generation == 2  # one's second write (generations still count)
    assert two.delete("alice") and not any(tmp_path.rglob("alice*"))


# -- engines ------------------------------------------------------------------------------------
def talk(text: str) -> list[dict]:
    return [{"role": "system", "content": "You keep notes."}, {"role": "user", "content": text}]


def more(msgs: list[dict], reply: str, text: str) -> list[dict]:
    return [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": text}]


@pytest.fixture
def pair(tiny_dirs, tmp_path):
    a = Engine(tiny_dirs["llama"], store=str(tmp_path), shared=True, node_id="a", durable=True, progress=False)
    b = Engine(tiny_dirs["llama"], store=f"file://{tmp_path}", shared=True, node_id="b", durable=True, progress=False)
    yield a, b
    a.close()
    b.close()


def test_a_node_reuses_ram_only_while_the_store_holds_its_record(pair) -> None:
    a, b = pair
    m1 = talk("Day one: rain. " * 8)
    r1 = a.chat("alice", m1, max_tokens=6)
    assert r1.saved and r1.cache == "cold"
    m2 = more(m1, r1.text, "Day two: sun.")
    hot = a.chat("alice", m2, max_tokens=6)
    assert hot.cache == "hot" and a.store_counters.stale_reloads == 0  # checked, and still current
    m3 = more(m2, hot.text, "Day three: fog.")
    moved = b.chat("alice", m3, max_tokens=6)  # the balancer moved alice to b
    assert moved.cache == "warm" and moved.usage.cached_tokens > 0 and moved.saved
    assert b.store_counters.takeovers == 1
    m4 = more(m3, moved.text, "Day four: snow.")
    back = a.chat("alice", m4, max_tokens=6)  # ...and back: a's RAM copy is two turns behind
    assert back.cache == "warm" and back.saved
    assert back.usage.cached_tokens == moved.usage.prompt_tokens + moved.usage.completion_tokens - 1
    assert a.store_counters.stale_reloads == 1 and a.store_counters.refused_writes == 0


def test_a_refused_save_drops_the_ram_copy_and_answers_saved_false(pair, caplog) -> None:
    a, b = pair
    m1 = talk("Remember the number 7. " * 6)
    r1 = a.chat("alice", m1, max_tokens=6)
    m2 = more(m1, r1.text, "And 8?")
    store = a._shelf.store
    moved: list[object] = []

    def b_writes_first() -> None:  # another node saves alice between a's check and a's save
        if not moved:
            moved.append(b.chat("alice", m2, max_tokens=4))

    store.before_write = b_writes_first
    with caplog.at_level(logging.WARNING, logger="kvshelf.runtime.shelf"):
        stale = a.chat("alice", m2, max_tokens=6)
    store.before_write = None
    assert stale.text and stale.saved is False  # the turn is answered, honestly not saved
    assert a.store_counters.refused_writes == 1
    warnings = [r for r in caplog.records if "dropping this node's RAM copy" in r.getMessage()]
    assert len(warnings) == 1 and "by node 'b'" in warnings[0].getMessage()
    assert a.flush() == []  # a refused write is not retried: nothing is left to save...
    assert "alice" not in a._shelf.pool  # ...and the stale copy is dropped, never reused
    assert stamp_of(store, "alice").node_id == "b"
    again = a.chat("alice", more(m2, moved[0].text, "And 9?"), max_tokens=4)  # type: ignore[attr-defined]
    assert again.cache == "warm" and again.saved  # b's record, read and written on top of


def test_a_deleted_agent_stays_deleted_for_the_node_that_held_it(pair) -> None:
    a, b = pair
    m1 = talk("A secret: the door code is 1234. " * 4)
    a.chat("carol", m1, max_tokens=6)
    b.forget("carol")  # DELETE on another node while a still holds carol in RAM
    assert not b._shelf.store.has_record("carol") and b.agent("carol") is None
    fresh = a.chat("carol", m1, max_tokens=6)
    assert fresh.cache == "cold" and fresh.usage.cached_tokens == 0  # nothing of the old conversation
    assert fresh.saved and stamp_of(a._shelf.store, "carol").generation == 3  # above the tombstone's 2


# -- a real paused node ---------------------------------------------------------------------------
PAUSED_NODE = """
import json, sys
from kvshelf.runtime.engine import Engine
model, root, m1, m2 = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
a = Engine(model, store=root, shared=True, node_id="a", durable=True, progress=False)
saved = [a.chat(agent, m1, max_tokens=6).saved for agent in ("dave", "erin")]
print(json.dumps({"ready": all(saved)}), flush=True)
sys.stdin.readline()  # paused (SIGSTOP) around here; resumed, it serves both agents' next turns
dave, erin = a.chat("dave", m2, max_tokens=6), a.chat("erin", m2, max_tokens=4)
print(json.dumps({"dave": [dave.cache, dave.usage.cached_tokens, dave.saved],
                  "erin": [erin.cache, erin.usage.cached_tokens], "counters": a.store_counters.snapshot()}), flush=True)
a.close()
"""


def test_a_paused_node_blocks_no_one_and_comes_back_to_the_newer_record(tiny_dirs, tmp_path) -> None:
    m1 = talk("Log: the pump failed at noon. " * 5)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PAUSED_NODE), str(tiny_dirs["llama"]), str(tmp_path), json.dumps(m1)]
        + [json.dumps(more(m1, "ok", "What failed?"))],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert json.loads(child.stdout.readline()) == {"ready": True}
        os.kill(child.pid, signal.SIGSTOP)
        b = Engine(tiny_dirs["llama"], store=str(tmp_path), shared=True, node_id="b", durable=True, progress=False)
        b._shelf.store.lock_timeout = 0.5  # a held lock would fail these saves: none is held
        started = time.monotonic()
        r = b.chat("dave", more(m1, "ok", "What failed?"), max_tokens=6)
        assert r.cache == "warm" and r.saved and time.monotonic() - started < 30
        b.forget("erin")  # deleted while a, paused, holds her in RAM
        fingerprint = b.loaded.fingerprint
        b.close()
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("\n")
        child.stdin.flush()
        report = json.loads(child.stdout.readline())
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
    cache, cached, saved = report["dave"]
    assert cache == "warm" and cached > 0 and saved  # b's newer record, not a's RAM copy
    assert report["erin"] == ["cold", 0]  # deleted stays deleted: nothing of her old turn is reused
    assert report["counters"]["stale_reloads"] == 2 and report["counters"]["takeovers"] == 1
    check = RecordStore(tmp_path, fingerprint, shared=True)
    assert stamp_of(check, "dave") == codec.Stamp(3, "a", False)  # a wrote on top of b's generation 2
    assert stamp_of(check, "erin") == codec.Stamp(3, "a", False)  # a fresh start above the tombstone


# -- kvshelf serve --shared -------------------------------------------------------------------------
def test_shared_servers_serve_one_store_and_an_unshared_one_still_stands_alone(tiny_dirs, tmp_path) -> None:
    import httpx

    from tests.support.servers import start_node, turn_here_then_there, wait_up

    model = tiny_dirs["llama"]
    nodes = [start_node(model, f"file://{tmp_path}", "--shared", "--node-id", name) for name in ("a", "b")]
    try:
        for proc, url in nodes:
            wait_up(proc, url)
        (_, a), (_, b) = nodes
        _, second = turn_here_then_there(a, b, "fay", "Note: the meeting moved to Friday. ")
        assert second["kvshelf"]["saved"] is True and second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert httpx.delete(a + "/v1/agents/fay", timeout=30).status_code == 200  # a's copy is stale: deleted anyway
        assert httpx.get(b + "/v1/agents/fay", timeout=30).status_code == 404
    finally:
        for proc, _ in nodes:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in nodes:
            proc.wait(timeout=60)
    for proc, _ in nodes:
        assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
    alone, url = start_node(model, str(tmp_path))
    try:
        wait_up(alone, url)
        rival, _ = start_node(model, str(tmp_path))  # unshared: refused, as without --store
        assert rival.wait(timeout=60) == 2
        assert rival.stdout is not None and "already serving" in rival.stdout.read()
    finally:
        alone.send_signal(signal.SIGTERM)
        alone.wait(timeout=60)
