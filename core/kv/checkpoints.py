"""Boundary checkpoints: a sliding-window layer's state kept at a few message boundaries.

A sliding-window layer keeps only its window (plus a slack block), so once a
conversation has passed the window it cannot rewind: a new conversation that shares
only the system prompt (CrewAI's next task, LangGraph's next ``invoke``, any framework
that trims or summarizes history) would recompute everything. A checkpoint is the
state each layer needs to resume at one position ``p``, taken when the prefill reaches
``p`` (a call ends exactly there, see the scheduler's plan), so resuming from it is the
same computation as prefilling ``0..p`` afresh:

- a sliding layer: its rows from the last block boundary at or before ``p - window + 1``
  up to ``p`` (packed K/V, plus the fp16 extras of coded schemes: the per-channel keys'
  partial block, attention sinks). At most a window plus one block of rows: the bytes
  are bounded however long the conversation grows. The live layer may have held older
  rows too (it drops whole blocks, one slack block late); no query from ``p`` on sees
  them, but they are part of the shape attention reduces over, and a different shape
  changes the last bits. So the checkpoint also keeps where the layer started
  (``origin``), and a resumed layer gets zero rows there: masked, hence weighted by
  exactly zero, as the real rows were, and the resumed state is bit-identical;
- a full-attention layer can rewind by itself, but its per-channel keys' partial block
  may have been quantized since ``p``; the checkpoint keeps that block's fp16 keys
  (under one block of rows), so a resumed layer holds exactly what a fresh one would.

Checkpoints hold their own copies (never views of the live buffers), count in the
agent's bytes (and so in the RAM budget), go into its record and come back with it.
They stay valid as long as the cache's first ``p`` tokens do: a cut below ``p`` drops
them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from kvshelf.kv.blocks import LayerRows, QTriple, QuantizedLayerCache
from kvshelf.model.spec import BLOCK_TOKENS

# Per agent: the first boundary (the end of the system prompt) and the latest turn end.
MAX_CHECKPOINTS = 2


def _copy(x: mx.array | None) -> mx.array | None:
    return mx.contiguous(x) if x is not None and x.size else None


def _copy3(q: QTriple) -> QTriple:
    a, b, c = (mx.contiguous(x) for x in q)
    return a, b, c


@dataclass(frozen=True, eq=False)
class LayerCheckpoint:
    """One layer at a checkpoint. Sliding layer: ``rows`` from ``start`` to the position,
    and where the layer's buffer started then (``origin``, at most ``start``). Full layer
    (``start`` None): only ``rows.k_tail``, the fp16 keys of its partial block."""

    rows: LayerRows
    start: int | None
    origin: int | None = None

    @property
    def nbytes(self) -> int:
        r = self.rows
        parts = [*(r.keys or ()), *(r.values or ()), r.k_tail, r.sink_k, r.sink_v]
        return sum(x.nbytes for x in parts if x is not None)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """Every layer's state at ``position`` (the cache's first ``position`` tokens)."""

    position: int
    layers: tuple[LayerCheckpoint | None, ...]  # None: a full layer with nothing to keep

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if c is not None)


def needs_checkpoints(layers: list[QuantizedLayerCache]) -> bool:
    """Only sliding-window layers lose positions they would need to resume."""
    return any(c.window is not None for c in layers)


def checkpoint_start(position: int, window: int, start: int) -> int:
    """The first row a sliding layer needs to resume at ``position``: the block boundary
    at or before the oldest position the next query sees (and never before ``start``)."""
    oldest = max(0, position - window + 1)
    return max(start, oldest // BLOCK_TOKENS * BLOCK_TOKENS)


def take(layers: list[QuantizedLayerCache]) -> Checkpoint:
    """A checkpoint of ``layers`` where they are now (all at the same offset)."""
    position = layers[0].offset
    out: list[LayerCheckpoint | None] = []
    for c in layers:
        tail = getattr(c, "k_tail", None)
        if c.window is None:
            out.append(LayerCheckpoint(LayerRows(k_tail=_copy(tail)), None) if tail is not None and tail.size else None)
            continue
        if c.used == 0:
            out.append(LayerCheckpoint(LayerRows(), c.start, c.start))
            continue
        start = checkpoint_start(position, c.window, c.start)
        keys, values = c.packed_rows("keys", start, position), c.packed_rows("values", start, position)
        rows = LayerRows(
            _copy3(keys),
            _copy3(values),
            _copy(tail),
            _copy(getattr(c, "sink_k", None)),
            _copy(getattr(c, "sink_v", None)),
        )
        out.append(LayerCheckpoint(rows, start, c.start))
    checkpoint = Checkpoint(position, tuple(out))
    mx.eval(*_arrays(checkpoint))
    return checkpoint


def resume(
    layers: list[QuantizedLayerCache], checkpoint: Checkpoint, make: Callable[[int], QuantizedLayerCache]
) -> list[QuantizedLayerCache]:
    """``layers`` as they were at ``checkpoint``: full layers rewound (their partial key
    block restored), sliding layers rebuilt from the checkpoint's rows by ``make(i)``."""
    position, out = checkpoint.position, []
    for i, (c, saved) in enumerate(zip(layers, checkpoint.layers)):
        if c.window is None:
            c.rewind_to(position)
            if saved is not None and saved.rows.k_tail is not None:
                c.k_tail = saved.rows.k_tail  # type: ignore[attr-defined]  # a coded scheme's fp16 keys
            out.append(c)
            continue
        assert saved is not None and saved.start is not None and saved.origin is not None  # sliding layers are kept
        fresh = make(i)
        rows = saved.rows
        if rows.keys is None or rows.values is None:
            fresh.start = fresh.offset = position
        else:
            skip = saved.start - saved.origin  # rows no query sees any more: zeros, as in the module doc
            keys, values = _after_zeros(rows.keys, skip), _after_zeros(rows.values, skip)
            rows = LayerRows(keys, values, rows.k_tail, rows.sink_k, rows.sink_v)
            fresh.restore(rows, saved.origin, position)  # into new buffers: the checkpoint stays as it is
        out.append(fresh)
    return out


