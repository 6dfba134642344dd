"""Timing decode steps, shared by ``benchmarks/decode.py`` and the Decode section.

A decode step reads every weight once (and each agent's cached K/V), so its time cannot
fall below ``bytes read / memory bandwidth``: ``bandwidth`` measures that bandwidth
in the same run, ``weight_bytes`` the bytes. Caches are filled with random K/V of the
right shapes (``fill``): timing does not depend on their values, and a 16K context costs
seconds to set up instead of minutes of prefill. ``step_ms`` times steps the way the
scheduler runs them (the decode working set kept across steps) or the per-step path.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from kvshelf.kv.batch import batch_views
from kvshelf.kv.coded_working_set import reads_codes
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model.head import ProjectedModel, buffer_view
from kvshelf.model.sgemv import system_sgemv
from kvshelf.model.skinny import skinny_product
from kvshelf.model.spec import ModelCacheSpec
from kvshelf.runtime.sampling import Sampler

FILL_CHUNK = 1024
GREEDY = Sampler()  # the scheduler's choice at temperature 0


def weight_bytes(model: nn.Module) -> int:
    params = tree_flatten(model.parameters())
    assert isinstance(params, list)  # (name, array) pairs: a dict comes back only for a dict destination
    return sum(v.nbytes for _, v in params)


# A buffer well above any last-level cache (this machine's L3: 32 MiB), so every pass
# reads DRAM; and enough passes, spread over the whole measurement, that a burst of
# other work on the machine spoils a few passes of each reading, not all of one.
STREAM_MB = 1024
REPEATS = 15

FLOOR_METHOD = (
    "Read bandwidth measured in the same run, five ways: (1) numpy sum and (2) MLX sum of a "
    "STREAM_MB float32 buffer (well above the LLC); (3) one cblas_sgemv (the OpenBLAS MLX uses, "
    "with its threads) of every 2-D weight of the model with a vector, i.e. the step's own read "
    "pattern over the weights' own bytes, (4) a numpy sum over the same weights, and (5) "
    "kvshelf's own one-row product (kvshelf.model.skinny, on every core) over them. Each is "
    "warmed by one untimed pass, then REPEATS passes are timed, interleaved round-robin with "
    "the other readings' so each spans the whole measurement; best, median and worst are "
    "reported. The floor uses the highest best pass of the five (what the machine was seen "
    "to do, so the floor errs low): floor_ms = weight bytes / that bandwidth."
)


def _stats(nbytes: int, seconds: list[float]) -> dict[str, float]:
    return {
        "best_gbs": round(nbytes / min(seconds) / 1e9, 2),
        "median_gbs": round(nbytes / statistics.median(seconds) / 1e9, 2),
        "worst_gbs": round(nbytes / max(seconds) / 1e9, 2),
    }


def _timed_ms(fn: Callable[[], Any]) -> Callable[[], float]:
    def timed() -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return timed


def _interleaved(reads: dict[str, tuple[int, Callable[[], Any]]], repeats: int) -> dict[str, dict[str, float]]:
    """Every read warmed once (first touch of the pages, MLX's kernel build), then
    ``repeats`` rounds of one timed pass of each."""
    ms = interleaved_ms([_timed_ms(fn) for _, fn in reads.values()], repeats, warmup=1)
    return {name: _stats(nbytes, [t / 1e3 for t in times]) for (name, (nbytes, _)), times in zip(reads.items(), ms)}


def bandwidth(model: nn.Module | None = None, megabytes: int = STREAM_MB, repeats: int = REPEATS) -> dict[str, Any]:
    """The read bandwidth a decode step's floor is measured against (``FLOOR_METHOD``).

    ``gbs`` is the bandwidth the floor uses; every reading is kept beside it, with its
    best, median and worst pass, so a run says how steady the machine was."""
    a = mx.random.uniform(shape=(megabytes * 2**20 // 4,))
    mx.eval(a)
    b = np.array(a)  # numpy's own copy: the two reads do not share pages
    reads: dict[str, tuple[int, Callable[[], Any]]] = {
        "stream_numpy_sum": (b.nbytes, lambda: float(b.sum())),
        "stream_mlx_sum": (b.nbytes, lambda: mx.eval(mx.sum(a))),
    }
    out: dict[str, Any] = {"method": FLOOR_METHOD, "stream_mb": megabytes, "repeats": repeats}
    if model is not None:
        weights = WeightsRead(model)
        views, wbytes = weights.views, weights.nbytes
        out["weights_read_mb"] = round(wbytes / 1e6, 1)
        sgemv = system_sgemv()
        if sgemv is not None:
            vecs = [np.ones(v.shape[1], dtype=np.float32) for v in views]
            reads["weights_sgemv"] = (wbytes, lambda: [sgemv(w, x) for w, x in zip(views, vecs)])
        reads["weights_numpy_sum"] = (wbytes, lambda: [float(v.sum()) for v in views])
        # the batch-1 step's own kernel on both cores: numpy's sum reads on one thread only,
        # so without this the floor could lie above what the step itself was seen to read
        if weights.row is not None:
            reads["weights_skinny_row"] = (wbytes, weights.step)
    readings = _interleaved(reads, repeats)
    chosen = max(readings, key=lambda k: readings[k]["best_gbs"])
    out.update(readings=readings, chosen=chosen, gbs=readings[chosen]["best_gbs"])
    return out


def describe_bandwidth(bw: dict[str, Any]) -> str:
    parts = [f"{k} {v['median_gbs']:.2f} (best {v['best_gbs']:.2f})" for k, v in bw["readings"].items()]
    return f"bandwidth GB/s, median of {bw['repeats']}: " + ", ".join(parts) + f"; floor: best {bw['chosen']}"


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
    """Every array one layer cache holds (its blocks, open tail and sinks; mlx-lm's own
    cache, its K/V), to evaluate or count. A kvshelf cache says (``arrays``) without
    writing the tokens a decode step staged, as the scheduler's evaluation does."""
    if hasattr(c, "arrays"):
        mine: list[mx.array] = c.arrays()
        return mine
    out: list[mx.array] = []
    for name in ("keys", "values"):
        x = getattr(c, name, None)
        if isinstance(x, tuple):
            out.extend(x)
        elif isinstance(x, mx.array):
            out.append(x)
    return out


class Stepper:
    """Decode steps of these agents together (one token each), one ``step`` at a time: the
    scheduler's path (``working``: the decode working set kept across steps) or the
    per-step one. Several steppers can take turns (``interleaved_ms``)."""

    def __init__(
        self, model: nn.Module | ProjectedModel, agents: list[list[Any]], working: bool = False, peer: bool = False
    ):
        self.model, self.agents, self.working = model, agents, working
        # kvshelf's scheduler chooses each agent's token from the evaluated step's numpy rows
        # (``kvshelf.runtime.sampling``); mlx-lm (``peer``) takes MLX's argmax
        self.peer = peer
        self.ws = WorkingSets()
        self._x = mx.array([[1]] * len(agents))

    def step(self) -> float:
        """One step, in ms."""
        t = time.perf_counter()
        caches: list[Any]
        if self.working:
            in_codes = reads_codes(self.model, len(self.agents))  # as the scheduler asks
            caches = self.ws.caches(list(range(len(self.agents))), self.agents, in_codes=in_codes)
        else:
            caches = self.agents[0] if len(self.agents) == 1 else batch_views(self.agents)
        logits = self.model(self._x, cache=caches)[:, -1]
        state = [a for layers in self.agents for c in layers for a in cache_arrays(c)], self.ws.arrays()
        if self.peer:
            mx.eval(mx.argmax(logits, axis=-1), *state)
        else:
            mx.eval(logits, *state)
            rows = np.asarray(logits)
            for row in rows:
                GREEDY(row)
        return (time.perf_counter() - t) * 1e3


def step_ms(
    model: nn.Module | ProjectedModel,
    agents: list[list[Any]],
    steps: int,
    warmup: int,
    working: bool = False,
    peer: bool = False,
) -> tuple[list[float], int]:
    """Milliseconds per decode step for these agents decoding together (one token each),
    and the working set's bytes (``working``: the scheduler's path; else per-step)."""
    stepper = Stepper(model, agents, working, peer=peer)
    times = [stepper.step() for _ in range(warmup + steps)][warmup:]
    return times, stepper.ws.nbytes


class WeightsRead:
    """The floor's own read as a step: one pass of kvshelf's one-row product (``row``, on
    every core) over every 2-D weight of ``model`` (``views``; numpy's sum without numba),
    ``nbytes`` read."""

    def __init__(self, model: nn.Module):
        params = tree_flatten(model.parameters())
        assert isinstance(params, list)
        self.views = [buffer_view(v) for _, v in params if v.ndim == 2 and v.dtype == mx.float32]
        self._rows = [np.ones((1, v.shape[1]), dtype=np.float32) for v in self.views]
        self.row = skinny_product()
        self.nbytes = sum(v.nbytes for v in self.views)

    def step(self) -> float:
        t = time.perf_counter()
        for w, x in zip(self.views, self._rows):
            if self.row is not None:
                self.row(x, w)
            else:
                float(w.sum())
        return (time.perf_counter() - t) * 1e3


def interleaved_ms(steps: Sequence[Callable[[], float]], rounds: int, warmup: int) -> list[list[float]]:
    """Each step's times in ms (a step returns its own), taken in rounds of one call each
    (after ``warmup`` rounds), so that the machine's drift over the run (its bandwidth here
    moved by a third within minutes) weighs on every step alike and their ratios hold."""
    times: list[list[float]] = [[] for _ in steps]
    for r in range(warmup + rounds):
        for step, mine in zip(steps, times):
            t = step()
            if r >= warmup:
                mine.append(t)
    return times


def kv_bytes(agents: list[list[Any]]) -> int:
    return sum(a.nbytes for layers in agents for c in layers for a in cache_arrays(c))
