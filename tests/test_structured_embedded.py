"""Constrained decoding on the embedded Gemma 3 270M: the replies that once ran to ``max_tokens``.

The structured benchmark found two ways a real small model kept a constrained reply going
until ``max_tokens`` cut it: a number written digit after digit (``"lon": 3000000...``), and,
with parallel calls allowed, the same call written again and again. Both are replayed here,
greedy, as the benchmark asked them; each reply must now end by itself and validate against
the schema as declared.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from kvshelf.runtime.engine import Engine

pytestmark = pytest.mark.embedded

STR = {"type": "string", "maxLength": 40}
RECORD: dict[str, Any] = {  # the benchmark's 5-field tool schema: unbounded numbers, nested objects
    "type": "object",
    "properties": {
        "coordinates": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        "ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 1,
            "maxItems": 4,
        },
        "meta": {
            "type": "object",
            "properties": {"source": STR, "version": {"type": "integer", "minimum": 0}},
            "required": ["source"],
        },
        "language": {"type": "string", "pattern": "^[a-z]{2}$"},
        "flags": {
            "type": "object",
            "properties": {"urgent": {"type": "boolean"}, "private": {"type": "boolean"}},
            "required": ["urgent"],
        },
    },
    "required": ["coordinates", "ids", "meta", "language", "flags"],
}
TOOL = {
    "type": "function",
    "function": {"name": "store_record_5", "description": "Store one record.", "parameters": RECORD},
}
ASK = [{"role": "user", "content": "Store a record of a book order of three novels with the store_record_5 tool."}]


@pytest.fixture(scope="module")
def engine(embedded_loaded, tmp_path_factory) -> Iterator[Engine]:
    eng = Engine(model=embedded_loaded, cache_dir=tmp_path_factory.mktemp("structured-embedded"), progress=False)
    yield eng
    eng.close()


def test_a_forced_call_with_numbers_and_parallel_calls_ends_by_itself(engine):
    r = engine.chat("records", ASK, tools=[TOOL], tool_choice="required", max_tokens=700)
    assert r.finish_reason == "tool_calls" and r.usage.completion_tokens < 700
    assert r.tool_calls and len({c.arguments for c in r.tool_calls}) == len(r.tool_calls)  # no call twice
    for call in r.tool_calls:
        args = json.loads(call.arguments)
        jsonschema.validate(args, RECORD)
        assert all(len(str(v)) <= 27 for v in args["coordinates"].values())  # 16 digits, a point, 10 more


def test_a_json_record_with_numbers_ends_by_itself(engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    ask = [{"role": "user", "content": "Describe a weather station in Oslo as a JSON record."}]
    r = engine.chat("station", ask, response_format=fmt, max_tokens=700)
    assert r.finish_reason == "stop" and r.usage.completion_tokens < 700
    jsonschema.validate(json.loads(r.text), RECORD)
