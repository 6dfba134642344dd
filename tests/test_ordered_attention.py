"""The compiled row-invariant attention (kvshelf.model.ordered_attention): what the
temperature-0 layers run, and its edges. Its row invariance, beside MLX's blocked kernel,
is ``tests/test_invariance.py::test_attention_rows_do_not_depend_on_the_call``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvshelf.model.arrays import buffer_view
from kvshelf.model.attention import InvariantAttention
from kvshelf.model.blas import usable_cpus
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import ProjectedModel
from kvshelf.model.loader import load
from kvshelf.model.ordered_attention import ordered_attention, ordered_attention_available, pitched_rows
from tests.support.qkv import random_qkv
from tests.support.tiny import make_tiny_model_dir


def test_the_temperature_zero_layers_run_the_ordered_loop(tmp_path):
    """``greedy_forward``'s body (``with_fast_linears(all_rows=True)``) wraps every attention
    in ``InvariantAttention`` on the compiled loop, and the model's prefill then decode on
    mlx-lm's cache give the last position the bits a one-call prefill gives it."""
    assert ordered_attention_available()
    path = make_tiny_model_dir(tmp_path / "m", "llama", num_hidden_layers=2)
    model = load(path, progress=False).model
    fast = with_fast_linears(model, all_rows=True)
    assert isinstance(fast, ProjectedModel)
    wrapped = [m for _, m in fast.body.named_modules() if isinstance(m, InvariantAttention)]
    assert len(wrapped) == 2 and all(m._ordered for m in wrapped)
    tokens = mx.array([[5, 9, 2, 31, 7, 7, 40, 3, 12, 1]])
    whole = [KVCache() for _ in range(2)]
    one_call = fast(tokens, cache=whole)[0, -1]
    parts = [KVCache() for _ in range(2)]
    fast(tokens[:, :-1], cache=parts)
    decoded = fast(tokens[:, -1:], cache=parts)[0, -1]
    assert mx.array_equal(decoded, one_call).item()


