"""Shared fixtures (helpers live in tests/support). Importing kvshelf first preloads OpenBLAS before MLX."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvshelf  # noqa: F401  (must precede any mlx import)
from tests.support.tiny import CONFIGS, make_tiny_model_dir


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


def pytest_configure(config: pytest.Config) -> None:
    """With pytest-xdist workers, compile every loop once before they start
    (``tests/support/numba_warm.py`` says why: numba's cache and concurrent writers)."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", default=None):
        from tests.support.numba_warm import warm

        warm()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that loads the real embedded model is an ``embedded`` test, marked or not.

    The marker decides the fast tier (``-m "not embedded"``: tiny models only), so it is
    derived from what a test really uses: any test whose fixtures reach ``embedded_loaded``
    (loading Gemma 3 270M costs seconds, far more with a cold page cache) gets it too.
    """
    for item in items:
        if "embedded_loaded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.embedded)
        # A module may name single parametrized cases it expects to fail (``XFAIL_CASES``:
        # item name -> reason), for suites such as langchain-tests whose tests must not be
        # overridden; the mark is strict, so a case that starts passing fails the run.
        reason = getattr(getattr(item, "module", None), "XFAIL_CASES", {}).get(item.name)
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
