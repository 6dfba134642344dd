"""A decode working set layer in codes: the members' Q4 blocks as coded attention reads them.

``kvshelf.kv.working_set.DecodeLayer`` holds its members' rows as fp32 (55 MB an agent at 4K
on the embedded Gemma 3), and decode attention reads all of them every step. This layer
holds the same positions as ``kvshelf.model.coded_attention`` reads them: key codes a row a
token with their per-channel scales, the open key block in fp32, value codes with their
scales; about a sixth of the bytes. The layout is the fp32 buffer's (left-padded, so that
every member's next token lands in one column; the batch's mask and window logic are
``BatchLayerView``'s), in numpy arrays the native step writes in place:

- built from the members' blocks (``kvshelf.kv.coded_view``) when the run starts, and again
  when the buffer is full (every ``GROW_COLUMNS`` steps), which also drops the columns no
  member reads any more;
- each step, ``coded_columns`` writes the step's new rows as the cache will code them
  (``read_back``: the value codes, the key as the open block keeps it) into the next column,
  and hands attention the buffers; ``advance`` then stages the tokens into the members'
  blocks and, where a token closed a key block, writes that block's key codes in place of
  its open rows (the token's own query read the block open, the next ones read it coded:
  the rule of ``kvshelf.kv.schemes``).

So every value attention reads is the one the cache's own fetch would give the next
token, but the sums run in another order than ``native_ops.attend``'s over fp32 rows (the
scales folded in, the rotation undone once): a step's logits are those of the fp32 working
set to fp32 rounding, not bit for bit. A step gives the same bits every time from the same
blocks, so a restored agent continues as one kept in RAM.

Who uses it: the default kernels' native step (``kvshelf.model.native_decode``) of at most
``MAX_LAYER_ROWS`` agents decoding above temperature 0 (``reads_codes``), for layers whose
members all keep codable blocks (``coded_view.codable``) with heads long enough to gain
(``coded_attention.worth_reading``: the embedded Gemma 3's 256 floats, not the llama's 64).
Measured as whole steps of the embedded Gemma 3 against the fp32 working set, side by side
(``benchmarks/decode.py --paths default,fp32-rows``, ``decode-20261208-003827.json``): 0.83-0.99x
the time at 1K-16K and batch 1-8, the most at 16K, with 0.19-0.29x its bytes.
``KVSHELF_NO_CODED_ATTENTION=1`` keeps fp32 rows. Any other call (the module path, a
temperature-0 step) goes through the members' own update and fetch, and the buffer is
rebuilt at the next coded step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.kv.batch import BatchLayerView, MemberView
from kvshelf.kv.blocks import CodedRows, QuantizedLayerCache
from kvshelf.kv.coded_view import codable, coded_view
from kvshelf.model.coded_attention import GROUP, CodedLayer, key_rows, value_rows, worth_reading
from kvshelf.model.skinny import MAX_LAYER_ROWS
from kvshelf.model.spec import BLOCK_TOKENS
from kvshelf.switches import env_on

CODED = not env_on("KVSHELF_NO_CODED_ATTENTION")

# Free columns added whenever the buffer is rebuilt (the fp32 working set's GROW_COLUMNS).
GROW_COLUMNS = 128

F32 = np.float32


def reads_codes(forward: Any, batch: int) -> bool:
    """Whether ``forward``'s decode step of ``batch`` agents reads layers kept in codes: the
    default kernels' native step (not temperature 0's, not the module path)."""
    native = getattr(forward, "native", None)
    return native is not None and not native.exact and native.defer_updates and batch <= MAX_LAYER_ROWS


def coded_layer_fits(members: list[QuantizedLayerCache]) -> bool:
    """Whether a coded layer can hold these members' caches of one layer, and gains there."""
    return all(codable(m) and worth_reading(m.layer.k_head_dim) for m in members)


