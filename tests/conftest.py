"""Shared fixtures. Importing kvshelf first preloads OpenBLAS before MLX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvshelf  # noqa: F401  (must precede any mlx import)
import pytest

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
    from kvshelf.model import load

    return load("embedded", progress=False)


def run_in_subprocess(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh Python process (a real restart); it must print one JSON line last."""
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
