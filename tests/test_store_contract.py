"""The store contract, run by the same test functions against every backend a store URL can name.

``file``: a shared directory (as on an NFS or SMB mount). ``s3``: an S3 protocol server the
test starts, moto's standalone server (``python -m moto.server``) on a free loopback port.
moto is an emulator: it speaks the S3 API, including the conditional puts this contract
needs (``create`` twice is refused, a stale ``If-Match`` ETag gets 412), but the production
targets are real S3-compatible services (AWS S3, Cloudflare R2, MinIO, Ceph RGW). Without
moto installed, the s3 variant is skipped, saying so.

The contract: a save loads back bit for bit; a write on top of a record this node did not
read last is refused (``StaleWrite``); a delete leaves a tombstone no stale writer gets
past, and a fresh conversation starts above it; a corrupt record is quarantined, never
deleted, and the agent starts cold; listing pages are complete and exclusive; records are
the same bytes on every backend, so copying one moves it.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvshelf.errors import StaleWrite
from kvshelf.storage import codec
from kvshelf.storage.location import open_store
from kvshelf.storage.records import RecordStore
from kvshelf.storage.remote import RemoteRecordStore
from tests.support.s3 import moto_server
from tests.test_store import FINGERPRINT, assert_same_record, make_record

HAS_MOTO = importlib.util.find_spec("moto") is not None and importlib.util.find_spec("obstore") is not None


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's standalone S3 server, started once for the session on a free port."""
    if not HAS_MOTO:
        pytest.skip("moto[server] or obstore is not installed (pip install -e '.[dev]'): no S3 server to test against")
    with moto_server() as url:
        yield url


def s3_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> str:
    """The standard AWS variables pointed at the emulator, and a new bucket; its name."""
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    bucket = f"kvshelf-{uuid.uuid4().hex[:12]}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10).read()
    return bucket


Opener = Callable[[str], RecordStore]


