"""The record format: what an agent's cache or a shared prefix looks like on disk.

A record is token ids, named tensors and a JSON header (``CacheRecord``). This module
is the one place that knows the tensor names, the header's keys and what makes a
record fit a model; the RAM caches (``kvshelf.kv``) only hand out and take back their
rows, and the file store (``kvshelf.storage``) encodes records to bytes and back
without knowing what they hold.

Agent record (``agent_record``), per layer ``i`` of the model:

- ``l{i}.k.w``, ``l{i}.k.s``, ``l{i}.k.b`` and ``l{i}.v.*``: the packed 4-bit words,
  scales and biases of the layer's own rows (after any shared base), absent when the
  layer holds no rows of its own;
- ``l{i}.k.tail``, ``l{i}.sink.k``, ``l{i}.sink.v``: a coded scheme's fp16 extras
  (per-channel keys' partial block, attention sinks), when non-empty;
- header: ``scheme`` (KV scheme name), ``spec`` (cache geometry JSON), ``layers`` (a
  JSON list of ``{start, offset, group_size, base_rows}``) and, for a fork,
  ``shared_prefix`` (the prefix id its first rows come from);
- boundary checkpoints (``kvshelf.kv.checkpoints``), when the model has sliding layers:
  header ``checkpoints``, a JSON list of ``{tokens, layers}`` (the checkpoint holds the
  record's first ``tokens`` tokens; ``layers`` has per layer ``{start, origin}`` for a
  sliding layer, the first row it holds and where the layer's buffer started, and null
  for a full one), and per checkpoint ``j`` the tensors ``c{j}.l{i}.*``, named as the
  layer's own (a full layer has at most ``c{j}.l{i}.k.tail``). Records written before
  checkpoints existed have none and load as before.

Shared-prefix record (``prefix_record``): ``l{i}.k.*``/``l{i}.v.*`` per layer that has
blocks; header ``kind: shared-prefix``, ``id``, ``scheme``, ``spec`` and ``layers`` (a
JSON list of ``{start, rows}`` or null).

The bytes must not change: records written by earlier versions have to keep loading.
Whatever does not fit raises ValueError with the reason; the store then quarantines
the record and the agent is recomputed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.blocks import LayerRows, QTriple, SharedLayer
from kvshelf.kv.checkpoints import Checkpoint, LayerCheckpoint
from kvshelf.kv.schemes import SCHEMES
from kvshelf.kv.shared import SharedPrefix
from kvshelf.model.spec import BLOCK_TOKENS, ModelCacheSpec

PACKED_PARTS = ("w", "s", "b")  # words, scales, biases of a packed triple
PREFIX_KIND = "shared-prefix"


@dataclass(eq=False)
class CacheRecord:
    """One agent's cache as stored: token ids, named tensors, JSON metadata.

    ``eq=False`` because ``==`` on MLX arrays is elementwise, which would make a
    generated ``__eq__`` raise; compare tensors explicitly instead.
    """

    tokens: list[int]
    """The token ids whose KV the tensors hold."""
    tensors: dict[str, mx.array] = field(default_factory=dict)
    """Tensor name -> array (packed uint32 data, float16/bfloat16 scales, ...)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable description (cache spec, quantization, layer layout)."""


# -- tensor names ------------------------------------------------------------------------
def _layer_key(i: int) -> str:
    return f"l{i}."


def _put_packed(tensors: dict[str, mx.array], key: str, keys: QTriple, values: QTriple) -> None:
    for part, q in (("k", keys), ("v", values)):
        for name, x in zip(PACKED_PARTS, q):
            tensors[f"{key}{part}.{name}"] = x


def _get_packed(tensors: dict[str, mx.array], key: str, part: str, what: str) -> QTriple | None:
    """The packed triple ``{key}{part}.w/s/b``; None if absent, ValueError if partly there."""
    names = [f"{key}{part}.{n}" for n in PACKED_PARTS]
    present = [n in tensors for n in names]
    if not any(present):
        return None
    if not all(present):
        missing = [n for n, p in zip(names, present) if not p]
        raise ValueError(f"{what} lacks tensor {missing[0]!r}")
    return tuple(tensors[n] for n in names)  # type: ignore[return-value]


def _header(meta: dict[str, Any], key: str, what: str) -> Any:
    if key not in meta:
        raise ValueError(f"{what}'s header has no {key!r}")
    return meta[key]


def _spec_of(meta: dict[str, Any], what: str) -> ModelCacheSpec:
    try:
        return ModelCacheSpec.from_json(_header(meta, "spec", what))
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{what}'s cache geometry is unreadable: {exc}") from None


def _layout_of(meta: dict[str, Any], spec: ModelCacheSpec, what: str) -> list[Any]:
    try:
        layout = json.loads(_header(meta, "layers", what))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}'s layer layout is unreadable: {exc}") from None
    if not isinstance(layout, list):
        raise ValueError(f"{what}'s layer layout is not a list")
    if len(layout) != len(spec.layers):
        raise ValueError(f"{what}'s layer count does not match the model")
    return layout


def _ints(lay: Any, keys: tuple[str, ...], what: str) -> dict[str, int]:
    if not isinstance(lay, dict):
        raise ValueError(f"{what}'s layout is not an object")
    out = {}
    for k in keys:
        value = lay.get(k, 0 if k == "base_rows" else None)  # base_rows came later: absent means 0
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{what}'s layout has no integer {k!r}")
        out[k] = value
    return out


# -- agent records -----------------------------------------------------------------------
def agent_record(cache: AgentCache) -> CacheRecord:
    """The agent's own tensors and header; a shared prefix is named, not copied.

    Lets go of a shared prefix that no layer uses any more (``cache.shared`` is then
    None), so the caller hands the writer the prefix the record really needs."""
    cache.drop_unused_share()
    tensors: dict[str, mx.array] = {}
    layout = []
    for i, c in enumerate(cache.layers):
        key = _layer_key(i)
        rows = c.own_rows()
        if rows.keys is not None and rows.values is not None:
            _put_packed(tensors, key, rows.keys, rows.values)
            extras = {"k.tail": rows.k_tail, "sink.k": rows.sink_k, "sink.v": rows.sink_v}
            tensors.update({key + name: x for name, x in extras.items() if x is not None and x.size})
        layout.append({"start": c.start, "offset": c.offset, "group_size": c.group_size, "base_rows": c.base_rows})
    meta = {"scheme": cache.scheme.name, "spec": cache.spec.to_json(), "layers": json.dumps(layout)}
    if cache.shared is not None:
        meta["shared_prefix"] = cache.shared.id
    if cache.checkpoints:
        meta["checkpoints"] = json.dumps([_put_checkpoint(tensors, j, c) for j, c in enumerate(cache.checkpoints)])
    return CacheRecord(tokens=list(cache.tokens), tensors=tensors, meta=meta)


def _put_rows(tensors: dict[str, mx.array], key: str, rows: LayerRows) -> None:
    if rows.keys is not None and rows.values is not None:
        _put_packed(tensors, key, rows.keys, rows.values)
    extras = {"k.tail": rows.k_tail, "sink.k": rows.sink_k, "sink.v": rows.sink_v}
    tensors.update({key + name: x for name, x in extras.items() if x is not None and x.size})


def _put_checkpoint(tensors: dict[str, mx.array], j: int, checkpoint: Checkpoint) -> dict[str, Any]:
    layers: list[dict[str, int] | None] = []
    for i, layer in enumerate(checkpoint.layers):
        if layer is not None:
            _put_rows(tensors, f"c{j}.{_layer_key(i)}", layer.rows)
        if layer is None or layer.start is None or layer.origin is None:
            layers.append(None)  # a full layer: its fp16 key tail at most
        else:
            layers.append({"start": layer.start, "origin": layer.origin})
    return {"tokens": checkpoint.position, "layers": layers}


def _checkpoints_of(record: CacheRecord, spec: ModelCacheSpec, channel_keys: bool) -> list[Checkpoint]:
    """The record's boundary checkpoints (none in a record written before them)."""
    raw = record.meta.get("checkpoints")
    if raw is None:
        return []
    try:
        listed = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"record's checkpoints are unreadable: {exc}") from None
    if not isinstance(listed, list):
        raise ValueError("record's checkpoints are not a list")
    out: list[Checkpoint] = []
    for j, entry in enumerate(listed):
        what = f"checkpoint {j}"
        if not isinstance(entry, dict) or not isinstance(entry.get("layers"), list):
            raise ValueError(f"{what} is not an object with layers")
        position = _ints(entry, ("tokens",), what)["tokens"]
        if not 0 < position <= len(record.tokens) or (out and position <= out[-1].position):
            raise ValueError(f"{what} is not within the record's tokens, in order")
        if len(entry["layers"]) != len(spec.layers):
            raise ValueError(f"{what}'s layer count does not match the model")
        layers = []
        for i, (layer, lay) in enumerate(zip(spec.layers, entry["layers"])):
            where = f"{what} layer {i}"
            rows = _layer_rows(record.tensors, f"c{j}.{_layer_key(i)}", where)
            bounds = None if layer.window is None else _ints(lay, ("start", "origin"), where)
            start = None if bounds is None else bounds["start"]
            if start is None:
                if lay is not None or rows.keys is not None:
                    raise ValueError(f"{where} is a full layer, but holds rows")
                tail = position % BLOCK_TOKENS if channel_keys else 0
                if (rows.k_tail.shape[2] if rows.k_tail is not None else 0) not in (0, tail):
                    raise ValueError(f"{where}'s fp16 key tail does not match its position")
                layers.append(LayerCheckpoint(rows, None) if rows.k_tail is not None else None)
                continue
            assert bounds is not None
            origin = bounds["origin"]
            if start % BLOCK_TOKENS or origin % BLOCK_TOKENS or not 0 <= origin <= start <= position:
                raise ValueError(f"{where} does not start on a block before its position")
            held = 0 if rows.keys is None or rows.values is None else rows.keys[0].shape[2]
            if held != position - start or any(x.shape[2] != held for x in (*(rows.keys or ()), *(rows.values or ()))):
                raise ValueError(f"{where} holds {held} rows, its position says {position - start}")
            if channel_keys and held:
                if (rows.k_tail.shape[2] if rows.k_tail is not None else 0) != held % BLOCK_TOKENS:
                    raise ValueError(f"{where}'s fp16 key tail does not match its length")
            layers.append(LayerCheckpoint(rows, start, origin))
        out.append(Checkpoint(position, tuple(layers)))
    return out


