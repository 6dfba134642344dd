"""Where a prompt's messages end, in tokens: the positions worth a boundary checkpoint.

A sliding-window cache can resume a new conversation only at a position it kept
(``kvshelf.kv.checkpoints``). Conversations of one agent share a prefix up to a message
boundary: the same system prompt (the next CrewAI task, the next LangGraph ``invoke``),
or the same history up to the last complete turn (a retried, edited or trimmed last
message). So a request names two positions: the end of its leading system messages (of
its first message, if it has none) and the end of everything before its newest message.

A position is found by rendering the messages before it, without a generation prompt,
and taking the tokens that rendering shares with the whole prompt. That works whatever
the template does at the boundary: where the rendering is a prefix (ChatML, most Jinja
templates) it is the exact message end; where the template folds the system text into
the first user turn (Gemma) the shared tokens stop where the system text does, which is
also where a conversation with the same system prompt and another question diverges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvshelf.kv.agent_cache import common_prefix_length
from kvshelf.model.loader import LoadedModel
from kvshelf.model.template import Message

SYSTEM_ROLES = ("system", "developer")


# What a conversation with the same leading messages might go on with: the boundary of
# a prompt that is all system text (a preamble prefilled ahead, to fork from) is where
# the rendering with and without a next message part.
PROBE: Message = {"role": "user", "content": "?"}


def boundary_counts(messages: Sequence[Message]) -> list[int]:
    """How many leading messages end at each boundary: the system messages (else the
    first message) and all but the newest one."""
    first = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), len(messages)) or 1
    return sorted({k for k in (first, len(messages) - 1) if 0 < k <= len(messages)})


def message_boundaries(
    loaded: LoadedModel,
    messages: Sequence[Message],
    prompt: list[int],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[int, ...]:
    """Token positions in ``prompt`` (the rendering of ``messages``, with ``tools`` for a
    template that shows them) where messages end; empty for a model whose every layer
    can rewind (nothing to checkpoint)."""
    if all(layer.window is None for layer in loaded.spec.layers):
        return ()

    def encode(head: Sequence[Message]) -> list[int]:
        return loaded.tokenizer.encode_prompt(loaded.template.render(head, add_generation_prompt=False, tools=tools))

    out = set()
    for k in boundary_counts(messages):
        ids = encode(messages[:k])
        p = common_prefix_length(ids, prompt)
        if k == len(messages):  # nothing follows in this prompt: where would a next message part?
            p = min(p, common_prefix_length(ids, encode([*messages, PROBE])))
        if 0 < p < len(prompt):
            out.add(p)
    return tuple(sorted(out))
