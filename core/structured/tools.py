"""Tools in the prompt, tool calls out of the model's text.

The model is shown its functions in the system text, with one calling convention,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: the same form in which
the chat templates render an assistant's earlier calls, so the model sees its own
convention in the conversation history too. The tool text depends only on the tools,
never on the turn, so earlier turns stay byte-stable and the agent's cache is reused.

``tool_choice``:

- ``"none"``: the tools are not rendered at all (and nothing is parsed);
- ``"auto"``: rendered; the model decides;
- ``"required"``: rendered, and the model's turn is opened with ``<tool_call>{"name": "``
  so that it has to name a function;
- a named function: opened with ``<tool_call>{"name": "<it>", "arguments":``.

A forced turn is one call: generation ends where the call's JSON object closes, or at
the closing tag if the model writes it first (a small model often drops the last brace).

The turn is also constrained by a grammar (``kvshelf.structured.grammar``), so a forced
call always parses and its arguments match the tool's schema, and under "auto" a call
once opened does too. Only ``max_tokens`` can still cut a call short; then, as for an
unconstrained reply (``plan_output(constrained=False)``), the reply comes back as plain
content with ``finish_reason`` "length", never as an invented call.

Parsing is lenient: tagged calls (closing tag optional at the very end), fenced or bare
JSON objects (or a list of them) with ``name`` and ``arguments`` (or ``parameters``).
Inside a tag, where the end of the call is known, a call whose JSON only lacks its
closing brackets is completed (``complete_json_prefix``); anything else malformed is
not a call.
A call is accepted only if it names one of the offered functions and its arguments are
a JSON object; an exact repeat of an earlier call in the same reply (a small model's
habit when parallel calls are allowed) is dropped. The content is the text before the first valid call, and without a
valid call all of the text is content, so a failed call is never silently lost.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshelf.model.template import message_text
from kvshelf.structured.json_mode import end_of_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# -- into the prompt ------------------------------------------------------------------
def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that shows the model its functions and how to call them."""
    lines = ["You can call the following functions. Each is described by a JSON schema:"]
    for tool in tools:
        fn = tool.get("function", tool)
        spec = {"name": fn["name"]}
        if fn.get("description"):
            spec["description"] = fn["description"]
        spec["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(spec, ensure_ascii=False))
    lines += [
        "",
        "To call a function, answer with one line per call, in exactly this form, and nothing after the calls:",
        f'{OPEN}{{"name": "function_name", "arguments": {{"argument": "value"}}}}{CLOSE}',
        "Each result comes back to you in a <tool_response> block. If no function is needed, answer normally.",
    ]
    return "\n".join(lines)


def opening(tool_choice: Any) -> str:
    """The text that opens the model's turn for a forced ``tool_choice`` ("" if none)."""
    if tool_choice == "required":
        return f'{OPEN}{{"name": "'
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":'
    return ""


def with_system_text(messages: Sequence[Mapping[str, Any]], extra: str) -> list[dict[str, Any]]:
    """Append ``extra`` to the first system message, or start with one holding it.

    Merging into the first system message (rather than adding another) keeps Jinja
    templates that accept a single leading system message working.
    """
    out = [dict(m) for m in messages]
    if not extra:
        return out
    if out and out[0].get("role") in ("system", "developer"):
        text = message_text(out[0])
        out[0]["content"] = f"{text}\n\n{extra}" if text else extra
    else:
        out.insert(0, {"role": "system", "content": extra})
    return out


def name_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Give each ``tool`` message the name of the function whose call it answers.

    OpenAI tool messages carry only ``tool_call_id``; the templates show the model the
    function's name. The result depends only on earlier messages, so it is stable.
    """
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        for call in m.get("tool_calls") or []:
            if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
                names[str(call.get("id"))] = str(call["function"].get("name"))
        if m.get("role") == "tool" and not m.get("name") and str(m.get("tool_call_id")) in names:
            m["name"] = names[str(m.get("tool_call_id"))]
        out.append(m)
    return out


# -- out of the model's text ----------------------------------------------------------
def _as_call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, Mapping):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def complete_json_prefix(text: str) -> str | None:
    """``text`` with its missing closing brackets added, if it is a JSON object cut short
    outside a string (``{"a": {"b": 1`` becomes ``{"a": {"b": 1}}``); None otherwise.

    Only the brackets are added: a cut inside a string, a dangling key or a value that is
    not JSON stays invalid, so nothing is invented beyond the closing of what was opened.
    """
    stack: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]":
            if not stack or stack.pop() != char:
                return None
    if in_string or not stack or not text.lstrip().startswith("{"):
        return None
    completed = text.rstrip().removesuffix(",") + "".join(reversed(stack))
    try:
        json.loads(completed)
    except (json.JSONDecodeError, RecursionError):
        return None
    return completed


def _json_value(text: str, trailing_ok: bool = False) -> Any:
    """The JSON value that ``text`` holds (code fences allowed), or None.

    ``trailing_ok`` accepts junk after the value (inside a tag, where its end is known).
    """
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        if trailing_ok:
            return json.JSONDecoder().raw_decode(text)[0]
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def parse_tool_calls(text: str, names: Sequence[str], *, repair: bool = True) -> tuple[str, list[ToolCall]]:
    """Split model text into (content, calls).

    The content is the text before the first valid call; what follows the calls is
    dropped (the model was told to write nothing there, and OpenAI's message puts no
    text after calls). Without a valid call, all the text is content.

    ``repair=False`` (a constrained reply, whose calls are whole unless ``max_tokens``
    cut the last one) drops a cut call instead of closing its brackets: closed, its
    arguments could lack required fields.
    """
    allowed = frozenset(names)
    if OPEN not in text:
        value = _json_value(text)
        items = value if isinstance(value, list) and value else [value]
        whole = [call for v in items if (call := _as_call(v, allowed)) is not None]
        if value is not None and len(whole) == len(items):
            return "", whole
        return text, []
    content_end, pos = len(text), 0
    calls: list[ToolCall] = []
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start)
        # no closing tag: the reply ended, perhaps inside the tag (``</tool_call`` then end of turn)
        body_end, pos = (end, end + len(CLOSE)) if end >= 0 else (len(text) - _partial_tag(text, CLOSE), len(text))
        body = text[start + len(OPEN) : body_end]
        value = _json_value(body, trailing_ok=True)
        if value is None and repair and (completed := complete_json_prefix(body.strip())) is not None:
            value = json.loads(completed)  # cut short: a call only if its arguments were begun
            value = value if isinstance(value, dict) and ("arguments" in value or "parameters" in value) else None
        call = _as_call(value, allowed)
        if call is not None:
            content_end = min(content_end, start)
            if not any((c.name, c.arguments) == (call.name, call.arguments) for c in calls):
                calls.append(call)  # an exact repeat asks nothing new (small models repeat a call)
    return text[:content_end], calls


def end_of_call(opening: str) -> Callable[[str], int]:
    """For ``Engine.stream(until=...)`` on a forced call: the length at which the call
    ends (its JSON object closes, or the model writes the closing tag first), or -1."""
    object_end = end_of_object(opening.removeprefix(OPEN))

    def until(text: str) -> int:
        end = object_end(text)
        tag = text.find(CLOSE)
        if tag >= 0 and (end < 0 or tag < end):
            return tag
        return end

    return until


def end_of_repeat(opening: str) -> Callable[[str], int]:
    """For a constrained reply that may hold several calls: where the reply ends because
    the model has begun to repeat itself, or -1.

    A small model allowed parallel calls tends to write the same call again and again
    until ``max_tokens`` (the parser drops exact repeats anyway). The reply is cut right
    before the first call that repeats an earlier one word for word, once that call is
    complete: the calls before it are what the model had to say, the reply ends with
    ``finish_reason`` "tool_calls" instead of "length", and no token past the repeat is
    spent. Fed the reply after ``opening``; linear work per closed call."""
    seen: set[str] = set()
    checked = 0  # calls already compared

    def until(text: str) -> int:
        nonlocal checked
        whole = opening + text
        if whole.count(CLOSE) <= checked:
            return -1
        bodies = list(_closed_calls(whole))
        for start, body in bodies[checked:]:
            if body in seen:
                cut = start - len(opening)
                return max(0, cut - 1 if text[:cut].endswith("\n") else cut)
            seen.add(body)
        checked = len(bodies)
        return -1

    return until


def _closed_calls(text: str) -> list[tuple[int, str]]:
    """(where the tag opens, the body) of every closed ``<tool_call>...</tool_call>``."""
    out, pos = [], 0
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start)) >= 0:
        out.append((start, text[start + len(OPEN) : end].strip()))
        pos = end + len(CLOSE)
    return out


class ToolCallStream:
    """Streams content while holding back anything that may become a tool call.

    ``feed`` returns the text that is safe to show now: everything before a ``<tool_call>``
    tag, minus a tail that could still grow into one. A reply that starts like bare JSON
    (``{``, ``[`` or a code fence) is held whole. ``finish`` parses what was held and
    returns (the content not yet shown, the calls).
    """

    def __init__(self, names: Sequence[str], *, repair: bool = True) -> None:
        self.names = list(names)
        self.repair = repair
        self.text = ""
        self.shown = 0
        self._held = False  # a tag or a JSON start was seen: hold the rest

    def feed(self, chunk: str) -> str:
        self.text += chunk
        if self._held:
            return ""
        if not self.shown:
            head = self.text.lstrip()
            if head.startswith(("{", "[", "```")):
                self._held = True
            if not head or self._held or (len(head) < 3 and "```".startswith(head)):
                return ""  # held, or still undecided
        tag = self.text.find(OPEN, self.shown)
        if tag >= 0:
            self._held = True
            safe = tag
        else:
            safe = len(self.text) - _partial_tag(self.text)
        out, self.shown = self.text[self.shown : safe], max(self.shown, safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_tool_calls(self.text, self.names, repair=self.repair)
        if not calls:
            return self.text[self.shown :], []
        # the shown part is the text before the first tag, i.e. a prefix of the content
        return content[self.shown :], calls


def _partial_tag(text: str, tag: str = OPEN) -> int:
    """How many trailing chars of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
