"""Grammars for constrained decoding: a JSON value of a schema, and kvshelf's tool calls.

A ``Grammar`` is what ``llguidance`` compiles into a token mask (``constraint``): here
it is built from the request alone, and checked before any generation, so a schema the
library cannot enforce is refused with ``InvalidSchema`` (a 400 naming the keyword, as
llguidance words it: ``Unimplemented keys: ["if", "then"]``), never loosened in silence.

JSON is written in one fixed style: no free whitespace (a small model otherwise pads
with newlines until ``max_tokens``), ``", "`` and ``": "`` as separators, which is the
style of the calling example the model is shown (``tools.tools_text``).

Schemas are closed where they leave it open: an object schema with ``properties`` and
no ``additionalProperties`` gets ``additionalProperties: false`` (what xgrammar's strict
mode and OpenAI's ``strict`` do). JSON Schema's own default would let the model add keys
of its own, which is exactly how small models fail a schema (they copy the schema in).
A number or integer without bounds gets JSON's interoperable range, ±(2**53 - 1) (RFC
8259), and a number at most ten digits after the point (``multipleOf: 1e-10``), so a model
cannot write digits until ``max_tokens`` (a 270M model writes ``"lon": 3000000...`` or
``3.00000...`` otherwise). The reply is then a subset of what the declared schema allows:
it still validates against it. (Exponents are not written: llguidance's bounded numbers
are plain decimals.)

The tool-call grammar follows the calling convention in ``tools``: ``<tool_call>``, a
``{"name": ..., "arguments": ...}`` object whose arguments match that tool's schema,
``</tool_call>``; calls are separated by a newline when ``parallel_tool_calls`` allows
more than one. Under ``tool_choice`` "auto" the reply is either text that never opens a
call, or text followed by calls: once the model writes ``<tool_call>``, the call is
constrained like a forced one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from kvshelf.errors import InvalidSchema
from kvshelf.structured.tools import CLOSE, OPEN

JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
SAFE_INTEGER = 2**53 - 1  # RFC 8259's interoperable integer range (JavaScript's Number.MAX_SAFE_INTEGER)
FRACTION_DIGITS = 10  # the most llguidance's ``multipleOf`` takes (1e-11 and finer are refused as "too many digits")
FRACTION_STEP = float(f"1e-{FRACTION_DIGITS}")
_VALUES = frozenset({"const", "enum", "default", "examples", "required"})  # JSON data, not schemas
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar and the text of the reply already in the prompt.

    ``opening`` is the start of the reply that kvshelf writes into the prompt (``{`` for
    a JSON object, ``<tool_call>{"name": "`` for a forced call): the grammar covers the
    whole reply, and the matcher is fed the opening before the model's first token.

    ``enforced=False`` makes it a validator only: no mask is applied (the model samples
    from its own logits, as unconstrained), the matcher consumes each sampled token, and
    the reply ends at the first token the grammar refuses (a reply that can no longer
    become valid need not run on to ``max_tokens``). ``benchmarks/structured.py`` uses it
    for the unconstrained side of its table."""

    source: str
    opening: str = ""
    description: str = ""
    enforced: bool = True


def closed(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that lists ``properties`` but
    says nothing of others gets ``additionalProperties: false``, every integer or number
    without bounds the safe range, and every number a finest step of ``1e-10``."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, Mapping):
        return copy.deepcopy(schema)
    out = {k: copy.deepcopy(v) if k in _VALUES else closed(v) for k, v in schema.items()}
    for names in _NAMED:  # maps of names to schemas: their keys are names, never keywords
        if isinstance(schema.get(names), Mapping):
            out[names] = {k: closed(v) for k, v in schema[names].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if kinds & {"integer", "number"}:
        # a small model may write digits until max_tokens: bound what the schema leaves open
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
    if "number" in kinds and "multipleOf" not in out:
        out["multipleOf"] = FRACTION_STEP  # at most FRACTION_DIGITS digits after the point
    return out


def _styled(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**closed(schema), "x-guidance": JSON_STYLE}


def _checked(source: str, param: str, what: str) -> str:
    """``source`` if llguidance accepts it; else ``InvalidSchema`` with its reason."""
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        reason = " ".join(error.split())[:400]  # llguidance's words name the keyword (or the pattern)
        raise InvalidSchema(f"{what} in '{param}' cannot be enforced: {reason}", param)
    return source


def _schema_source(schema: Any, param: str, what: str) -> str:
    if not isinstance(schema, Mapping):
        raise InvalidSchema(f"{what} in '{param}' must be a JSON object, not {type(schema).__name__}", param)
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_styled(schema)))
    except (TypeError, ValueError) as exc:
        raise InvalidSchema(f"{what} in '{param}' is not a JSON schema: {exc}", param) from None
    return _checked(source, param, what)


def json_grammar(schema: Mapping[str, Any] | None, *, param: str = "response_format.json_schema.schema") -> Grammar:
    """A JSON value matching ``schema`` (None: any JSON object, as ``json_object`` asks).

    The reply opens with ``{`` in the prompt when the value must be an object."""
    target = ANY_OBJECT if schema is None else schema
    source = _schema_source(target, param, "The JSON schema")
    is_object = target.get("type") == "object" or ("properties" in target and "type" not in target)
    return Grammar(source, "{" if is_object else "", "json_object" if schema is None else "json_schema")


def _call_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One JSON schema for a call of any of ``tools`` (name first, then its arguments)."""
    options = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters") or NO_ARGUMENTS
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": closed(params)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return (
        {"anyOf": options, "x-guidance": JSON_STYLE} if len(options) > 1 else {**options[0], "x-guidance": JSON_STYLE}
    )


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, *, parallel: bool = True, opening: str = ""
) -> Grammar:
    """Calls of ``tools`` in kvshelf's format, as ``tool_choice`` allows.

    ``tool_choice``: "required" (one call or more, of any tool), a named function (only
    that tool) or "auto" (text, or text then calls). Each tool's schema is checked on its
    own first, so an error names the tool's ``parameters``."""
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        _schema_source(fn.get("parameters") or NO_ARGUMENTS, f"tools[{i}].function.parameters", "The schema")
    chosen = list(tools)
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t.get("function", t)["name"] == name]
    one = f"{json.dumps(OPEN)} call {json.dumps(CLOSE)}"
    more = f' ("\\n" {one})*' if parallel else ""
    call = f"call: %json {json.dumps(_call_schema(chosen))}"
    if tool_choice == "auto":
        # TEXT never holds the opening tag; the lazy trigger ends right at it, so a reply
        # that opens a call must go on as a call
        tag = OPEN  # no regex metacharacters in it
        lines = [
            f"start: TEXT | trigger call {json.dumps(CLOSE)}{more}",
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/",
            f"trigger[lazy]: /(.|\\n)*{tag}/",
            call,
        ]
    else:
        lines = [f"start: {one}{more}", call]
    lark = "%llguidance {}\n" + "\n".join(lines) + "\n"
    source = _checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools", "The tool-call grammar")
    return Grammar(source, opening, "tool_calls")