def shared_prefix_id(record: CacheRecord) -> str | None:
    """The id of the shared prefix an agent record starts on, None if it has none."""
    pid = record.meta.get("shared_prefix")
    if pid is not None and not isinstance(pid, str):
        raise ValueError(f"record names its shared prefix with a {type(pid).__name__}, not a str")
    return pid


def agent_cache_from_record(spec: ModelCacheSpec, record: CacheRecord, prefix: SharedPrefix | None) -> AgentCache:
    """Rebuild an agent's cache from its record; raise ValueError if it does not fit.

    ``prefix`` is the shared prefix the record names (``shared_prefix_id``), None if it
    names none. A record keeps the KV scheme it was written with (any scheme this build
    knows is read as that scheme, and the agent goes on in it); an unknown scheme is
    refused, so the record is quarantined rather than misread.
    """
    meta, tokens = record.meta, record.tokens
    name = meta.get("scheme")
    if not isinstance(name, str) or name not in SCHEMES:
        raise ValueError(f"record uses KV scheme {name!r}, which this build does not know")
    if _spec_of(meta, "record") != spec:
        raise ValueError("record was written for a different cache geometry")
    layout = _layout_of(meta, spec, "record")
    wanted = shared_prefix_id(record)
    if wanted is not None and (prefix is None or prefix.id != wanted):
        raise ValueError(f"record needs shared prefix {wanted!r}, which is not available")
    if prefix is not None and (wanted is None or list(tokens[: len(prefix.tokens)]) != prefix.tokens):
        raise ValueError("record's tokens do not start with its shared prefix")
    scheme = SCHEMES[name]
    cache = AgentCache.empty(spec, scheme)
    for i, (c, raw) in enumerate(zip(cache.layers, layout)):
        what = f"layer {i}"
        lay = _ints(raw, ("start", "offset", "group_size", "base_rows"), what)
        if lay["offset"] != len(tokens) or lay["group_size"] != c.group_size:
            raise ValueError(f"layer {i} layout does not match the record's tokens")
        base = prefix.layers[i] if prefix is not None and lay["base_rows"] else None
        if (base.rows if base is not None else 0) < lay["base_rows"]:
            raise ValueError(f"layer {i} needs more shared rows than its prefix holds")
        if base is not None and base.rows > lay["base_rows"]:
            base = base.tail(base.rows - lay["base_rows"])  # a window moved past some
        if base is not None and base.start != lay["start"]:
            raise ValueError("shared base does not start where the record's layer starts")
        rows = _layer_rows(record.tensors, _layer_key(i), what)
        start, offset, base_rows = lay["start"], lay["offset"], base.rows if base is not None else 0
        used = offset - start - base_rows  # the layer's own rows
        if rows.keys is None or rows.values is None:
            if used != 0:
                raise ValueError("record holds no rows for this layer, header says it has some")
        else:
            for x in (*rows.keys, *rows.values):
                if x.shape[2] != used:
                    raise ValueError(f"record holds {x.shape[2]} rows, header says {used}")
        if scheme.channel_keys and (rows.keys is not None or base is not None):
            tail = (offset - start) % BLOCK_TOKENS  # the fp16 keys of the partial last block
            if (rows.k_tail.shape[2] if rows.k_tail is not None else 0) != tail:
                raise ValueError("record's fp16 key tail does not match its length")
        c.restore(rows, start, offset, base)
    cache.tokens = list(tokens)
    cache.shared = prefix if wanted is not None else None
    cache.checkpoints = _checkpoints_of(record, spec, scheme.channel_keys)
    return cache


