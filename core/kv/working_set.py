"""The decode working set: the rows attention reads, kept ready while agents decode.

Q4 blocks are the format at rest (RAM budget, disk), but a decode step that reads them
through the dense path dequantizes and un-rotates every block of every layer, every
step, though full blocks never change (measured on the embedded Gemma 3 at 1K context:
170 of a 484 ms step). So while agents decode together, each layer keeps its members'
rows in the form attention takes (``attention_rows``: dense in the compute dtype and
un-rotated for the schemes' dense path, which plain Q4 takes on the CPU too; packed
triples for plain Q4's ``quantized_matmul`` on a GPU), in one persistent batch buffer
per layer:

- made once when the decode run starts (or taken over from the previous run for the
  members that stay), dropped when the run ends or its membership changes;
- each step a member's new token is stored in its Q4 blocks (``append``; a step that
  codes its tokens on numpy rows stages them instead, ``QuantizedLayerCache.stage``,
  written to the blocks many at once), and the new rows of all members are coded once,
  together (``coded_rows``: exactly
  what each member's ``attention_rows`` of that position returns, coding being row by
  row) and written into the buffer's next column. A per-channel key block (KIVI)
  that an append filled is still read in fp16 by that step's query (the block's last
  token), as by every query inside it (``kvschemes``: one representation of past
  tokens); at the next step its rows are read back quantized and replace the buffer's.
  A sink's row is read back too (its fp16 copy). So every value attention sees is the
  one the cache's own ``update_and_fetch`` would return, and the step's results are
  bit-identical to the per-step dense path;
- the buffer is left-padded so that every member's next token lands in the same column;
  attention gets the last ``max(length)`` columns, which is exactly the layout (and the
  mask, per-agent RoPE offsets and windows) of ``BatchLayerView``. Columns a member does
  not use (padding, or rows its window has left) are masked; they are zeros or stale
  finite values, which a masked softmax weighs by exactly zero. Rows no member can see
  any more are dropped when the buffer grows.

One agent on plain Q4 without a shared base needs no copy: its cache's own fetch is a
slice of one packed buffer, so its layers pass straight through.

A step that codes its own tokens (``kvshelf.model.native_decode``) can split the update in
two: ``previous_columns`` hands attention the stored columns, ``read_back`` gives the new
rows as they will be stored (numpy, the same bits), and ``advance`` appends them after the
last layer, re-reading at once a key block that they closed, so the buffer holds the same
values at every step as through ``update_and_fetch``.

The cost is RAM while decoding: on the embedded Gemma 3 (fp32 compute, default scheme)
about 55 MB per agent at 4K context and 130 MB at 16K (the Q4 blocks: 9 and 20 MB);
``WorkingSets.nbytes`` says how much is held now.

The default kernels' native step keeps the default scheme's layers in codes instead, where
their heads gain by it (``kvshelf.kv.coded_working_set.CodedDecodeLayer``: a fraction of
these bytes, read in place by ``kvshelf.model.coded_attention``); temperature 0's steps and
the module path keep these fp32 rows.

A run is keyed by its members' identities (the scheduler passes its requests), so an
agent that leaves and comes back (after a rewind, a reload or a fork) is read afresh
from its blocks, never from stale rows.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.kv import coded_working_set
from kvshelf.kv.batch import MemberView
from kvshelf.kv.blocks import CodedRows, Codes, QuantizedLayerCache, each
from kvshelf.kv.coded_working_set import CodedDecodeLayer, coded_layer_fits
from kvshelf.model.arrays import buffer_view
from kvshelf.switches import env_on

# Free columns added whenever a buffer fills up: a grow copies the buffer, so it comes
# once every GROW_COLUMNS steps.
GROW_COLUMNS = 128

# Whether each layer starts MLX on the step so far (``mx.async_eval`` of its new K/V, that
# is every earlier layer and this one's projections) before Python builds the rest of the
# step's graph: building a step's graph is Python work (11.6 ms of the 30-layer llama's
# body at batch 1, benchmarks/decode_profile.py, load 2.4), which otherwise comes before
# any of MLX's. The same operations run on the same inputs, so no result changes by a bit
# (tested). Off by default: its effect on a step's time has not been measured under the
# benchmark lock yet (``benchmarks/decode.py --paths default,pipeline``);
# ``KVSHELF_DECODE_PIPELINE=1`` turns it on.
PIPELINE = env_on("KVSHELF_DECODE_PIPELINE")

Rows = tuple[mx.array, ...]  # one dense array, or a packed (words, scales, biases) triple
Layers = Sequence[QuantizedLayerCache]  # one agent's caches, one per model layer
Carried = tuple[Rows, Rows, int]  # a member's rows taken over from a previous run, and its closed mark


def _rows(x: Any) -> Rows:
    return x if isinstance(x, tuple) else (x,)


def _fetched(rows: Rows) -> Any:
    return rows if len(rows) == 3 else rows[0]


def _visible(m: QuantizedLayerCache) -> int:
    """How many of ``m``'s rows the next token's step keeps (its window may move on)."""
    return m.offset - m.start_after(1)


def _member_codes(codes: Codes, b: int) -> Codes:
    """Member ``b``'s rows of a decode step's codes."""
    keys, values = codes
    row = lambda x: x[b : b + 1]  # noqa: E731
    return (each(keys, row) if keys is not None else None), each(values, row)


def _place(x: mx.array, width: int, capacity: int) -> mx.array:
    """``x``'s rows right-aligned at column ``width`` of ``capacity`` columns, zeros elsewhere."""
    b, h, n, d = x.shape
    parts = [mx.zeros((b, h, width - n, d), dtype=x.dtype), x, mx.zeros((b, h, capacity - width, d), dtype=x.dtype)]
    return mx.concatenate([p for p in parts if p.shape[2]], axis=2)


