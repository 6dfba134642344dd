"""A layer cache's staged tokens (``QuantizedLayerCache.stage``: a decode step's tokens
written to the blocks later, many at once) leave the cache exactly as appending each on
its arrival does: the same stored rows, open fp16 key block, sinks, start and offset, and
the same rows read back, through key blocks that close and windows that move, for every
scheme a decode working set stages into. A clone taken with tokens staged keeps its own."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvshelf.kv.blocks import QuantizedLayerCache
from kvshelf.kv.schemes import SCHEMES
from kvshelf.model.spec import LayerSpec

# Every scheme: the plain ones decode on dense rows on the CPU too (``blocks.packed_decode``).
STAGED = list(SCHEMES)
SPECS = {"full": LayerSpec(None, 2, 64, 64), "window-100": LayerSpec(100, 2, 64, 64)}


def _tokens(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((n, 2, 64)).astype(np.float32) * 3 for _ in range(2))
    return k, v


def _state(c: QuantizedLayerCache) -> list[np.ndarray]:
    """Everything a record stores, and what attention reads of every kept row."""
    rows = c.own_rows()
    parts = [*(rows.keys or ()), *(rows.values or ())]
    parts += [x for x in (rows.k_tail, rows.sink_k, rows.sink_v) if x is not None]
    lo = c.start_after(1)
    parts += list(c.attention_rows(lo, c.offset, mx.float32, dense=True))
    return [np.array(x) for x in parts]


def _same(a: QuantizedLayerCache, b: QuantizedLayerCache) -> None:
    assert (a.offset, a.start, a.stable_until) == (b.offset, b.start, b.stable_until)
    mine, theirs = _state(a), _state(b)
    assert len(mine) == len(theirs)
    for x, y in zip(mine, theirs):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(x, y, equal_nan=True)


def _append_one(c: QuantizedLayerCache, k: np.ndarray, v: np.ndarray) -> None:
    c.append(mx.array(k[None, :, None, :]), mx.array(v[None, :, None, :]))


def _stage_one(c: QuantizedLayerCache, k: np.ndarray, v: np.ndarray) -> None:
    coded = c.read_back(k[None], v[None])
    assert coded is not None  # every scheme decoding on dense rows codes on numpy rows
    c.stage(k, v, coded.member(0))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", STAGED)
def test_staged_tokens_leave_the_cache_as_appends_do(name, spec):
    appended, staged = SCHEMES[name].make(SPECS[spec]), SCHEMES[name].make(SPECS[spec])
    k, v = _tokens(700, seed=len(name))
    for c in (appended, staged):  # a 3-token prompt: sink positions (sink4 schemes) are staged too
        c.update_and_fetch(mx.array(k[:3].transpose(1, 0, 2)[None]), mx.array(v[:3].transpose(1, 0, 2)[None]))
    checks = {4, 17, 255, 256, 257, 300, 511, 512, 513, 699}  # around key blocks closing (256)
    for t in range(3, 700):
        _append_one(appended, k[t], v[t])
        _stage_one(staged, k[t], v[t])
        assert staged.offset == appended.offset and staged.stable_until == appended.stable_until
        if t in checks:
            _same(appended, staged)  # reading settles the staged tokens


@pytest.mark.parametrize("name", ["q4-g64-kivi-rotv", "q4-g64-rot"])
def test_a_clone_with_staged_tokens_keeps_its_own(name):
    spec = SPECS["window-100"]
    appended, staged = SCHEMES[name].make(spec), SCHEMES[name].make(spec)
    k, v = _tokens(400, seed=3)
    for t in range(150):
        _append_one(appended, k[t], v[t])
        (_append_one if t < 140 else _stage_one)(staged, k[t], v[t])
    twin, reference = staged.clone(), appended.clone()
    for t in range(150, 400):  # the original goes on (staged); its clone must not see it
        _append_one(appended, k[t], v[t])
        _stage_one(staged, k[t], v[t])
    _same(twin, reference)
    _same(staged, appended)
    for t in range(150, 200):  # and the clone goes on by itself
        _stage_one(twin, k[t], v[t])
        _append_one(reference, k[t], v[t])
    _same(twin, reference)


def test_staged_tokens_count_in_the_cache_bytes():
    """The pool's budget sees a staged token's numpy rows before they are written."""
    cache = SCHEMES["q4-g64-kivi-rotv"].make(SPECS["full"])
    k, v = _tokens(20, seed=4)
    for t in range(5):
        _append_one(cache, k[t], v[t])
    held = cache.nbytes
    for t in range(5, 15):
        _stage_one(cache, k[t], v[t])
    assert cache.nbytes >= held + 10 * (k[0].nbytes + v[0].nbytes)  # the buffers' own room did not grow
    cache.settle()  # what a request's end does (``Shelf.give_back``): nothing left staged
    assert cache.nbytes == sum(x.nbytes for x in cache.arrays())
