"""A software prefetch for numba loops: ask for a weight row's cache lines before they are read.

Why: a product of several rows by a weight (``kvshelf.model.skinny``) computes long enough
on each weight row that the hardware prefetcher, which follows the loads, no longer runs
far enough ahead; the loop then waits for memory and computes in turn instead of both at
once. Eight rows by the embedded Gemma 3's 262144x640 head took 40-51 ms, its memory
alone about 22 and its arithmetic about 16 (2-core EPYC). Asking for the rows a few rows
ahead overlaps the two: 23-25 ms (scratch runs, 2026-12-06).

``line(a, i, j)`` compiles to LLVM's ``llvm.prefetch`` of the address of ``a[i, j]``: a
hint, which never faults and changes no result. Importing this module imports numba, so
the loops import it when they are built; they call it as ``prefetch.line`` (a module
attribute, which numba resolves when it compiles), so that numba's on-disk cache, which
keys a loop by its closure's values, finds the same key in every process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# Floats in a 64-byte cache line: a row is prefetched one line in this many elements.
LINE_FLOATS = 16


def _prefetch_typing(typingctx: Any, array: Any, i: Any, j: Any) -> Any:
    """numba's typing of ``line``, and the LLVM it compiles to."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        index = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:])]
        address = cgutils.get_item_pointer(context, builder, array_type, view, index)
        byte_pointer = builder.bitcast(address, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer.type, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        # read (0), locality 2 (into the L2 and up: the line is read once), a data cache (1)
        builder.call(function, [byte_pointer, i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return types.void(array, i, j), codegen


# Prefetch the cache line of ``array[i, j]`` (a 2-D array) for reading; inside numba loops only.
line = cast(Callable[[Any, int, int], None], intrinsic(_prefetch_typing))
