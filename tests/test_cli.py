"""The command line a new user meets first: --version, defaults in --help, the BLAS line, doctor."""

from __future__ import annotations

import os
import subprocess
import sys

import kvshelf
from kvshelf.runtime.anonymous import MAX_ENTRIES
from tests.support import REPO_ROOT


def kvshelf_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvshelf.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def test_version_and_defaults_in_help():
    r = kvshelf_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvshelf {kvshelf.__version__}"
    demo = kvshelf_cli("demo", "--help").stdout
    assert "(default: 2)" in demo and "(default: 48)" in demo and "--log-level" in demo
    serve = " ".join(kvshelf_cli("serve", "--help").stdout.split())
    assert "(default: 8000)" in serve and "(default: 127.0.0.1)" in serve and "(default: info)" in serve
    assert "--anonymous-prefixes N requests that name no agent: keep the caches of the last N" in serve
    assert f"starts cold) (default: {MAX_ENTRIES})" in serve
    refused = kvshelf_cli("serve", "--anonymous-prefixes", "-1")
    assert refused.returncode == 2 and "expected a whole number, 0 or more, not '-1'" in refused.stderr


def test_doctor_reports_the_blas_it_measured(tmp_path):
    home = {"KVSHELF_HOME": str(tmp_path)}
    fast = kvshelf_cli("doctor", env=home)
    assert fast.returncode == 0, fast.stdout + fast.stderr
    report = {line.split(maxsplit=1)[0]: line for line in fast.stdout.splitlines() if line.strip()}
    assert "OpenBLAS" in report["BLAS"] and "GFLOP/s" in report["matmul"]
    assert "cpu" in report["device"].lower() and str(tmp_path) in report["store"]
    assert "WARNING" not in fast.stdout
    # the same machine without the OpenBLAS preload: the reference BLAS, a warning naming the fix, status 1
    slow = kvshelf_cli("doctor", env={**home, "KVSHELF_NO_OPENBLAS": "1"})
    assert slow.returncode == 1
    warning = next(line for line in slow.stdout.splitlines() if line.startswith("WARNING"))
    assert "reference BLAS" in warning and "Fix: unset KVSHELF_NO_OPENBLAS" in warning


def test_every_command_that_runs_the_model_names_its_blas_first(tmp_path):
    """The demo on a tiny model: the BLAS line is the first thing on stderr, and the
    warning appears exactly when the reference BLAS is in use."""
    from tests.support.tiny import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "m", "llama")
    # no rounds: the BLAS lines come before the model loads, and a round is thousands of prompt
    # tokens (twice, once on the reference BLAS) that this test does not look at
    args = ("demo", "--model", str(model), "--cache-dir", str(tmp_path / "c"), "--turns", "0")
    fast = kvshelf_cli(*args)
    assert fast.returncode == 0, fast.stderr
    assert fast.stderr.splitlines()[0].startswith("BLAS: OpenBLAS") and "WARNING" not in fast.stderr
    slow = kvshelf_cli(*args, env={"KVSHELF_NO_OPENBLAS": "1"})
    assert slow.returncode == 0, slow.stderr
    lines = slow.stderr.splitlines()
    assert lines[0].startswith("BLAS: reference BLAS") and lines[1].startswith("WARNING: MLX is using the reference")
