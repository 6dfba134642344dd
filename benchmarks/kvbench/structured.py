"""Structured output: replies that parse and validate, constrained vs unconstrained, and the mask's cost.

Twenty tool schemas and twenty JSON schemas of increasing complexity (1 to 20 fields:
strings, bounded integers, enums, numbers, arrays, nested objects, formats, nullable and
optional fields; every object closed with ``additionalProperties: false``, as OpenAI's
strict mode asks); a reduced run (``structured_schemas``) takes sizes spread over 1..20,
both ends included, and ``structured_cases`` (``tool:1-18``, ``tool:19-20,json:1-20``)
splits the full run in parts that each stay side by side. A reply of k fields may take
``structured_max_tokens + structured_tokens_per_field * k`` tokens (digits are one token
each in Gemma's vocabulary: a 20-field record takes ~600), so a constrained reply ends by
its grammar; one that is cut anyway is counted invalid and shown
(``constrained_cut_by_max_tokens``). Each case is asked twice on the same agent, greedy,
in one run: unconstrained first, then constrained (kvshelf's default).

- **Unconstrained** (``plan_output(constrained=False)``): the same system text, with the
  schema, and the same opening; no mask. The model's reply is checked as it is written by
  a *validator*: the schema's grammar, compiled by llguidance but not applied as a mask
  (``Grammar(enforced=False)``: the matcher consumes each sampled token), so the reply
  stops at the first token after which it can no longer become valid, and is recorded
  invalid with that token's position and text and the grammar's reason. The validator
  refuses only what no continuation could make valid: it is the declared schema with
  JSON's free whitespace, its properties in any order (``patternProperties``: llguidance's
  JSON grammar otherwise fixes the declared order), ``required`` and ``format`` left to
  the final check (both can only fail at the end of a value) and no bound added to its
  numbers. A reply that completes (its object closes) is validated like a constrained one.
- **Constrained**: llguidance's token mask (``kvshelf.structured``), applied in the step.
- **valid**, the same check for both: the reply as written (no bracket repair) is one JSON
  value (a JSON reply) or one ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  with exactly those two keys and that tool's name (a tool reply, the format the model is
  shown), whose object or arguments validate against the declared schema with
  ``jsonschema``, formats checked (``FormatChecker``). Each invalid reply names its reason.
- **ms/token**: the decode time per generated token (total minus time to first token, over
  the tokens after the first), constrained and unconstrained: medians over the schemas,
  and pooled (all decode time over all tokens). Beside them, the floor of a step: the
  model's weight bytes over the memory bandwidth measured in the same run.
- **the mask**, replayed over every constrained reply's own tokens: computing it
  (llguidance, on the scheduler's side thread, overlapped with the model's step) and
  applying it to one row of logits (on the step's critical path), per token, as a share of
  the unconstrained step.
"""

from __future__ import annotations

