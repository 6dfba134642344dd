"""Decode speed: ms per generated token against the machine's memory-bandwidth floor.

One decode step reads every weight once (and each agent's cached K/V), so its time
cannot fall below ``bytes read / memory bandwidth``. This script measures, in one run
and side by side, for each model and context length:

- kvshelf's step with the default KV scheme and with plain per-token Q4, at batch
  1, 2, 4 and 8: the scheduler's own path (the decode working set,
  ``kvshelf.kv.working_set``, kept across steps; the head at batch 1 through sgemv,
  ``kvshelf.model.gemv``), beside it (``--paths blis``) the same with a batch's rows
  through BLIS (off by default, ``kvshelf.model.few_rows``), and (``--paths per-step``)
  the per-step path it replaced ("per-step": the model's own call on the agents' layer
  caches, one ``BatchLayerView`` per layer when several agents decode together), and
  (``--paths pipeline``) the scheduler's path with the working set's pipelining
  (``kvshelf.kv.working_set.PIPELINE``, off by default), and (``--paths fp32-rows``) the
  scheduler's path with the default scheme's layers kept as fp32 rows, as before
  2026-12-08, instead of in codes that attention reads in place
  (``kvshelf.kv.coded_working_set.CODED`` off), and (``--paths greedy``) what a
  temperature-0 request runs, ``LoadedModel.greedy_forward``'s shape-invariant kernels
  (their native step, ``kvshelf.model.exact_ops``; ``--paths greedy-module``: their layers
  through MLX's graph, as before it), and
  (``--paths mlx-sdpa``) the scheduler's path with decode attention through MLX's own
  ``scaled_dot_product_attention`` (one product per query head) instead of
  ``kvshelf.model.grouped_attention`` (one per KV head), and (``--paths no-skinny``) the
  scheduler's path, and with ``greedy`` the temperature-0 one, without
  ``kvshelf.model.skinny``'s few-row products (MLX's matmuls, the head one sgemv per row),
  and (``--paths no-blocks``) the scheduler's path with those products row-invariant
  (``skinny_product``) instead of in register blocks (``blocked_product``), and
  (``--paths no-prefetch``) with those blocks not asking for their weight ahead
  (``KVSHELF_NO_PREFETCH``, as before ``skinny.PREFETCH_ROWS``), and
  (``--paths no-native``) the scheduler's path with its layers through MLX's graph (the
  module path) instead of ``kvshelf.model.native_decode``'s numpy step, and
  (``--paths no-defer``) the native step with the working set updated inside each layer
  (an MLX evaluation per layer) instead of once after the last (``defer_updates``), and
  (``--paths fp32-weights``) the scheduler's path reading every weight as fp32 instead of
  as its fp16 or bf16 codes where those hold it (``kvshelf.model.half_weights``), and
  (``--paths q4-packed``) plain Q4 decoding on its packed rows through
  ``quantized_matmul`` (``kvshelf.kv.blocks.PACKED_DECODE``: a GPU's path) beside ``q4``,
  which on the CPU decodes on dense rows;
- mlx-lm's own step on the same model with its fp32 ``KVCache``/``RotatingKVCache``
  (batch 1: what ``mlx_lm.generate`` runs);
- the floor: the model's weight bytes (and weights + K/V bytes) divided by the memory
  bandwidth measured in the same run (``kvbench.decode_steps.FLOOR_METHOD``: a 1 GiB
  buffer and the weights' own bytes through sgemv, the best of 15 interleaved passes;
  the method is written into the JSON). ``--floor-only N`` measures only the floor, N
  times, to show that it repeats.

Every path and batch of one context takes its steps in rounds, one step each in turn,
with one pass of the floor's own read (``floor_ms_in_rounds``, its best pass): this
machine's bandwidth moved by a third within minutes, and steps timed one configuration
after another put that drift into their ratios.

Caches are filled with random K/V of the right shapes (timing does not depend on their
values), so a 16K context costs seconds to set up instead of minutes of prefill.
Models: the embedded Gemma 3 270M, and a llama-family model of SmolLM2-135M's shape
(30 thin layers, GQA) with random weights, built in memory: fp32 values (``llama30``), or
the same rounded to bf16 (``llama30-bf16``), as a published bf16 checkpoint loads; and a
DeepSeek-V2 model with DeepSeek-V2-Lite's latent attention and vocabulary in 12 dense layers
(``deepseek12``, ``deepseek12-bf16``), random too: the three cache geometries kvshelf supports.

    python benchmarks/decode.py [--quick] [--models embedded,llama30] [--contexts 1024,4096,16384]
        [--batches 1,2,4,8] [--paths mlx-lm,default,q4,per-step]

Each invocation should stay within a few minutes: select a subset with the flags.

Run it alone on the machine (``flock -x`` on the agreed lock file): other work on the
CPU makes every figure here meaningless.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
from collections.abc import Sequence
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from common import RESULTS, write_json
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes

from kvbench.decode_steps import (
    FLOOR_METHOD,
    Stepper,
    WeightsRead,
    bandwidth,
    describe_bandwidth,
    fill,
    interleaved_ms,
    kv_bytes,
    weight_bytes,
)
from kvshelf.kv import blocks, coded_working_set, working_set
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.schemes import DEFAULT_SCHEME, SCHEMES
from kvshelf.model import few_rows, half_weights, skinny
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.head import ProjectedModel, with_fast_head
from kvshelf.model.huge_pages import THREAD_NAME as HUGE_PAGES_THREAD
from kvshelf.model.huge_pages import collapse, weights_of
from kvshelf.model.loader import load, materialize
from kvshelf.model.spec import ModelCacheSpec

# SmolLM2-135M's shape: the "llama-family model with 30 thin layers" of issue 14.
LLAMA30 = dict(
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=100000.0,
)

# DeepSeek-V2-Lite's attention (multi-head latent attention: a 512-wide KV latent, heads of
# 128 + 64 query/key and 128 value floats, no query latent) and vocabulary, in 12 dense layers
# of 1024 with 8 heads: about 0.36 B parameters, the third cache geometry kvshelf supports
# (per-head keys and values of different widths, many heads, no sharing between them).
DEEPSEEK12 = dict(
    model_type="deepseek_v2",
    hidden_size=1024,
    num_hidden_layers=12,
    intermediate_size=2816,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=102400,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 32768},
)
RANDOM_MODELS = {"llama30": LLAMA30, "deepseek12": DEEPSEEK12}


def build_model(name: str, huge_pages: bool = True) -> nn.Module:
    """The model, its weights in huge pages as the engine's load leaves them
    (``kvshelf.model.huge_pages``), or with ``huge_pages=False`` in the allocator's pages."""
    if name == "embedded":
        if huge_pages:
            model = load("embedded", progress=False).model
            for thread in threading.enumerate():  # the load's background collapse: done before timing
                if thread.name == HUGE_PAGES_THREAD:
                    thread.join()
            return model
        os.environ["KVSHELF_NO_HUGE_PAGES"] = "1"
        try:
            return load("embedded", progress=False).model
        finally:
            del os.environ["KVSHELF_NO_HUGE_PAGES"]
    config = RANDOM_MODELS.get(name.removesuffix("-bf16"))
    if config is not None:
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
        mx.random.seed(0)
        # ...-bf16: the same weights rounded to bf16, as a published checkpoint (SmolLM2's is
        # bf16) loads for the CPU (fp32 arrays of bf16 values), which the products read as bf16 codes
        kind = mx.bfloat16 if name.endswith("-bf16") else mx.float32
        model.update(
            tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(kind).astype(mx.float32), model.parameters())
        )
        materialize(model)
        if huge_pages:
            collapse(weights_of(model))
        return model
    known = ", ".join(f"{m}, {m}-bf16" for m in RANDOM_MODELS)
    raise ValueError(f"unknown model {name!r}; known: embedded, {known}")


