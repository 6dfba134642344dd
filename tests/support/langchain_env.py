"""The environment every LangChain test module runs in (used as an autouse fixture)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshelf.paths import kvshelf_home


def offline_langchain_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``$HOME`` in a temporary directory (the converted model stays where it is), no
    tracing, no server or key from the environment."""
    patch = pytest.MonkeyPatch()
    patch.setenv("KVSHELF_HOME", str(kvshelf_home()))
    patch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    patch.setenv("LANGSMITH_TRACING", "false")
    patch.setenv("LANGCHAIN_TRACING_V2", "false")
    patch.delenv("KVSHELF_API_KEY", raising=False)
    patch.delenv("KVSHELF_BASE_URL", raising=False)
    yield
    patch.undo()
