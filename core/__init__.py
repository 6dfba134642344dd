"""kvshelf: every LLM agent keeps its own persistent 4-bit KV cache.

The public surface is what this module exports (see ``__all__``): the ``Engine``, the
values it hands back, the generation settings, the agent id type and the errors.
Everything else is an implementation layer (``kvshelf.model``, ``kv``, ``storage``,
``runtime``, ``structured``, ``serving``) whose names may change between releases.

Importing kvshelf is cheap (MLX is imported with the ``Engine``, on first use), and it
first preloads OpenBLAS on Linux (see ``kvshelf.model.blas``) so that
MLX's CPU backend does not fall back to the slow reference BLAS; that is why the
preload comes before anything that imports ``mlx``.
"""

from typing import TYPE_CHECKING, Any

from kvshelf.model.blas import load_openblas

load_openblas()

# isort: split
from kvshelf.errors import (  # noqa: E402  (after the OpenBLAS preload)
    AgentBusy,
    AgentExists,
    ContextLengthExceeded,
    InvalidAgentId,
    InvalidSchema,
    KVShelfError,
    StorageError,
    UnknownAgent,
)
from kvshelf.runtime.params import DEFAULT_MAX_TOKENS, GenerationParams  # noqa: E402
from kvshelf.runtime.results import AgentInfo, ChatResult, ForgetResult, ForkResult, Usage  # noqa: E402
from kvshelf.storage.agent_id import AgentId, validate_agent_id  # noqa: E402
from kvshelf.structured.tools import ToolCall  # noqa: E402

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvshelf.runtime.engine import Engine


def __getattr__(name: str) -> Any:
    """``kvshelf.Engine`` is imported on first use: it brings in MLX and mlx-lm (seconds),
    which a client of a remote ``kvshelf serve`` (``kvshelf.adapters`` with ``base_url``)
    never needs."""
    if name == "Engine":
        from kvshelf.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'kvshelf' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "AgentBusy",
    "AgentExists",
    "AgentId",
    "AgentInfo",
    "ChatResult",
    "ContextLengthExceeded",
    "Engine",
    "ForgetResult",
    "ForkResult",
    "GenerationParams",
    "InvalidAgentId",
    "InvalidSchema",
    "KVShelfError",
    "StorageError",
    "ToolCall",
    "UnknownAgent",
    "Usage",
    "__version__",
    "validate_agent_id",
]
