"""Framework identities as kvshelf agent ids.

Frameworks name agents freely ("Research Analyst", "alice_3f2a…", an md5 key), while an
agent id becomes a file name and is held to a strict whitelist. ``agent_key`` keeps an
id that is already valid, and otherwise makes a readable slug plus a hash of the exact
name, so two names never collide and the same name always maps to the same cache.

Some calls carry no agent at all (CrewAI's forced final answer, LangChain runs without
metadata). ``fallback_key`` keys those by the system text: calls that share a persona
share a cache, and that key is stable across restarts.

Both return an ``AgentId``: this is where an adapter's id is validated, once; the
backend, the server's request code and the engine's caller-facing checks take it as it is.
"""

from __future__ import annotations

import hashlib
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


def fallback_key(messages: Sequence[Mapping[str, Any]], prefix: str = "anon-") -> AgentId:
    """A stable id for a call that names no agent: a hash of its system text.

    Raises ``InvalidAgentId`` when ``prefix`` cannot start an id."""
    system = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") in ("system", "developer"))
    return AgentId(f"{prefix}{_digest(system)}")
