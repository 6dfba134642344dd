"""fp16 and bf16 inside numba loops: widen a weight element as it is loaded, narrow one to make a copy.

Why: numba has no float16 type, but LLVM has, and x86's F16C converts 16 halves at once
(``vcvtph2ps``); these intrinsics hand a uint16 holding fp16's bits to LLVM as a half, so the
loops of ``kvshelf.model.skinny`` read a half-width weight (``kvshelf.model.half_weights``)
with the same vector code as an fp32 one. bf16 is the high half of an fp32's bits, held in
an int16 (numba compiles a loop per dtype, so the two encodings need two): widened by a
shift. ``widen`` is exact for every finite fp16 (subnormals too: the tests check all 63488)
and every bf16, and the identity on an fp32, so one loop body serves all three. Importing
this module imports numba; the loops import it when they are built and call it as a
module attribute (see ``kvshelf.model.prefetch`` for why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


def _widen_typing(typingctx: Any, value: Any) -> Any:
    """numba's typing of ``widen``: fp32 stays itself, a uint16 is read as fp16's bits."""
    if value == types.float32:
        return types.float32(value), lambda context, builder, signature, args: args[0]
    if value == types.uint16:

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(value), codegen
    if value == types.int16:  # bf16's bits: the high half of the fp32's

        def brain(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())

        return types.float32(value), brain
    return None


# A weight element as fp32: itself, the fp16 value its uint16 codes hold, or the bf16 value its
# int16 codes hold; inside numba loops only.
widen = cast(Callable[[Any], float], intrinsic(_widen_typing))


def _narrow_typing(typingctx: Any, value: Any) -> Any:
    """numba's typing of ``narrow``: an fp32 rounded to fp16, as fp16's bits (a uint16)."""
    if value != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


# An fp32 rounded to the nearest fp16, as its bits; inside numba loops only.
narrow = cast(Callable[[float], int], intrinsic(_narrow_typing))
