"""Several agents' quantized caches presented to the model as one batch, for decode.

mlx-lm batches only fp16 caches, and its server turns batching off when the KV is
quantized. ``BatchLayerView`` wraps one layer's ``QuantizedLayerCache`` of each agent
in the batch: each agent's new token goes into that agent's own blocks (so its cache
stays its own, and leaves the batch unchanged), and attention sees all agents' packed
blocks left-padded to a common length, with a mask that hides the padding and each
agent's out-of-window keys. Every agent keeps its own RoPE offset.

Agents can join or leave between steps: a view is rebuilt from the member list, so
membership changes cost nothing beyond the next step's gather. That gather (every
member's rows, dequantized and padded, every step) is what the decode working set
(``kvshelf.kv.working_set.DecodeLayer``, the step loop's path) avoids by keeping the
same layout in a persistent buffer; this view stays as its mask and offset logic and
as the per-step reference it is tested against.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.kv.blocks import CodedRows, PackedFetch, QuantizedLayerCache


def _left_pad(x: mx.array, length: int) -> mx.array:
    pad = length - x.shape[2]
    if pad == 0:
        return x
    return mx.concatenate([mx.zeros((*x.shape[:2], pad, x.shape[3]), dtype=x.dtype), x], axis=2)


class BatchLayerView(PackedFetch):
    """One layer of a decode batch: one token per agent per step."""

    def __init__(self, members: list[QuantizedLayerCache]):
        self.members = members
        self.window = members[0].window
        self.group_size = members[0].group_size
        self._bits = members[0]._bits
        self._quantized_fetch = False

    @property
    def dense_decode(self) -> bool:
        """Whether the step's fetch is dense: every member's is (see ``QuantizedLayerCache``)."""
        return all(m.dense_decode for m in self.members)

    @property
    def offset(self) -> mx.array:
        """Per-agent RoPE offsets."""
        return mx.array([m.offset for m in self.members])

    def _key_lengths(self) -> list[int]:
        return [m.offset + 1 - m.start_after(1) for m in self.members]

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        if n != 1:
            raise ValueError("a batch view decodes one token per agent per step")
        # Built in numpy and handed over as one array: as MLX operations, four a member, the
        # native step's first evaluation of them (``native_ops.mask_bias``) took about 1 ms
        # of a batch-4 step on Gemma 3 (two masks a step).
        window = window_size or self.window
        lengths = self._key_lengths()
        width = max(lengths)
        col = np.arange(width)
        rows = []
        for m, length in zip(self.members, lengths):
            valid = col >= width - length
            if window is not None:
                k_pos = m.start_after(1) + col - (width - length)
                valid &= k_pos > m.offset - window
            rows.append(valid)
        return mx.array(np.stack(rows)[:, None, None, :])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        fetched = [m.update_and_fetch(keys[b : b + 1], values[b : b + 1]) for b, m in enumerate(self.members)]
        self._quantized_fetch = all(m._quantized_fetch for m in self.members)
        width = max(k[0].shape[2] if isinstance(k, tuple) else k.shape[2] for k, _ in fetched)

        def stack(parts: list) -> Any:
            if isinstance(parts[0], tuple):
                return tuple(mx.concatenate([_left_pad(p[i], width) for p in parts], axis=0) for i in range(3))
            return mx.concatenate([_left_pad(p, width) for p in parts], axis=0)

        return stack([k for k, _ in fetched]), stack([v for _, v in fetched])


def batch_views(layer_caches: list[list[QuantizedLayerCache]]) -> list[BatchLayerView]:
    """``layer_caches[b][i]`` is agent b's cache of layer i; returns one view per layer."""
    return [BatchLayerView(list(per_layer)) for per_layer in zip(*layer_caches)]


class MemberView(BatchLayerView):
    """What every decode working set layer is to the model: with one member, that member's
    cache (its own mask and integer RoPE offset); with several, their batch view. It also
    says what a step's new rows read back as (``read_back``)."""

    def __init__(self, members: list[QuantizedLayerCache]):
        super().__init__(members)
        # Dense unless every member hands packed rows to quantized_matmul (plain Q4 on a GPU).
        self._dense = not all(m.quantized_decode for m in members)
        self._quantized_fetch = not self._dense

    @property
    def dense_decode(self) -> bool:
        return self._dense

    @property
    def offset(self) -> Any:
        if len(self.members) == 1:
            return self.members[0].offset
        return super().offset

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if len(self.members) == 1:
            return self.members[0].make_mask(n, window_size=window_size, return_array=return_array)
        return super().make_mask(n, window_size, return_array)

    def read_back(self, keys: np.ndarray, values: np.ndarray) -> CodedRows | None:
        """This step's new rows (numpy, one per member) coded as the cache codes them, bit
        for bit, and what they read back as once appended, or None where that is not
        known here (a scheme without a numpy coding, a sink's position, packed rows)."""
        if not self._dense or any(m.own_rows_at(m.offset) for m in self.members):
            return None
        return self.members[0].read_back(keys, values)