def _after_zeros(q: QTriple, n: int) -> QTriple:
    if not n:
        return q

    def pad(x: mx.array) -> mx.array:
        zeros = mx.zeros((*x.shape[:2], n, x.shape[3]), dtype=x.dtype)
        return mx.concatenate([zeros, x], axis=2)

    return pad(q[0]), pad(q[1]), pad(q[2])


def _arrays(checkpoint: Checkpoint) -> list[mx.array]:
    out: list[mx.array] = []
    for c in checkpoint.layers:
        if c is not None:
            r = c.rows
            out.extend(x for x in (*(r.keys or ()), *(r.values or ()), r.k_tail, r.sink_k, r.sink_v) if x is not None)
    return out


def still_useful(checkpoints: list[Checkpoint], layers: list[QuantizedLayerCache]) -> list[Checkpoint]:
    """The first checkpoint (the end of the system prompt: the window will move past it),
    and the later ones the layers can no longer rewind to exactly by themselves: a window
    has moved past it, or a per-channel key block around it has been quantized since (a
    prefill ahead often closes one with tokens the next prompt does not share). A later one
    the layers still reach exactly is dropped: the next request can only diverge there by
    rewinding, and any request that goes further takes a newer turn end instead."""
    first, rest = checkpoints[:1], checkpoints[1:]
    return first + [c for c in rest if not all(_reaches(layer, c.position) for layer in layers)]


def _reaches(layer: QuantizedLayerCache, position: int) -> bool:
    """Whether ``layer`` can be cut back to ``position`` and hold what a prefill to there holds."""
    return layer.can_rewind_to(position) and layer.exact_rewind_point(position) == position


def retained(checkpoints: list[Checkpoint], new: Checkpoint) -> list[Checkpoint]:
    """The checkpoints to keep once ``new`` is taken: the first (the end of the system
    prompt, which every later conversation of the agent shares) and the latest ones."""
    kept = sorted([c for c in checkpoints if c.position != new.position] + [new], key=lambda c: c.position)
    if len(kept) > MAX_CHECKPOINTS:
        kept = [kept[0], *kept[-(MAX_CHECKPOINTS - 1) :]]
    return kept
