"""How a test that compares a warm cache with a fresh one, bit for bit, sizes its prefill.

Greedy turns and prefill-only requests run the shape-invariant kernels
(``LoadedModel.greedy_forward``), so at the engine's default prefill chunk, as users run
it, a cache is a pure function of its tokens however they were chunked across turns.
deepseek_v2's attention (MLA) is not chunk-invariant yet (a warm continuation differs from
a fresh prefill in the last bits), so its cases still feed one token per forward call:
then a warm and a fresh cache are made by the same one-token calls.
"""

from __future__ import annotations

import inspect

from kvshelf.runtime.engine import Engine

NOT_CHUNK_INVARIANT = frozenset({"deepseek_v2"})
DEFAULT_CHUNK: int = inspect.signature(Engine).parameters["prefill_chunk"].default


def exact_chunk(kind: str) -> int:
    """The ``prefill_chunk`` under which a ``kind`` model's cache is a pure function of its
    tokens: the engine's default where the greedy kernels are shape-invariant, else 1."""
    return 1 if kind in NOT_CHUNK_INVARIANT else DEFAULT_CHUNK
