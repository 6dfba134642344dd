"""Structured output: replies that parse and validate, constrained vs unconstrained, and the mask's cost.

Twenty tool schemas and twenty JSON schemas of increasing complexity (1 to 20 fields:
strings, bounded integers, enums, numbers, arrays, nested objects, formats, nullable and
optional fields); a reduced run (``structured_schemas``) takes sizes spread over 1..20,
both ends included. A reply of k fields may take ``structured_max_tokens +
structured_tokens_per_field * k`` tokens (digits are one token each in Gemma's
vocabulary: a 20-field record takes ~600), so a constrained reply ends by its grammar;
one that is cut anyway is counted invalid and shown (``constrained_cut_by_max_tokens``).
Each is asked once with constrained decoding (kvshelf's default) and once without it
(``plan_output(constrained=False)``: the schema in the prompt, the reply opened and cut
where its brackets close), greedy, on the same agent, in one run.

- valid: a tool reply is valid when it holds a call of the tool whose arguments validate
  against the tool's schema; a JSON reply when it parses and validates against its schema
  (the schema as declared, with ``jsonschema``).
- ms/token: the decode time per generated token (total minus time to first token, over the
  tokens after the first), constrained and unconstrained, medians over the schemas.
- the mask, replayed over every constrained reply's own tokens: computing it
  (llguidance, on the scheduler's side thread, overlapped with the model's step) and
  applying it to one row of logits (on the step's critical path), per token.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np

from kvbench.charts import bars
from kvbench.context import BenchContext

TITLE = "Structured output: valid replies constrained vs unconstrained, and the mask's cost per token"

STR = {"type": "string", "maxLength": 40}
FIELDS: list[tuple[str, dict[str, Any], bool]] = [  # name, schema, required
    ("name", STR, True),
    ("age", {"type": "integer", "minimum": 0, "maximum": 120}, True),
    ("active", {"type": "boolean"}, True),
    ("unit", {"enum": ["celsius", "fahrenheit"]}, True),
    ("score", {"type": "number"}, True),
    ("tags", {"type": "array", "items": STR, "maxItems": 3}, True),
    (
        "address",
        {"type": "object", "properties": {"street": STR, "city": STR}, "required": ["street", "city"]},
        True,
    ),
    ("email", {"type": "string", "format": "email"}, True),
    ("priority", {"enum": ["low", "medium", "high"]}, True),
    ("count", {"type": "integer", "minimum": 1, "maximum": 1000}, True),
    ("ratio", {"type": "number", "minimum": 0, "maximum": 1}, True),
    ("date", {"type": "string", "format": "date"}, True),
    (
        "items",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "label": STR},
                "required": ["id", "label"],
            },
            "maxItems": 3,
        },
        True,
    ),
    ("notes", STR, False),
    ("status", {"type": ["string", "null"], "maxLength": 20}, True),
    (
        "coordinates",
        {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        True,
    ),
    (
        "ids",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
        True,
    ),
    (
        "meta",
        {
            "type": "object",
            "properties": {"source": STR, "version": {"type": "integer", "minimum": 0}},
            "required": ["source"],
        },
        True,
    ),
    ("language", {"type": "string", "pattern": "^[a-z]{2}$"}, True),
    (
        "flags",
        {
            "type": "object",
            "properties": {"urgent": {"type": "boolean"}, "private": {"type": "boolean"}},
            "required": ["urgent"],
        },
        True,
    ),
]
SUBJECTS = [
    "a customer called Ada Lovelace, 36, in London",
    "a weather station in Oslo",
    "a book order of three novels",
]


def schema_of(fields: list[tuple[str, dict[str, Any], bool]]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: s for name, s, _ in fields},
        "required": [name for name, _, req in fields if req],
    }


def sizes(n: int, largest: int = len(FIELDS)) -> list[int]:
    """``n`` schema sizes spread evenly over 1..``largest`` fields, both ends included
    (a reduced run still covers the simplest and the most complex schema)."""
    if n >= largest:
        return list(range(1, largest + 1))
    if n <= 1:
        return [largest][:n]
    return sorted({round(1 + i * (largest - 1) / (n - 1)) for i in range(n)})


def json_cases(fields: list[int]) -> list[dict[str, Any]]:
    return [
        {"kind": "json", "fields": k, "schema": schema_of(FIELDS[:k]), "subject": SUBJECTS[k % len(SUBJECTS)]}
        for k in fields
    ]


def tool_cases(fields: list[int]) -> list[dict[str, Any]]:
    """Tool k takes the last k fields, so tools and JSON schemas differ at every size."""
    return [
        {"kind": "tool", "fields": k, "schema": schema_of(FIELDS[len(FIELDS) - k :]), "subject": SUBJECTS[k % 3]}
        for k in fields
    ]


def _ask(case: dict[str, Any], constrained: bool) -> dict[str, Any]:
    """The engine keywords and messages of one case."""
    if case["kind"] == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": f"record_{case['fields']}", "schema": case["schema"]}}
        text = f"Describe {case['subject']} as a JSON record."
        return {"messages": [{"role": "user", "content": text}], "response_format": fmt}
    name = f"store_record_{case['fields']}"
    tool = {
        "type": "function",
        "function": {"name": name, "description": "Store one record.", "parameters": case["schema"]},
    }
    text = f"Store a record of {case['subject']} with the {name} tool."
    return {
        "messages": [{"role": "user", "content": text}],
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one record, one call
    }


def _valid(case: dict[str, Any], text: str, calls: list[Any]) -> bool:
    try:
        if case["kind"] == "json":
            jsonschema.validate(json.loads(text), case["schema"])
        else:
            if not calls:
                return False
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), case["schema"])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _ms_per_token(result: Any) -> float | None:
    n = result.usage.completion_tokens
    return (result.total_s - result.ttft_s) * 1000 / (n - 1) if n > 1 else None


def _replay_mask(engine: Any, grammar: Any, tokens: list[int], width: int) -> tuple[list[float], list[float]]:
    """(compute ms, apply ms) per token of a constrained reply, replayed on a fresh matcher."""
    vocab = engine.vocabulary
    matcher = llguidance.LLMatcher(vocab.llg, grammar.source, log_level=0)
    if grammar.opening:
        matcher.consume_tokens(vocab.encode(grammar.opening))
    logits = mx.random.normal((width,))
    mx.eval(logits)
    computed, applied = [], []
    for token in tokens:
        t0 = time.perf_counter()
        bits = matcher.compute_bitmask()
        t1 = time.perf_counter()
        allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:width].astype(bool)
        masked = mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
        mx.eval(masked)
        t2 = time.perf_counter()
        computed.append((t1 - t0) * 1000)
        applied.append((t2 - t1) * 1000)
        if not matcher.consume_token(token) or matcher.is_stopped():
            break
    return computed, applied


def run(ctx: BenchContext) -> dict:
    from kvshelf.structured.plan import plan_output

    s = ctx.settings
    engine = ctx.get_engine()
    fields = [int(k) for k in s.structured_fields] or sizes(s.structured_schemas)  # --set gives strings
    cases = (tool_cases(fields) if "tool" in s.structured_kinds else []) + (
        json_cases(fields) if "json" in s.structured_kinds else []
    )
    width = engine.vocabulary.llg.vocab_size
    rows = []
    for i, case in enumerate(cases):
        ask = _ask(case, True)
        messages = ask.pop("messages")
        row: dict[str, Any] = {
            "kind": case["kind"],
            "fields": case["fields"],
            "max_tokens": s.structured_max_tokens + s.structured_tokens_per_field * case["fields"],
        }
        for constrained in (False, True):
            if ("constrained" if constrained else "free") not in s.structured_modes:
                continue  # a run split by mode (validity is the same either way: greedy, one agent per case)
            plan = plan_output(
                ask.get("tools"),
                ask.get("tool_choice"),
                ask.get("parallel_tool_calls", True),
                ask.get("response_format"),
                constrained=constrained,
            )
            r = engine.chat(
                f"structured-{i}",
                plan.messages(messages),
                max_tokens=row["max_tokens"],
                grammar=plan.grammar,
                until=plan.until(),
            )
            content, calls = plan.parse(r.text)
            key = "constrained" if constrained else "free"
            row[f"{key}_valid"] = _valid(case, content, calls)
            row[f"{key}_tokens"] = r.usage.completion_tokens
            row[f"{key}_ms_per_token"] = _ms_per_token(r)
            row[f"{key}_finish"] = "tool_calls" if calls else r.finish_reason
            if constrained:
                assert plan.grammar is not None
                computed, applied = _replay_mask(engine, plan.grammar, r.token_ids, width)
                row["mask_compute_ms"] = statistics.median(computed) if computed else None
                row["mask_compute_max_ms"] = max(computed) if computed else None
                row["mask_apply_ms"] = statistics.median(applied) if applied else None
                row["reply"] = content if case["kind"] == "json" else [c.to_openai() for c in calls]
            else:
                row["free_reply"] = (plan.opening + r.text)[:300]
        print(_line(row), flush=True)
        rows.append(row)
        with open(ctx.out_dir / "structured-rows.jsonl", "a") as log:  # a run cut short keeps its rows
            log.write(json.dumps(row, default=str) + "\n")
    summary = _summary(rows)
    return {
        "title": TITLE,
        "model": engine.loaded.name,
        "table": [
            {k: v for k, v in r.items() if k not in ("reply", "free_reply", "mask_compute_max_ms")} for r in rows
        ],
        "rows": rows,
        "summary": summary,
        "extra_tables": {"Summary": summary},
        "description": (
            f"Model {engine.loaded.name}, greedy, at most {s.structured_max_tokens} + "
            f"{s.structured_tokens_per_field} x fields tokens per reply. {len(fields)} tool schemas (tool_choice "
            f"required, parallel_tool_calls false) and {len(fields)} JSON schemas (response_format json_schema) "
            f"of {', '.join(map(str, fields))} fields"
            f"{'' if len(fields) == len(FIELDS) else f' (a reduced run: {len(fields)} of the {len(FIELDS)} sizes)'}, "
            "asked unconstrained (schema in the prompt, reply "
            "opened and cut where it closes) and constrained (llguidance's token mask), one after the other on "
            "the same agent. ms/token: decode time over the tokens after the first. Mask compute: llguidance's "
            "mask for each token of the constrained reply, replayed on a fresh matcher (in the engine this runs "
            "on a side thread during the model's step); mask apply: unpacking it and masking one row of logits, "
            "which is on the step's critical path."
        ),
    }


def _line(row: dict[str, Any]) -> str:
    """One case's figures as printed during the run (a mode left out shows as -)."""
    text = f"  structured {row['kind']:4s} {row['fields']:2d} fields:"
    for key in ("free", "constrained"):
        if f"{key}_valid" in row:
            text += (
                f" {key} valid {row[f'{key}_valid']!s:5s} ({row[f'{key}_tokens']}/{row['max_tokens']} tokens, "
                f"{row[f'{key}_finish']}, {row[f'{key}_ms_per_token'] or 0:.1f} ms/token)"
            )
        else:
            text += f" {key} -"
    if "mask_apply_ms" in row:
        text += f", mask {row['mask_compute_ms'] or 0:.2f} + {row['mask_apply_ms'] or 0:.2f} ms"
    return text


