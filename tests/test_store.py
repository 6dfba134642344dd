"""Tests of the on-disk record store (kvshelf.storage.records and .codec) and agent-id validation.

All tensors are real MLX arrays (4-bit ``mx.quantize`` output of random data);
the filesystem failures are either real (RLIMIT_FSIZE in a child process) or
injected at the ``os`` level, never by mocking MLX.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

import kvshelf  # noqa: F401  (preloads OpenBLAS before mlx)
from kvshelf.errors import InvalidAgentId, KVShelfError, StorageError
from kvshelf.kv.record import CacheRecord
from kvshelf.storage import codec
from kvshelf.storage import records as store_module
from kvshelf.storage.agent_id import AgentId, validate_agent_id
from kvshelf.storage.codec import FORMAT_VERSION
from kvshelf.storage.records import RecordStore

FINGERPRINT = hashlib.sha256(b"model-a").hexdigest()
OTHER_FINGERPRINT = hashlib.sha256(b"model-b").hexdigest()
LOGGER = "kvshelf.storage.records"


def make_record(n_layers: int = 2, n_tokens: int = 48, head_dim: int = 64, seed: int = 0) -> CacheRecord:
    """A realistic record: per layer, 4-bit packed K and V with fp16/bf16 scales."""
    key = mx.random.key(seed)
    tensors: dict[str, mx.array] = {}
    for layer in range(n_layers):
        dtype = mx.bfloat16 if layer % 2 else mx.float16
        for kind in ("keys", "values"):
            key, sub = mx.random.split(key)
            x = mx.random.normal((1, 2, n_tokens, head_dim), key=sub).astype(dtype)
            packed, scales, biases = mx.quantize(x, group_size=32, bits=4)
            tensors[f"layers.{layer}.{kind}.packed"] = packed
            tensors[f"layers.{layer}.{kind}.scales"] = scales
            tensors[f"layers.{layer}.{kind}.biases"] = biases
    tokens = np.random.default_rng(seed).integers(0, 262_144, n_tokens).tolist()
    meta = {"bits": 4, "group_size": 32, "n_layers": n_layers, "layout": {"kind": "quantized", "heads": 2}}
    return CacheRecord(tokens=tokens, tensors=tensors, meta=meta)


def unchecked_record(tokens: object, tensors: object, meta: object) -> CacheRecord:
    """A record with fields of any type, as a caller without a type checker could build one."""
    return CacheRecord(cast(Any, tokens), cast(Any, tensors), cast(Any, meta))


def load_safetensors(path: Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors and metadata of a safetensors file (mx.load's stub returns the union of every format's result)."""
    loaded = mx.load(str(path), return_metadata=True)
    assert isinstance(loaded, tuple)
    arrays, metadata = loaded
    return arrays, metadata


def raw_bytes(array: mx.array) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array).tobytes()


