"""Shared prefixes: the whole blocks that forked agents have in common, held once.

Many agents of a workflow start with the same long preamble (a task brief, a document,
a tool list). ``Engine.fork`` turns the full 256-token blocks of an agent's cache into
a ``SharedPrefix``: per layer, an immutable ``SharedLayer`` that every agent forked from
it starts on (``QuantizedLayerCache.base``). The prefix is kept

- in RAM once: the registry hands out the same object to every cache that uses it, by
  weak reference, so it is freed when its last resident user goes;
- on disk once: ``shared/<fingerprint>/<prefix id>.safetensors``, in the same verified
  record format as an agent's, with one marker file per agent whose record uses it
  (``<prefix id>.users/<agent id>``). Each agent's own record holds only its rows after
  the prefix, plus the prefix id.

Reference counting is those marker files. A marker is written before the agent's
record that needs it and removed only after that record no longer needs it, so a crash
can leave an unused prefix behind (reclaimed when the last marker goes) but never a
record whose prefix is missing. Erasing an agent deletes its record, its lock file and
its marker; the prefix file goes with the last marker.

A prefix's id is a hash of its KV scheme, token ids and blocks, so the same preamble
prefilled the same way twice becomes one prefix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kvshelf.kv.blocks import SharedLayer
from kvshelf.kv.record import CacheRecord
from kvshelf.model.spec import ModelCacheSpec


def prefix_id(scheme: str, tokens: list[int], layers: list[SharedLayer | None]) -> str:
    """A name for exactly these blocks: the same tokens coded into the same bits.

    The bits count, not only the tokens: a preamble prefilled in different chunks can
    differ in the last bits, and an agent must go on from the state it computed."""
    h = hashlib.blake2b(scheme.encode(), digest_size=10)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    for layer in layers:
        for x in (*layer.keys, *layer.values) if layer is not None else ():
            h.update(memoryview(x))
    return "prefix-" + h.hexdigest()


@dataclass(eq=False)
class SharedPrefix:
    """The shared blocks of ``tokens`` (a multiple of 256), one ``SharedLayer`` per layer
    (None where a sliding window had already dropped every block of the prefix)."""

    id: str
    scheme: str
    tokens: list[int]
    layers: list[SharedLayer | None]
    __weakref__: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers if layer is not None)

    def to_record(self, spec: ModelCacheSpec) -> CacheRecord:
        tensors: dict[str, mx.array] = {}
        layout = []
        for i, layer in enumerate(self.layers):
            if layer is None:
                layout.append(None)
                continue
            for part, q in (("k", layer.keys), ("v", layer.values)):
                for name, x in zip(("w", "s", "b"), q):
                    tensors[f"l{i}.{part}.{name}"] = x
            layout.append({"start": layer.start, "rows": layer.rows})
        meta = {
            "kind": "shared-prefix",
            "id": self.id,
            "scheme": self.scheme,
            "spec": spec.to_json(),
            "layers": json.dumps(layout),
        }
        return CacheRecord(tokens=list(self.tokens), tensors=tensors, meta=meta)

    @classmethod
    def from_record(cls, pid: str, spec: ModelCacheSpec, record: CacheRecord) -> SharedPrefix:
        meta = record.meta
        if meta.get("kind") != "shared-prefix" or ModelCacheSpec.from_json(meta["spec"]) != spec:
            raise ValueError("not a shared prefix of this model")
        if meta.get("id") != pid:
            raise ValueError("shared prefix's header names another prefix")
        layout = json.loads(meta["layers"])
        if len(layout) != len(spec.layers):
            raise ValueError("shared prefix's layer count does not match the model")
        layers: list[SharedLayer | None] = []
        for i, lay in enumerate(layout):
            if lay is None:
                layers.append(None)
                continue
            triple = lambda part: tuple(record.tensors[f"l{i}.{part}.{n}"] for n in ("w", "s", "b"))  # noqa: E731
            layer = SharedLayer(triple("k"), triple("v"), int(lay["start"]))
            if layer.rows != lay["rows"] or layer.start + layer.rows != len(record.tokens):
                raise ValueError(f"shared prefix layer {i} does not end where its tokens do")
            layers.append(layer)
        return cls(pid, meta["scheme"], list(record.tokens), layers)