def _share(rows: list[dict[str, Any]], key: str) -> float | None:
    sel = [r[key] for r in rows if key in r]
    return sum(sel) / len(sel) if sel else None


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for kind in ("tool", "json", "all"):
        sel = [r for r in rows if kind == "all" or r["kind"] == kind]
        if not sel:
            continue
        free_ms = _median([r.get("free_ms_per_token") for r in sel])
        cons_ms = _median([r.get("constrained_ms_per_token") for r in sel])
        apply_ms = _median([r.get("mask_apply_ms") for r in sel])
        out.append(
            {
                "schemas": f"{kind} ({len(sel)})",
                "valid_free": _share(sel, "free_valid"),
                "valid_constrained": _share(sel, "constrained_valid"),
                "constrained_cut_by_max_tokens": sum(r.get("constrained_finish") == "length" for r in sel),
                "free_ms_per_token": free_ms,
                "constrained_ms_per_token": cons_ms,
                "constrained_over_free": cons_ms / free_ms if cons_ms and free_ms else None,
                "mask_compute_ms": _median([r.get("mask_compute_ms") for r in sel]),
                "mask_compute_max_ms": max((r.get("mask_compute_max_ms") or 0) for r in sel),
                "mask_apply_ms": apply_ms,
                "apply_share_of_step": apply_ms / free_ms if apply_ms and free_ms else None,
            }
        )
    return out


