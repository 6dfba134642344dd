"""Nothing lost, nothing leaked: crashes, a full disk, two servers on one directory, erasure.

All on tiny random-weight models (tests/tiny.py) and real processes, files and
filesystems: the crash rounds SIGKILL a real child (tests/support/crashkit.py; the 50-round
version is benchmarks/crash.py), the full disk is a real tmpfs, and the first server on
a directory is a real ``kvshelf serve`` process.
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from tests.support.crashkit import KILL_MODES, Ledger, crash_once, warm_restore_check
from tests.support.servers import ServerThread, wait_up
from tests.support.tiny import make_tiny_model_dir

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from kvshelf.kv.agent_cache import AgentCache, common_prefix_length  # noqa: E402
from kvshelf.kv.record import CacheRecord  # noqa: E402
from kvshelf.runtime.engine import Engine  # noqa: E402
from kvshelf.serving.server import create_app, serve  # noqa: E402
from kvshelf.storage import exclusive  # noqa: E402
from kvshelf.storage import records as store_module  # noqa: E402
from kvshelf.storage.agent_id import AgentId  # noqa: E402
from kvshelf.storage.index import INDEX_NAME  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("faults-model") / "llama", "llama")


def resident(engine: Engine, aid: str) -> AgentCache:
    """The agent's cache in RAM, where the test's last turn left it."""
    cache = engine._shelf.pool.get(aid)
    assert cache is not None
    return cache


def on_disk(engine: Engine, aid: str) -> CacheRecord:
    """The agent's record, which the test knows was saved."""
    record = engine._shelf.store.load(aid)
    assert record is not None
    return record