# "blis" (or "no-blis"): the engine with the other setting of BLIS for a batch's rows beside it
PATHS = (
    "mlx-lm",
    "default",
    "q4",
    "blis",
    "no-blis",
    "per-step",
    "head-only",
    "one-row-sgemv",
    "pipeline",
    "fp32-rows",
    "greedy",
    "greedy-module",
    "mlx-sdpa",
    "no-skinny",
    "no-blocks",
    "no-prefetch",
    "no-native",
    "no-defer",
    "fp32-weights",
    "q4-packed",
)


def with_switch(model: nn.Module, switch: str) -> nn.Module | ProjectedModel:
    """The engine's forward built with the environment switch ``switch`` on (the products are
    taken at build time), so both forms run in one process: ``KVSHELF_NO_ROW_BLOCKS`` (every
    few-row product row-invariant, one row per loop, instead of ``blocked_product``'s register
    blocks), ``KVSHELF_NO_PREFETCH`` (the blocks without asking for their weight ahead) or
    ``KVSHELF_NO_HALF_WEIGHTS`` (every weight read as fp32, not as its 16-bit codes)."""
    os.environ[switch] = "1"
    skinny.blocked_product.cache_clear()
    try:
        return with_fast_linears(model)
    finally:
        del os.environ[switch]
        skinny.blocked_product.cache_clear()


