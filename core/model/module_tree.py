"""A copy of an MLX module tree over the same arrays, some of its modules replaced.

The sgemv/BLIS projections (``gemv``) and the row-invariant attention (``attention``)
each run a loaded model through wrappers of some of its modules without touching the
model itself (no monkeypatching, and the default kernels stay one call away). Both
walk the tree the same way, so the walk lives here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.nn as nn


def with_children(module: nn.Module, make: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` whose every child module, also inside lists, tuples
    and dicts, is ``make(child)``; arrays and other values are shared, not copied."""
    new = copy.copy(module)
    for key, value in module.items():
        new[key] = _mapped(value, make)
    return new


def _mapped(value: Any, make: Callable[[nn.Module], nn.Module]) -> Any:
    if isinstance(value, nn.Module):
        return make(value)
    if isinstance(value, list):
        return [_mapped(v, make) for v in value]
    if isinstance(value, tuple):
        return tuple(_mapped(v, make) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, make) for k, v in value.items()}
    return value
