"""Helpers every section shares: offline texts, exact-length prompts, timing summaries.

Everything here works offline: the texts come from Python's own reference manual
(``pydoc_data``) and Debian's licences, so a benchmark never needs the network.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import kvshelf  # noqa: F401  (OpenBLAS before mlx)


def licence_text(name: str = "GPL-3") -> str:
    """One licence from Debian's common-licenses (GPL-3: about 8K Gemma tokens of legal prose)."""
    path = Path("/usr/share/common-licenses") / name
    if path.exists():
        return path.read_text(errors="replace")
    return pydoc_text()  # not Debian: fall back to prose that every Python has


def pydoc_text() -> str:
    """Python's reference-manual topics (pydoc_data): technical prose with code, 100K+ tokens."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


TEXTS = {"gpl3": licence_text, "pydoc": pydoc_text}


def offline_text() -> str:
    """Long English prose available on any Debian or Python install (licences, pydoc)."""
    parts = []
    for name in ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "GFDL-1.3"):
        p = Path("/usr/share/common-licenses") / name
        if p.exists():
            parts.append(p.read_text(errors="replace"))
    parts.append(pydoc_text())
    return "\n\n".join(parts)


def prompt_of_tokens(tokenizer: Any, n: int, salt: str = "") -> str:
    """Text that encodes to about ``n`` tokens (a distinct ``salt`` makes distinct prompts)."""
    ids = tokenizer.encode(salt + offline_text())
    while len(ids) < n:
        ids = ids + ids
    return tokenizer.decode(ids[:n])


def documents(tokenizer: Any, count: int, max_tokens: int, min_tokens: int | None = None) -> dict[str, str]:
    """``count`` distinct documents of ``min_tokens``..``max_tokens`` tokens: reference-manual topics.

    Topics are taken in name order, spread over the whole manual so that they differ
    in subject (lexical analysis, exceptions, formatting, the import system...), and
    each is cut at a line boundary to at most ``max_tokens`` tokens. The few non-ASCII
    characters are dropped, so any tokenizer can encode the documents.
    """
    from pydoc_data.topics import topics

    min_tokens = min_tokens if min_tokens is not None else max_tokens // 2
    fitting: list[tuple[str, str]] = []
    for name in sorted(topics):
        # ASCII only: every tokenizer encodes it (the tests' byte-level one has no unknown token)
        text = topics[name].encode("ascii", "ignore").decode()
        ids = tokenizer.encode(text)
        if len(ids) < min_tokens:
            continue
        if len(ids) > max_tokens:
            text = tokenizer.decode(ids[:max_tokens])
            text = text[: text.rfind("\n")] if "\n" in text[len(text) // 2 :] else text
        fitting.append((name, text.strip()))
    if len(fitting) < count:
        raise ValueError(f"only {len(fitting)} reference topics have {min_tokens}+ tokens; need {count}")
    step = len(fitting) / count
    return dict(fitting[int(i * step)] for i in range(count))


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget a file's cached pages, so the next read hits the disk."""
    if hasattr(os, "posix_fadvise") and path.exists():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bandwidth(directory: Path, size: int = 256 << 20) -> float:
    """Bytes/s reading a fresh file from disk (page cache dropped first)."""
    path = directory / "bandwidth.probe"
    path.write_bytes(os.urandom(size))
    drop_from_page_cache(path)
    t = time.perf_counter()
    with path.open("rb") as f:
        while f.read(8 << 20):
            pass
    elapsed = time.perf_counter() - t
    path.unlink()
    return size / elapsed


def follow_up(messages: list[dict], reply: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]