def read_bytes(model: nn.Module) -> int:
    """The weight bytes a default decode step reads: each weight once, as fp16 or bf16 codes where
    those hold it (``kvshelf.model.half_weights``: every 2-D weight of the embedded Gemma 3 and of
    ``llama30-bf16``, none of ``llama30``'s random fp32 ones), else as fp32."""
    params = tree_flatten(model.parameters())
    assert isinstance(params, list)
    return sum(code_bytes(v) for _, v in params)


def code_bytes(weight: mx.array) -> int:
    """The bytes a default decode step reads ``weight`` as: its 16-bit codes where they hold it, else fp32."""
    return weight.nbytes // 2 if weight.ndim == 2 and half_weights.half_of(weight) is not None else weight.nbytes


def engine_forward(model: nn.Module, blis: bool | None = None) -> nn.Module | ProjectedModel:
    """What the engine runs (``with_fast_linears``); ``blis``: a decode batch's rows through
    BLIS or not (None: the engine's default, ``kvshelf.model.few_rows``), so both are timed
    in one run."""
    return with_fast_linears(model, batches=blis)


def run(
    models: list[str], contexts: list[int], batches: list[int], steps: int, warmup: int, paths: Sequence[str] = PATHS
) -> dict:
    load_start = list(os.getloadavg())
    rows = []
    floors: dict[str, dict[str, Any]] = {}
    for name in models:
        model = build_model(name)
        bw = bandwidth(model)
        gbs = bw["gbs"]
        print(f"{name}: {describe_bandwidth(bw)}")
        spec = ModelCacheSpec.from_model(model)
        wbytes = weight_bytes(model)
        fast = engine_forward(model)  # what the engine runs: sgemv for the head at batch 1
        blis_default = few_rows.batches_through_blis()
        toggled = engine_forward(model, blis=not blis_default)  # the other setting of BLIS for a batch's rows
        toggled_name = "no-blis" if blis_default else "blis"
        head_only = with_fast_head(model)  # the previous engine path: only the batch-1 head through sgemv
        # batch 1's layer projections through sgemv too, and decode attention through MLX's own (per
        # query head): both in the module path, so without the native step
        one_row = with_fast_linears(model, one_row=True, native=False)
        mlx_sdpa = with_fast_linears(model, grouped=False, native=False)
        no_native = with_fast_linears(model, native=False) if "no-native" in paths else None
        no_defer = with_fast_linears(model) if "no-defer" in paths else None
        if isinstance(no_defer, ProjectedModel) and no_defer.native is not None:
            no_defer.native.defer_updates = False  # the working set updated inside each layer
        no_skinny = with_fast_linears(model, skinny=False)  # the projections as before kvshelf.model.skinny
        no_blocks = with_switch(model, "KVSHELF_NO_ROW_BLOCKS") if "no-blocks" in paths else None
        no_prefetch = with_switch(model, "KVSHELF_NO_PREFETCH") if "no-prefetch" in paths else None
        # every weight read as fp32, where the default reads fp16 codes that hold it (kvshelf.model.half_weights)
        fp32_weights = with_switch(model, "KVSHELF_NO_HALF_WEIGHTS") if "fp32-weights" in paths else None
        # what a temperature-0 request runs (LoadedModel.greedy_forward): the shape-invariant kernels
        greedy = with_fast_linears(model, all_rows=True, attention=True) if "greedy" in paths else None
        # the same kernels with the layers through MLX's graph (before temperature 0's native step)
        greedy_module = (
            with_fast_linears(model, all_rows=True, attention=True, native=False) if "greedy-module" in paths else None
        )
        greedy_no_skinny = (
            with_fast_linears(model, all_rows=True, attention=True, skinny=False)
            if "greedy" in paths and "no-skinny" in paths
            else None
        )
        floor_ms = wbytes / (gbs * 1e9) * 1e3
        read = read_bytes(model)
        floors[name] = {**bw, "weight_bytes": wbytes, "floor_ms": round(floor_ms, 1), "read_bytes": read}
        print(
            f"\n{name}: {len(spec.layers)} layers, weights {wbytes / 1e9:.3f} GB, floor {floor_ms:.1f} ms/step; "
            f"the default path reads {read / 1e9:.3f} GB of them (fp16 or bf16 codes where they hold a weight)"
        )
        for context in contexts:
            # every (path, batch) of this context takes its steps in rounds, one step each,
            # beside one pass of the floor's own read: the machine drifts over a run
            runs: list[tuple[str, int, Stepper]] = []
            if "mlx-lm" in paths:
                peer = make_prompt_cache(model)
                fill(peer, spec, context, seed=1)
                runs.append(("mlx-lm fp32 KV", 1, Stepper(model, [peer], peer=True)))
            plain = "q4" in paths or "q4-packed" in paths
            schemes = [s for p, s in ((True, DEFAULT_SCHEME), (plain, "q4-g64-per-token-v1")) if p]
            schemes = schemes if "default" in paths else schemes[1:]
            for scheme in schemes:
                agents = []
                for b in range(max(batches)):
                    cache = AgentCache.empty(spec, SCHEMES[scheme])
                    fill(cache.layers, spec, context, seed=10 + b)
                    agents.append(cache.layers)
                for batch in batches:
                    kinds: list[tuple[bool, str, Any]] = [(True, scheme, fast)]
                    if ("blis" in paths or "no-blis" in paths) and batch > 1:
                        kinds.append((True, f"{scheme} {toggled_name}", toggled))
                    if "head-only" in paths:
                        kinds.append((True, f"{scheme} head-only sgemv", head_only))
                    if "one-row-sgemv" in paths:
                        kinds.append((True, f"{scheme} one-row sgemv", one_row))
                    if "mlx-sdpa" in paths:
                        kinds.append((True, f"{scheme} mlx sdpa", mlx_sdpa))
                    if "no-skinny" in paths:
                        kinds.append((True, f"{scheme} no skinny", no_skinny))
                    if no_blocks is not None:
                        kinds.append((True, f"{scheme} no row blocks", no_blocks))
                    if no_prefetch is not None:
                        kinds.append((True, f"{scheme} no prefetch", no_prefetch))
                    if fp32_weights is not None:
                        kinds.append((True, f"{scheme} fp32 weights", fp32_weights))
                    if no_native is not None:
                        kinds.append((True, f"{scheme} no native step", no_native))
                    if no_defer is not None:
                        kinds.append((True, f"{scheme} no deferred update", no_defer))
                    if greedy is not None:
                        kinds.append((True, f"{scheme} greedy (shape-invariant)", greedy))
                    if greedy_module is not None:
                        kinds.append((True, f"{scheme} greedy module path", greedy_module))
                    if greedy_no_skinny is not None:
                        kinds.append((True, f"{scheme} greedy no skinny", greedy_no_skinny))
                    if "pipeline" in paths:
                        kinds.append((True, f"{scheme} pipeline", fast))
                    if "fp32-rows" in paths and scheme == DEFAULT_SCHEME:
                        kinds.append((True, f"{scheme} fp32 rows", fast))
                    if "q4-packed" in paths and SCHEMES[scheme].plain:
                        kinds.append((True, f"{scheme} packed", fast))
                    if "per-step" in paths:
                        kinds.append((False, f"{scheme} per-step", model))
                    for working, path, forward in kinds:
                        members = [_clone(layers) for layers in agents[:batch]]
                        switch = next((s for suffix, s in SWITCHES.items() if path.endswith(suffix)), None)
                        stepper = (
                            SwitchedStepper(switch, forward, members, working)
                            if switch is not None
                            else Stepper(forward, members, working)
                        )
                        runs.append((path, batch, stepper))
                del agents
            floor_read = WeightsRead(model)
            times = interleaved_ms([stepper.step for _, _, stepper in runs] + [floor_read.step], steps, warmup)
            floor_now = wbytes / floor_read.nbytes * min(times[-1])  # ms: the best pass of the rounds
            print(f"  {context}: the floor's read in the rounds, best pass {floor_now:.1f} ms")
            for (path, batch, stepper), t in zip(runs, times):
                row = _row(name, context, path, batch, t, floor_ms, wbytes, kv_bytes(stepper.agents), gbs)
                rows.append(
                    {
                        **row,
                        "working_set_mb": round(stepper.ws.nbytes / 1e6, 1),
                        "floor_ms_in_rounds": round(floor_now, 1),
                        "x_floor_in_rounds": round(statistics.median(t) / floor_now, 2),
                        # against the bytes the default path reads (fp16 or bf16 codes where they hold a weight)
                        "read_floor_ms_in_rounds": round(floor_now * read / wbytes, 1),
                        "x_read_floor_in_rounds": round(statistics.median(t) / (floor_now * read / wbytes), 2),
                    }
                )
            del runs
        del model
    load_end = list(os.getloadavg())
    _against_batch_1(rows)
    print(f"load average at start {load_start}, at end {load_end}")
    return {
        "floor_method": FLOOR_METHOD,
        "floors": floors,
        "steps": steps,
        "warmup": warmup,
        "load_average_at_start": load_start,
        "load_average_at_end": load_end,
        "rows": rows,
    }


