"""The RAM side of the block pool: which agents are resident, and the byte budget.

Blocks are owned by agents (``AgentCache``), so the pool counts real bytes: each
agent's allocated 256-token blocks, and each shared prefix (``kvshelf.kv.shared``)
once, however many resident agents start on it. When the total passes the budget, the
least recently used agents are spilled (saved by the shelf, ``kvshelf.runtime.shelf``,
then dropped), which frees their blocks for real. Only the shelf uses this container.

Everything it keeps per agent is for resident agents only and goes with them, so a
process that has served 100,000 agents holds no more bookkeeping than one that served
the few now in RAM. Listings read ``residents()``, a snapshot kept as agents are put
back, so they never need the worker thread that owns the caches.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kvshelf.kv.agent_cache import AgentCache

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: int | str | None) -> int | None:
    """``2GB``, ``512MiB``, ``1e9`` or an int; None means no budget."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value <= 0:
            raise ValueError("budget must be positive")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use e.g. '2GB', '512MiB' or bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError("budget must be positive")
    return n


@dataclass(frozen=True)
class Resident:
    """A resident agent as a listing shows it, as of when it was last put back."""

    tokens: int
    ram_bytes: int
    last_used: float


class BlockPool:
    """Resident agent caches in least-recently-used order, under a byte budget."""

    def __init__(self, budget: int | str | None = None):
        self.budget = parse_bytes(budget)
        self._agents: OrderedDict[str, AgentCache] = OrderedDict()
        self.last_used: dict[str, float] = {}
        """When each resident agent was last used (an evicted agent's is its record's mtime)."""
        self._residents: dict[str, Resident] = {}
        # Bytes the step loop holds for the agents decoding now, on top of their blocks (the
        # decode working set, ``kvshelf.kv.working_set``): they count against the budget too.
        # Asked when needed, so an agent that just finished is no longer counted.
        self.working_bytes: Callable[[], int] = lambda: 0

    def get(self, agent_id: str) -> AgentCache | None:
        return self._agents.get(agent_id)

    def put(self, agent_id: str, cache: AgentCache) -> None:
        self._agents[agent_id] = cache
        self.touch(agent_id)

    def touch(self, agent_id: str) -> None:
        self._agents.move_to_end(agent_id)
        now = self.last_used[agent_id] = time.time()
        cache = self._agents[agent_id]
        self._residents[agent_id] = Resident(len(cache.tokens), cache.nbytes, now)

    def pop(self, agent_id: str) -> AgentCache | None:
        self.last_used.pop(agent_id, None)
        self._residents.pop(agent_id, None)
        return self._agents.pop(agent_id, None)

    def residents(self) -> dict[str, Resident]:
        """A snapshot of the resident agents, safe to take from any thread (one dict copy)."""
        return self._residents.copy()

    def __contains__(self, agent_id: str) -> bool:
        return agent_id in self._agents

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._agents))

    @property
    def resident_bytes(self) -> int:
        """Every resident agent's own blocks, plus each shared prefix in use once."""
        return _bytes(self._agents.values())

    def over_budget_victims(self) -> list[str]:
        """Agents to spill, oldest first, until the rest (and the working set) fit the budget.

        A shared prefix is freed only with its last resident user, so spilling an agent
        frees its own blocks, and the prefix's too if nobody else holds it."""
        if self.budget is None:
            return []
        rest = list(self._agents.items())
        victims = []
        while rest and _bytes(c for _, c in rest) + self.working_bytes() > self.budget:
            victims.append(rest.pop(0)[0])
        return victims


def _bytes(caches: Iterable[AgentCache]) -> int:
    own, shared = 0, {}
    for c in caches:
        own += c.nbytes
        if c.shared is not None:
            shared[c.shared.id] = c.shared.nbytes
    return own + sum(shared.values())
