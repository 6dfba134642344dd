"""Helpers shared by the benchmarks: offline texts, prompts of an exact token length, output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from kvshelf import _blas

RESULTS = Path(__file__).parent / "results"


def offline_text() -> str:
    """Long English prose available on any Debian or Python install (licences, pydoc)."""
    parts = []
    for name in ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "GFDL-1.3"):
        p = Path("/usr/share/common-licenses") / name
        if p.exists():
            parts.append(p.read_text(errors="replace"))
    from pydoc_data.topics import topics

    parts.extend(topics[k] for k in sorted(topics))
    return "\n\n".join(parts)


def licence_text(name: str = "GPL-3") -> str:
    """One licence from Debian's common-licenses (GPL-3: about 8K Gemma tokens of legal prose)."""
    return (Path("/usr/share/common-licenses") / name).read_text(errors="replace")


def pydoc_text() -> str:
    """Python's reference-manual topics (pydoc_data): technical prose with code, 100K+ tokens."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


TEXTS = {"gpl3": licence_text, "pydoc": pydoc_text}


def prompt_of_tokens(tokenizer, n: int, salt: str = "") -> str:
    """Text that encodes to about ``n`` tokens (a distinct ``salt`` makes distinct prompts)."""
    ids = tokenizer.encode(salt + offline_text())
    while len(ids) < n:
        ids = ids + ids
    return tokenizer.decode(ids[:n])


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "mlx_device": str(mx.default_device()),
        "blas": _blas.loaded_path or "MLX bundled BLAS",
        "python": platform.python_version(),
    }


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2))
    return path


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget a file's cached pages, so the next read hits the disk."""
    if hasattr(os, "posix_fadvise"):
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
