"""Chat templates: turning a message list into the exact text the model was trained on.

Prefix reuse depends on one property: rendering a conversation and then rendering it
again with more messages appended must give a string that starts with the first one.
Every template here keeps earlier turns byte-stable as the conversation grows.

The embedded Gemma GGUF carries no template, so kvshelf supplies Gemma's turn format
(and its own tool format, which ``kvshelf.serving.tools`` writes and parses); models that
ship a Jinja ``chat_template`` use theirs, rendered by transformers' own renderer with a
fixed date, and with mlx-lm's tool parser where it knows the template's format.

A last assistant message marked ``"prefix": True`` (as in Mistral's API) is left open:
the model continues it instead of starting a fresh turn. The server uses this to start
a forced tool call or a JSON object. Its rendering is a byte prefix of the same message
rendered complete, so the next turn still reuses the cache.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Message = Mapping[str, Any]
VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatTemplate(Protocol):
    """Renders messages to prompt text (without the BOS token).

    ``writes_bos`` says whether the reference rendering (transformers'
    ``apply_chat_template``, which tokenizes the template's text with
    ``add_special_tokens=False``) starts with the model's BOS: only a template that writes
    ``bos_token`` itself gives one, whatever ``add_bos_token`` says. The engine prepends the
    BOS id exactly then (``kvshelf.model.loader``), so prompt ids equal the reference's.

    ``tools`` (OpenAI function specs) are shown by a template that renders them itself
    (a model's own Jinja template: see ``native_tool_parser``); kvshelf's own templates
    ignore them, and the caller describes the tools in the system text instead
    (``kvshelf.structured.plan``)."""

    stop_strings: tuple[str, ...]
    writes_bos: bool

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str: ...


def message_text(message: Message) -> str:
    """The text of a message; OpenAI-style content parts are joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError("only text content parts are supported")
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, not {type(content).__name__}")


def validate_messages(messages: Any) -> list[Message]:
    """Check the shape of a message list; raise ValueError with a usable message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in VALID_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(VALID_ROLES)}, not {role!r}")
        message_text(m)
        out.append(m)
    return out


def split_open_turn(messages: Sequence[Message]) -> tuple[Sequence[Message], str]:
    """Separate a trailing ``{"role": "assistant", "prefix": True}`` message.

    Returns the messages before it and its text ("" when there is no open turn).
    """
    if messages and messages[-1].get("role") == "assistant" and messages[-1].get("prefix") is True:
        return messages[:-1], message_text(messages[-1])
    return messages, ""


def _tool_call_text(message: Message) -> str:
    calls = message.get("tool_calls") or []
    lines = []
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        lines.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
    return "\n".join(f"<tool_call>{line}</tool_call>" for line in lines)


class GemmaTemplate:
    """Gemma's turn format. System text joins the first user turn, as Gemma expects."""

    stop_strings: tuple[str, ...] = ("<end_of_turn>",)
    writes_bos = True  # Gemma's own template starts with ``{{ bos_token }}``

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,  # kvshelf's own format: shown in the system text
    ) -> str:
        messages, opened = split_open_turn(messages)
        system = [message_text(m) for m in messages if m["role"] in ("system", "developer")]
        prefix = "\n\n".join(system) + "\n\n" if system else ""
        out = []
        for m in messages:
            role = m["role"]
            if role in ("system", "developer"):
                continue
            text = message_text(m)
            if role == "assistant":
                calls = _tool_call_text(m)
                text = f"{text}\n{calls}" if text and calls else text or calls
                out.append(f"<start_of_turn>model\n{text}<end_of_turn>\n")
                continue
            if role == "tool":
                name = m.get("name") or m.get("tool_call_id") or "tool"
                text = f"<tool_response name={json.dumps(name)}>\n{text}\n</tool_response>"
            if prefix:
                text, prefix = prefix + text, ""
            out.append(f"<start_of_turn>user\n{text}<end_of_turn>\n")
        if prefix:  # only system messages so far
            out.append(f"<start_of_turn>user\n{prefix.rstrip()}<end_of_turn>\n")
        if add_generation_prompt or opened:
            out.append("<start_of_turn>model\n" + opened)
        return "".join(out)


