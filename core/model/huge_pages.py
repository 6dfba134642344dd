"""The model's weights in 2 MB pages, so that a decode step streams them at the memory's speed.

Why: a decode step reads every weight once, and with 4 KB pages each 4 KB of a 671 MB
head is another page-table entry to walk (the TLB holds a few thousand) and a boundary
the hardware prefetcher stops at. numpy asks Linux for huge pages for its own large
arrays; MLX's allocator does not. Measured on the embedded Gemma 3 (a Zen 4 EPYC,
``benchmarks/huge_pages.py``, ``results/huge-pages-20261204-193006.json``: two copies of
the model in one process, one collapsed, decode steps interleaved, 1K context), a step
took 58.3 against 62.1 ms at batch 1, 62.6 against 70.4 at batch 4 and 116.1 against
122.6 at batch 8 (medians of 12). The 30-layer llama, whose layer weights are under 2 MB
each and stay in small pages, showed no difference (43.9 against 43.8 at batch 1).

How: ``madvise(MADV_COLLAPSE)`` (Linux 6.1 and later) on every 2 MB-aligned stretch of
each weight's buffer, which moves those pages into huge pages in place: the same memory,
the same values, nothing else changes. It costs about 2 s of one core for Gemma 3's
1.07 GB, so it runs on a background thread after the model is loaded (the model is usable
meanwhile). Where it cannot be done (another OS, an older kernel, transparent huge pages
``never``, no free 2 MB blocks) nothing happens. ``KVSHELF_NO_HUGE_PAGES=1`` skips it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvshelf.model.arrays import buffer_view
from kvshelf.switches import env_on

HUGE_PAGE = 1 << 21
THREAD_NAME = "kvshelf-huge-pages"
MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1)


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _stretch(array: mx.array) -> tuple[int, int] | None:
    """The 2 MB-aligned part of ``array``'s buffer: (start address, length), if any."""
    view = buffer_view(array)
    start, end = view.ctypes.data, view.ctypes.data + view.nbytes
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi > lo else None


def collapse(arrays: list[mx.array]) -> int:
    """Move the 2 MB-aligned stretches of these arrays' buffers into huge pages; returns
    the bytes moved (0 where the system cannot)."""
    return _collapse_stretches([s for s in map(_stretch, arrays) if s is not None])


def _collapse_stretches(stretches: list[tuple[int, int]], keep: object = None) -> int:
    """``collapse`` of stretches found already (``keep``: what keeps their memory alive)."""
    madvise = _madvise()
    if madvise is None:
        return 0
    return sum(length for start, length in stretches if madvise(start, length, MADV_COLLAPSE) == 0)


def huge_page_bytes(arrays: list[mx.array]) -> int:
    """Bytes in huge pages of the mappings that hold these arrays (/proc/self/smaps; 0 off
    Linux). Linux merges adjacent anonymous mappings, so a mapping may hold other arrays too.
    Every mapping a buffer overlaps counts, not only the one it starts in: a buffer may
    begin at the end of the brk heap (never in huge pages) and go on in the next mapping."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return 0
    spans = [(buffer_view(a).ctypes.data, a.nbytes) for a in arrays]
    total, inside = 0, False
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's address range opens its entry
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(lo < s + n and s < hi for s, n in spans)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def weights_of(model: nn.Module) -> list[mx.array]:
    """The model's parameters of at least one huge page, largest first (the head first)."""
    pairs = tree_flatten(model.parameters(), destination=[])
    assert isinstance(pairs, list)  # a list destination gives a list of (name, array) pairs
    arrays = [a for _, a in pairs if isinstance(a, mx.array) and a.nbytes >= HUGE_PAGE]
    return sorted(arrays, key=lambda a: -a.nbytes)


def collapse_in_background(model: nn.Module) -> threading.Thread | None:
    """Start collapsing ``model``'s weights on a daemon thread (ctypes lets the GIL go while
    the kernel works); the thread, or None where it is skipped."""
    if env_on("KVSHELF_NO_HUGE_PAGES") or _madvise() is None:
        return None
    arrays = weights_of(model)
    # found here, on the caller's thread (reading MLX's buffers); only the kernel calls run there
    stretches = [s for s in map(_stretch, arrays) if s is not None]
    if not stretches:
        return None
    thread = threading.Thread(target=_collapse_stretches, args=(stretches, arrays), name=THREAD_NAME, daemon=True)
    thread.start()
    return thread
