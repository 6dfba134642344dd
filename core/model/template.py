"""Chat templates: turning a message list into the exact text the model was trained on.

Prefix reuse depends on one property: rendering a conversation and then rendering it
again with more messages appended must give a string that starts with the first one.
Every template here keeps earlier turns byte-stable as the conversation grows.

The embedded Gemma GGUF carries no template, so kvshelf supplies Gemma's turn format;
models that ship a Jinja ``chat_template`` use theirs.

A last assistant message marked ``"prefix": True`` (as in Mistral's API) is left open:
the model continues it instead of starting a fresh turn. The server uses this to start
a forced tool call or a JSON object. Its rendering is a byte prefix of the same message
rendered complete, so the next turn still reuses the cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Message = Mapping[str, Any]
VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatTemplate(Protocol):
    """Renders messages to prompt text (without the BOS token)."""

    stop_strings: tuple[str, ...]

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str: ...


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

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
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

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
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


class JinjaTemplate:
    """A model's own Hugging Face ``chat_template``, rendered in a sandbox."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", stop_strings: tuple[str, ...] = ()):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        self._template = env.from_string(source)
        self._bos, self._eos = bos_token, eos_token
        self.stop_strings = stop_strings

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        messages, opened = split_open_turn(messages)
        msgs = [dict(m, content=message_text(m)) for m in messages]
        text = self._template.render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt or bool(opened),
            bos_token=self._bos,
            eos_token=self._eos,
        )
        if self._bos and text.startswith(self._bos):
            text = text[len(self._bos) :]  # the engine adds BOS as a token id
        return text + opened