def _layer_rows(tensors: dict[str, mx.array], key: str, what: str) -> LayerRows:
    keys, values = _get_packed(tensors, key, "k", what), _get_packed(tensors, key, "v", what)
    if (keys is None) != (values is None):
        raise ValueError(f"{what} holds {'keys' if keys is not None else 'values'} without the other")
    for q in (keys, values):
        if q is not None and any(x.ndim != 4 for x in q):
            raise ValueError(f"{what}'s packed rows are not 4-dimensional")
    extras = {name: tensors.get(key + name) for name in ("k.tail", "sink.k", "sink.v")}
    if any(x is not None and x.ndim != 4 for x in extras.values()):
        raise ValueError(f"{what}'s fp16 rows are not 4-dimensional")
    return LayerRows(keys, values, extras["k.tail"], extras["sink.k"], extras["sink.v"])


# -- shared-prefix records -----------------------------------------------------------------
def prefix_record(prefix: SharedPrefix, spec: ModelCacheSpec) -> CacheRecord:
    """A shared prefix as a record of its own (stored once, however many agents use it)."""
    tensors: dict[str, mx.array] = {}
    layout: list[dict[str, int] | None] = []
    for i, layer in enumerate(prefix.layers):
        if layer is None:
            layout.append(None)
            continue
        _put_packed(tensors, _layer_key(i), layer.keys, layer.values)
        layout.append({"start": layer.start, "rows": layer.rows})
    meta = {
        "kind": PREFIX_KIND,
        "id": prefix.id,
        "scheme": prefix.scheme,
        "spec": spec.to_json(),
        "layers": json.dumps(layout),
    }
    return CacheRecord(tokens=list(prefix.tokens), tensors=tensors, meta=meta)