class DecodeLayer(MemberView):
    """One layer of a decode run: its members' rows in one persistent batch buffer.

    A drop-in cache for mlx-lm attention, one token per member per step."""

    def __init__(self, members: list[QuantizedLayerCache], carried: list[Carried | None]):
        super().__init__(members)
        self._carried = carried  # rows start..offset of members taken over from a previous run
        # One agent whose packed rows are one buffer already (no shared base): its own
        # fetch is a slice, so a copy would only cost bytes.
        self._passthrough = len(members) == 1 and not self._dense and members[0].base is None
        self.keys: Rows | None = None
        self.values: Rows | None = None
        self.end = 0  # the column the next token goes into
        self.synced = [m.offset for m in members]  # member offsets the buffer holds rows up to
        # Per member: the buffer holds its keys below this as quantized blocks (above, the
        # open block's fp16 rows, also of a block that closed at the last step).
        self.closed = [c[2] if c is not None else m.stable_until for m, c in zip(members, carried)]

    # -- mlx-lm cache protocol ---------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[2] != 1:
            raise ValueError("a decode working set takes one token per agent per step")
        if PIPELINE:
            mx.async_eval(keys, values)
        if self._passthrough:
            out = self.members[0].update_and_fetch(keys, values)
            self.synced = [self.members[0].offset]
            return out
        olds, stables = self._prepare(keys.dtype)
        # Every member's new row coded at once: coding is row by row, so a member's slice is
        # what its own append would store, and what its own ``attention_rows`` of that row
        # would give back.
        codes = self.members[0].code_rows(keys, values)
        for b, m in enumerate(self.members):
            m.append(keys[b : b + 1], values[b : b + 1], _member_codes(codes, b))
        new_k, new_v = (_rows(x) for x in self.members[0].coded_rows(keys, values, keys.dtype, self._dense, codes))
        assert self.keys is not None and self.values is not None  # built by _prepare
        self._write(self.keys, slice(None), self.end, list(new_k))
        self._write(self.values, slice(None), self.end, list(new_v))
        self._written(olds, stables, keys.dtype)
        width = max(m.offset - m.start for m in self.members)
        cut = lambda buf: _fetched(tuple(x[..., self.end - width : self.end, :] for x in buf))  # noqa: E731
        return cut(self.keys), cut(self.values)

    def _prepare(self, dtype: mx.Dtype) -> tuple[list[int], list[int]]:
        """Room for a step's column (the buffers built first if need be); each member's
        offset and ``stable_until`` before the step's tokens arrive."""
        if self.keys is None or self.values is None:
            self._build(dtype)
        self._make_room()
        return [m.offset for m in self.members], [m.stable_until for m in self.members]

    def _written(self, olds: list[int], stables: list[int], dtype: mx.Dtype) -> None:
        """After the step's rows went into the next column (the members took their tokens):
        re-read the rows that changed, and move on a column."""
        col = self.end
        for b, m in enumerate(self.members):
            # The new token reads the key blocks closed before its own quantized (the last
            # one closed at the previous step, whose query still read it open: kvschemes),
            # and a sink from its fp16 copy: re-read those rows.
            lo = olds[b]
            if m.open_key_block and stables[b] > self.closed[b]:
                lo, self.closed[b] = max(self.closed[b], m.start), stables[b]
            elif not m.open_key_block and m.stable_until > stables[b]:  # the earlier reads: at once
                lo = min(stables[b], olds[b])
            if lo == olds[b] and not m.own_rows_at(olds[b]):
                continue
            self._reread(b, lo, col + 1, dtype)
        self.end = col + 1
        self.synced = [m.offset for m in self.members]

    # -- a step that codes its own token (kvshelf.model.native_decode) -------------------
    def previous_columns(self, dtype: mx.Dtype) -> tuple[Rows, Rows, int, int]:
        """Before this step's tokens are appended: the buffers and the columns ``lo..end``
        that the step's queries read besides their own tokens (what ``update_and_fetch``
        would return, less its last column), building the buffers first if need be."""
        if self.keys is None or self.values is None:
            self._build(dtype)
        assert self.keys is not None and self.values is not None
        width = max(m.offset + 1 - m.start_after(1) for m in self.members)
        return self.keys, self.values, self.end - (width - 1), self.end

    def columns_with(self, coded: CodedRows) -> tuple[Rows, Rows, int, int]:
        """For a step whose attention reads one array of columns, its own tokens' included
        (the temperature-0 kernels' ordered attention): room made, this step's rows as
        attention reads them (``coded``, their ``read_back``) written into the next column in
        place, and the buffers with the columns ``lo..end`` the step's queries read: what
        ``update_and_fetch`` would return, without its MLX operations. ``advance`` then
        appends the tokens (and writes that column again, with the same rows)."""
        self._prepare(mx.float32)
        keys, values, lo, end = self.previous_columns(mx.float32)
        buffer_view(keys[0])[:, :, end, :] = coded.keys
        buffer_view(values[0])[:, :, end, :] = coded.values
        return keys, values, lo, end + 1

    def advance(self, keys: np.ndarray, values: np.ndarray, coded: CodedRows) -> None:
        """Append a step's tokens (fp32 rows, one per member: batch x heads x dim) after its
        attention has read them (``previous_columns`` and ``coded``, their ``read_back``):
        the members stage them (``QuantizedLayerCache.stage``: written to their blocks
        later, many at once), the buffer takes the rows ``coded`` says attention reads,
        and a key block that these tokens closed is re-read at once (their own queries
        read it open, fp16; the next ones read it quantized)."""
        olds, stables = self._prepare(mx.float32)
        for b, m in enumerate(self.members):
            m.stage(keys[b], values[b], coded.member(b))
        assert self.keys is not None and self.values is not None  # dense: one array each
        # Written in place through numpy: two MLX operations a layer to build and evaluate
        # otherwise (about 1 ms of a batch-1 step). These buffers are this layer's alone:
        # made here (``_build``, ``_make_room``), never handed to MLX as a view that reads
        # them later (``member_rows``'s are copied by the next run's ``_build``, evaluated
        # before it writes, and a replaced run is never written again).
        buffer_view(self.keys[0])[:, :, self.end, :] = coded.keys
        buffer_view(self.values[0])[:, :, self.end, :] = coded.values
        self._written(olds, stables, mx.float32)
        for b, m in enumerate(self.members):
            if m.open_key_block and m.stable_until > self.closed[b]:
                lo, self.closed[b] = max(self.closed[b], m.start), m.stable_until
                self._reread(b, lo, self.end, mx.float32)

    def _reread(self, b: int, lo: int, end: int, dtype: mx.Dtype) -> None:
        """Member ``b``'s rows ``lo..offset`` read again from its cache, ending at column ``end``."""
        assert self.keys is not None and self.values is not None
        m = self.members[b]
        k, v = (_rows(x) for x in m.attention_rows(lo, m.offset, dtype, self._dense))
        self._write(self.keys, slice(b, b + 1), end - k[0].shape[2], list(k))
        self._write(self.values, slice(b, b + 1), end - v[0].shape[2], list(v))

    # -- the buffer ----------------------------------------------------------------------
    @staticmethod
    def _write(buf: Rows, rows: slice, col: int, new: list[mx.array]) -> None:
        """Write ``new`` at columns ``col..`` of members ``rows`` (in place: MLX donates the buffer)."""
        for x, y in zip(buf, new):
            x[rows, :, col : col + y.shape[2], :] = y

    def _build(self, dtype: mx.Dtype) -> None:
        """Gather every member's rows that the step keeps, once, left-padded into one buffer."""
        keys, values = [], []
        for b, (m, carried) in enumerate(zip(self.members, self._carried)):
            if carried is None:
                self.closed[b] = m.stable_until
            n = _visible(m)
            rows = carried[:2] if carried is not None else m.attention_rows(m.offset - n, m.offset, dtype, self._dense)
            k, v = (tuple(x[..., x.shape[2] - n :, :] for x in _rows(r)) for r in rows)
            keys.append(k)
            values.append(v)
        self._carried = [None] * len(self.members)
        width = max(_visible(m) for m in self.members)
        capacity = width + GROW_COLUMNS
        stack = lambda rows: tuple(  # noqa: E731
            mx.concatenate([_place(r[i], width, capacity) for r in rows], axis=0) for i in range(len(rows[0]))
        )
        self.keys, self.values = stack(keys), stack(values)
        self.end = width

    def _make_room(self) -> None:
        """Grow by GROW_COLUMNS when full, keeping only the columns some member still reads."""
        assert self.keys is not None and self.values is not None
        if self.end < self.keys[0].shape[2]:
            return
        width = max(_visible(m) for m in self.members)
        capacity = width + GROW_COLUMNS
        regrow = lambda buf: tuple(_place(x[..., self.end - width : self.end, :], width, capacity) for x in buf)  # noqa: E731
        self.keys, self.values = regrow(self.keys), regrow(self.values)
        self.end = width

    def member_rows(self, b: int) -> Carried | None:
        """Member ``b``'s rows ``start..offset`` and its ``closed`` mark (None before the
        first step built them)."""
        if self.keys is None or self.values is None:
            return self._carried[b]
        m = self.members[b]
        n = m.offset - m.start
        cut = lambda buf: tuple(x[b : b + 1, :, self.end - n : self.end, :] for x in buf)  # noqa: E731
        return cut(self.keys), cut(self.values), self.closed[b]

    def arrays(self) -> list[mx.array]:
        return [*(self.keys or ()), *(self.values or ())]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())