def chart(result: dict, path: Path) -> Path | None:
    summary = [r for r in result.get("summary", []) if not r["schemas"].startswith("all")]
    if not summary or any(r["valid_free"] is None or r["valid_constrained"] is None for r in summary):
        return None
    return bars(
        path,
        "Replies that parse and validate",
        "share valid",
        [r["schemas"] for r in summary],
        {
            "unconstrained": [r["valid_free"] for r in summary],
            "constrained": [r["valid_constrained"] for r in summary],
        },
    )


def headline(result: dict) -> str | None:
    every = next((r for r in result.get("summary", []) if r["schemas"].startswith("all")), None)
    if every is None or every["valid_free"] is None or every["valid_constrained"] is None:
        return None  # a run of one mode: its rows say it
    ratio = every["constrained_over_free"]
    share = every["apply_share_of_step"]
    return (
        f"Structured output: {every['valid_constrained']:.0%} of replies valid constrained vs "
        f"{every['valid_free']:.0%} unconstrained; decode {every['constrained_ms_per_token']:.1f} vs "
        f"{every['free_ms_per_token']:.1f} ms/token ({(ratio - 1) * 100 if ratio else float('nan'):+.1f}%), "
        f"mask applied in {every['mask_apply_ms']:.2f} ms/token ({(share or 0) * 100:.1f}% of a step), computed "
        f"beside the step in {every['mask_compute_ms']:.2f} ms (median)."
    )
