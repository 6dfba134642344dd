"""Framework identities as kvshelf agent ids.

Frameworks name agents freely ("Research Analyst", "alice_3f2a…", an md5 key), while an
agent id becomes a file name and is held to a strict whitelist. ``agent_key`` keeps an
id that is already valid, and otherwise makes a readable slug plus a hash of the exact
name, so two names never collide and the same name always maps to the same cache.

Some calls carry no agent at all (CrewAI's forced final answer, LangChain runs without
metadata). ``fallback_key`` keys those by the system text and the tools: calls that share
a persona share a cache, and that key is stable across restarts. It depends on content
only, never on incidental order: tools are keyed sorted by name (``langgraph-supervisor``
builds its handoff tools from a ``set``, whose order follows ``PYTHONHASHSEED``), and
each tool's JSON with sorted keys. Two *unnamed* agents with the same system text and
tools therefore share one cache: answers stay correct (prefix reuse only reuses what
matches, token for token), but each evicts the other's history; name them to keep them
apart.

``scoped_key`` nests an agent's name under a caller-wide id (``user-42.researcher``), so
an id given for a whole run never merges the agents of one graph.

Both return an ``AgentId``: this is where an adapter's id is validated, once; the
backend, the server's request code and the engine's caller-facing checks take it as it is.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvshelf.errors import InvalidAgentId
from kvshelf.storage.agent_id import AgentId

_UNSAFE = re.compile(r"[^A-Za-z0-9._:@-]+")


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


def agent_key(name: str, prefix: str = "") -> AgentId:
    """A valid, stable agent id for a framework's agent name (``prefix`` namespaces it)."""
    if isinstance(name, AgentId) and not prefix:
        return name
    candidate = f"{prefix}{name}"
    try:
        return AgentId(candidate)
    except InvalidAgentId:
        pass
    slug = _UNSAFE.sub("-", name).strip("-.")[:80].replace("..", ".") or "agent"
    return AgentId(f"{prefix}{slug}-{_digest(name)}")


def scoped_key(scope: str, name: str) -> AgentId:
    """``<scope>.<name>`` as a valid id: agent ``name`` within a caller-wide ``scope``."""
    return agent_key(f"{scope}.{name}")


def _tool_name(tool: Any) -> str:
    if isinstance(tool, Mapping):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
        return str(name or "")
    return ""


def _tool_text(tool: Any) -> str:
    return json.dumps(tool, sort_keys=True, default=str)


def sorted_tools(tools: Sequence[Any]) -> list[Any]:
    """``tools`` in canonical order: by name, then by content. A call keyed by its content
    (``fallback_key``) shows the model its tools this way too, so that the same content
    renders the same prompt, and finds the same cached tokens, in every process."""
    return sorted(tools, key=lambda t: (_tool_name(t), _tool_text(t)))


def canonical_tools(tools: Sequence[Any]) -> str:
    """The tools as one canonical text: sorted by name (then by content), keys sorted."""
    return json.dumps([_tool_text(t) for t in sorted_tools(tools)])


def fallback_key(
    messages: Sequence[Mapping[str, Any]], prefix: str = "anon-", tools: Sequence[Any] | None = None
) -> AgentId:
    """A stable id for a call that names no agent: a hash of its system text and tools.

    The same in every process and for any order of ``tools`` (see the module doc).
    Raises ``InvalidAgentId`` when ``prefix`` cannot start an id."""
    system = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") in ("system", "developer"))
    if tools:
        system = f"{system}\n{canonical_tools(tools)}"
    return AgentId(f"{prefix}{_digest(system)}")
