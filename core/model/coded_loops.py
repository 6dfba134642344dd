"""The inner loops of ``kvshelf.model.coded_attention``, one head's columns at a time.

Why a module of their own: inside the parallel loop's body numba did not vectorize the
value sums (Gemma 3's heads at 1K, every layer, batch 1: 11.7 ms, against 3.4 with the same
loop as a function called from the body; scratch, 2026-12-08). They are reached as module
attributes, as ``kvshelf.model.prefetch`` says why.

Codes are unpacked in floats (the high nibble ``floor(x / 16)``, the low one
``x - 16 * high``): numba types integer masks and shifts as 64-bit, and a decode attention
loop that unpacked so ran about twice as slow (the llama's heads at 1K, batch 1: 5.57 ms
against 2.85; 2026-12-07, ``benchmarks/attention_bounds.py``'s kernels).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvshelf.model.jit import njit
from kvshelf.model.native_ops import MASKED

GROUP = 64  # tokens a key scale covers (per channel), and elements a value scale covers (per row)


@njit(inline="always")
def split(x: np.uint8) -> tuple[np.float32, np.float32]:
    """``x``'s low and high 4-bit codes (the even element, then the odd)."""
    xf = np.float32(x)
    high = np.floor(xf * np.float32(0.0625))
    return xf - np.float32(16.0) * high, high


@njit(fastmath=True, cache=True, boundscheck=False)
def key_scores(
    q: Any, kc: Any, ks: Any, kz: Any, open_k: Any, base: int, c0: int, shift: int, closed: int, bias: Any, scores: Any
) -> None:
    """Scores of one head's query rows ``q`` (group, d) against its columns ``c0 ..
    c0 + len(bias)``: codes at rows ``base + c`` of ``kc`` for columns before ``closed``,
    their key group's scales ``ks``/``kz`` (groups, d) folded into the query; fp32 rows of
    ``open_k`` from ``closed`` on; ``bias`` added, a ``MASKED`` column not read."""
    group, d = q.shape
    half = d // 2
    scaled = np.empty((group, d), dtype=np.float32)  # the query times a key group's scales: evens, odds
    offsets = np.empty(group, dtype=np.float32)  # the query . that group's offsets
    folded = -1  # the key group ``scaled`` holds
    for t in range(bias.shape[0]):
        c = c0 + t
        if bias[t] == MASKED:
            for g in range(group):
                scores[g, t] = MASKED
        elif c >= closed:  # the open block: fp32 rows
            for g in range(group):
                total = np.float32(0.0)
                for i in range(d):
                    total += q[g, i] * open_k[c - closed, i]
                scores[g, t] = total + bias[t]
        else:
            kg = (c + shift) // GROUP
            if kg != folded:
                for g in range(group):
                    o = np.float32(0.0)
                    for i in range(d):
                        scaled[g, (i % 2) * half + i // 2] = q[g, i] * ks[kg, i]
                        o += q[g, i] * kz[kg, i]
                    offsets[g] = o
                folded = kg
            r = base + c
            for g in range(group):
                total = np.float32(0.0)
                for j in range(half):
                    low, high = split(kc[r, j])
                    total += scaled[g, j] * low + scaled[g, half + j] * high
                scores[g, t] = total + offsets[g] + bias[t]


@njit(fastmath=True, cache=True, boundscheck=False)
def value_sums(weights: Any, vc: Any, vs: Any, vz: Any, base: int, out: Any) -> None:
    """``out`` (group, dv): the rows' ``weights`` (group, n) times value rows ``base ..
    base + n``, each row's scales folded into its weight and its offsets summed apart; a
    column no row weighs is not read."""
    group, dv = out.shape
    half = dv // 2
    acc = np.zeros((group, dv), dtype=np.float32)  # even elements, then odd
    shifts = np.zeros((group, dv // GROUP), dtype=np.float32)
    for t in range(weights.shape[1]):
        weighed = False
        for g in range(group):
            weighed = weighed or weights[g, t] != 0.0
        if not weighed:
            continue
        r = base + t
        for g in range(group):
            w = weights[g, t]
            for grp in range(dv // GROUP):
                a = w * vs[r, grp]
                shifts[g, grp] += w * vz[r, grp]
                for j in range(grp * (GROUP // 2), (grp + 1) * (GROUP // 2)):
                    low, high = split(vc[r, j])
                    acc[g, j] += a * low
                    acc[g, half + j] += a * high
    for g in range(group):
        for i in range(dv):
            out[g, i] = acc[g, (i % 2) * half + i // 2] + shifts[g, i // GROUP]