def assert_same_record(loaded: CacheRecord | None, expected: CacheRecord) -> None:
    assert loaded is not None
    assert loaded.tokens == list(expected.tokens)
    assert all(type(t) is int for t in loaded.tokens)
    assert loaded.meta == expected.meta
    assert sorted(loaded.tensors) == sorted(expected.tensors)
    for name, want in expected.tensors.items():
        got = loaded.tensors[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert raw_bytes(got) == raw_bytes(want), name


def rewrite_header(path: Path, change) -> None:
    """Edit a record's metadata/table and re-seal it with a valid header checksum."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    document = json.loads(data[8 : 8 + length])
    metadata = document.pop("__metadata__")
    change(metadata, document)
    path.write_bytes(codec.encode_header(metadata, document) + data[8 + length :])


def flip_byte(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def header_length(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def temp_files(store: RecordStore) -> list[str]:
    return sorted(p.name for p in store.directory.glob("*.tmp"))


@pytest.fixture
def store(tmp_path: Path) -> RecordStore:
    return RecordStore(tmp_path, FINGERPRINT)


# ---------------------------------------------------------------- round trip


def test_round_trip_is_bitwise_identical(store: RecordStore) -> None:
    record = make_record()
    record.tensors["odd.transposed"] = mx.random.normal((3, 5), key=mx.random.key(7)).T  # non-contiguous
    record.tensors["odd.scalar"] = mx.array(-(2**40), dtype=mx.int64)
    record.tensors["odd.empty"] = mx.zeros((0, 4), dtype=mx.float16)
    record.tensors["odd.mask"] = mx.array([True, False, True])
    record.tensors["odd.offset_slice"] = mx.arange(100, dtype=mx.uint32)[10:20]
    record.tensors["odd.broadcast"] = mx.broadcast_to(mx.array([1, 2, 3], dtype=mx.uint16), (4, 3))
    record.tensors["odd.bf16"] = mx.array([1.5, -0.0, float("inf"), float("nan")], dtype=mx.bfloat16)
    written = store.save("alice", record)
    path = store.path_for("alice")
    assert written == path.stat().st_size == store.size_on_disk("alice")
    assert_same_record(store.load("alice"), record)
    assert {t.dtype for t in record.tensors.values()} >= {mx.uint32, mx.float16, mx.bfloat16}
    assert path.parent == store.directory == store.root / FINGERPRINT[:16]
    assert temp_files(store) == []


def test_records_are_plain_safetensors_without_prompt_text(store: RecordStore) -> None:
    record = make_record(seed=3)
    store.save("alice", record)
    arrays, metadata = load_safetensors(store.path_for("alice"))
    assert metadata["kvshelf.format_version"] == str(FORMAT_VERSION)
    assert metadata["kvshelf.model_fingerprint"] == FINGERPRINT
    assert json.loads(metadata["kvshelf.meta"]) == record.meta
    assert int(metadata["kvshelf.n_tokens"]) == len(record.tokens)
    assert set(json.loads(metadata["kvshelf.tensor_blake2b"])) == set(arrays)
    assert arrays["__tokens__"].dtype == mx.int32
    assert arrays["__tokens__"].tolist() == record.tokens
    for name, want in record.tensors.items():
        assert raw_bytes(arrays[name]) == raw_bytes(want)
    from safetensors import safe_open  # the strict reference parser accepts it too

    with safe_open(str(store.path_for("alice")), framework="numpy") as handle:
        assert set(handle.keys()) == set(arrays)
        assert handle.get_tensor("__tokens__").tolist() == record.tokens


def test_save_overwrites_and_lists_agents(store: RecordStore) -> None:
    assert store.agent_ids() == []
    assert store.load("alice") is None
    assert not store.root.exists() or list(store.root.iterdir()) == []  # load of an unknown agent writes nothing
    first, second = make_record(seed=1), make_record(seed=2, n_tokens=80)
    store.save("alice", first)
    store.save("bob@example.com", first)
    store.save("alice", second)
    assert_same_record(store.load("alice"), second)
    assert_same_record(store.load("bob@example.com"), first)
    assert store.agent_ids() == ["alice", "bob@example.com"]
    assert store.size_on_disk("carol") == 0
    assert temp_files(store) == []


def test_save_rejects_malformed_records_without_writing(store: RecordStore) -> None:
    good = make_record(n_layers=1)
    bad_records = [
        unchecked_record(good.tokens, {"x": np.zeros(3)}, {}),  # not an mx.array
        unchecked_record(good.tokens, {"__tokens__": mx.zeros(3)}, {}),  # reserved name
        unchecked_record(good.tokens, {"": mx.zeros(3)}, {}),
        unchecked_record([1, -5], good.tensors, {}),
        unchecked_record([1, 2**40], good.tensors, {}),
        unchecked_record(["a"], good.tensors, {}),
        unchecked_record([1.5], good.tensors, {}),
        unchecked_record([[1, 2]], good.tensors, {}),
        unchecked_record(good.tokens, good.tensors, {"x": object()}),  # not JSON
        unchecked_record(good.tokens, good.tensors, {"x": float("nan")}),
    ]
    for record in bad_records:
        with pytest.raises((TypeError, ValueError)):
            store.save("alice", record)
    assert store.agent_ids() == []
    assert temp_files(store) == []


# ---------------------------------------------------------------- agent ids

GOOD_IDS = [
    "a",
    "alice",
    "0",
    "x" * 128,
    hashlib.md5(b"crew agent").hexdigest(),
    f"alice_{uuid.uuid5(uuid.NAMESPACE_DNS, 'alice')}",  # fixed: both xdist workers must collect the same ids
    "bob@example.com",
    "team:planner-1",
    "A.b_c:d@e-f",
    "Alice",
    "console",
    "con-1",
]
BAD_IDS = [
    "../x",
    "..",
    ".",
    "a/b",
    "/etc/passwd",
    "a\\b",
    "",
    " ",
    " alice",
    "alice ",
    "a\tb",
    "alice\n",
    "x" * 129,
    "\x00",
    "a\x00b",
    "a..b",
    ".hidden",
    "-rf",
    "_x",
    "@x",
    "trailing.",
    "CON",
    "nul.txt",
    "com1",
    "lpt9.log",
    "\u0430lice",  # Cyrillic a
    "\uff41lice",  # fullwidth a
    "caf\u00e9",
    "alice\u200b",  # zero-width space
    "a*b",
    "a?b",
    "a%2fb",
    42,
    None,
    b"alice",
    ["alice"],
]


@pytest.mark.parametrize("agent_id", GOOD_IDS)
def test_good_agent_ids_are_accepted(store: RecordStore, agent_id: str) -> None:
    assert validate_agent_id(agent_id) == agent_id
    path = store.path_for(agent_id)
    assert path.resolve().parent == store.directory.resolve()
    assert path.name == f"{agent_id}.safetensors"


@pytest.mark.parametrize("agent_id", BAD_IDS, ids=repr)
def test_bad_agent_ids_are_rejected_before_touching_disk(store: RecordStore, agent_id: Any) -> None:
    with pytest.raises(InvalidAgentId) as info:
        validate_agent_id(agent_id)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KVShelfError)
    assert "agent id" in str(info.value)
    for call in (store.path_for, store.load, store.delete, store.size_on_disk, store.lock):
        with pytest.raises(InvalidAgentId):
            call(agent_id)
    with pytest.raises(InvalidAgentId):
        store.save(agent_id, make_record(n_layers=1, n_tokens=4))
    assert not store.root.exists() or list(store.root.rglob("*")) == []


@pytest.mark.parametrize("agent_id", BAD_IDS, ids=repr)
def test_shared_prefix_markers_refuse_bad_ids_before_touching_disk(tmp_path: Path, agent_id: Any) -> None:
    """Markers name files after agent and prefix ids too, through the same check."""
    from kvshelf.model.spec import LayerSpec, ModelCacheSpec
    from kvshelf.storage.prefixes import SharedPrefixes

    shared = SharedPrefixes(tmp_path, FINGERPRINT, ModelCacheSpec((LayerSpec(None, 1, 64, 64),)))
    for call in (
        lambda: shared.add_user("prefix-0123", agent_id),
        lambda: shared.add_user(agent_id, AgentId("alice")),
        lambda: shared.release(agent_id),
        lambda: shared.users(agent_id),
    ):
        with pytest.raises(InvalidAgentId):
            call()
    if isinstance(agent_id, str):  # the RAM registry is looked up first, by (hashable) id
        with pytest.raises(InvalidAgentId):
            shared.get(agent_id)
    assert not tmp_path.exists() or list(tmp_path.rglob("*")) == []


def test_str_subclass_cannot_smuggle_a_different_name() -> None:
    class Sneaky(str):
        def __str__(self) -> str:
            return "../escape"

    checked = validate_agent_id(Sneaky("alice"))
    assert type(checked) is AgentId  # the subclass and its overrides are gone
    assert checked == "alice" and str(checked) == "alice" and f"{checked}" == "alice"


def test_record_symlinked_outside_the_store_is_refused(store: RecordStore, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"secret")
    store.directory.mkdir(parents=True)
    (store.directory / "alice.safetensors").symlink_to(outside)
    with pytest.raises(StorageError):
        store.path_for("alice")
    with pytest.raises(StorageError):
        store.load("alice")
    assert outside.read_bytes() == b"secret"


# ---------------------------------------------------------------- quarantine


def _truncate(size_of):
    def corrupt(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: size_of(len(data), header_length(path))])

    return corrupt


def _set_meta(key: str, value):
    def corrupt(path: Path) -> None:
        rewrite_header(path, lambda meta, table: meta.__setitem__(key, value(meta)))

    return corrupt


def _wrong_tensor_checksum(path: Path) -> None:
    def change(meta, table):
        sums = json.loads(meta["kvshelf.tensor_blake2b"])
        sums["layers.0.keys.packed"] = "0" * 32
        meta["kvshelf.tensor_blake2b"] = json.dumps(sums)

    rewrite_header(path, change)


def _plain_safetensors(path: Path) -> None:
    mx.save_safetensors(str(path), {"x": mx.zeros((4,))})  # valid file, no kvshelf header


def _garbled_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    length = header_length(path)
    data[8 : 8 + length] = b"{" + b"\xff garbage " * (length // 10) + b" " * (length - 1 - 10 * (length // 10))
    path.write_bytes(bytes(data))


def _edit_meta_in_place(path: Path) -> None:
    # Valid JSON of the same length, but not what was sealed by the header checksum.
    data = path.read_bytes()
    path.write_bytes(data.replace(b'\\"bits\\":4', b'\\"bits\\":8', 1))


BAD_RECORDS = {
    "empty file": (_truncate(lambda size, hl: 0), "truncated"),
    "truncated inside the header": (_truncate(lambda size, hl: 8 + hl // 2), "truncated"),
    "truncated data": (_truncate(lambda size, hl: (size + 8 + hl) // 2), "truncated"),
    "last byte missing": (_truncate(lambda size, hl: size - 1), "truncated"),
    "trailing bytes": (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8), "unexpected bytes"),
    "flipped data byte": (lambda p: flip_byte(p, p.stat().st_size - 100), "checksum mismatch"),
    "flipped header byte": (lambda p: flip_byte(p, 8 + header_length(p) // 2), "header"),
    "flipped length byte": (lambda p: flip_byte(p, 0), "header"),
    "tensor checksum mismatch": (_wrong_tensor_checksum, "checksum mismatch in tensor 'layers.0.keys.packed'"),
    "header edited": (_edit_meta_in_place, "header checksum mismatch"),
    "foreign model": (_set_meta("kvshelf.model_fingerprint", lambda m: OTHER_FINGERPRINT), "foreign model"),
    "unknown format version": (_set_meta("kvshelf.format_version", lambda m: "2"), "unsupported format version"),
    "token count mismatch": (
        _set_meta("kvshelf.n_tokens", lambda m: str(int(m["kvshelf.n_tokens"]) + 1)),
        "token count mismatch",
    ),
    "missing header": (_plain_safetensors, "missing kvshelf header"),
    "garbled header": (_garbled_header, "garbled header"),
    "not a safetensors file": (lambda p: p.write_bytes(os.urandom(4096)), "header"),
}


@pytest.mark.parametrize("kind", list(BAD_RECORDS))
def test_bad_record_is_quarantined_and_recomputed(store: RecordStore, caplog, kind: str) -> None:
    corrupt, reason_fragment = BAD_RECORDS[kind]
    store.save("alice", make_record())
    path = store.path_for("alice")
    corrupt(path)
    damaged = path.read_bytes()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    assert store.load("alice") is None

    assert not path.exists()
    quarantined = sorted(store.quarantine_dir.glob("alice.*.safetensors"))
    reasons = sorted(store.quarantine_dir.glob("alice.*.reason"))
    assert len(quarantined) == 1 and len(reasons) == 1
    assert quarantined[0].read_bytes() == damaged  # moved, not rewritten or deleted
    assert reasons[0].stem == quarantined[0].stem
    reason_text = reasons[0].read_text()
    assert reason_fragment in reason_text and "alice" in reason_text
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert any("alice" in r.getMessage() and reason_fragment in r.getMessage() for r in warnings)
    assert store.agent_ids() == []
    assert store.load("alice") is None  # the quarantined file is never picked up again

    fresh = make_record(seed=9)
    store.save("alice", fresh)
    assert_same_record(store.load("alice"), fresh)
    assert len(list(store.quarantine_dir.glob("*.safetensors"))) == 1


def test_same_prefix_different_model_is_foreign(tmp_path: Path, caplog) -> None:
    # Both fingerprints share the 16-char directory name; only the full one tells them apart.
    mine = RecordStore(tmp_path, FINGERPRINT)
    theirs = RecordStore(tmp_path, FINGERPRINT[:16] + "f" * 48)
    assert mine.directory == theirs.directory
    theirs.save("alice", make_record())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert mine.load("alice") is None
    assert "foreign model" in caplog.text
    assert len(list(mine.quarantine_dir.glob("*.reason"))) == 1


def test_header_peeks_and_explicit_quarantine(store: RecordStore, caplog) -> None:
    """token_count/mtime read only metadata; quarantine() is for records the caller can't use."""
    assert store.token_count("alice") == 0 and store.mtime("alice") is None
    assert store.quarantine("alice", "nothing there") is None
    record = make_record(n_tokens=37)
    saved_after = time.time()
    store.save("alice", record)
    assert store.token_count("alice") == 37
    # on time.time()'s scale, and no older than the save (1 s: coarse filesystem clocks)
    mtime = store.mtime("alice")
    assert mtime is not None and saved_after - 1 <= mtime <= time.time() + 1
    flip_byte(store.path_for("alice"), 8 + header_length(store.path_for("alice")) // 2)
    assert store.token_count("alice") == 0  # a damaged header counts nothing...
    assert store.path_for("alice").exists()  # ...and a peek never quarantines
    store.save("alice", record)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    moved = store.quarantine("alice", "layer layout does not fit this model")
    assert moved is not None and moved.parent == store.quarantine_dir and moved.exists()
    assert "does not fit" in moved.with_suffix(".reason").read_text()
    assert "does not fit" in caplog.text
    assert store.load("alice") is None and store.token_count("alice") == 0


def test_record_copied_from_another_agent_is_ignored_not_quarantined(store: RecordStore, caplog) -> None:
    store.save("alice", make_record())
    os.replace(store.path_for("alice"), store.path_for("bob"))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.load("bob") is None
    assert "not 'bob'" in caplog.text
    assert not store.quarantine_dir.exists()


def test_every_single_byte_change_is_detected(tmp_path: Path) -> None:
    """Exhaustive over a small record: each byte xor 0x01 and xor a random mask."""
    store = RecordStore(tmp_path, FINGERPRINT)
    store.save("alice", make_record(n_layers=1, n_tokens=8, head_dim=32))
    good = store.path_for("alice").read_bytes()
    assert codec.decode(bytearray(good), FINGERPRINT) is not None
    masks = np.random.default_rng(0).integers(1, 256, len(good))
    for position in range(len(good)):
        for mask in (0x01, int(masks[position])):
            damaged = bytearray(good)
            damaged[position] ^= mask
            with pytest.raises(codec.RecordRejected):
                codec.decode(damaged, FINGERPRINT)
    for cut in range(len(good)):
        with pytest.raises(codec.RecordRejected):
            codec.decode(bytearray(good[:cut]), FINGERPRINT)


# ---------------------------------------------------------------- delete


def test_delete_removes_exactly_that_agents_files(store: RecordStore) -> None:
    record = make_record(n_layers=1)
    neighbours = ["alice.b", "alice2", "Alice", "bob"]
    for agent in ["alice", *neighbours]:
        store.save(agent, record)
    stale = store.directory / ".alice.tmp"  # left by a writer that crashed, however young
    stale.write_bytes(b"partial")
    old = time.time() - 2 * store_module.STALE_TEMP_SECONDS
    neighbour_temp = store.directory / ".alice.b.tmp"
    neighbour_temp.write_bytes(b"in progress")
    os.utime(neighbour_temp, (old, old))
    before = {p.name for p in store.directory.iterdir()}

    removed = store.delete("alice")

    assert set(removed) == {store.path_for("alice"), store.directory / "alice.lock", stale}
    after = {p.name for p in store.directory.iterdir()}
    assert before - after == {p.name for p in removed}
    assert neighbour_temp.exists()
    assert store.load("alice") is None
    for agent in neighbours:
        assert_same_record(store.load(agent), record)
    assert store.agent_ids() == sorted(neighbours)
    assert store.delete("alice") == []
    assert store.delete("nobody-ever") == []
    assert not (store.directory / "nobody-ever.lock").exists()


def test_delete_while_holding_the_lock_keeps_the_lock_file(store: RecordStore) -> None:
    store.save("alice", make_record(n_layers=1))
    with store.lock("alice"):
        assert store.delete("alice") == [store.path_for("alice")]
        assert (store.directory / "alice.lock").exists()


def test_lock_is_reentrant_and_excludes_other_threads(tmp_path: Path) -> None:
    store = RecordStore(tmp_path, FINGERPRINT)
    impatient = RecordStore(tmp_path, FINGERPRINT, lock_timeout=0.2)
    record = make_record(n_layers=1)
    outcome: list[BaseException | None] = []

    def other_thread() -> None:
        try:
            impatient.save("alice", record)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (reported to the main thread)
            outcome.append(exc)

    with store.lock("alice"):
        store.save("alice", record)  # same thread: no deadlock
        assert_same_record(store.load("alice"), record)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert isinstance(outcome[0], StorageError) and outcome[0].errno == errno.ETIMEDOUT
    impatient.save("alice", record)  # free again


# ---------------------------------------------------------------- failed writes


@pytest.mark.parametrize("target", ["fsync", "replace", "write"])
def test_failed_write_keeps_the_old_record(store: RecordStore, caplog, monkeypatch, target: str) -> None:
    """ENOSPC injected at the syscall wrappers the store uses (os.write/fsync/replace)."""
    old, new = make_record(seed=1), make_record(seed=2, n_tokens=96)
    store.save("alice", old)
    before = store.path_for("alice").read_bytes()
    real_write = os.write
    calls = []

    def failing(*args):
        calls.append(args)
        if target == "write" and len(calls) == 1:  # a partial write, then the disk is full
            fd, data = args
            return real_write(fd, memoryview(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    caplog.set_level(logging.ERROR, logger=LOGGER)
    with monkeypatch.context() as patch:
        patch.setattr(os, target, failing)
        with pytest.raises(StorageError) as info:
            store.save("alice", new)
    assert calls
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert "alice" in str(info.value) and "unchanged" in str(info.value)
    assert any(r.levelno == logging.ERROR and "alice" in r.getMessage() for r in caplog.records)
    assert temp_files(store) == []
    assert store.path_for("alice").read_bytes() == before
    assert_same_record(store.load("alice"), old)
    store.save("alice", new)  # works again once the disk has room
    assert_same_record(store.load("alice"), new)


_EFBIG_CHILD = textwrap.dedent(
    """
    import errno, resource, signal, sys
    import kvshelf
    import mlx.core as mx
    from pathlib import Path
    from kvshelf.errors import StorageError
    from kvshelf.kv.record import CacheRecord
    from kvshelf.storage.records import RecordStore

    store = RecordStore(Path(sys.argv[1]), sys.argv[2])
    store.save("alice", CacheRecord([1, 2, 3], {"x": mx.arange(1000, dtype=mx.uint32)}, {"v": 1}))
    before = store.path_for("alice").read_bytes()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        store.save("alice", CacheRecord([4], {"x": mx.arange(1_000_000, dtype=mx.uint32)}, {"v": 2}))
    except StorageError as exc:
        assert exc.errno == errno.EFBIG, exc
    else:
        sys.exit("the oversized save did not fail")
    assert store.path_for("alice").read_bytes() == before
    assert store.load("alice").meta == {"v": 1}
    print("CHILD-OK")
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX resource limits")
def test_real_write_failure_keeps_the_old_record(tmp_path: Path) -> None:
    """A genuine failing write(2): RLIMIT_FSIZE makes the kernel refuse it."""
    result = subprocess.run(
        [sys.executable, "-c", _EFBIG_CHILD, str(tmp_path), FINGERPRINT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "CHILD-OK" in result.stdout, result.stderr
    store = RecordStore(tmp_path, FINGERPRINT)
    assert temp_files(store) == []
    assert "saving the record of agent 'alice'" in result.stderr  # the error was logged


# ---------------------------------------------------------------- two processes

_WORKER = textwrap.dedent(
    """
    import sys, time
    import kvshelf
    import mlx.core as mx
    from pathlib import Path
    from kvshelf.kv.record import CacheRecord
    from kvshelf.storage.records import RecordStore

    root, fingerprint, worker, rounds, go = sys.argv[1:]
    worker, rounds = int(worker), int(rounds)
    store = RecordStore(Path(root), fingerprint)

    def packed(w):
        x = mx.random.normal((1, 4, 1024, 64), key=mx.random.key(w)).astype(mx.bfloat16)
        return mx.quantize(x, group_size=64, bits=4)

    expected = {w: [bytes(memoryview(a)) for a in packed(w)] for w in (0, 1)}
    mine = packed(worker)
    crossed = 0
    Path(f"{go}.{worker}").touch()  # ready
    while not Path(go).exists():
        time.sleep(0.001)
    for i in range(rounds):
        stamp = worker * 100_000 + i
        tensors = {"q": mine[0], "scales": mine[1], "biases": mine[2],
                   "stamp": mx.full((16_384,), stamp, dtype=mx.uint32)}
        store.save("shared", CacheRecord([worker, i] + [stamp % 997] * 30, tensors, {"stamp": stamp}))
        for _ in range(2):
            got = store.load("shared")
            if got is None:
                sys.exit(f"round {i}: load returned None")
            w, j = got.tokens[:2]
            crossed += w != worker
            want = w * 100_000 + j
            ok = (got.meta == {"stamp": want} and got.tokens[2:] == [want % 997] * 30
                  and got.tensors["stamp"].tolist() == [want] * 16_384
                  and [bytes(memoryview(got.tensors[k])) for k in ("q", "scales", "biases")] == expected[w])
            if not ok:
                sys.exit(f"round {i}: inconsistent record from worker {w} round {j}")
    print("WORKER-OK", crossed)
    """
)


def test_two_processes_never_see_a_torn_or_quarantined_record(tmp_path: Path) -> None:
    go = tmp_path / "go"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(tmp_path / "store"), FINGERPRINT, str(w), "60", str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in (0, 1)
    ]
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.{w}").exists() for w in (0, 1)) and time.monotonic() < deadline:
        if any(w.poll() is not None for w in workers):
            break
        time.sleep(0.01)
    go.touch()  # both loops start together
    outputs = [w.communicate(timeout=120) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0 and "WORKER-OK" in out, err
    store = RecordStore(tmp_path / "store", FINGERPRINT)
    assert not store.quarantine_dir.exists()
    assert temp_files(store) == []
    assert store.agent_ids() == ["shared"]
    assert store.load("shared") is not None


def test_fingerprint_must_be_hex() -> None:
    bads: list[Any] = ["", "abc", "not-a-hex-digest-at-all", 123]  # 123: not even a str
    for bad in bads:
        with pytest.raises(ValueError):
            RecordStore(Path("/nonexistent"), bad)
    assert RecordStore(Path("/x"), FINGERPRINT.upper()).model_fingerprint == FINGERPRINT