class ChatMLTemplate:
    """A plain role-tagged format for models with no template of their own."""

    stop_strings: tuple[str, ...] = ("<|im_end|>",)
    writes_bos = False  # ChatML writes no BOS (a ``bos_token`` such as <|im_start|> would double it)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,  # kvshelf's own format: shown in the system text
    ) -> str:
        messages, opened = split_open_turn(messages)
        out = []
        for m in messages:
            text = message_text(m)
            if m["role"] == "assistant":
                calls = _tool_call_text(m)
                text = f"{text}\n{calls}" if text and calls else text or calls
            out.append(f"<|im_start|>{m['role']}\n{text}<|im_end|>\n")
        if add_generation_prompt or opened:
            out.append("<|im_start|>assistant\n" + opened)
        return "".join(out)


FIXED_DATE = datetime.date(2026, 1, 1)
"""The date a template's ``strftime_now`` sees. Templates that print today's date (Llama 3,
Mistral, Granite) would otherwise change every agent's system prompt at midnight, and with
it every cached prefix: a record saved yesterday would be recomputed from its first token."""


@dataclass(frozen=True)
class ToolParser:
    """mlx-lm's parser for the tool-call format a model's template uses (``mlx_lm.tool_parsers``)."""

    name: str
    start: str
    end: str
    parse: Callable[..., Any]

    def calls(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Every call in ``text``, as ``{"name", "arguments"}`` dicts; a malformed one raises ValueError."""
        out: list[dict[str, Any]] = []
        rest = text
        while (i := rest.find(self.start)) >= 0:
            rest = rest[i + len(self.start) :]
            if self.end:
                body, sep, rest = rest.partition(self.end)
            else:  # the format has no closing tag (Mistral's [TOOL_CALLS]): the rest is the call
                body, sep, rest = rest, "", ""
            try:
                parsed = self.parse(body, list(tools) if tools is not None else None)
            except Exception as exc:  # each parser raises its own kind
                raise ValueError(f"a {self.name} tool call could not be parsed: {exc}") from exc
            out.extend(parsed if isinstance(parsed, list) else [parsed])
            if not sep:
                break
        return out

    def split(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) of a whole reply: the text before the first call, and the calls
        (with ``tools``, only calls of those functions). A reply without a call that parses
        is all content: a failed call is never lost."""
        i = text.find(self.start)
        if i < 0:
            return text, []
        try:
            found = self.calls(text[i:], tools)
        except ValueError:
            return text, []
        names = {str(t.get("function", t).get("name")) for t in tools} if tools is not None else None
        calls = [
            c
            for c in found
            if isinstance(c, Mapping) and isinstance(c.get("name"), str) and (names is None or c["name"] in names)
        ]
        return (text[:i], calls) if calls else (text, [])

    def stream(self, tools: Sequence[Mapping[str, Any]] | None = None) -> CallStream:
        """A reader of a streamed reply: shows its content as it comes, holds back its calls."""
        return CallStream(self, tools)


class CallStream:
    """A streamed reply in a model's own tool-call format (``ToolParser``): content is
    shown as it comes, except what might be the start of a call (held back until it is
    clearly not); from the first call on, everything is held for ``finish``."""

    def __init__(self, parser: ToolParser, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self._parser, self._tools = parser, tools
        self._text, self._shown = "", 0
        self._calling = False

    def feed(self, chunk: str) -> str:
        """The content that may be shown now."""
        self._text += chunk
        if self._calling:
            return ""
        start = self._parser.start
        i = self._text.find(start, self._shown)
        if i >= 0:
            self._calling = True
            safe = i
        else:
            tail = self._text[self._shown :]
            held = next((k for k in range(min(len(start) - 1, len(tail)), 0, -1) if start.startswith(tail[-k:])), 0)
            safe = len(self._text) - held
        out, self._shown = self._text[self._shown : safe], max(self._shown, safe)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not shown yet, the calls). Calls that do not parse come back as content."""
        content, calls = self._parser.split(self._text, self._tools)
        if not calls:
            return self._text[self._shown :], []
        return content[self._shown :], calls


def infer_tool_parser(chat_template: str, vocab: Mapping[str, int], name: str | None = None) -> ToolParser | None:
    """The parser mlx-lm would use for this template (or the one ``name``d in the tokenizer
    config's ``tool_parser_type``); None where mlx-lm knows none."""
    import importlib

    from mlx_lm.tokenizer_utils import _infer_tool_parser

    class _Probe:  # the two things mlx-lm's inference reads from a tokenizer
        def __init__(self) -> None:
            self.chat_template = chat_template

        def get_vocab(self) -> Mapping[str, int]:
            return vocab

    name = name or _infer_tool_parser(_Probe())
    if name is None:
        return None
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolParser(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def native_tool_parser(template: ChatTemplate) -> ToolParser | None:
    """The parser of the model's own tool-call format, where the model's template shows
    ``tools`` itself and mlx-lm can read its calls back; None where kvshelf's own format
    is used instead (Gemma, ChatML, a template without tools or whose format mlx-lm
    does not know): the tools are then described in the system text."""
    if isinstance(template, JinjaTemplate) and template.renders_tools:
        return template.tool_parser
    return None


def _template_message(message: Message) -> dict[str, Any]:
    """A message as Hugging Face templates read it: text content, and each earlier tool
    call's ``arguments`` as a dict (OpenAI sends a JSON string; templates ``tojson`` it)."""
    out = dict(message, content=message_text(message))
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = dict(call.get("function", call))
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


class JinjaTemplate:
    """A model's own Hugging Face ``chat_template``, rendered by transformers' own renderer.

    The template is compiled by transformers (``chat_template_utils``: its sandbox, its
    ``tojson``, ``{% break %}``/``{% continue %}``, ``{% generation %}``, ``raise_exception``),
    so a template renders here exactly as ``apply_chat_template`` renders it, except that
    ``strftime_now`` sees a fixed date (``FIXED_DATE``), so prefixes stay byte-stable from
    one day to the next. ``tools`` (OpenAI function specs) are handed to the template, which
    shows them in the model's own format; ``tool_parser`` reads that format's calls back
    (mlx-lm's parser for it), or is None where mlx-lm knows none.
    """

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        stop_strings: tuple[str, ...] = (),
        *,
        date: datetime.date = FIXED_DATE,
        tool_parser: ToolParser | None = None,
    ):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self._template = _compile_jinja_template(source)  # transformers' cache: compiled once per process
        self._source = source
        self._bos, self._eos = bos_token, eos_token
        self.stop_strings = stop_strings
        self.tool_parser = tool_parser
        self.renders_tools = "tools" in source
        """True when the template shows ``tools`` itself (else a caller describes them in text)."""
        self._date = datetime.datetime.combine(date, datetime.time())
        self.writes_bos = self._writes_bos()

    def _writes_bos(self) -> bool:
        """Whether a rendered conversation starts with the BOS text, probed once on a
        one-message conversation (a template that refuses that one is taken to write the
        BOS if it names ``bos_token`` at all)."""
        if not self._bos:
            return False
        try:
            probe = self._template.render(
                messages=[{"role": "user", "content": "Hi"}],
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
                strftime_now=self._strftime_now,
            )
        except Exception:  # e.g. raise_exception for a conversation without a system turn
            return "bos_token" in self._source
        return probe.startswith(self._bos)

    def _strftime_now(self, fmt: str) -> str:
        return self._date.strftime(fmt)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        messages, opened = split_open_turn(messages)
        text = self._template.render(
            messages=[_template_message(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt or bool(opened),
            bos_token=self._bos,
            eos_token=self._eos,
            strftime_now=self._strftime_now,  # a render variable shadows transformers' global, for this render only
        )
        if self._bos and text.startswith(self._bos):
            text = text[len(self._bos) :]  # the engine adds BOS as a token id
        return text + opened