class DecodeRun:
    """One decode batch's working set: a ``DecodeLayer`` per model layer.

    ``keys`` identify the members (the scheduler's requests), ``agents`` are their layer
    caches (``AgentCache.layers``); ``previous`` is the run before a membership change,
    whose rows the staying members bring along; ``in_codes``: see ``WorkingSets.caches``."""

    layers: list[DecodeLayer | CodedDecodeLayer]

    def __init__(
        self,
        keys: Sequence[Hashable],
        agents: Sequence[Layers],
        previous: DecodeRun | None = None,
        in_codes: bool = False,
    ):
        self.keys = list(keys)
        self.agents = [list(layers) for layers in agents]
        self.in_codes = in_codes
        index = previous._index() if previous is not None else {}
        layers: list[DecodeLayer | CodedDecodeLayer] = []
        for i, per_layer in enumerate(zip(*self.agents)):
            members = list(per_layer)
            if in_codes and coded_working_set.CODED and coded_layer_fits(members):
                layers.append(CodedDecodeLayer(members))
                continue
            carried: list[Carried | None] = []
            for key in self.keys:
                old = index.get(key)
                rows = previous.layers[i].member_rows(old) if previous is not None and old is not None else None
                carried.append(rows)
            layers.append(DecodeLayer(members, carried))
        self.layers = layers

    def _index(self) -> dict[Hashable, int]:
        """Members whose rows are still current: same caches, no token added or removed since."""
        return {key: b for b, key in enumerate(self.keys) if self._current(b, self.agents[b])}

    def _current(self, b: int, agent: Layers) -> bool:
        return len(agent) == len(self.layers) and all(
            layer.members[b] is c and layer.synced[b] == c.offset for layer, c in zip(self.layers, agent)
        )

    def serves(self, keys: Sequence[Hashable], agents: Sequence[Layers], in_codes: bool = False) -> bool:
        return (
            list(keys) == self.keys
            and in_codes == self.in_codes
            and all(self._current(b, a) for b, a in enumerate(agents))
        )

    def arrays(self) -> list[mx.array]:
        return [x for layer in self.layers for x in layer.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class WorkingSets:
    """What a step loop asks for "the caches for this batch": the current run while its
    members are unchanged, a new one (taking over the staying members' rows) otherwise."""

    def __init__(self) -> None:
        self.run: DecodeRun | None = None

    def caches(
        self, keys: Sequence[Hashable], agents: Sequence[Layers], in_codes: bool = False
    ) -> list[DecodeLayer | CodedDecodeLayer]:
        """The model's caches for a step of these members (``agents[b]``: member b's layers).
        ``in_codes``: the step is the default kernels' native step (no member at temperature
        0), which reads layers kept in codes (``kvshelf.kv.coded_working_set``) where
        ``CODED`` is on and the layer's members allow it."""
        if self.run is None or not self.run.serves(keys, agents, in_codes):
            self.run = DecodeRun(keys, agents, self.run, in_codes)
        return self.run.layers

    def clear(self) -> None:
        """Drop every row (no agent is decoding)."""
        self.run = None

    def arrays(self) -> list[mx.array]:
        return self.run.arrays() if self.run is not None else []

    @property
    def nbytes(self) -> int:
        """Bytes the working set holds on top of the agents' Q4 blocks."""
        return self.run.nbytes if self.run is not None else 0

    def nbytes_of(self, keys: Collection[Hashable]) -> int:
        """The bytes that serve the members among ``keys`` (each holds an equal share of
        every buffer); the rows of members that left go with the next step's rebuild."""
        if self.run is None or not self.run.keys:
            return 0
        staying = sum(1 for key in self.run.keys if key in keys)
        return self.nbytes * staying // len(self.run.keys)