@pytest.fixture(params=["file", "s3"])
def nodes(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Opener:
    """Opens the store of one URL as node ``name`` (each node with its own local cache)."""
    if request.param == "file":
        url = f"file://{tmp_path / 'store'}"
    else:
        url = f"s3://{s3_env(monkeypatch, request.getfixturevalue('moto_endpoint'))}/team/agents"

    def open_node(name: str) -> RecordStore:
        return open_store(url, FINGERPRINT, shared=True, node_id=name, cache_dir=tmp_path / f"cache-{name}")

    return open_node


def raw(store: RecordStore, agent: str) -> bytes | None:
    """The bytes the store holds for the agent (a file, or an object), read behind its back."""
    if isinstance(store, RemoteRecordStore):
        got = store.backend.get(store.key_for(agent))
        return bytes(got.data) if got is not None and not isinstance(got, str) else None
    path = store.path_for(agent)
    return path.read_bytes() if path.exists() else None


def put_raw(store: RecordStore, agent: str, data: bytes) -> None:
    """Put bytes where the agent's record goes, behind the store's back (a copy, a corruption)."""
    if isinstance(store, RemoteRecordStore):
        store.backend.overwrite(store.key_for(agent), [data])
    else:
        store.path_for(agent).parent.mkdir(parents=True, exist_ok=True)
        store.path_for(agent).write_bytes(data)


def stamp(store: RecordStore, agent: str) -> codec.Stamp:
    data = raw(store, agent)
    assert data is not None
    found = codec.header_of(data, len(data), FINGERPRINT)
    assert not isinstance(found, int)
    return found[1]


def quarantined(store: RecordStore) -> list[str]:
    if isinstance(store, RemoteRecordStore):
        return sorted(k for page in store.backend.list("quarantine/") for k, _ in page)
    return sorted(p.name for p in store.quarantine_dir.iterdir()) if store.quarantine_dir.exists() else []


# -- the contract -----------------------------------------------------------------------------
def test_save_and_load(nodes: Opener) -> None:
    a = nodes("a")
    record = make_record(seed=1)
    written = a.save("alice", record)
    assert written == len(raw(a, "alice") or b"") and stamp(a, "alice") == codec.Stamp(1, "a", False)
    assert_same_record(a.load("alice"), record)
    assert_same_record(nodes("b").load("alice"), record)  # another node, nothing cached yet
    assert a.load("nobody") is None and not a.has_record("nobody")


def test_a_conditional_write_is_refused(nodes: Opener) -> None:
    a, b = nodes("a"), nodes("b")
    a.save("alice", make_record(seed=1))
    assert b.load("alice") is not None and b.counters.takeovers == 1
    newer = make_record(seed=2)
    b.save("alice", newer)
    assert a.is_current("alice") is False and b.is_current("alice") is True
    with pytest.raises(StaleWrite, match="generation 2 by node 'b'"):
        a.save("alice", make_record(seed=3))
    with pytest.raises(StaleWrite):
        nodes("c").save("alice", make_record(seed=4))  # never read it: no blind overwrite either
    assert a.counters.refused_writes == 1 and a.counters.failures == 0
    assert_same_record(a.load("alice"), newer)  # nothing went back in time
    a.save("alice", make_record(seed=5))  # on top of what it read: accepted
    assert stamp(a, "alice") == codec.Stamp(3, "a", False)


def test_tombstone(nodes: Opener) -> None:
    a, b = nodes("a"), nodes("b")
    a.save("alice", make_record(seed=1))
    a.save("alice", make_record(seed=2))
    assert b.delete("alice")
    assert stamp(b, "alice") == codec.Stamp(3, "b", True)
    tomb = raw(b, "alice") or b""
    assert b"__tokens__" in tomb and len(tomb) < 2048  # the id and a generation, nothing of the conversation
    with pytest.raises(StaleWrite, match="deleted at generation 3"):
        a.save("alice", make_record(seed=3))
    assert b.delete("alice") == []  # already deleted: nothing more to remove
    assert a.load("alice") is None and not a.has_record("alice") and a.info("alice") is None
    assert a.page() == ([], False) and a.agent_ids() == []
    a.save("alice", make_record(seed=4))  # a fresh conversation under the same id, above the tombstone
    assert stamp(a, "alice") == codec.Stamp(4, "a", False)
    assert [i.agent_id for i in b.page()[0]] == ["alice"]


def test_quarantine_of_a_corrupt_record(nodes: Opener) -> None:
    a = nodes("a")
    a.save("alice", make_record(seed=1))
    good = raw(a, "alice")
    assert good is not None
    torn = good[:-100]
    put_raw(a, "alice", torn)
    assert a.load("alice") is None  # unusable: the agent starts cold...
    kept = quarantined(a)
    assert [name.rsplit(".", 1)[-1] for name in kept] == ["reason", "safetensors"]  # ...and it is kept aside
    assert not a.has_record("alice")
    a.save("alice", make_record(seed=2))  # the next save writes over the place it left
    assert a.load("alice") is not None


def test_listing(nodes: Opener) -> None:
    a = nodes("a")
    ids = [f"agent{i:02d}" for i in range(7)]
    for i, agent in enumerate(ids):
        a.save(agent, make_record(n_layers=1, n_tokens=16 + i))
    a.delete("agent03")
    seen: list[str] = []
    after = None
    while True:
        page, more = a.page(after, 2)
        seen += [info.agent_id for info in page]
        assert all(info.tokens == 16 + int(info.agent_id[-2:]) and info.disk_bytes > 0 for info in page)
        if not more:
            break
        after = page[-1].agent_id
    assert seen == [agent for agent in ids if agent != "agent03"]  # each once, in order, none deleted
    assert a.agent_ids() == seen and nodes("b").agent_ids() == seen
    assert a.token_count("agent05") == 21 and a.size_on_disk("agent05") == len(raw(a, "agent05") or b"")


# -- between backends ------------------------------------------------------------------------------
def test_copying_a_record_moves_it_between_a_directory_and_a_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto_endpoint: str
) -> None:
    directory = open_store(tmp_path / "dir", FINGERPRINT, shared=True, node_id="a")
    bucket = open_store(
        f"s3://{s3_env(monkeypatch, moto_endpoint)}/p", FINGERPRINT, shared=True, cache_dir=tmp_path / "c"
    )
    assert isinstance(bucket, RemoteRecordStore)
    record = make_record(seed=7)
    directory.save("alice", record)
    data = directory.path_for("alice").read_bytes()
    assert bucket.key_for("alice") == directory.path_for("alice").relative_to(directory.root).as_posix()
    put_raw(bucket, "alice", data)  # a plain copy of the file into the bucket
    assert_same_record(bucket.load("alice"), record)
    bucket.save("bob", make_record(seed=8))
    put_raw(directory, "bob", raw(bucket, "bob") or b"")  # and an object back into a directory
    assert_same_record(directory.load("bob"), make_record(seed=8))


