"""What a request's ``tools``, ``tool_choice`` and ``response_format`` make of its turn.

One ``OutputPlan`` decides, for the engine (``Engine.chat(..., tools=, response_format=)``)
and for the server and adapters (``kvshelf.serving.completions.prepare``) alike:

- the system text that shows the model its tools or asks for JSON (``tools``, ``json_mode``);
- the opening written into the model's turn (a forced call's ``<tool_call>{"name": "``,
  a JSON object's ``{``);
- the grammar that constrains the reply (``grammar``): on by default, so a forced call
  always parses and its arguments match the tool's schema, and a JSON reply always
  matches its schema; ``constrained=False`` keeps the older best effort, which ends the
  reply where the object closes (``until``) and parses what came (used to compare);
- how the reply's text is split into content and calls (``parse``).

A model whose own chat template shows ``tools`` and whose call format mlx-lm can read
(``kvshelf.model.template.native_tool_parser``, passed as ``native``) is shown its tools
by its template, in the format it was trained on, and its calls are read back by
mlx-lm's parser for that format, under "auto". A forced call ("required", a named
function) still uses kvshelf's format, where the grammar can guarantee it.

``tool_choice`` "none" renders no tools and constrains nothing (a ``response_format``
still applies); "auto" lets the model answer in text or open a call, and a call once
opened is constrained; "required" and a named function force one call, or several where
``parallel_tool_calls`` allows (each on its own line).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshelf.errors import ApiError
from kvshelf.model.template import ToolParser
from kvshelf.structured import json_mode
from kvshelf.structured import tools as calling
from kvshelf.structured.grammar import Grammar, json_grammar, tool_call_grammar


@dataclass(frozen=True)
class OutputPlan:
    tools: list[dict[str, Any]] = field(default_factory=list)  # offered and in use ("none": empty)
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    grammar: Grammar | None = None
    opening: str = ""
    system_text: str = ""
    native: ToolParser | None = None  # the model's own format shows the tools and reads the calls

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the model's own template to show (None: kvshelf's format, in the system text)."""
        return self.tools if self.native is not None and self.tools else None

    @property
    def tool_names(self) -> list[str]:
        return [t.get("function", t)["name"] for t in self.tools]

    @property
    def json_mode(self) -> bool:
        return json_mode.wants_json(self.response_format)

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the system text added and the reply opened."""
        out = calling.with_system_text(calling.name_tool_results(messages), self.system_text)
        if self.opening:
            out.append({"role": "assistant", "content": self.opening, "prefix": True})
        return out

    def until(self) -> Callable[[str], int] | None:
        """Where a reply is complete: for an unconstrained one, where its call or object
        closes; a constrained one ends where its grammar does, or where it starts to
        repeat a call it has already made (``tools.end_of_repeat``)."""
        if self.grammar is not None:
            if self.tools and self.parallel_tool_calls:
                return calling.end_of_repeat(self.opening)
            return None
        if self.tools and self.opening:
            return calling.end_of_call(self.opening)
        if self.json_mode and not self.tools:
            return json_mode.end_of_object(self.opening)
        return None

    def parse(self, text: str) -> tuple[str, list[calling.ToolCall]]:
        """(content, calls) of a reply whose generated text is ``text`` (after the opening)."""
        whole = self.opening + text
        if not self.tools:
            return whole, []
        if self.native is not None:
            content, found = self.native.split(whole, self.tools)
            calls = [calling.ToolCall(*call_fields(c), calling.new_call_id()) for c in found]
            return content, calls if self.parallel_tool_calls else calls[:1]
        content, calls = calling.parse_tool_calls(whole, self.tool_names, repair=self.grammar is None)
        return content, calls if self.parallel_tool_calls else calls[:1]


def call_fields(call: Mapping[str, Any]) -> tuple[str, str]:
    """(name, arguments as a JSON object string) of a call an mlx-lm parser read."""
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {}
    return str(call["name"]), json.dumps(args if isinstance(args, dict) else {}, ensure_ascii=False)


def _name(tool: Mapping[str, Any]) -> str:
    return str(tool.get("function", tool)["name"])


def plan_output(
    tools_offered: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    response_format: Mapping[str, Any] | None = None,
    *,
    constrained: bool = True,
    native: ToolParser | None = None,
) -> OutputPlan:
    """The plan for these OpenAI fields; bad ones raise a 400 (``ApiError``,
    ``InvalidSchema``) naming the field, before anything runs. ``native``: the model's
    own tool-call format, used for "auto" (see the module's docstring)."""
    offered = [dict(t) for t in tools_offered or []]
    names = [_name(t) for t in offered]
    choice: str | dict[str, Any] = (
        dict(tool_choice) if isinstance(tool_choice, Mapping) else (tool_choice or ("auto" if offered else "none"))
    )
    if choice not in ("none", "auto", "required") and not isinstance(choice, dict):
        raise ApiError(
            f"tool_choice must be 'none', 'auto', 'required' or a function, not {choice!r}",
            400,
            "invalid_value",
            param="tool_choice",
        )
    if choice not in ("none", "auto") and not offered:
        raise ApiError("tool_choice requires 'tools'; send the functions the model may call", 400, param="tool_choice")
    if isinstance(choice, dict):
        named = str((choice.get("function") or {}).get("name"))
        if named not in names:
            raise ApiError(
                f"tool_choice names function {named!r}, which is not in 'tools' ({', '.join(names)})",
                400,
                "invalid_value",
                param="tool_choice",
            )
    use_tools = bool(offered) and choice != "none"
    native = native if use_tools and choice == "auto" else None
    fmt = dict(response_format) if response_format is not None else None
    want_json = json_mode.wants_json(fmt)
    schema = _schema_of(fmt) if want_json else None
    extra = []
    if use_tools and native is None:
        extra.append(calling.tools_text(offered))
    if want_json:
        extra.append(json_mode.instruction(fmt or {}))
    grammar: Grammar | None = None
    if native is not None:
        opening = ""  # the model writes its own calls, read by its own parser
    elif use_tools:
        opening = calling.opening(choice)
        if constrained:
            grammar = tool_call_grammar(offered, choice, parallel=parallel_tool_calls, opening=opening)
    elif want_json:
        json_g = json_grammar(schema)  # checked even unconstrained: a bad schema is refused alike
        opening = json_g.opening if constrained else json_mode.OPENING
        grammar = json_g if constrained else None
    else:
        opening = ""
    return OutputPlan(
        tools=offered if use_tools else [],
        tool_choice=choice,
        parallel_tool_calls=parallel_tool_calls,
        response_format=fmt,
        grammar=grammar,
        opening=opening,
        system_text="\n\n".join(extra),
        native=native,
    )


def _schema_of(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The schema of a ``json_schema`` format (None for ``json_object``); a missing or
    malformed one is refused here, not loosened to "any object"."""
    if response_format is None or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ApiError(
            "response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}",
            400,
            "invalid_value",
            param="response_format.json_schema",
        )
    schema = spec.get("schema")
    if schema is None:
        return None  # OpenAI allows a name without a schema: any JSON object
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            pass
    if not isinstance(schema, Mapping):
        raise ApiError(
            "response_format.json_schema.schema must be a JSON schema object",
            400,
            "invalid_json_schema",
            param="response_format.json_schema.schema",
        )
    return dict(schema)