def prefix_from_record(pid: str, spec: ModelCacheSpec, record: CacheRecord) -> SharedPrefix:
    """The shared prefix ``pid`` from its record; raise ValueError if it does not fit."""
    meta = record.meta
    if meta.get("kind") != PREFIX_KIND or _spec_of(meta, "shared prefix") != spec:
        raise ValueError("not a shared prefix of this model")
    if meta.get("id") != pid:
        raise ValueError("shared prefix's header names another prefix")
    scheme = meta.get("scheme")
    if not isinstance(scheme, str):
        raise ValueError("shared prefix's header names no KV scheme")
    layout = _layout_of(meta, spec, "shared prefix")
    layers: list[SharedLayer | None] = []
    for i, raw in enumerate(layout):
        if raw is None:
            layers.append(None)
            continue
        what = f"shared prefix layer {i}"
        lay = _ints(raw, ("start", "rows"), what)
        keys = _get_packed(record.tensors, _layer_key(i), "k", what)
        values = _get_packed(record.tensors, _layer_key(i), "v", what)
        if keys is None or values is None or any(x.ndim != 4 for x in (*keys, *values)):
            raise ValueError(f"{what} lacks its packed blocks")
        layer = SharedLayer(keys, values, lay["start"])
        if layer.rows != lay["rows"] or layer.start + layer.rows != len(record.tokens):
            raise ValueError(f"shared prefix layer {i} does not end where its tokens do")
        layers.append(layer)
    return SharedPrefix(pid, scheme, list(record.tokens), layers)
