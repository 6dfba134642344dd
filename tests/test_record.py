"""The record format (kvshelf.kv.record): names and header stay as written, misfits are refused.

Records on disk outlive the code that wrote them, so the tensor names and header keys
are pinned here literally; a change that renames one would make every existing record
unreadable (quarantined and recomputed) and must fail this test first.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import save_prompt_cache

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.blocks import QuantizedLayerCache
from kvshelf.kv.record import (
    CacheRecord,
    agent_cache_from_record,
    agent_record,
    prefix_from_record,
    prefix_record,
    shared_prefix_id,
)
from kvshelf.model.spec import ModelCacheSpec
from kvshelf.runtime.engine import Engine

PREAMBLE = [{"role": "system", "content": "You are one of four careful planners sharing this brief. " * 12}]
ASK = PREAMBLE + [{"role": "user", "content": "What should we do first?"}]
SCHEME = "q4-g64-kivi-rotv-sink4"  # every kind of tensor a record can hold


@pytest.fixture(scope="module")
def forked(tiny_dirs, tmp_path_factory):
    """A gemma3 engine (sliding and global layers) with a seed agent and a fork of it."""
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path_factory.mktemp("rec"), kv_scheme=SCHEME, progress=False)
    engine.prefill("seed", PREAMBLE)
    engine.fork("seed", "fork")
    engine.prefill("fork", ASK)
    engine.prefill("alone", ASK)
    yield engine
    engine.close()


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))


def copy(record: CacheRecord, **meta) -> CacheRecord:
    return CacheRecord(list(record.tokens), dict(record.tensors), {**record.meta, **meta})


def test_an_agent_record_keeps_the_names_and_header_of_format_1(forked):
    cache = forked._shelf.pool.get("alone")
    record = without_checkpoints(agent_record(cache))
    assert record.tokens == cache.tokens
    assert set(record.meta) == {"scheme", "spec", "layers"}
    assert record.meta["scheme"] == SCHEME and record.meta["spec"] == forked.loaded.spec.to_json()
    layout = json.loads(record.meta["layers"])
    assert [set(lay) for lay in layout] == [{"start", "offset", "group_size", "base_rows"}] * len(cache.layers)
    expected = set()
    for i, (c, lay) in enumerate(zip(cache.layers, layout)):
        assert lay == {"start": c.start, "offset": len(cache.tokens), "group_size": 64, "base_rows": 0}
        packed = {f"l{i}.{part}.{n}" for part in "kv" for n in "wsb"}
        expected |= packed | {f"l{i}.k.tail", f"l{i}.sink.k", f"l{i}.sink.v"}
    assert set(record.tensors) == expected
    assert record.tensors["l0.k.w"].dtype == mx.uint32 and record.tensors["l0.k.s"].dtype == mx.float16
    assert record.tensors["l0.k.tail"].shape[2] == len(cache.tokens) % 256
    assert record.tensors["l0.sink.k"].shape[2] == 4 and record.tensors["l0.sink.k"].dtype == mx.float16


def without_checkpoints(record: CacheRecord) -> CacheRecord:
    """The record as written before boundary checkpoints existed."""
    tensors = {n: x for n, x in record.tensors.items() if not n.startswith("c")}
    return CacheRecord(list(record.tokens), tensors, {k: v for k, v in record.meta.items() if k != "checkpoints"})


def test_checkpoints_are_named_and_described_as_pinned_here(forked):
    """A boundary checkpoint at the end of the system text, as the header says."""
    cache = forked._shelf.pool.get("alone")
    record = agent_record(cache)
    (checkpoint,) = cache.checkpoints
    listed = json.loads(record.meta["checkpoints"])
    spec = forked.loaded.spec
    layers: list[dict[str, int] | None] = []
    expected = set()
    for i, (layer, saved) in enumerate(zip(spec.layers, checkpoint.layers)):
        if layer.window is None:
            assert saved is not None and saved.start is None  # a full layer: its fp16 key tail
            layers.append(None)
            expected.add(f"c0.l{i}.k.tail")
            continue
        assert saved is not None and saved.start is not None and saved.origin is not None
        layers.append({"start": saved.start, "origin": saved.origin})
        expected |= {f"c0.l{i}.{part}.{n}" for part in "kv" for n in "wsb"}
        expected |= {f"c0.l{i}.k.tail", f"c0.l{i}.sink.k", f"c0.l{i}.sink.v"}
    assert listed == [{"tokens": checkpoint.position, "layers": layers}]
    assert {n for n in record.tensors if n.startswith("c")} == expected
    assert record.tensors[f"c0.l{layers.index(None)}.k.tail"].shape[2] == checkpoint.position % 256


def test_a_record_from_before_checkpoints_loads_and_one_with_them_comes_back_whole(forked):
    cache = forked._shelf.pool.get("alone")
    record = agent_record(cache)
    old = agent_cache_from_record(forked.loaded.spec, without_checkpoints(record), None)
    assert old.tokens == cache.tokens and old.checkpoints == []
    back = agent_cache_from_record(forked.loaded.spec, record, None)
    assert [c.position for c in back.checkpoints] == [c.position for c in cache.checkpoints]
    assert back.checkpoint_bytes == cache.checkpoint_bytes > 0


def test_checkpoints_that_do_not_fit_are_refused(forked):
    record = agent_record(forked._shelf.pool.get("alone"))
    spec = forked.loaded.spec
    listed = json.loads(record.meta["checkpoints"])
    sliding = next(i for i, layer in enumerate(spec.layers) if layer.window is not None)

    def refused(changed: CacheRecord, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            agent_cache_from_record(spec, changed, None)

    refused(copy(record, checkpoints="not json"), "checkpoints are unreadable")
    beyond = [{**listed[0], "tokens": len(record.tokens) + 1}]
    refused(copy(record, checkpoints=json.dumps(beyond)), "within the record's tokens")
    refused(copy(record, checkpoints=json.dumps([{**listed[0], "layers": listed[0]["layers"][:-1]}])), "layer count")
    moved = json.loads(record.meta["checkpoints"])
    moved[0]["layers"][sliding]["start"] += 1
    refused(copy(record, checkpoints=json.dumps(moved)), "does not start on a block")
    short = copy(record)
    for n in ("k.w", "k.s", "k.b", "v.w", "v.s", "v.b"):
        short.tensors[f"c0.l{sliding}.{n}"] = record.tensors[f"c0.l{sliding}.{n}"][..., 1:, :]
    refused(short, "holds")


def test_a_fork_record_names_its_prefix_and_the_prefix_record_keeps_its_format(forked):
    cache = forked._shelf.pool.get("fork")
    record = without_checkpoints(agent_record(cache))
    prefix = cache.shared
    assert prefix is not None and record.meta["shared_prefix"] == prefix.id == shared_prefix_id(record)
    assert set(record.meta) == {"scheme", "spec", "layers", "shared_prefix"}
    assert [lay["base_rows"] for lay in json.loads(record.meta["layers"])] == [c.base_rows for c in cache.layers]
    shared = prefix_record(prefix, forked.loaded.spec)
    assert shared.meta == {
        "kind": "shared-prefix",
        "id": prefix.id,
        "scheme": SCHEME,
        "spec": forked.loaded.spec.to_json(),
        "layers": json.dumps([None if la is None else {"start": la.start, "rows": la.rows} for la in prefix.layers]),
    }
    names = {f"l{i}.{p}.{n}" for i, la in enumerate(prefix.layers) if la is not None for p in "kv" for n in "wsb"}
    assert set(shared.tensors) == names and shared.tokens == prefix.tokens
    again = prefix_from_record(prefix.id, forked.loaded.spec, shared)
    assert again.tokens == prefix.tokens and again.scheme == prefix.scheme
    for a, b in zip(again.layers, prefix.layers):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.start == b.start and all(same(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))


@pytest.mark.parametrize("agent", ["alone", "fork"])
def test_a_record_rebuilds_the_same_cache(forked, agent):
    cache = forked._shelf.pool.get(agent)
    record = agent_record(cache)
    back = agent_cache_from_record(forked.loaded.spec, record, cache.shared)
    assert back.tokens == cache.tokens and back.scheme == cache.scheme and back.shared is cache.shared
    again = agent_record(back)
    assert again.meta == record.meta and set(again.tensors) == set(record.tensors)
    assert all(same(again.tensors[n], x) for n, x in record.tensors.items())


def test_records_that_do_not_fit_are_refused_with_the_reason(forked):
    alone, fork = agent_record(forked._shelf.pool.get("alone")), agent_record(forked._shelf.pool.get("fork"))
    prefix = forked._shelf.pool.get("fork").shared
    spec = forked.loaded.spec
    other = ModelCacheSpec(spec.layers[:-1])

    def refused(record: CacheRecord, match: str, prefix=None, spec=spec) -> None:
        with pytest.raises(ValueError, match=match):
            agent_cache_from_record(spec, record, prefix)

    refused(copy(alone, scheme="q3-future"), "KV scheme 'q3-future'")
    refused(alone, "different cache geometry", spec=other)
    refused(copy(alone, spec=other.to_json()), "different cache geometry")
    refused(copy(alone, layers=json.dumps(json.loads(alone.meta["layers"])[:-1])), "layer count")
    refused(fork, "needs shared prefix", prefix=None)
    refused(alone, "do not start with its shared prefix", prefix=prefix)
    longer = copy(alone)
    longer.tokens = [*alone.tokens, 5]
    refused(longer, "layout does not match")
    cut = copy(alone)
    cut.tensors["l0.k.tail"] = alone.tensors["l0.k.tail"][..., :-1, :]
    refused(cut, "key tail")
    gone = copy(alone)
    del gone.tensors["l1.v.s"]
    refused(gone, "lacks tensor 'l1.v.s'")
    rows = copy(alone)
    for n in ("k.w", "k.s", "k.b", "v.w", "v.s", "v.b"):
        rows.tensors[f"l0.{n}"] = alone.tensors[f"l0.{n}"][..., 1:, :]
    refused(rows, "record holds")
    shared = prefix_record(prefix, spec)
    with pytest.raises(ValueError, match="another prefix"):
        prefix_from_record("prefix-other", spec, shared)
    with pytest.raises(ValueError, match="not a shared prefix"):
        prefix_from_record(prefix.id, spec, alone)


def test_mlx_lm_cannot_save_a_kvshelf_cache_as_an_empty_prompt_cache(forked, tmp_path):
    """mlx-lm's own cache files go through ``state``, which would be empty for our caches."""
    cache: AgentCache = forked._shelf.pool.get("alone")
    target = tmp_path / "prompt.safetensors"
    with pytest.raises(NotImplementedError, match="kvshelf's records"):
        save_prompt_cache(str(target), cache.layers)
    assert not target.exists()
    plain = QuantizedLayerCache(forked.loaded.spec.layers[0])  # the plain Q4 cache, empty
    with pytest.raises(NotImplementedError, match="kvshelf's records"):
        save_prompt_cache(str(target), [plain])
    assert not target.exists()
    with pytest.raises(NotImplementedError, match="kvshelf's records"):
        cache.layers[0].state = []
    with pytest.raises(NotImplementedError, match="kvshelf's records"):
        cache.layers[0].meta_state  # noqa: B018
