"""Shared fixtures. Importing kvshelf first preloads OpenBLAS before MLX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvshelf  # noqa: F401  (must precede any mlx import)

sys.path.insert(0, str(Path(__file__).parent))
from tiny import CONFIGS, make_tiny_model_dir  # noqa: E402

TESTS_DIR = Path(__file__).parent


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved random-weight model directory per architecture."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: make_tiny_model_dir(root / kind, kind) for kind in CONFIGS}


@pytest.fixture(scope="session")
def embedded_loaded():
    """The embedded Gemma 3 270M, converted once per machine and loaded once per session."""
    from kvshelf.model.loader import load

    return load("embedded", progress=False)


def run_in_subprocess(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh Python process (a real restart); it must print one JSON line last."""
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def continue_in_new_process(model: str, cache_dir: Path, agent_id: str, messages: list[dict], max_tokens: int) -> dict:
    """A real restart: a new process restores ``agent_id`` from ``cache_dir`` and continues.

    Returns the next-token logits after ``messages`` and the greedy reply's token ids.
    """
    import numpy as np

    out = cache_dir / f"{agent_id}-restored.npy"
    code = f"""
import json, numpy as np, kvshelf
from kvshelf.runtime.engine import Engine
e = Engine(model={model!r}, cache_dir={str(cache_dir)!r}, progress=False)
np.save({str(out)!r}, e.prefill({agent_id!r}, {messages!r}))
r = e.chat({agent_id!r}, {messages!r}, max_tokens={max_tokens})
print(json.dumps({{"tokens": r.token_ids, "cache": r.cache, "cached": r.usage.cached_tokens}}))
"""
    result = run_in_subprocess(code)
    result["logits"] = np.load(out)
    return result