def test_a_row_that_sees_no_key_gives_zeros_and_the_others_their_own_bits():
    """A padded query row (its mask all False) gets zeros, not 0 / 0, and does not change
    its neighbours."""
    q, k, v = random_qkv(3, 4, 2, 6, 32)
    seen = mx.array([[True] * 6, [False] * 6] * 3)[None, None]  # rows 1, 3, 5 see nothing
    out = ordered_attention(q, k, v, 0.2, seen)
    assert not mx.any(mx.isnan(out)).item()
    assert mx.array_equal(out[:, :, 1::2], mx.zeros_like(out[:, :, 1::2])).item()
    alone = ordered_attention(q[:, :, :1], k, v, 0.2, None)
    assert mx.array_equal(alone[:, :, 0], out[:, :, 0]).item()
    want = mx.fast.scaled_dot_product_attention(q[:, :, :1], k, v, scale=0.2)
    assert mx.allclose(alone, want, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("members", [1, 3])
def test_the_last_columns_of_a_longer_buffer_are_read_in_place_with_the_same_bits(members):
    """A decode working set hands attention the last columns of a longer buffer: they are
    read where they lie (no copy) and every row has the bits it gets from a copy of them,
    for one member and for several (each member's rows a buffer apart)."""
    rng = np.random.default_rng(members)
    heads, kv, used, capacity, d = 6, 2, 37, 64, 32
    q = mx.array(rng.standard_normal((members, heads, 1, d)).astype(np.float32))
    k_buf, v_buf = (mx.array(rng.standard_normal((members, kv, capacity, d)).astype(np.float32)) for _ in range(2))
    k, v = k_buf[:, :, capacity - used :], v_buf[:, :, capacity - used :]
    rows, pitch = pitched_rows(k)
    assert pitch == capacity and np.shares_memory(rows, buffer_view(k_buf))
    seen = mx.array(rng.random((members, 1, 1, used)) < 0.8)
    in_place = ordered_attention(q, k, v, 0.3, seen)
    copied = ordered_attention(q, mx.array(np.array(k)), mx.array(np.array(v)), 0.3, seen)
    assert mx.array_equal(in_place, copied).item()
    mixed = ordered_attention(q, k, mx.array(np.array(v)), 0.3, seen)  # the values laid out otherwise
    assert mx.array_equal(mixed, copied).item()
    dense = mx.fast.scaled_dot_product_attention(
        q, mx.repeat(k, heads // kv, 1), mx.repeat(v, heads // kv, 1), scale=0.3, mask=seen
    )
    assert mx.allclose(in_place, dense, rtol=1e-5, atol=1e-6).item()


def test_bad_masks_and_shapes_are_refused():
    q, k, v = random_qkv(4, 4, 2, 5, 16)
    with pytest.raises(TypeError, match="boolean"):
        ordered_attention(q, k, v, 0.25, mx.zeros((5, 5)))
    with pytest.raises(ValueError, match="one mask for all heads"):
        ordered_attention(q, k, v, 0.25, mx.ones((1, 4, 5, 5), dtype=mx.bool_))
    with pytest.raises(ValueError, match="attention shapes"):
        ordered_attention(q[:, :3], k, v, 0.25, None)  # 3 query heads over 2 KV heads


@pytest.mark.parametrize("shape", [(1, 4, 1, 1, 300, 64), (2, 9, 3, 5, 40, 16), (1, 8, 2, 3, 70, 32)])
def test_query_heads_sharing_a_job_keep_their_bits(shape):
    """A job that takes several query heads of one KV head (each key read once for them)
    gives every head the bits the one-head-a-job loop gives it, in any number of parts."""
    from kvshelf.model.ordered_attention import _kernel, head_parts

    one_head, heads_at_once = _kernel()
    b, heads, kv, length, t, d = shape
    rng = np.random.default_rng(11)
    q = rng.standard_normal((b, heads, length, d)).astype(np.float32)
    keys = rng.standard_normal((b * kv * t, d)).astype(np.float32)
    values = rng.standard_normal((b * kv * t, d)).astype(np.float32)
    seen = (rng.random((b, length, t)) > 0.2).astype(np.uint8)
    seen[0, 0] = 0  # a row that sees no key: zeros either way
    want = np.empty((b, heads, length, d), dtype=np.float32)
    one_head(q, keys, values, kv, t, t, seen, np.float32(0.3), want)
    for parts in range(1, heads // kv + 1):
        got = np.full_like(want, np.nan)
        heads_at_once(q, keys, values, kv, t, t, seen, np.float32(0.3), parts, got)
        assert np.array_equal(got, want), parts
    assert np.all(want[0, :, 0] == 0.0)
    cpus = usable_cpus()
    for jobs, group in ((1, 4), (256, 4), (3, 3), (1, 3), (2, 8), (1, 1), (9, 3)):
        parts = head_parts(jobs, group)
        # the fewest even parts that fill the cores alike, else the fewest that give each a job
        divisors = [p for p in range(1, group + 1) if group % p == 0]
        even = [p for p in divisors if jobs * p % cpus == 0]
        filling = [p for p in divisors if jobs * p >= cpus]
        assert parts == (even or filling or [group])[0]


def test_a_kv_head_is_read_once_where_the_cores_cannot_share_it_evenly(monkeypatch):
    """On two cores: a decode row of the 30-layer llama (three KV heads of three query heads)
    runs as three jobs, each reading its head's keys and values once, not as nine; Gemma 3's
    one KV head of four query heads as two jobs of two; a lone KV head of three as three."""
    from kvshelf.model import ordered_attention

    monkeypatch.setattr(ordered_attention, "usable_cpus", lambda: 2)
    assert ordered_attention.head_parts(3, 3) == 1
    assert ordered_attention.head_parts(1, 4) == 2
    assert ordered_attention.head_parts(1, 3) == 3
    assert ordered_attention.head_parts(256, 4) == 1


def test_attention_weights_are_exp_within_fp32_rounding():
    """The loop's own exp of a row's scores: within 3e-7 (relative) of the exact exp where
    the row sees the column, exactly 1 at the maximum, exactly 0 where it does not see it
    or where the score lies 87 or more below the maximum; an element's bits its own."""
    from kvshelf.model import ordered_dot

    rng = np.random.default_rng(13)
    scores = np.concatenate([-rng.uniform(0, 86.9, 5000), [0.0, -87.0, -90.0, -1e30]]).astype(np.float32)
    seen = (rng.random(scores.size) > 0.1).astype(np.uint8)
    seen[-4:] = 1
    out = np.empty_like(scores)
    ordered_dot.weights(scores, np.float32(0.0), seen, out)
    exact = np.exp(scores.astype(np.float64))
    visible = (seen == 1) & (scores > -87.0)
    assert np.all(np.abs(out[visible] - exact[visible]) <= 3e-7 * exact[visible])
    assert out[-4] == 1.0 and np.all(out[-3:] == 0.0) and np.all(out[seen == 0] == 0.0)
    part = np.empty(777, dtype=np.float32)
    ordered_dot.weights(scores[3:780], np.float32(0.0), seen[3:780], part)  # another length and offset
    assert np.array_equal(part, out[3:780])
