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
from dataclasses import dataclass, field

import numpy as np

from kvshelf.kv.blocks import SharedLayer
from kvshelf.model.arrays import borrow


def prefix_id(scheme: str, tokens: list[int], layers: list[SharedLayer | None]) -> str:
    """A name for exactly these blocks: the same tokens coded into the same bits.

    The bits count, not only the tokens: a preamble prefilled in different chunks can
    differ in the last bits, and an agent must go on from the state it computed."""
    h = hashlib.blake2b(scheme.encode(), digest_size=10)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    for layer in layers:
        for x in (*layer.keys, *layer.values) if layer is not None else ():
            h.update(borrow(x))
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
