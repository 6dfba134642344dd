"""The softmax of decode attention's loops: weights of one range of columns, and the ranges
merged, for ``kvshelf.model.native_ops.attend`` (over fp32 rows) and
``kvshelf.model.coded_attention`` (over codes), which differ only in how they read keys and
values.

Each (agent, KV head) has its columns cut into ranges, one job each across the cores: a
range's scores become weights ``exp(score - the range's max)`` (``weigh``), its values are
summed with them, and then each head's ranges are merged at their common maximum and
normalized (``merge``). A weight at ``vector_exp.FLOOR`` or below is exactly 0 (a masked
column, or underflow), and a range that sees no column weighs nothing, so a row that sees
none gets zeros. Reached as module attributes, as ``kvshelf.model.prefetch`` says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshelf.model import vector_exp
from kvshelf.model.jit import njit
from kvshelf.model.native_ops import MASKED


@njit(fastmath=True, cache=True, boundscheck=False)
def weigh(scores: Any, n: int, tops: Any, sums: Any) -> None:
    """In place, each query row's first ``n`` scores (group, >= n) turned into its weights;
    ``tops``/``sums`` (group,): each row's maximum score and the sum of its weights."""
    powers = np.empty(max(n, 1), dtype=np.int32)  # 2**k of each weight's exp, as fp32 bits
    scales = powers.view(np.float32)
    for g in range(scores.shape[0]):
        top = MASKED
        for t in range(n):
            top = max(top, scores[g, t])
        # exp(score - top) in two vector loops (``kvshelf.model.vector_exp``)
        for t in range(n):
            x = scores[g, t] - top
            e, powers[t] = vector_exp.parts(max(x, vector_exp.FLOOR))
            scores[g, t] = e if x >= vector_exp.FLOOR and top > MASKED else np.float32(0.0)
        denominator = np.float32(0.0)
        for t in range(n):
            e = scores[g, t] * scales[t]
            scores[g, t] = e
            denominator += e
        tops[g] = top
        sums[g] = denominator


@njit(fastmath=True, cache=True, boundscheck=False)
def merge(tops: Any, sums: Any, parts: Any, out: Any) -> None:
    """``out`` (group, dv): one head's ranges' weighted sums ``parts`` (ranges, group, dv),
    rescaled to their common maximum (``tops``/``sums``: (ranges, group), from ``weigh``)
    and normalized."""
    ranges, group, dv = parts.shape
    for g in range(group):
        top = MASKED
        for part in range(ranges):
            top = max(top, tops[part, g])
        denominator = np.float32(0.0)
        for i in range(dv):
            out[g, i] = 0.0
        for part in range(ranges):
            weight = np.exp(tops[part, g] - top)
            denominator += weight * sums[part, g]
            for i in range(dv):
                out[g, i] += weight * parts[part, g, i]
        scale = np.float32(1.0) / denominator if denominator > 0.0 else np.float32(0.0)
        for i in range(dv):
            out[g, i] *= scale
