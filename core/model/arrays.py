"""MLX arrays as Python buffers: borrowing an array's memory without a copy.

``mx.array`` implements the buffer protocol, but mlx's type stubs do not declare it;
this is the one place that says so, for the record codec, the prefix hashes and the
projection's zero-copy view of the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer


def borrow(array: mx.array) -> memoryview:
    """The array's own memory (evaluated first if still lazy), borrowed, not copied."""
    return memoryview(cast("Buffer", array))


def buffer_view(array: mx.array) -> np.ndarray:
    """A numpy array over ``array``'s own memory (evaluated first if still lazy), no copy."""
    return np.asarray(borrow(array))