# Paths whose steps run with a module-level switch set, and only theirs: the working set's
# pipelining on (``kvshelf.kv.working_set.PIPELINE``), plain Q4 decoding on its packed rows
# through ``quantized_matmul`` (``kvshelf.kv.blocks.PACKED_DECODE``: a GPU's path, and the
# CPU's before plain Q4 got the dense working set), and the default scheme's layers kept as
# fp32 rows instead of codes (``kvshelf.kv.coded_working_set.CODED`` off, as before
# 2026-12-08).
SWITCHES: dict[str, tuple[Any, str, bool]] = {
    " pipeline": (working_set, "PIPELINE", True),
    " packed": (blocks, "PACKED_DECODE", True),
    " fp32 rows": (coded_working_set, "CODED", False),
}


class SwitchedStepper(Stepper):
    """A stepper whose steps run with ``switch`` (a module, the name of its flag and the
    value to give it) set, and only its steps: the other steppers of the same rounds run
    without it."""

    def __init__(self, switch: tuple[Any, str, bool], *args: Any) -> None:
        super().__init__(*args)
        self._module, self._name, self._value = switch

    def step(self) -> float:
        default = getattr(self._module, self._name)
        setattr(self._module, self._name, self._value)
        try:
            return super().step()
        finally:
            setattr(self._module, self._name, default)


