"""Prefix caches for requests that name no agent: kept in RAM only, matched token for token.

A plain OpenAI client (a framework's own ``ChatOpenAI``, ``OpenAIChatCompletionClient`` or
CrewAI ``LLM`` left to its defaults) sends no ``X-Agent-Id``, ``prompt_cache_key`` or
``user``, yet re-sends its whole, growing conversation every turn. Without an identity
there is nothing to persist under, but the last few anonymous conversations' caches can
still be kept in RAM and reused where a new prompt starts with exactly the same tokens,
as OpenAI's own automatic prompt caching does.

The rules that keep this safe:

- only anonymous requests read or write these caches, so no named agent's cache is ever
  seen by an anonymous one, or the other way round;
- a cache is reused only for the tokens it shares exactly with the new prompt (so what
  the model computes is what it would have computed from nothing);
- nothing here is ever written to disk;
- they live within the byte budget, after the named agents: the shelf shrinks them first,
  to whatever room the named agents leave (``shrink_to``), and a count cap keeps the
  matching cheap.

A cache the new prompt extends (the same conversation, one turn on) is handed out and
leaves this store until its request ends; one that only shares a beginning with it (a
common system prompt) is forked, copy-on-write, so the conversation it belongs to keeps
its own tokens.
"""

from __future__ import annotations

from kvshelf.kv.agent_cache import AgentCache, common_prefix_length

MAX_ENTRIES = 8
"""Anonymous conversations kept at once (each match scans them all)."""

MIN_REUSE_TOKENS = 16
"""A shorter match saves less than the fork costs: start cold instead."""


class AnonymousPrefixes:
    """The recently finished anonymous requests' caches, least recently used first."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 0:
            raise ValueError(f"anonymous prefixes: keep 0 or more, not {max_entries}")
        self.max_entries = max_entries
        self._entries: list[AgentCache] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held here (a fork's arrays that its source shares are counted for both)."""
        return sum(c.nbytes for c in self._entries)

    def take(self, prompt: list[int]) -> AgentCache | None:
        """The kept cache sharing the longest exact token prefix with ``prompt``, or None.

        If the prompt extends all of it, the cache itself is handed out (and leaves the
        store); otherwise a copy-on-write fork, and the original stays for its own
        conversation. The caller cuts it back to the common prefix (``reuse_prefix``).
        """
        best, best_len = None, 0
        for cache in self._entries:
            n = common_prefix_length(cache.tokens, prompt)
            if n > best_len:
                best, best_len = cache, n
        if best is None or best_len < min(MIN_REUSE_TOKENS, len(prompt) - 1):
            return None
        if best_len == len(best.tokens):
            self._entries.remove(best)
            return best
        return best.fork()

    def keep(self, cache: AgentCache) -> None:
        """Keep a finished request's cache (its tokens are what it holds, exactly)."""
        if not cache.tokens or any(c.offset != len(cache.tokens) for c in cache.layers):
            return  # empty, or interrupted mid-forward: not reusable
        self._entries = [c for c in self._entries if c.tokens != cache.tokens]
        self._entries.append(cache)
        del self._entries[: max(0, len(self._entries) - self.max_entries)]

    def shrink_to(self, room: int | None) -> None:
        """Drop the least recently used caches until they fit in ``room`` bytes (None: no limit)."""
        if room is None:
            return
        while self._entries and self.nbytes > max(room, 0):
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()