def test_the_local_cache_is_read_through_and_validated_by_etag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto_endpoint: str
) -> None:
    url = f"s3://{s3_env(monkeypatch, moto_endpoint)}/p"
    a = open_store(url, FINGERPRINT, shared=True, node_id="a", cache_dir=tmp_path / "a")
    b = open_store(url, FINGERPRINT, shared=True, node_id="b", cache_dir=tmp_path / "b")
    assert isinstance(a, RemoteRecordStore)
    a.save("alice", make_record(seed=1))
    assert a.path_for("alice").read_bytes() == raw(a, "alice")  # kept locally, byte for byte
    a.backend.overwrite("unrelated", [b"x"])  # (so that the bucket holds more than one object)
    mtime = a.path_for("alice").stat().st_mtime_ns
    assert_same_record(a.load("alice"), make_record(seed=1))  # served from the copy: the ETag matched
    assert a.path_for("alice").stat().st_mtime_ns == mtime
    assert b.load("alice") is not None
    b.save("alice", make_record(seed=2))
    assert_same_record(a.load("alice"), make_record(seed=2))  # the copy was stale: fetched again
    assert a.path_for("alice").read_bytes() == raw(a, "alice")
    os.remove(a.path_for("alice"))
    assert_same_record(a.load("alice"), make_record(seed=2))  # a lost copy is only a transfer


# -- engines on a bucket ------------------------------------------------------------------------------
def test_engines_share_a_bucket_with_one_writer_per_agent(tiny_dirs, tmp_path, monkeypatch, moto_endpoint) -> None:
    from kvshelf.runtime.engine import Engine

    url = f"s3://{s3_env(monkeypatch, moto_endpoint)}/cluster"
    a, b = (
        Engine(tiny_dirs["llama"], tmp_path / name, store=url, shared=True, node_id=name, durable=True, progress=False)
        for name in ("a", "b")
    )
    try:
        m1 = [{"role": "user", "content": "Inventory: 4 crates of apples. " * 5}]
        r1 = a.chat("ivy", m1, max_tokens=5)
        assert r1.saved and r1.cache == "cold"
        m2 = [*m1, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "How many?"}]
        r2 = b.chat("ivy", m2, max_tokens=5)  # moved to b: restored from the bucket
        assert r2.cache == "warm" and r2.usage.cached_tokens > 0 and r2.saved
        m3 = [*m2, {"role": "assistant", "content": r2.text}, {"role": "user", "content": "And pears?"}]
        r3 = a.chat("ivy", m3, max_tokens=5)  # back on a: its RAM copy is behind, the bucket's record wins
        assert r3.cache == "warm" and r3.usage.cached_tokens == r2.usage.prompt_tokens + r2.usage.completion_tokens - 1
        assert a.store_counters.stale_reloads == 1 and a.store_counters.round_trips > 0
        b.forget("ivy")
        r4 = a.chat("ivy", m3, max_tokens=5)
        assert r4.cache == "cold" and r4.usage.cached_tokens == 0  # deleted on b: gone for a too
        assert b.agent("ivy") is not None  # a's fresh conversation above the tombstone is listed
    finally:
        a.close()
        b.close()


def test_kvshelf_serve_nodes_on_a_bucket(tiny_dirs, tmp_path, monkeypatch, moto_endpoint) -> None:
    import signal

    import httpx

    from tests.support.servers import start_node, turn_here_then_there, wait_up

    url = f"s3://{s3_env(monkeypatch, moto_endpoint)}/team"
    nodes = [
        start_node(tiny_dirs["llama"], url, "--shared", "--node-id", name, "--cache-dir", str(tmp_path / name))
        for name in ("a", "b")
    ]
    try:
        for proc, base in nodes:
            wait_up(proc, base)
        (_, a), (_, b) = nodes
        _, second = turn_here_then_there(a, b, "kai", "Keep this: the launch is on Monday. ")
        assert second["kvshelf"]["cache"] == "warm" and second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        listed = httpx.get(a + "/v1/agents", timeout=30).json()["data"]
        assert [entry["id"] for entry in listed] == ["kai"] and listed[0]["disk_bytes"] > 0
    finally:
        for proc, _ in nodes:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in nodes:
            proc.wait(timeout=60)
    for proc, _ in nodes:
        assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
