"""What the engine hands back: a chat result with usage and timing, and agent listings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvshelf.structured.tools import ToolCall

CacheSource = Literal["hot", "warm", "cold", "none"]


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timeline:
    """Where a turn's time to first token went, by the node's own clock and in steps of
    its loop: what an operator reads to tell a slow restore from a turn that queued behind
    other agents' work (``kvshelf.runtime.scheduler``). Times are seconds from the
    request's arrival at the engine."""

    admitted_s: float
    """When the loop took the request up (its cache lent, or its restore started)."""
    cache_ready_s: float
    """When the loop had the agent's cache in hand (restored from the store, if it was there)."""
    first_token_s: float
    restored_s: float | None = None
    """When the restore's read and verification ended (None: the cache was in RAM)."""
    prefill_calls: int = 0
    """Model calls that fed this prompt."""
    others_prefill_calls: int = 0
    """Other requests' prefill calls run between this one's arrival and its first token."""
    decode_steps: int = 0
    """Batched decode steps of other agents run between its arrival and its first token."""
    passed_over: int = 0
    """Steps in which it was ready with calls left but got none (shorter turns went first)."""


@dataclass
class ChatResult:
    text: str
    finish_reason: Literal["stop", "length", "tool_calls"]
    usage: Usage
    ttft_s: float
    total_s: float = 0.0
    cache: CacheSource = "cold"  # where the agent's cache came from for this request
    agent_id: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    saved: bool | None = None
    """Durable engines only: True once the agent's record on disk holds this turn, False
    when its save failed (the agent is served from RAM and the save is retried). None
    when the engine does not wait for saves (the default: they are written behind)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """``Engine.chat(tools=...)`` only: the calls parsed out of the reply (``text`` is then
    the content before them), with ``finish_reason`` "tool_calls"."""
    timeline: Timeline | None = field(default=None, repr=False)
    """Where the time to first token went (``Timeline``); None for a turn that sampled none."""


@dataclass
class AgentInfo:
    agent_id: str
    tokens: int
    ram_bytes: int
    disk_bytes: int
    last_used: float | None
    resident: bool


@dataclass
class Residency:
    """Where this engine's agents are, in counts and bytes (what ``/metrics`` exports)."""

    ram_agents: int
    ram_bytes: int
    store_agents: int
    """Agents with a record in the store (on a shared store: every node's)."""
    store_bytes: int


@dataclass
class AgentPage:
    """One page of ``Engine.agents_page``: agents in id order, and whether more follow.

    Pass the last id as ``after`` to get the next page (``has_more`` says whether to)."""

    data: list[AgentInfo]
    has_more: bool

    @property
    def first_id(self) -> str | None:
        return self.data[0].agent_id if self.data else None

    @property
    def last_id(self) -> str | None:
        return self.data[-1].agent_id if self.data else None


@dataclass
class ForkResult:
    """What ``Engine.fork`` made: the new agent, and how much of it is shared."""

    agent_id: str
    source: str
    tokens: int
    shared_tokens: int
    """Tokens in the shared prefix (whole blocks, held once for every agent on it)."""
    shared_prefix: str | None
    saved: bool | None = None
    """Durable engines only: whether both agents' records reached the disk (False: they
    are served from RAM and the saves are retried), as ``ChatResult.saved``."""


@dataclass
class Appended(Usage):
    """What ``Engine.append`` computed, and (durable engines only, as ``ChatResult.saved``)
    whether the agent's record on disk now holds it."""

    saved: bool | None = None


@dataclass
class ForgetResult:
    """What ``Engine.forget`` erased: RAM freed and every file removed."""

    agent_id: str
    ram_bytes_freed: int
    tokens_freed: int
    files_removed: list[str]
