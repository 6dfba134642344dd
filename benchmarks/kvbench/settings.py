"""What each mode measures: ``--quick`` (a smoke run, < 15 min on 2 cores), the
default, and ``--full`` (adds 32K prompts and more samples).

Every field can be overridden with ``--set name=value`` (lists comma-separated), which
is how the test runs the whole bench on a tiny model in seconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

SECTIONS = (
    "ttft",
    "capacity",
    "quality",
    "decode",
    "invariance",
    "phases",
    "routing",
    "peer",
    "store",
    "structured",
    "cluster",
)


@dataclass(frozen=True)
class Settings:
    mode: str = "default"
    sections: tuple[str, ...] = SECTIONS
    # TTFT: cold prefill runs per size (each a fresh agent); warm and hot samples per agent
    ttft_sizes: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    ttft_cold_runs: int = 2
    ttft_cold_runs_large: int = 1  # for sizes above 4096 (a cold 16K prompt is minutes of CPU)
    ttft_repeats: int = 3
    # Capacity: agents resident under one byte budget, Q4 vs fp16
    capacity_sizes: tuple[int, ...] = (4096, 8192, 16384)
    capacity_budget: int = 1 << 30
    capacity_max_agents: int = 2000
    # Quality: perplexity over one text window per text, every layer coded
    ppl_tokens: int = 4096
    ppl_schemes: tuple[str, ...] = ("q4-g64-per-token-v1", "q4-g64-kivi-rotv", "q8-g64")
    ppl_texts: tuple[str, ...] = ("gpl3", "pydoc")
    # Routing: expert agents primed with one document each, then a stream of questions
    routing_experts: int = 10
    routing_doc_tokens: int = 1536
    routing_questions: int = 20  # after the priming question to each expert
    routing_max_tokens: int = 16
    routing_resident_experts: float = 3.5  # the RAM budget, in experts
    # Decode (kvbench.decode_section): ms per step at these contexts and batch sizes
    decode_contexts: tuple[int, ...] = (1024, 4096, 16384)
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_steps: int = 5
    decode_warmup: int = 2
    decode_stream_mb: int = 1024  # the floor's streamed buffer (kvbench.decode_steps.FLOOR_METHOD)
    # Invariance (kvbench.invariance): conversations through every cache path (issue 21: 50 of 300-3000)
    invariance_conversations: int = 10
    invariance_min_tokens: int = 300
    invariance_max_tokens: int = 3000
    invariance_generate: int = 64
    # A finished ``benchmarks/invariance.py`` run directory: the section reports its pooled
    # conversations instead of measuring (the 50-conversation run takes hours)
    invariance_results: str = ""
    # Phases (kvbench.phases): generated tokens per turn, 0 = the scenario's own default
    phases_max_tokens: int = 0
    # Against the peer (mlx_lm.server) over HTTP
    peer_agents: int = 10
    peer_doc_tokens: int = 1536
    peer_rounds_before: int = 1  # rounds after the priming round, before the restart
    peer_rounds_after: int = 1
    peer_max_tokens: int = 8
    peer_budget_fraction: float = 0.4  # kvshelf's budget, as a share of the agents' total Q4 bytes
    peer_startup_timeout_s: float = 300.0
    # a vllm-mlx executable to run as a second peer ("" = not run; default $KVSHELF_BENCH_VLLM_MLX)
    peer_vllm_mlx: str = field(default_factory=lambda: os.environ.get("KVSHELF_BENCH_VLLM_MLX", ""))
    # Store scale (issue 22): other agents' files in the store, a tiny model's durable turns
    store_sizes: tuple[int, ...] = (0, 1000, 10000, 100000)
    store_repeats: int = 15
    # Structured output: N tool and N JSON schemas, their sizes spread over 1..20 fields (or the
    # sizes given), constrained vs unconstrained; a reply of k fields may take base + k * per_field tokens
    structured_schemas: int = 20
    structured_fields: tuple[int, ...] = ()
    structured_kinds: tuple[str, ...] = ("tool", "json")
    structured_modes: tuple[str, ...] = ("free", "constrained")  # one alone: a run split in two
    structured_max_tokens: int = 64
    structured_tokens_per_field: int = 32
    structured_cases: tuple[str, ...] = ()  # e.g. ("tool:1-18",): a part of the full run (overrides the above)
    structured_reference_tokens: int = 64  # the unconstrained step: a free decode of this many tokens per kind
    structured_deadline_s: float = 0.0  # start no case after this many seconds (0: no limit)
    seed: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


QUICK = Settings(
    mode="quick",
    ttft_sizes=(1024, 2048, 4096),
    ttft_cold_runs=1,
    ttft_repeats=3,
    capacity_sizes=(1024, 2048, 4096),
    capacity_budget=256 << 20,
    ppl_tokens=1024,
    ppl_schemes=("q4-g64-per-token-v1", "q4-g64-kivi-rotv"),
    decode_contexts=(1024,),
    decode_steps=3,
    invariance_conversations=2,
    invariance_max_tokens=1000,
    invariance_generate=32,
    routing_doc_tokens=512,
    routing_questions=10,
    peer_doc_tokens=512,
    phases_max_tokens=8,
    store_sizes=(0, 1000, 10000),
    structured_schemas=4,
)

FULL = Settings(
    mode="full",
    ttft_sizes=(1024, 2048, 4096, 8192, 16384, 32000),
    ttft_cold_runs=3,
    ttft_cold_runs_large=2,
    ppl_schemes=("q4-g64-per-token-v1", "q4-g64-kivi-rotv", "q4-g64-rot", "q4-g64-kivi", "q8-g64"),
    routing_questions=40,
    invariance_conversations=50,
    peer_rounds_before=2,
    peer_rounds_after=2,
)

MODES = {"quick": QUICK, "default": Settings(), "full": FULL}


def _coerce(current: object, text: str) -> object:
    if isinstance(current, tuple):
        items = [x for x in text.split(",") if x]
        kinds = {type(x) for x in current}
        kind = kinds.pop() if len(kinds) == 1 else str
        return tuple(kind(x) for x in items)
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, int):
        return int(float(text))
    if isinstance(current, float):
        return float(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def with_overrides(base: Settings, pairs: list[str]) -> Settings:
    """Apply ``name=value`` overrides; an unknown name is an error, not a silent no-op."""
    names = {f.name: f for f in fields(base)}
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in names:
            raise ValueError(f"--set wants name=value with a known name; got {pair!r} (known: {', '.join(names)})")
        changes[name] = _coerce(getattr(base, name), value)
    unknown = set(changes.get("sections", ())) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    return replace(base, **changes)
