"""Where kvshelf keeps converted models and agent records.

Everything lives under one root so that a user can find (and wipe) it: the
platform's user cache dir, or ``$KVSHELF_HOME`` when set (tests and CI use that).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def kvshelf_home() -> Path:
    """The root directory for models and caches."""
    env = os.environ.get("KVSHELF_HOME")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvshelf", appauthor=False))


def models_dir() -> Path:
    return kvshelf_home() / "models"


def default_cache_dir() -> Path:
    """Default directory for per-agent KV records."""
    return kvshelf_home() / "agents"