class CodedDecodeLayer(MemberView):
    """One layer of a decode run, its members' K/V in codes (the module's layout)."""

    def __init__(self, members: list[QuantizedLayerCache]):
        super().__init__(members)
        self.codes: CodedLayer | None = None
        self.end = 0  # the column the next token goes into
        self.synced = [m.offset for m in members]
        self._closed = [0] * len(members)  # per member: the first position of its open key block

    # -- a step through the module path (anything but the native step) ------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """The members' own update and fetch (dense rows, per step); the buffer is rebuilt
        at the next coded step."""
        if keys.shape[2] != 1:
            raise ValueError("a decode working set takes one token per agent per step")
        if len(self.members) == 1:
            out = self.members[0].update_and_fetch(keys, values)
        else:
            out = BatchLayerView.update_and_fetch(self, keys, values)
        self.codes = None
        self.synced = [m.offset for m in self.members]
        return out

    # -- the native step ------------------------------------------------------------------
    def coded_columns(self, coded: CodedRows) -> tuple[CodedLayer, int, int]:
        """Before this step's tokens are appended: this step's rows as attention reads them
        (``coded``, their ``read_back``) written into the next column, and the buffers with
        the columns ``lo..end`` the step's queries read."""
        if self.codes is None or self.end == self.codes.key_codes.shape[2]:
            self._build()
        codes = self.codes
        assert codes is not None
        col = self.end
        words, scales, offsets = coded.value_codes
        codes.value_codes[:, :, col] = value_rows(words)
        codes.value_scales[:, :, col] = scales
        codes.value_offsets[:, :, col] = offsets
        for b in range(len(self.members)):
            codes.open_keys[b, :, col - codes.closed[b]] = coded.keys[b]
        width = max(m.offset + 1 - m.start_after(1) for m in self.members)
        return codes, col - (width - 1), col + 1

    def advance(self, keys: np.ndarray, values: np.ndarray, coded: CodedRows) -> None:
        """After the step's attention: the members stage their tokens (written to their
        blocks later, many at once), and a key block a token closed is read in as codes."""
        codes = self.codes
        assert codes is not None  # built by coded_columns
        for b, m in enumerate(self.members):
            m.stage(keys[b], values[b], coded.member(b))
            if m.stable_until > self._closed[b]:  # the token filled its key block: now coded
                self._read_block(b, self._closed[b], m.stable_until)
        self.end += 1
        self.synced = [m.offset for m in self.members]

    def _read_block(self, b: int, lo: int, hi: int) -> None:
        """Member ``b``'s key blocks ``lo..hi`` (closed) read into the buffer as codes."""
        codes = self.codes
        assert codes is not None
        m = self.members[b]
        words, scales, offsets = (np.array(x) for x in m.packed_rows("keys", lo, hi))
        key_codes, key_scales, key_offsets = key_rows(words, scales, offsets, m.layer.k_head_dim)
        first = self.end + lo - (m.offset - 1)  # position lo's column: the step's token went into end
        codes.key_codes[b, :, first : first + hi - lo] = key_codes[0]
        row = (first + int(codes.shift[b])) // GROUP
        codes.key_scales[b, :, row : row + (hi - lo) // GROUP] = key_scales[0]
        codes.key_offsets[b, :, row : row + (hi - lo) // GROUP] = key_offsets[0]
        codes.closed[b] = first + hi - lo
        self._closed[b] = hi

    def _build(self) -> None:
        """Every member's positions from its first kept block, read from its blocks into one
        left-padded buffer with ``GROW_COLUMNS`` free columns."""
        lows = [m.start_after(1) for m in self.members]  # a block boundary: where the buffer will start
        width = max(m.offset - lo for m, lo in zip(self.members, lows))
        columns = width + GROW_COLUMNS
        first = self.members[0].layer
        b, kv, d, dv = len(self.members), first.kv_heads, first.k_head_dim, first.v_head_dim
        codes = CodedLayer(
            key_codes=np.zeros((b, kv, columns, d // 2), np.uint8),
            key_scales=np.zeros((b, kv, columns // GROUP + 2, d), F32),
            key_offsets=np.zeros((b, kv, columns // GROUP + 2, d), F32),
            open_keys=np.zeros((b, kv, BLOCK_TOKENS, d), F32),
            value_codes=np.zeros((b, kv, columns, dv // 2), np.uint8),
            value_scales=np.zeros((b, kv, columns, dv // GROUP), F32),
            value_offsets=np.zeros((b, kv, columns, dv // GROUP), F32),
            shift=np.zeros(b, np.int64),
            closed=np.zeros(b, np.int64),
            rotated=False,
        )
        for i, (m, lo) in enumerate(zip(self.members, lows)):
            view = coded_view(m, lo)
            codes.rotated = view.rotated
            n = m.offset - lo
            col = width - n  # the column of position lo
            codes.key_codes[i, :, col:width] = view.key_codes[0]
            groups = view.key_scales.shape[2]
            codes.key_scales[i, :, :groups] = view.key_scales[0]
            codes.key_offsets[i, :, :groups] = view.key_offsets[0]
            opened = m.offset - m.stable_until
            codes.open_keys[i, :, :opened] = view.open_keys[0, :, :opened]
            codes.value_codes[i, :, col:width] = view.value_codes[0]
            codes.value_scales[i, :, col:width] = view.value_scales[0]
            codes.value_offsets[i, :, col:width] = view.value_offsets[0]
            codes.shift[i] = -col  # column c's key group: (c - col) // 64 from lo's
            codes.closed[i] = col + m.stable_until - lo
            self._closed[i] = m.stable_until
        self.codes, self.end = codes, width

    def member_rows(self, b: int) -> None:
        """Nothing for a next run to take over: it reads its members from their blocks."""
        return None

    def arrays(self) -> list[mx.array]:
        return []  # numpy buffers, written in place: nothing for MLX to evaluate

    @property
    def nbytes(self) -> int:
        if self.codes is None:
            return 0
        c = self.codes
        parts = (c.key_codes, c.key_scales, c.key_offsets, c.open_keys, c.value_codes, c.value_scales, c.value_offsets)
        return sum(x.nbytes for x in parts)
