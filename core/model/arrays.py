"""MLX arrays as Python buffers: borrowing an array's memory without a copy.

``mx.array`` implements the buffer protocol, but mlx's type stubs do not declare it;
this is the one place that says so, for the record codec, the prefix hashes and the
projection's zero-copy view of the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx

if TYPE_CHECKING:
    from typing_extensions import Buffer


def borrow(array: mx.array) -> memoryview:
    """The array's own memory (evaluated first if still lazy), borrowed, not copied."""
    return memoryview(cast("Buffer", array))
