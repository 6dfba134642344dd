"""Timing decode steps, shared by ``benchmarks/decode.py`` and the Decode section.

A decode step reads every weight once (and each agent's cached K/V), so its time cannot
fall below ``bytes read / memory bandwidth``: ``bandwidth_gbs`` measures that bandwidth
in the same run, ``weight_bytes`` the bytes. Caches are filled with random K/V of the
right shapes (``fill``): timing does not depend on their values, and a 16K context costs
seconds to set up instead of minutes of prefill. ``step_ms`` times steps the way the
scheduler runs them (the decode working set kept across steps) or the per-step path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from kvshelf.kv.batch import batch_views
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.head import ProjectedModel
from kvshelf.model.spec import ModelCacheSpec

FILL_CHUNK = 1024


def weight_bytes(model: nn.Module) -> int:
    params = tree_flatten(model.parameters())
    assert isinstance(params, list)  # (name, array) pairs: a dict comes back only for a dict destination
    return sum(v.nbytes for _, v in params)


def bandwidth_gbs(megabytes: int = 512, repeats: int = 7) -> dict[str, float]:
    """Read bandwidth: the best of several full passes over a large array (MLX and numpy)."""
    n = megabytes * 2**20 // 4
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    best_mx = min(_timed(lambda: mx.eval(mx.sum(a))) for _ in range(repeats))
    b = np.asarray(a)
    best_np = min(_timed(lambda: float(b.sum())) for _ in range(repeats))
    nbytes = n * 4
    return {"mlx_sum_gbs": nbytes / best_mx / 1e9, "numpy_sum_gbs": nbytes / best_np / 1e9}


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fill(layers: list[Any], spec: ModelCacheSpec, context: int, seed: int) -> None:
    """Feed ``context`` random tokens' K/V to every layer, in chunks (windows trim as they go)."""
    key = mx.random.key(seed)
    for layer, c in zip(spec.layers, layers):
        for done in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - done)
            key, k1, k2 = mx.random.split(key, 3)
            k = mx.random.normal((1, layer.kv_heads, n, layer.k_head_dim), key=k1)
            v = mx.random.normal((1, layer.kv_heads, n, layer.v_head_dim), key=k2)
            c.update_and_fetch(k, v)
            mx.eval([x for x in cache_arrays(c) if x is not None])


def cache_arrays(c: Any) -> list[mx.array]:
    """Every array one layer cache holds (its blocks, open tail and sinks), to evaluate or count."""
    out: list[mx.array] = []
    for name in ("keys", "values", "k_tail", "sink_k", "sink_v"):
        x = getattr(c, name, None)
        if isinstance(x, tuple):
            out.extend(x)
        elif isinstance(x, mx.array):
            out.append(x)
    return out


def step_ms(
    model: nn.Module | ProjectedModel, agents: list[list[Any]], steps: int, warmup: int, working: bool = False
) -> tuple[list[float], int]:
    """Milliseconds per decode step for these agents decoding together (one token each),
    and the working set's bytes (``working``: the scheduler's path; else per-step)."""
    batch = len(agents)
    x = mx.array([[1]] * batch)
    times = []
    ws = WorkingSets()
    for i in range(warmup + steps):
        t = time.perf_counter()
        caches: list[Any]
        if working:
            caches = ws.caches(list(range(batch)), agents)
        else:
            caches = agents[0] if batch == 1 else batch_views(agents)
        logits = model(x, cache=caches)[:, -1]
        token = mx.argmax(logits, axis=-1)
        mx.eval(token, [a for layers in agents for c in layers for a in cache_arrays(c)], ws.arrays())
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return times, ws.nbytes


def kv_bytes(agents: list[list[Any]]) -> int:
    return sum(a.nbytes for layers in agents for c in layers for a in cache_arrays(c))
