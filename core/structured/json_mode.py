"""``response_format`` JSON output: the instruction, the opening and the cut.

For ``json_object`` and ``json_schema`` the turn:

1. gets an instruction in the system text (the same every turn, so the cache is reused),
   with the schema for ``json_schema``;
2. is opened with ``{`` when the value is an object, so the reply starts as one;
3. is constrained by the schema's grammar (``kvshelf.structured.grammar``): the reply is
   a JSON value that validates, and ends where it closes.

Only ``max_tokens`` can cut it short (``finish_reason`` "length"); the text is then
returned as generated, as OpenAI's JSON mode does with a truncated reply, and a warning
is logged. Unconstrained (``plan_output(constrained=False)``, for comparison), the reply
ends where the top-level object closes (``end_of_object``) and may not be valid at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

OPENING = "{"


def wants_json(response_format: Mapping[str, Any] | None) -> bool:
    return response_format is not None and response_format.get("type") in ("json_object", "json_schema")


def instruction(response_format: Mapping[str, Any]) -> str:
    """The system text that asks for JSON (with the schema, for ``json_schema``)."""
    text = "Answer with a single valid JSON object and nothing else."
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if schema is not None:
        text += " The object must match this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)
    return text


def is_valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def end_of_object(opening: str = OPENING) -> Callable[[str], int]:
    """For ``Engine.stream(until=...)``: given the reply so far (after ``opening``), the
    length at which its top-level object closes, or -1. Fed incrementally (each call
    sees the text grown by a token), so a reply costs linear time."""
    cutter = JsonObjectCutter()
    cutter.feed(opening)
    fed, end = 0, -1

    def until(text: str) -> int:
        nonlocal fed, end
        if end < 0:
            kept = cutter.feed(text[fed:])
            end = fed + len(kept) if cutter.done else -1
            fed = len(text)
        return end

    return until


class JsonObjectCutter:
    """Passes text through until the first top-level JSON object closes, then nothing.

    It tracks brace depth outside strings (with escapes), so ``"}"`` inside a string
    does not end the object.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, chunk: str) -> str:
        if self.done:
            return ""
        for i, ch in enumerate(chunk):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return chunk[: i + 1]
        return chunk
