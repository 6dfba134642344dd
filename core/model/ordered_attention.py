"""Row-invariant attention as one compiled loop: each query row sums its keys in position order.

Why: the temperature-0 kernels need a row's attention to have the same bits whatever came
with it (``kvshelf.model.attention`` says why). ``invariant_attention`` gets that from
MLX's products by giving them fixed shapes (tiles of query rows by 256-key blocks aligned
to absolute positions), which takes tens of MLX operations a layer: padding every member
onto the blocks, masking, a maximum, the exponentials, two products and two cumulative
sums. In a decode step each costs MLX's fixed price for one operation, and a profile of
the embedded Gemma 3 at temperature 0 and 1K context spent about 12 ms of an 85 ms step
there (py-spy, 2026-12-05).

Here every (member, query head, query row) is one job of a numba loop, or, where a KV
head's query heads in parts use the cores as evenly (``head_parts``: a decode row of
Gemma 3, four query heads over one KV head), a job takes a part of them and reads each key
and value row once for all (at 16K context one global layer's attention took 2.2 ms
against 3.2 so, in a scratch run; the same bits). A row's bits depend on nothing but its
own query and the keys/values it may see, by construction:

- a score is one dot product over the head's dims (one compiled loop, vectorized the same
  way for every key);
- the maximum is exact in any order;
- the weights, their sum and the weighted sum of values run over the visible keys one
  after the other in column order, which is position order in every cache here (column
  ``c`` is position ``origin + c``), with no reassociation: a key the row may not see is
  skipped, so padding, a window that starts elsewhere or more columns change nothing;
- the normalization comes last (``numerator / denominator``).

So a decode row has the bits the same token gets inside a 256-row prefill chunk, at batch
1 or among other agents. It is not ``invariant_attention`` bit for bit (other sums), only
to fp32 rounding; the temperature-0 kernels use one or the other for every call, never
both (``InvariantAttention``). Without numba, or with ``KVSHELF_NO_ORDERED_ATTENTION=1``,
they keep ``invariant_attention``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvshelf.model.arrays import buffer_view
from kvshelf.model.attention_mask import seen_keys
from kvshelf.model.blas import usable_cpus
from kvshelf.switches import env_on


@cache
def _kernel() -> Any:
    """The compiled loop (numba, cached on disk); None without numba."""
    try:
        from kvshelf.model.jit import njit, prange
    except ImportError:
        return None

    from kvshelf.model import ordered_dot  # a module attribute, so numba's disk cache finds the loop

    # No reassociation here: the sums over keys run in column order.
    # keys and values come as rows (member, kv head, column) -> (member * kv + head) * pitch
    # + column, ``pitch`` columns apart: a slice of a longer buffer is read in place.
    @njit(parallel=True, fastmath={"contract"}, cache=True, boundscheck=False)
    def attend_one_head(
        q: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        kv: int,
        columns: int,
        pitch: int,
        seen: np.ndarray,
        scale: np.float32,
        out: np.ndarray,
    ) -> None:
        members, heads, rows, d = q.shape
        dv = values.shape[1]
        group = heads // kv
        for job in prange(members * heads * rows):
            b = job // (heads * rows)
            h = (job // rows) % heads
            r = job % rows
            first = (b * kv + h // group) * pitch
            query = np.empty(d, dtype=np.float32)
            for i in range(d):
                query[i] = q[b, h, r, i] * scale
            scores = np.zeros(columns, dtype=np.float32)
            top = np.float32(-np.inf)
            for c in range(columns):
                if seen[b, r, c]:
                    s = ordered_dot.dot(query, keys[first + c])
                    scores[c] = s
                    top = max(top, s)
            num = np.zeros(dv, dtype=np.float32)
            den = np.float32(0.0)
            if top > -np.inf:
                weight = np.empty(columns, dtype=np.float32)
                ordered_dot.weights(scores, top, seen[b, r], weight)
                for c in range(columns):
                    if seen[b, r, c]:
                        w = weight[c]
                        den += w
                        for e in range(dv):
                            num[e] += w * values[first + c, e]
                for e in range(dv):
                    out[b, h, r, e] = num[e] / den
            else:  # a row that sees no key (a padded one): zeros, not 0 / 0
                for e in range(dv):
                    out[b, h, r, e] = 0.0

    # The same sums, a job taking ``per_job`` query heads of one KV head (``head_parts``):
    # each key and value row read once for all of them, each head's sums as ``attend_one_head``
    # runs them (the same bits).
    @njit(parallel=True, fastmath={"contract"}, cache=True, boundscheck=False)
    def attend_heads(
        q: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        kv: int,
        columns: int,
        pitch: int,
        seen: np.ndarray,
        scale: np.float32,
        parts: int,
        out: np.ndarray,
    ) -> None:
        members, heads, rows, d = q.shape
        dv = values.shape[1]
        group = heads // kv
        per_job = -(-group // parts)
        for job in prange(members * kv * parts * rows):
            r = job % rows
            part = (job // rows) % parts
            g = (job // (rows * parts)) % kv
            b = job // (rows * parts * kv)
            h0 = g * group + part * per_job
            n = max(min(per_job, group - part * per_job), 0)
            first = (b * kv + g) * pitch
            query = np.empty((max(n, 1), d), dtype=np.float32)
            for t in range(n):
                for i in range(d):
                    query[t, i] = q[b, h0 + t, r, i] * scale
            scores = np.zeros((max(n, 1), columns), dtype=np.float32)
            tops = np.full(max(n, 1), -np.inf, dtype=np.float32)
            for c in range(columns):
                if seen[b, r, c]:
                    key = keys[first + c]
                    for t in range(n):
                        s = ordered_dot.dot(query[t], key)
                        scores[t, c] = s
                        tops[t] = max(tops[t], s)
            num = np.zeros((max(n, 1), dv), dtype=np.float32)
            den = np.zeros(max(n, 1), dtype=np.float32)
            weight = np.empty((max(n, 1), columns), dtype=np.float32)
            for t in range(n):
                if tops[t] > -np.inf:
                    ordered_dot.weights(scores[t], tops[t], seen[b, r], weight[t])
            for c in range(columns):
                if seen[b, r, c]:
                    value = values[first + c]
                    for t in range(n):
                        if tops[t] > -np.inf:
                            w = weight[t, c]
                            den[t] += w
                            for e in range(dv):
                                num[t, e] += w * value[e]
            for t in range(n):
                for e in range(dv):
                    # a row that sees no key (a padded one): zeros, not 0 / 0
                    out[b, h0 + t, r, e] = num[t, e] / den[t] if tops[t] > -np.inf else np.float32(0.0)

    return attend_one_head, attend_heads


def head_parts(jobs: int, group: int) -> int:
    """Into how many parts a KV head's ``group`` query heads are cut (each part one job that
    reads the head's keys and values once): the fewest parts, dividing the group evenly,
    that give every core the same number of ``jobs`` (member, KV head, query row) times
    parts; where none does, the fewest that give every core a job. A decode row of Gemma 3
    (one KV head, four query heads) runs as two jobs of two heads on two cores; a prefill
    chunk's rows are jobs enough, each with every head of its group.

    A part reads all of its KV head's keys and values, so more parts read them more often:
    a decode row of the 30-layer llama (three KV heads of three query heads) at 16K took
    0.94 ms a layer as three jobs of three heads, one core taking two, against 2.41 ms as
    nine jobs of one head (the fallback before; 0.098 against 0.096 at 1K; random K/V,
    scratch, 2-core EPYC, 2026-12-07). Whole temperature-0 steps of ``llama30-bf16`` at
    16K, batch 1, two interleaved pairs of ``benchmarks/decode.py`` processes (load 0.7-1.3):
    75.6 / 83.4 ms before, 53.1 / 39.9 after (the default kernels 44.4-49.9 in the same
    runs). The same bits either way."""
    cpus = usable_cpus()
    divisors = [parts for parts in range(1, group + 1) if group % parts == 0]
    for parts in divisors:
        if jobs * parts % cpus == 0:
            return parts
    for parts in divisors:
        if jobs * parts >= cpus:
            return parts
    return group


def ordered_attention_available() -> bool:
    """Whether ``ordered_attention`` runs here (numba, and not switched off)."""
    return not env_on("KVSHELF_NO_ORDERED_ATTENTION") and _kernel() is not None


def _seen(mask: Any, batch: int, length: int, keys: int) -> np.ndarray:
    """The mask as (batch, length, keys) bytes, 1 where a query sees a key."""
    return np.ascontiguousarray(seen_keys(mask, batch, length, keys)).view(np.uint8)


def _rows(x: mx.array | np.ndarray) -> np.ndarray:
    """``x`` as a C-contiguous fp32 numpy array (a copy where its layout is another)."""
    return np.ascontiguousarray(x if isinstance(x, np.ndarray) else buffer_view(x.astype(mx.float32)), dtype=np.float32)


def pitched_rows(x: mx.array | np.ndarray) -> tuple[np.ndarray, int]:
    """Keys or values (B, kv, T, d) as C-contiguous rows, column ``c`` of member ``b``'s head
    ``g`` at row ``(b * kv + g) * pitch + c``, and that pitch. A decode working set hands
    over the last ``T`` columns of a longer buffer (``kvshelf.kv.working_set``): read in
    place, its columns ``pitch`` rows apart, instead of copied every layer of every step
    (the 30-layer llama at 16K context: its whole 761 MB K/V a step). Whole temperature-0
    steps, batch 1, interleaved in one process (scratch, 2026-12-06, load 0.6-0.8), ms in
    place / copied: the llama at 16K 139.9 / 197.1, at 1K 72.2 / 74.3; Gemma 3 at 16K 80.8
    / 82.2, at 1K 77.3 / 76.7 (its global layers' buffers were mostly full); the same bits.
    Anything laid out otherwise is copied as before. A numpy view (fp32) is read as it is."""
    view = x if isinstance(x, np.ndarray) else buffer_view(x.astype(mx.float32))
    b, kv, t, d = view.shape
    item = view.itemsize
    if view.flags.c_contiguous:
        return view.reshape(-1, d), t
    s0, s1, s2, s3 = view.strides
    if s3 == item and s2 == d * item and s1 % s2 == 0 and s1 >= t * s2 and (b == 1 or s0 == kv * s1):
        pitch = s1 // s2
        rows = np.lib.stride_tricks.as_strided(view, ((b * kv - 1) * pitch + t, d), (s2, s3))
        return rows, pitch
    return np.ascontiguousarray(view).reshape(-1, d), t


def ordered_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention whose rows do not depend on the other rows, columns or batch members.

    queries (B, heads, L, d); keys (B, kv_heads, T, d); values (B, kv_heads, T, dv), column
    order being position order; ``mask``: None, ``"causal"`` or booleans broadcastable to
    (B, 1, L, T). Out: (B, heads, L, dv), computed in fp32, in the queries' dtype."""
    return mx.array(ordered_rows(_rows(queries), keys, values, scale, mask)).astype(queries.dtype)


def ordered_rows(
    queries: np.ndarray, keys: mx.array | np.ndarray, values: mx.array | np.ndarray, scale: float, mask: Any
) -> np.ndarray:
    """``ordered_attention`` of fp32 numpy queries (B, heads, L, d), the same bits, as numpy
    (fp32): what a decode step on numpy rows calls (``kvshelf.model.native_decode``). Keys
    and values may be fp32 numpy views (a working set's buffer, sliced in numpy: an MLX
    slice would be evaluated on its own, twice a layer)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("ordered attention needs numba")
    b, heads, length, d = queries.shape
    kv, t, dv = keys.shape[1], keys.shape[2], values.shape[3]
    if heads % kv or keys.shape[0] != b or values.shape[:3] != keys.shape[:3] or keys.shape[3] != d:
        raise ValueError(f"attention shapes: queries {queries.shape}, keys {keys.shape}, values {values.shape}")
    out = np.empty((b, heads, length, dv), dtype=np.float32)
    key_rows, key_pitch = pitched_rows(keys)
    value_rows, value_pitch = pitched_rows(values)
    if key_pitch != value_pitch:  # one index for both: copies, each T columns apart
        key_rows, value_rows, key_pitch = _rows(keys).reshape(-1, d), _rows(values).reshape(-1, dv), t
    seen = _seen(mask, b, length, t)
    rows = np.ascontiguousarray(queries, dtype=np.float32)
    args = (rows, key_rows, value_rows, kv, t, key_pitch, seen, np.float32(scale))
    parts = head_parts(b * kv * length, heads // kv)
    if parts == heads // kv:  # one head a job: the loop without per-head arrays, faster for it
        kernel[0](*args, out)
    else:
        kernel[1](*args, parts, out)
    return out