def ask(client: TestClient, agent: str, content: str, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Agent-Id": agent})
    assert r.status_code == 200, r.text
    return r.json()


# -- crashes -------------------------------------------------------------------------------
def test_sigkill_during_saves_evictions_and_erasures(llama, tmp_path):
    """One round per kill mode: at a random moment, inside a record write, inside an erasure."""
    ledger = Ledger()
    outcomes = [crash_once(llama, tmp_path / "cache", ledger, seed=i, mode=mode) for i, mode in enumerate(KILL_MODES)]
    for o in outcomes:
        assert o.failures == [], o
    assert sum(o.ops_acked for o in outcomes) > 0  # acknowledged work was there to lose
    restored = warm_restore_check(llama, tmp_path / "cache", ledger)
    assert set(restored.values()) <= {"warm"}, restored


def test_durable_engine_answers_once_the_turn_is_on_disk(llama, tmp_path):
    engine = Engine(model=llama, cache_dir=tmp_path, durable=True, progress=False)
    r = engine.chat("dee", [{"role": "user", "content": "hello"}], max_tokens=3)
    # nothing was flushed: the answer itself waited for the save
    assert r.saved is True and engine._shelf.store.token_count("dee") == len(resident(engine, "dee").tokens)
    assert (
        Engine(model=llama, cache_dir=tmp_path, progress=False)
        .chat("x", [{"role": "user", "content": "a"}], max_tokens=1)
        .saved
        is None
    )
    engine.close()


# -- a full disk ---------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path | None]:
    """A real 2 MB tmpfs, or None where mounting is not allowed (then the write fails by fiat)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory: Path) -> Path:
    """Fill the filesystem under ``directory`` to the last byte."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_full_disk_save_fails_clearly_serving_goes_on_and_the_save_is_retried(
    small_disk, tmp_path, llama, caplog, monkeypatch
):
    root = small_disk or tmp_path / "cache"
    engine = Engine(model=llama, cache_dir=root, durable=True, progress=False)
    client = TestClient(create_app(engine, close_engine=False))
    first = ask(client, "fay", "Remember the number 42.")
    assert first["kvshelf"]["saved"] is True
    path = engine._shelf.store.path_for("fay")
    good = path.read_bytes()
    good_tokens = on_disk(engine, "fay").tokens

    if small_disk is not None:
        filler = fill(small_disk)
    else:  # no mount here: the same failure, simulated where the store writes
        print("no tmpfs could be mounted: simulating ENOSPC in the store's writes")

        def no_space(fd, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(store_module, "_write_all", no_space)
    caplog.set_level(logging.INFO)
    second = ask(client, "fay", "Remember the number 42. And 43?")
    assert second["kvshelf"]["saved"] is False  # answered all the same, from RAM
    assert path.read_bytes() == good  # the old record is intact
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("fay" in m and "No space left on device" in m and "previous record is unchanged" in m for m in errors)
    assert any("fay" in m and "retrying later" in m for m in errors)
    third = ask(client, "fay", "Remember the number 42. And 43? And 44?")
    assert third["kvshelf"]["cache"] == "hot" and third["kvshelf"]["saved"] is False
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "fay" in engine._shelf.unsaved
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # failed writes cleaned up

    if small_disk is not None:
        filler.unlink()
    else:
        monkeypatch.undo()
    in_ram = list(resident(engine, "fay").tokens)
    deadline = time.monotonic() + 60  # retries back off from 1 s; nobody calls flush()
    while engine._shelf.store.token_count("fay") != len(in_ram):
        assert time.monotonic() < deadline, "the failed save was never retried"
        time.sleep(0.1)
    assert engine._shelf.unsaved == set() and engine.flush() == []
    engine.close()
    restarted = Engine(model=llama, cache_dir=root, progress=False)
    assert on_disk(restarted, "fay").tokens == in_ram  # the third turn, written by a retry
    fourth = [{"role": "user", "content": "Remember the number 42. And 43? And 44? 45?"}]
    again = restarted.chat("fay", fourth, max_tokens=2)
    reusable = common_prefix_length(in_ram, restarted._encode(fourth))
    assert again.cache == "warm" and again.usage.cached_tokens == reusable
    assert reusable > common_prefix_length(good_tokens, restarted._encode(fourth))  # more than turn 1 held
    restarted.close()


# -- a read-only store -------------------------------------------------------------------------
@contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only for every process, root included: a bind mount of it onto
    itself, remounted read-only (chmod does not stop root, and the tests run as root).
    Skipped where mount(2) is not allowed (not root, a container without CAP_SYS_ADMIN,
    a Mac), with the reason in the skip message."""
    done = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a read-only bind mount needs root and mount(2), which this machine refuses: {done.stderr}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def client_port(r: httpx.Response) -> int:
    """The client side's port of the connection a response came on."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_a_read_only_store_is_read_without_locks_and_every_write_says_saved_false(llama, tmp_path, caplog):
    root = tmp_path / "cache"
    engine = Engine(model=llama, cache_dir=root, durable=True, progress=False)
    server = ServerThread(create_app(engine, close_engine=False))
    store = engine._shelf.store

    def say(http: httpx.Client, agent: str, content: str) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
        r = http.post("/v1/chat/completions", json=body, headers={"X-Agent-Id": agent})
        assert r.status_code == 200, r.text
        return r

    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert say(http, "rita", "Remember 42.").json()["kvshelf"]["saved"] is True
            assert say(http, "ruth", "I am ruth.").json()["kvshelf"]["saved"] is True
            assert engine.evict("rita") and engine.evict("ruth")  # on disk only
            torn = store.path_for("ruth")
            torn.write_bytes(torn.read_bytes()[:-100])
            caplog.set_level(logging.INFO)
            with read_only(root):
                first = say(http, "rita", "Remember 42. And 43?")
                reply = first.json()["kvshelf"]
                assert reply["cache"] == "warm" and reply["saved"] is False, reply  # read, not refused
                assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                reply = say(http, "ruth", "I am ruth. Still here.").json()["kvshelf"]
                assert reply["cache"] == "cold" and reply["saved"] is False  # unreadable: cold, not a 503
                r = http.post("/v1/agents/rita/fork", json={"new_agent": "rita2"})
                assert r.status_code == 200 and r.json()["saved"] is False, r.text
                more = [{"role": "user", "content": "Remember 42. And 43? And 44."}]
                r = http.post("/v1/agents/rita/append", json={"messages": more})
                assert r.status_code == 200 and r.json()["saved"] is False, r.text
                r = http.delete("/v1/agents/rita")  # the disk refuses: a clear 503 ...
                assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
                after = http.get("/v1/agents/rita")  # ... on a connection that lives on
                assert after.status_code == 200 and client_port(after) == client_port(first)
                assert after.json()["resident"] and after.json()["tokens"] > 0  # and RAM kept it whole
                assert http.get("/health").status_code == 200
            logged = [r.getMessage() for r in caplog.records]
            assert any("rita" in m and "reading its record without it" in m for m in logged)
            assert any("ruth" in m and "could not be quarantined" in m for m in logged)
            in_ram = {a: list(resident(engine, a).tokens) for a in ("rita", "rita2", "ruth")}
            assert engine.flush() == []  # writable again: every acknowledged turn reaches the disk
    finally:
        server.stop()
        engine.close()
    restarted = Engine(model=llama, cache_dir=root, progress=False)
    for agent, tokens in in_ram.items():
        assert on_disk(restarted, agent).tokens == tokens
    restarted.close()


# -- two servers on one directory ------------------------------------------------------------
def start_server(model: Path, cache_dir: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvshelf.cli",
            "serve",
            "--model",
            str(model),
            "--cache-dir",
            str(cache_dir),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def listening_on(pid: int, port: int) -> list[str]:
    """The addresses a process listens on at ``port``, from /proc (IPv4 and IPv6)."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                found.append(str(ipaddress.ip_address(words)))
    return found


def spy_on_model_loading(monkeypatch) -> list[object]:
    """The models an Engine loads from now on (it still loads them): a refusal that
    comes before any load leaves the list empty."""
    from kvshelf.runtime import engine as engine_module

    loads: list[object] = []
    real = engine_module.load

    def counted(model, *args, **kwargs):
        loads.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(engine_module, "load", counted)
    return loads


def test_a_second_server_on_the_same_directory_refuses_to_start(llama, tmp_path, monkeypatch):
    first, url = start_server(llama, tmp_path)
    try:
        wait_up(first, url)
        assert listening_on(first.pid, int(url.rsplit(":", 1)[1])) == ["127.0.0.1"]  # loopback unless told
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Agent-Id": "sam"}, timeout=60)
        assert r.json()["kvshelf"]["saved"] is True, r.text
        # the second server is this test's own process: the locks exclude it just the same,
        # and it is refused before it loads the model
        loads = spy_on_model_loading(monkeypatch)
        with pytest.raises(exclusive.DirectoryInUse) as refused:
            serve(str(llama), cache_dir=tmp_path, port=1)
        message = str(refused.value)
        assert f"another kvshelf server (pid {first.pid}) is already serving" in message and "--cache-dir" in message
        assert loads == []
        assert httpx.get(url + "/v1/agents/sam", timeout=10).json()["tokens"] > 0  # the first was not disturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # however a server dies, the kernel drops its lock: the next one may start
    engine = Engine(model=llama, cache_dir=tmp_path, progress=False)
    exclusive.claim(engine._shelf.store.directory).close()
    assert engine._shelf.store.token_count("sam") > 0
    engine.close()


def store_of(model: Path, root: Path) -> Path:
    """The store directory a server of ``model`` claims under ``root``."""
    from kvshelf.model.loader import fingerprint_of
    from kvshelf.storage.records import RecordStore

    return RecordStore(root, fingerprint_of(model)).directory


def test_deleting_the_store_under_a_server_stops_its_saves_and_a_second_server_is_still_refused(
    llama, tmp_path, monkeypatch
):
    """``rm -rf`` of the store used to take the lock file with it: the next save recreated
    the directory, a second server started on it, and each could write back what the
    other erased. The claim is on the path and the inode, neither of them a file."""
    store = store_of(llama, tmp_path)
    first, url = start_server(llama, tmp_path)
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        wait_up(first, url)
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Agent-Id": "sam"}, timeout=60)
        assert r.json()["kvshelf"]["saved"] is True and store.is_dir()
        shutil.rmtree(store)
        again = {**body, "messages": [{"role": "user", "content": "hi again"}]}
        r = httpx.post(url + "/v1/chat/completions", json=again, headers={"X-Agent-Id": "sam"}, timeout=60)
        assert r.status_code == 200 and r.json()["kvshelf"]["saved"] is False, r.text  # served, honestly unsaved
        assert not store.exists()  # the save did not recreate the directory
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy", health.text
        assert str(store) in health.json()["reason"]
        loads = spy_on_model_loading(monkeypatch)
        with pytest.raises(exclusive.DirectoryInUse) as refused:  # on the path, with nothing on disk
            serve(str(llama), cache_dir=tmp_path, port=1)
        assert f"(pid {first.pid})" in str(refused.value) and loads == []
        assert httpx.get(url + "/health", timeout=10).status_code == 503  # until restarted
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    logged = first.stdout.read() if first.stdout else ""
    assert re.search(rf"ERROR .*store directory {re.escape(str(store))} was deleted or replaced", logged), logged
    exclusive.claim(store).close()  # the kernel dropped both locks with the process


def run_cli_serve(model: Path, cache_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvshelf.cli", "serve", "--model", str(model), "--cache-dir", str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_on_an_unusable_store_exits_2_with_one_line(llama, tmp_path):
    """A read-only store (a real read-only bind mount) and a file where the directory
    should be. Missing permissions cannot be shown here: the tests run as root, whom
    chmod does not stop; they take the same path (an OSError when the pid file is written)."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    done = run_cli_serve(llama, a_file)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"kvshelf serve: cannot use the store directory {a_file}") and "Not a directory" in line

    readonly = tmp_path / "ro"
    store_of(llama, readonly).mkdir(parents=True)
    with read_only(readonly):
        done = run_cli_serve(llama, readonly)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line == f"kvshelf serve: cannot use the store directory {store_of(llama, readonly)}: Read-only file system"


# -- erasure -------------------------------------------------------------------------------------
def test_delete_erases_every_file_block_and_byte_of_the_agent(llama, tmp_path):
    engine = Engine(model=llama, cache_dir=tmp_path, durable=True, progress=False)
    client = TestClient(create_app(engine, close_engine=False))
    for agent in ("zed", "zed2", "zed.b"):  # neighbours whose names start the same
        ask(client, agent, f"I am {agent}.")
    ask(client, "zed", "I am zed. More.")
    store = engine._shelf.store
    # leftovers only a crash or a corrupt record leave: a quarantined record and a young temp
    good = store.path_for("zed").read_bytes()
    assert engine.evict("zed")
    store.path_for("zed").write_bytes(good[:-100])  # torn: quarantined on the next load
    assert ask(client, "zed", "I am zed. More.")["kvshelf"]["cache"] == "cold"
    assert len(list(store.quarantine_dir.glob("zed.*"))) == 2  # the record and its reason
    cache = resident(engine, "zed")
    blocks = weakref.ref(cache)
    arrays = [weakref.ref(a) for a in cache.arrays()]
    assert arrays
    del cache
    temp = store.directory / ".zed.tmp"  # a save of zed that crashed (the next save would replace it)
    temp.write_bytes(b"half a record of zed")

    r = client.delete("/v1/agents/zed")
    assert r.status_code == 200, r.text
    removed = set(r.json()["files_removed"])
    assert {"zed.safetensors", "zed.lock", temp.name} <= removed
    gc.collect()
    zeds = re.compile(r"\.?zed\.(safetensors|lock|tmp|[0-9a-f]{32}\.tmp|\d{8}T[0-9.]+Z\.[0-9a-f]{8}\.\w+)")
    left = [p for p in tmp_path.rglob("*") if zeds.fullmatch(p.name)]
    assert left == [], left
    assert blocks() is None and all(a() is None for a in arrays)  # no block of it is held anywhere
    assert (
        "zed" not in engine._shelf.pool
        and "zed" not in engine._shelf.pool.last_used
        and "zed" not in engine._shelf.unsaved
    )
    assert "zed" not in engine._shelf._saves and not engine._shelf.lent(AgentId("zed"))
    assert client.get("/v1/agents/zed").status_code == 404
    assert client.delete("/v1/agents/zed").status_code == 404
    assert "zed" not in {a["id"] for a in client.get("/v1/agents").json()["data"]}
    for agent in ("zed2", "zed.b"):
        assert store.path_for(agent).exists() and agent in engine._shelf.pool
    assert ask(client, "zed", "I am zed. More.")["kvshelf"]["cache"] == "cold"  # nothing came back

    # an agent known only by a quarantined record is still erasable
    assert engine.evict("zed")
    store.path_for("zed").write_bytes(b"garbage")
    assert engine._shelf.load(AgentId("zed")) is None  # quarantined, so no longer listed
    assert client.get("/v1/agents/zed").status_code == 404
    r = client.delete("/v1/agents/zed")
    assert r.status_code == 200 and any(n.endswith(".reason") for n in r.json()["files_removed"])
    assert not list(store.quarantine_dir.glob("zed.*"))
    engine.close()


def test_erasing_forked_agents_releases_their_shared_prefix(llama, tmp_path):
    engine = Engine(model=llama, cache_dir=tmp_path, durable=True, progress=False)
    client = TestClient(create_app(engine, close_engine=False))
    engine.prefill("fz-seed", [{"role": "system", "content": "The shared brief. " * 40}])  # > one 256-token block
    engine.fork("fz-seed", "fz-1")
    engine.fork("fz-seed", "fz-2")
    assert engine.flush() == []
    [pid] = engine._shelf.shared.on_disk()
    assert engine._shelf.shared.users(pid) == ["fz-1", "fz-2", "fz-seed"]
    [prefix] = engine._shelf.shared.resident()
    held = weakref.ref(prefix)
    del prefix

    r = client.delete("/v1/agents/fz-1")
    assert r.status_code == 200 and "fz-1" in r.json()["files_removed"]  # its marker on the prefix
    assert engine._shelf.shared.users(pid) == ["fz-2", "fz-seed"] and engine._shelf.shared.on_disk() == [
        pid
    ]  # still in use
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(("fz-1.", ".fz-1.")) or p.name == "fz-1"]
    for agent in ("fz-seed", "fz-2"):
        assert client.delete(f"/v1/agents/{agent}").status_code == 200
    gc.collect()
    assert engine._shelf.shared.on_disk() == [] and engine._shelf.shared.users(pid) == []
    left = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith((".server", INDEX_NAME))]
    assert not left, list(tmp_path.rglob("*"))  # not a record, lock, marker or prefix file is left
    assert engine._shelf.store.page()[0] == []  # and the store's index names no agent
    assert held() is None and engine._shelf.shared.resident() == []  # nor its blocks in RAM
    engine.close()