def floors_only(models: list[str], runs: int) -> dict:
    """Only the floor, ``runs`` times over (each a fresh measurement of every reading),
    to show how repeatable it is: the spread of each model's floor across the runs."""
    load_start = list(os.getloadavg())
    out: dict[str, Any] = {"floor_method": FLOOR_METHOD, "models": {}}
    for name in models:
        model = build_model(name)
        wbytes = weight_bytes(model)
        measured = []
        for i in range(runs):
            bw = bandwidth(model)
            floor_ms = round(wbytes / (bw["gbs"] * 1e9) * 1e3, 1)
            print(f"{name} run {i + 1}: floor {floor_ms} ms; {describe_bandwidth(bw)}")
            measured.append({**bw, "floor_ms": floor_ms})
        ms = [m["floor_ms"] for m in measured]
        spread = round(max(ms) / min(ms) - 1, 3)
        print(f"{name}: floors {ms} ms, spread {100 * spread:.1f}%")
        out["models"][name] = {"weight_bytes": wbytes, "runs": measured, "floor_ms": ms, "spread": spread}
        del model
    out["load_average_at_start"] = load_start
    out["load_average_at_end"] = list(os.getloadavg())
    print(f"load average at start {load_start}, at end {out['load_average_at_end']}")
    return out


def _against_batch_1(rows: list[dict]) -> None:
    """Each batched row's tokens/s as a multiple of batch 1's on the same model, context and
    scheme (issue 14's goals: >= 3x at batch 4, >= 5x at batch 8), printed and kept in the row."""
    one = {(r["model"], r["context"], r["path"]): r for r in rows if r["batch"] == 1}
    for r in rows:
        path = r["path"].removesuffix(" no-blis").removesuffix(" blis")
        base = one.get((r["model"], r["context"], path))
        if base is not None and r["batch"] > 1:
            r["x_batch_1_tokens_per_s"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
            x = r["x_batch_1_tokens_per_s"]
            print(f"  {r['model']} {r['context']} {r['path']} batch {r['batch']}: {x}x batch 1's tokens/s")


def _clone(layers: list[Any]) -> list[Any]:
    """A copy whose decode steps leave the original at its context length."""
    return [c.clone() for c in layers]


def _row(
    model: str,
    context: int,
    path: str,
    batch: int,
    times: list[float],
    floor_ms: float,
    wbytes: int,
    kvb: int,
    gbs: float,
) -> dict:
    med = statistics.median(times)
    floor_kv_ms = (wbytes + kvb) / (gbs * 1e9) * 1e3
    row = {
        "model": model,
        "context": context,
        "path": path,
        "batch": batch,
        "ms_per_step": round(med, 1),
        "ms_min": round(min(times), 1),
        "ms_max": round(max(times), 1),
        "tokens_per_s": round(batch * 1e3 / med, 2),
        "x_floor": round(med / floor_ms, 2),
        "x_floor_with_kv": round(med / floor_kv_ms, 2),
        "floor_ms": round(floor_ms, 1),
        "kv_mb": round(kvb / 1e6, 1),
    }
    print(
        f"  {context:>6d} {path:<31s} batch {batch}: {med:7.1f} ms/step  {row['tokens_per_s']:6.2f} tok/s  "
        f"{row['x_floor']:.2f}x floor ({row['x_floor_with_kv']:.2f}x with KV)"
    )
    return row


def chart(result: dict) -> None:
    from kvbench.charts import bars

    for model in sorted({r["model"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["model"] == model and r["batch"] == 1]
        contexts = sorted({r["context"] for r in rows})
        paths = sorted({r["path"] for r in rows})
        series: dict[str, Sequence[float]] = {
            p: [next((r["ms_per_step"] for r in rows if r["path"] == p and r["context"] == c), 0.0) for c in contexts]
            for p in paths
        }
        series["floor (weights / bandwidth)"] = [rows[0]["floor_ms"]] * len(contexts)
        bars(
            RESULTS / f"decode-{model}.png",
            f"Decode step at batch 1, {model}",
            "ms per token",
            [f"{c // 1024}K" for c in contexts],
            series,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1K context, batch 1 and 4, 4 steps")
    parser.add_argument("--models", default="embedded,llama30")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--paths", default="mlx-lm,default,q4,blis", help=f"any of {','.join(PATHS)}")
    parser.add_argument("--floor-only", type=int, default=0, metavar="RUNS", help="only the floor, RUNS times")
    args = parser.parse_args()
    if args.floor_only:
        print(f"wrote {write_json('decode-floor', floors_only(args.models.split(','), args.floor_only))}")
        return
    contexts = [1024] if args.quick else [int(c) for c in args.contexts.split(",")]
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    steps = 4 if args.quick else args.steps
    result = run(args.models.split(","), contexts, batches, steps, args.warmup, args.paths.split(","))
    path = write_json("decode", result)
    chart(result)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