import json
import os
import re
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
from kvbench.decode_steps import bandwidth, weight_bytes

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
        {
            "type": "object",
            "properties": {"street": STR, "city": STR},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
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
                "additionalProperties": False,
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
            "additionalProperties": False,
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
            "additionalProperties": False,
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
            "additionalProperties": False,
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
        "additionalProperties": False,
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


def selected_cases(s: Any) -> list[dict[str, Any]]:
    """The run's cases: ``structured_cases`` (``tool:1-18``, ``json:3,7``) where given,
    else the sizes of ``structured_fields`` or ``structured_schemas`` for each kind."""
    if s.structured_cases:
        out = []
        for spec in ",".join(s.structured_cases).split(","):  # --set gives one string, settings a tuple
            kind, _, span = spec.partition(":")
            lo, _, hi = span.partition("-")
            make = tool_cases if kind == "tool" else json_cases
            out += make(list(range(int(lo), int(hi or lo) + 1)))
        return out
    fields = [int(k) for k in s.structured_fields] or sizes(s.structured_schemas)  # --set gives strings
    return (tool_cases(fields) if "tool" in s.structured_kinds else []) + (
        json_cases(fields) if "json" in s.structured_kinds else []
    )


def _ask(case: dict[str, Any]) -> dict[str, Any]:
    """The engine keywords and messages of one case."""
    if case["kind"] == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": f"record_{case['fields']}", "schema": case["schema"]}}
        text = f"Describe {case['subject']} as a JSON record."
        return {"messages": [{"role": "user", "content": text}], "response_format": fmt}
    name = _tool_name(case)
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


def _tool_name(case: dict[str, Any]) -> str:
    return f"store_record_{case['fields']}"


def _call_schema(case: dict[str, Any]) -> dict[str, Any]:
    """A call in the format the model is shown: exactly a name and the arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": _tool_name(case)}, "arguments": case["schema"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_VALUES = frozenset({"const", "enum", "default", "examples"})  # JSON data, not schemas


def order_free(schema: Any) -> Any:
    """A schema that admits every prefix of a valid value, in llguidance's terms: its
    properties in any order (as ``patternProperties``; llguidance's JSON grammar keeps the
    declared order of ``properties``), ``required`` and ``format`` dropped (the final check
    has them: a missing key or a bad date shows only at the value's end)."""
    if isinstance(schema, list):
        return [order_free(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else order_free(v) for k, v in schema.items() if k not in ("required", "format")}
    if isinstance(schema.get("properties"), dict):
        del out["properties"]
        out["patternProperties"] = {f"^{re.escape(k)}$": order_free(v) for k, v in schema["properties"].items()}
    return out


def validator(case: dict[str, Any], opening: str) -> Any:
    """The unconstrained reply's validator: the case's grammar, not enforced (no mask),
    over the whole reply (its opening included); anything may follow the value, where
    the reply is cut anyway (``OutputPlan.until``)."""
    from kvshelf.structured.grammar import Grammar

    schema = _call_schema(case) if case["kind"] == "tool" else case["schema"]
    prefix = '"<tool_call>" ' if case["kind"] == "tool" else ""
    lark = (
        "%llguidance {}\n"
        f"start: {prefix}value REST\n"
        f"value: %json {json.dumps(order_free(schema))}\n"
        "REST: /(.|\\n)*/\n"
    )
    source = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(source)
    assert not error, error
    return Grammar(source, opening, "validator", enforced=False)


def _broke(engine: Any, grammar: Any, tokens: list[int]) -> dict[str, Any] | None:
    """Where a validator refused the reply (the engine ended it there): the token's
    position and text, and the grammar's reason; None when it never did."""
    vocab = engine.vocabulary
    matcher = llguidance.LLMatcher(vocab.llg, grammar.source, log_level=0)
    matcher.consume_tokens(vocab.encode(grammar.opening))
    kept = matcher.try_consume_tokens(tokens)
    if kept == len(tokens):
        return None
    matcher.consume_token(tokens[kept])
    reason = " ".join(matcher.get_error().split("<state>")[0].split())
    return {"at": kept, "token": engine.loaded.tokenizer.decode([tokens[kept]]), "reason": reason[:200]}


_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def check(case: dict[str, Any], whole: str) -> str | None:
    """Why the reply ``whole`` (its opening included) is not valid, or None when it is."""
    text = whole.strip()
    if case["kind"] == "tool":
        if not text.startswith("<tool_call>"):
            return "no <tool_call>"
        text = text.removeprefix("<tool_call>")
        schema = _call_schema(case)
    else:
        schema = case["schema"]
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg} at {exc.pos}"
    rest = text[end:].strip()
    if rest and not (case["kind"] == "tool" and rest == "</tool_call>"):
        return f"text after the value: {rest[:40]!r}"
    try:
        jsonschema.validate(value, schema, format_checker=_FORMATS)
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "(root)"
        return f"schema: {where}: {exc.message[:120]}"
    return None


def _decode_s(result: Any) -> tuple[float, int]:
    """(seconds, tokens) of a reply's decode: after its first token."""
    return result.total_s - result.ttft_s, result.usage.completion_tokens - 1


def _ms_per_token(result: Any) -> float | None:
    seconds, n = _decode_s(result)
    return seconds * 1000 / n if n > 0 else None


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


def _floor_ms(engine: Any) -> dict[str, float]:
    """A decode step's floor: the model's weight bytes over the bandwidth measured now."""
    gbs = bandwidth(engine.loaded.model, megabytes=256, repeats=5)["gbs"]
    return {"floor_ms": weight_bytes(engine.loaded.model) / gbs / 1e6, "bandwidth_gbs": gbs}


def _reference_steps(engine: Any, cases: list[dict[str, Any]], tokens: int) -> dict[str, float | None]:
    """The unconstrained step per kind, to set ms/token against: the largest case's
    prompt decoded free (no mask, no validator) for ``tokens`` tokens. An unconstrained
    reply itself is often too short to time: its validator ends it after a few tokens."""
    from kvshelf.structured.plan import plan_output

    out: dict[str, float | None] = {}
    for kind in ("tool", "json"):
        mine = [c for c in cases if c["kind"] == kind]
        if not mine or tokens < 2:
            continue
        case = max(mine, key=lambda c: c["fields"])
        ask = _ask(case)
        plan = plan_output(
            ask.get("tools"), ask.get("tool_choice"), False, ask.get("response_format"), constrained=False
        )
        r = engine.chat(f"structured-reference-{kind}", plan.messages(ask["messages"]), max_tokens=tokens)
        out[kind] = _ms_per_token(r)
        print(f"  structured {kind} unconstrained step: {out[kind] or 0:.1f} ms/token over {len(r.token_ids)} tokens")
    return out


def run(ctx: BenchContext) -> dict:
    from kvshelf.structured.plan import plan_output

    s = ctx.settings
    started = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    engine = ctx.get_engine()
    cases = selected_cases(s)
    width = engine.vocabulary.llg.vocab_size
    floor = _floor_ms(engine)
    reference = _reference_steps(engine, cases, s.structured_reference_tokens)
    rows = []
    for i, case in enumerate(cases):
        if s.structured_deadline_s and time.perf_counter() - started > s.structured_deadline_s:
            print(f"  structured: deadline of {s.structured_deadline_s:.0f} s reached, {len(cases) - i} not run")
            break
        ask = _ask(case)
        messages = ask.pop("messages")
        row: dict[str, Any] = {
            "kind": case["kind"],
            "fields": case["fields"],
            "max_tokens": s.structured_max_tokens + s.structured_tokens_per_field * case["fields"],
        }
        for key in ("free", "constrained"):
            if key not in s.structured_modes:
                continue  # a run split by mode (validity is the same either way: greedy, one agent per case)
            plan = plan_output(
                ask.get("tools"),
                ask.get("tool_choice"),
                ask.get("parallel_tool_calls", True),
                ask.get("response_format"),
                constrained=key == "constrained",
            )
            grammar = plan.grammar if key == "constrained" else validator(case, plan.opening)
            r = engine.chat(
                f"structured-{case['kind']}-{case['fields']}",
                plan.messages(messages),
                max_tokens=row["max_tokens"],
                grammar=grammar,
                until=plan.until(),
            )
            whole = plan.opening + r.text
            broke = None if key == "constrained" else _broke(engine, grammar, r.token_ids)
            if broke is not None:
                reason: str | None = f"left its schema at token {broke['at']} ({broke['token']!r}): {broke['reason']}"
            elif r.finish_reason == "length":
                reason = "cut by max_tokens"
            else:
                reason = check(case, whole)
            seconds, n = _decode_s(r)
            row[f"{key}_valid"] = reason is None
            row[f"{key}_reason"] = reason
            row[f"{key}_tokens"] = r.usage.completion_tokens
            row[f"{key}_decode_s"] = seconds
            row[f"{key}_decode_tokens"] = n
            row[f"{key}_ms_per_token"] = _ms_per_token(r)
            row[f"{key}_finish"] = "broke" if broke else r.finish_reason
            row[f"{key}_reply"] = whole if key == "constrained" else whole[:400]  # whole: grammar_libs.py replays it
            if broke is not None:
                row["free_broke_at"] = broke["at"]
            if key == "constrained":
                assert plan.grammar is not None
                computed, applied = _replay_mask(engine, plan.grammar, r.token_ids, width)
                row["mask_compute_ms"] = statistics.median(computed) if computed else None
                row["mask_compute_p99_ms"] = float(np.percentile(computed, 99)) if computed else None
                row["mask_compute_max_ms"] = max(computed) if computed else None
                row["mask_apply_ms"] = statistics.median(applied) if applied else None
                row["constrained_token_ids"] = r.token_ids  # for benchmarks/grammar_libs.py
        print(_line(row), flush=True)
        rows.append(row)
        with open(ctx.out_dir / "structured-rows.jsonl", "a") as log:  # a run cut short keeps its rows
            log.write(json.dumps(row, default=str) + "\n")
    for row in rows:
        row["step_ms"] = reference.get(row["kind"])
    summary = _summary(rows, floor["floor_ms"])
    if rows and all(f"{k}_valid" in r for r in rows for k in ("free", "constrained")):
        part: dict[str, Any] = {"name": ctx.out_dir.name, "cases": _names(cases[: len(rows)]), "floor": floor}
        part |= {"load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()]}
        (ctx.out_dir / "TABLE.md").write_text(table_md(rows, [part | {"elapsed_s": time.perf_counter() - started}]))
    shown = ("free_reply", "constrained_reply", "constrained_token_ids", "mask_compute_max_ms", "mask_compute_p99_ms")
    return {
        "title": TITLE,
        "model": engine.loaded.name,
        "table": [{k: v for k, v in r.items() if k not in shown and not k.endswith("_decode_s")} for r in rows],
        "rows": rows,
        "summary": summary,
        "floor": floor,
        "unconstrained_step_ms": reference,
        "load_average_start": load_start,
        "cases_not_run": len(cases) - len(rows),
        "extra_tables": {"Summary": summary},
        "description": (
            f"Model {engine.loaded.name}, greedy, at most {s.structured_max_tokens} + "
            f"{s.structured_tokens_per_field} x fields tokens per reply; tool schemas (tool_choice required, "
            "parallel_tool_calls false) and JSON schemas (response_format json_schema): "
            f"{_names(cases[: len(rows)])}"
            f"{f' ({len(cases) - len(rows)} not run: deadline)' if len(rows) < len(cases) else ''}. "
            "Each asked unconstrained (same prompt and opening, no mask; a validator, the schema's grammar "
            "consuming the sampled tokens, ends the reply at the first token after which it can no longer "
            "become valid) and constrained (llguidance's mask), one after the other on the same agent. Valid: "
            "the reply as written is one JSON value, or one call with exactly name and arguments, that "
            "validates against the declared schema (jsonschema, formats checked). ms/token: decode time over "
            "the tokens after the first; floor: weight bytes over bandwidth measured in this run. Mask compute: "
            "llguidance's mask for each token of the constrained reply, replayed on a fresh matcher (in the "
            "engine this runs on a side thread during the model's step); mask apply: unpacking it and masking "
            "one row of logits, which is on the step's critical path."
        ),
    }


def _names(cases: list[dict[str, Any]]) -> str:
    """``tool 1-18, json 1-20``: the cases of a run, as spans of sizes per kind."""
    parts = []
    for kind in ("tool", "json"):
        ks = [c["fields"] for c in cases if c["kind"] == kind]
        spans: list[list[int]] = []
        for k in ks:
            if spans and k == spans[-1][1] + 1:
                spans[-1][1] = k
            else:
                spans.append([k, k])
        parts += [f"{kind} {a}" if a == b else f"{kind} {a}-{b}" for a, b in spans]
    return ", ".join(parts)


def _line(row: dict[str, Any]) -> str:
    """One case's figures as printed during the run (a mode left out shows as -)."""
    text = f"  structured {row['kind']:4s} {row['fields']:2d} fields:"
    for key in ("free", "constrained"):
        if f"{key}_valid" in row:
            text += (
                f" {key} {'valid' if row[f'{key}_valid'] else 'INVALID'} ({row[f'{key}_tokens']}/{row['max_tokens']}"
                f" tokens, {row[f'{key}_finish']}, {row[f'{key}_ms_per_token'] or 0:.1f} ms/token)"
            )
        else:
            text += f" {key} -"
    if "mask_apply_ms" in row:
        text += f", mask {row['mask_compute_ms'] or 0:.2f} + {row['mask_apply_ms'] or 0:.2f} ms"
    if row.get("free_reason"):
        text += f"\n      free: {row['free_reason'][:160]}"
    if row.get("constrained_reason"):
        text += f"\n      constrained: {row['constrained_reason'][:160]}"
    return text


def _share(rows: list[dict[str, Any]], key: str) -> float | None:
    sel = [r[key] for r in rows if key in r]
    return sum(sel) / len(sel) if sel else None


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _pooled(rows: list[dict[str, Any]], key: str) -> float | None:
    """All decode time over all decode tokens of one mode (long replies weigh more)."""
    n = sum(r.get(f"{key}_decode_tokens", 0) for r in rows if r.get(f"{key}_decode_tokens", 0) > 0)
    seconds = sum(r[f"{key}_decode_s"] for r in rows if r.get(f"{key}_decode_tokens", 0) > 0)
    return seconds * 1000 / n if n else None


def _summary(rows: list[dict[str, Any]], floor_ms: float) -> list[dict[str, Any]]:
    out = []
    for kind in ("tool", "json", "all"):
        sel = [r for r in rows if kind == "all" or r["kind"] == kind]
        if not sel:
            continue
        free_ms = _median([r.get("free_ms_per_token") for r in sel])
        cons_ms = _median([r.get("constrained_ms_per_token") for r in sel])
        apply_ms = _median([r.get("mask_apply_ms") for r in sel])
        step_ms = _median([r.get("step_ms") for r in sel])
        out.append(
            {
                "schemas": f"{kind} ({len(sel)})",
                "valid_free": _share(sel, "free_valid"),
                "valid_constrained": _share(sel, "constrained_valid"),
                "free_broke_early": sum(r.get("free_finish") == "broke" for r in sel),
                "free_tokens": sum(r.get("free_tokens", 0) for r in sel),
                "constrained_tokens": sum(r.get("constrained_tokens", 0) for r in sel),
                "constrained_cut_by_max_tokens": sum(r.get("constrained_finish") == "length" for r in sel),
                "free_ms_per_token": free_ms,
                "constrained_ms_per_token": cons_ms,
                "free_ms_per_token_pooled": _pooled(sel, "free"),
                "constrained_ms_per_token_pooled": _pooled(sel, "constrained"),
                "unconstrained_step_ms": step_ms,
                "floor_ms": floor_ms,
                "constrained_over_step": cons_ms / step_ms if cons_ms and step_ms else None,
                "mask_compute_ms": _median([r.get("mask_compute_ms") for r in sel]),
                "mask_compute_p99_ms": _median([r.get("mask_compute_p99_ms") for r in sel]),
                "mask_compute_max_ms": max((r.get("mask_compute_max_ms") or 0) for r in sel),
                "mask_apply_ms": apply_ms,
                "apply_share_of_step": apply_ms / step_ms if apply_ms and step_ms else None,
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
    ratio = every["constrained_over_step"]
    return (
        f"Structured output: {every['valid_constrained']:.0%} of replies valid constrained vs "
        f"{every['valid_free']:.0%} unconstrained; decode {_num(every, 'constrained_ms_per_token')} ms/token "
        f"constrained vs {_num(every, 'unconstrained_step_ms')} unconstrained "
        f"({(ratio - 1) * 100 if ratio else float('nan'):+.1f}%; the short unconstrained replies "
        f"{_num(every, 'free_ms_per_token')}; floor {every['floor_ms']:.1f} ms), mask applied in "
        f"{_num(every, 'mask_apply_ms', '.2f')} ms/token "
        f"({_num(every, 'apply_share_of_step', '.1%')} of a step), computed beside the step in "
        f"{_num(every, 'mask_compute_ms', '.2f')} ms (median)."
    )


def _cell(row: dict[str, Any], key: str) -> str:
    if f"{key}_valid" not in row:
        return "not run"
    ms = row[f"{key}_ms_per_token"]
    return (
        f"{'yes' if row[f'{key}_valid'] else 'no'} ({row[f'{key}_tokens']}/{row['max_tokens']}, "
        f"{row[f'{key}_finish']}, {f'{ms:.1f}' if ms is not None else '-'} ms/token)"
    )


def _num(d: dict[str, Any], key: str, fmt: str = ".1f") -> str:
    return "-" if d.get(key) is None else format(d[key], fmt)


def table_md(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    """The side-by-side table of one run or of a run's parts (``runs``: each part's
    cases, load averages and floor), with the summary over every row."""
    floor = min(r["floor"]["floor_ms"] for r in runs)
    summary = _summary(rows, floor)
    out = [
        "| schema | constrained valid (tokens, finish, ms/token) | free valid (tokens, finish, ms/token) "
        "| why not valid |"
    ]
    out.append("|---|---|---|---|")
    for r in rows:
        why = "; ".join(f"{k}: {r[f'{k}_reason']}" for k in ("constrained", "free") if r.get(f"{k}_reason"))
        out.append(
            f"| {r['kind']} {r['fields']} | {_cell(r, 'constrained')} | {_cell(r, 'free')} | "
            f"{why.replace('|', '/')[:220]} |"
        )
    out += [
        "",
        "| schemas | valid constrained | valid free | free ended early | tokens constrained / free | "
        "ms/token constrained / unconstrained step / free replies (median) | pooled constrained / free | floor | "
        "mask compute median / p99 | mask apply | apply / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        ms = [_num(s, k) for k in ("constrained_ms_per_token", "unconstrained_step_ms", "free_ms_per_token")]
        pooled = [_num(s, k) for k in ("constrained_ms_per_token_pooled", "free_ms_per_token_pooled")]
        out.append(
            f"| {s['schemas']} | {_num(s, 'valid_constrained', '.0%')} | {_num(s, 'valid_free', '.0%')} | "
            f"{s['free_broke_early']} | {s['constrained_tokens']} / {s['free_tokens']} | {' / '.join(ms)} | "
            f"{' / '.join(pooled)} | {s['floor_ms']:.1f} ms | {_num(s, 'mask_compute_ms', '.2f')} / "
            f"{_num(s, 'mask_compute_p99_ms', '.2f')} ms | {_num(s, 'mask_apply_ms', '.2f')} ms | "
            f"{_num(s, 'apply_share_of_step', '.2%')} |"
        )
    out += ["", "Runs (each side by side, free then constrained per case, under kv-bench):", ""]
    for run in runs:
        out.append(
            f"- {run['name']}: {run['cases']}, load {run['load_start']} -> {run['load_end']}, "
            f"{run['elapsed_s']:.0f} s, floor {run['floor']['floor_ms']:.1f} ms "
            f"({run['floor']['bandwidth_gbs']:.1f} GB/s)"
        )
    return "\n".join(out) + "\n"
