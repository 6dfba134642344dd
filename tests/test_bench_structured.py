"""The structured section of ``kvshelf bench`` end to end on a tiny model: the table, not the figures.

A random-weight model writes noise unconstrained, so the section must show what the mask
does: every constrained JSON reply valid, no unconstrained one (each stopped by its
validator where it broke, with the reason), and the mask's cost measured for every reply.
Timings are printed and written, never asserted. The validator itself is checked on its
own: it refuses only what no continuation could make valid.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import llguidance
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from kvbench import structured  # noqa: E402


def test_structured_section_compares_constrained_and_free_replies(tiny_dirs, tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--model", str(tiny_dirs["llama"]), "--out", str(out)]
    cmd += ["--sections", "structured", "--set", "structured_cases=tool:1-3,json:1-3"]
    cmd += ["--set", "structured_max_tokens=400", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stderr[-4000:]
    section = json.loads((out / "results.json").read_text())["sections"]["structured"]
    assert "error" not in section, section.get("error")
    rows = section["rows"]
    assert [(r["kind"], r["fields"]) for r in rows] == [("tool", k) for k in (1, 2, 3)] + [
        ("json", k) for k in (1, 2, 3)
    ]
    assert all(r["constrained_valid"] and r["constrained_reason"] is None for r in rows)  # 400 tokens: enough
    assert not any(r["free_valid"] for r in rows)  # a random model's unconstrained reply never validates
    assert all(r["free_reason"] for r in rows)  # and says why
    for r in rows:  # a reply stopped by its validator ends on the token that broke it
        if r["free_finish"] == "broke":
            assert r["free_tokens"] == r["free_broke_at"] + 1 and "left its schema at token" in r["free_reason"]
    assert all(r["mask_apply_ms"] is not None and r["mask_compute_ms"] is not None for r in rows)
    summary = {r["schemas"]: r for r in section["summary"]}
    assert summary["all (6)"]["valid_constrained"] == 1.0 and summary["all (6)"]["valid_free"] == 0.0
    assert section["floor"]["floor_ms"] > 0
    report = (out / "REPORT.md").read_text()
    assert f"## {section['title']}" in report and "### Summary" in report and "structured.png" in report
    table = (out / "TABLE.md").read_text()
    assert "| tool 3 | yes (" in table and "| json 1 | yes (" in table and "all (6) | 100% | 0% |" in table


def _validator(case: dict, text_after_opening: str = "") -> tuple[llguidance.LLMatcher, list[int], Any]:
    from kvshelf.model.loader import TextTokenizer
    from kvshelf.structured.constraint import Vocabulary
    from tests.support.tiny import byte_tokenizer

    vocab = Vocabulary(TextTokenizer(byte_tokenizer(), None, frozenset({0})))
    grammar = structured.validator(case, "")
    return llguidance.LLMatcher(vocab.llg, grammar.source, log_level=0), vocab.encode(text_after_opening), vocab


@pytest.mark.parametrize("k", [1, 7, 13, 20])
def test_the_validator_admits_a_valid_reply_in_any_key_order_and_whitespace(k):
    """A reply that validates must never be stopped: keys in reverse order, JSON's own
    whitespace, numbers of any length."""
    (case,) = structured.json_cases([k])
    value = {name: _example(schema) for name, schema, _ in reversed(structured.FIELDS[:k])}
    text = json.dumps(value, indent=2)
    assert structured.check(case, text) is None
    matcher, ids, _ = _validator(case, text)
    assert matcher.try_consume_tokens(ids) == len(ids)
    (tool,) = structured.tool_cases([k])
    call = "<tool_call>" + json.dumps(
        {"arguments": {n: _example(s) for n, s, _ in tool_fields(k)}, "name": f"store_record_{k}"}
    )
    assert structured.check(tool, call + "</tool_call>") is None
    matcher, ids, _ = _validator(tool, call)
    assert matcher.try_consume_tokens(ids) == len(ids)


def tool_fields(k: int) -> list:
    return structured.FIELDS[len(structured.FIELDS) - k :]


@pytest.mark.parametrize(
    "text, broken_at",
    [
        ('{"type": "object"', '{"t'),  # the schema copied in: no such key
        ('{"name": "Ada", "age": "36"', '{"name": "Ada", "age": "'),  # a string for an integer
        ('{"name": "Ada", "age": 121', '{"name": "Ada", "age": 121'),  # past the maximum
    ],
)
def test_the_validator_stops_a_reply_at_the_first_token_that_breaks_it(text, broken_at):
    (case,) = structured.json_cases([2])
    matcher, ids, vocab = _validator(case, text)
    kept = matcher.try_consume_tokens(ids)
    assert vocab.encode(broken_at) == ids[: kept + 1]
    assert structured.check(case, text + "}") is not None


def _example(schema: dict):
    """A valid value of one of the benchmark's field schemas."""
    if "enum" in schema:
        return schema["enum"][-1]
    kind = schema["type"][0] if isinstance(schema["type"], list) else schema["type"]
    if kind == "object":
        return {n: _example(s) for n, s in reversed(schema["properties"].items())}
    if kind == "array":
        return [_example(schema["items"])] * schema.get("minItems", 1)
    if kind == "integer":
        return schema.get("maximum", 123456789012345678)
    if kind == "number":
        return schema.get("maximum", 3.14159265358979)
    if kind == "boolean":
        return True
    return {"email": "ada@example.org", "date": "1815-12-10"}.get(schema.get("format", ""), "en")
