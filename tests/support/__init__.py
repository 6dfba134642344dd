"""Helpers shared by the tests (and benchmarks/crash.py): tiny models, servers, subprocesses, crash rounds.

Fixtures stay in tests/conftest.py; everything here is plain code, imported as
``from tests.support.tiny import make_tiny_model_dir`` with the repository root on the
path (pytest puts it there because ``tests`` is a package; subprocesses run from it).
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
