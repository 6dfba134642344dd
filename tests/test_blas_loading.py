"""Which OpenBLAS kvshelf preloads for MLX (kvshelf.model.blas), and the opt-in pip one
(``kvshelf[openblas]``, kvshelf.model.pip_openblas): loaded only where its checks pass,
else one line saying why. Each case runs in a fresh interpreter, since the preload happens
once, when kvshelf is first imported, and is judged by which library MLX's ``cblas_sgemm``
really resolves to (blas_check) and by a matmul MLX computes through it."""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvshelf.model import blas, pip_openblas
from tests.support import REPO_ROOT

LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
EXTRA_LINE = "kvshelf: the OpenBLAS of kvshelf[openblas]"

# What the child reports: the candidate the loader took, the library that provides
# cblas_sgemm to MLX, and an MLX matmul checked against numpy's.
REPORT = """
import json
import kvshelf
from kvshelf.model import blas, blas_check
import mlx.core as mx
import numpy as np
info = blas_check.detect()
a = np.random.default_rng(0).standard_normal((96, 80), dtype=np.float32)
with mx.stream(mx.cpu):
    got = np.asarray(mx.array(a) @ mx.array(a.T))
print(json.dumps({
    "source": blas.loaded_source, "loaded": blas.loaded_path, "refused": blas.extra_refused,
    "provider": info.path, "provider_source": info.source, "slow": info.slow, "line": info.line(),
    "matmul_ok": bool(np.allclose(got, a @ a.T, rtol=1e-4, atol=1e-3)), "fix": blas_check.fix_for_this_os(),
}))
"""


def run_child(env: dict[str, str], code: str = REPORT, prefix: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """The child's report and the lines kvshelf wrote to its stderr."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("KVSHELF_NO_OPENBLAS", "KVSHELF_OPENBLAS")}
    done = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**child_env, **env},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvshelf:")]
    return json.loads(done.stdout.strip().splitlines()[-1]), lines


def extra_file() -> Path:
    found = pip_openblas.installed_file()
    assert found is not None, "the dev extra brings kvshelf[openblas]: pip install -e '.[dev]'"
    return found


def test_cpu_flags_are_read_from_the_text_given():
    intel = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert pip_openblas.cpu_flags(intel) == {"fpu", "sse", "sse2", "avx", "avx2", "avx512f"}
    assert pip_openblas.cpu_flags("processor : 0\nFeatures : fp asimd\n") == {"fp", "asimd"}
    assert pip_openblas.cpu_flags("no flags here\n") == frozenset()


@pytest.mark.skipif(not LINUX_X86, reason="kvshelf[openblas] is a Linux x86-64 wheel (the check says so elsewhere)")
def test_the_extra_is_checked_against_the_cpu_it_would_run_on():
    library = extra_file()
    assert pip_openblas.check(library, "flags : fpu sse sse2 avx2\n") is None
    why = pip_openblas.check(library, "flags : fpu tsc cx8\n")  # an x86 without SSE2
    assert why is not None and "lacks" in why and "sse2" in why
    # the real CPU: the verdict follows its flags, whichever they are
    expected_ok = pip_openblas.NEEDED_FLAGS <= pip_openblas.cpu_flags()
    assert (pip_openblas.check(library) is None) == expected_ok


def test_a_build_for_one_cpu_is_refused_and_off_linux_x86_anything_is(tmp_path):
    one_cpu = tmp_path / "libopenblas.so.0"
    one_cpu.write_bytes(b"\x7fELF OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4\x00")
    why = pip_openblas.check(one_cpu, "flags : sse2\n")
    if LINUX_X86:
        assert why is not None and "one CPU" in why  # not an OpenBLAS with run-time dispatch
    else:
        assert why is not None and "Linux x86-64" in why


@pytest.mark.skipif(not LINUX_X86, reason="kvshelf[openblas] is a Linux x86-64 wheel")
def test_without_the_system_openblas_mlx_runs_on_the_extra(tmp_path):
    """The system's OpenBLAS skipped: on a CPU with what the extra's kernels need, MLX's
    cblas_sgemm is the extra's and its matmul is right; on one without, it is refused
    with one line and MLX keeps its reference BLAS."""
    library = os.path.realpath(extra_file())
    report, lines = run_child({"KVSHELF_NO_SYSTEM_OPENBLAS": "1", "KVSHELF_HOME": str(tmp_path)})
    assert report["matmul_ok"]
    if pip_openblas.NEEDED_FLAGS <= pip_openblas.cpu_flags():
        assert report["source"] == "kvshelf[openblas]" and report["refused"] is None
        assert report["provider"] == library and report["provider_source"] == "kvshelf[openblas]"
        assert not report["slow"] and report["line"].startswith("BLAS: OpenBLAS") and lines == []
    else:
        assert report["source"] is None and report["slow"] and len(lines) == 1 and "lacks" in lines[0]


@pytest.mark.skipif(not LINUX_X86, reason="kvshelf[openblas] is a Linux x86-64 wheel")
def test_a_cpu_without_the_needed_instruction_sets_is_refused_in_one_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu vme de pse tsc msr cx8 mmx\n")
    report, lines = run_child(
        {"KVSHELF_NO_SYSTEM_OPENBLAS": "1", "KVSHELF_CPUINFO": str(cpuinfo), "KVSHELF_HOME": str(tmp_path)}
    )
    assert report["source"] is None and report["slow"] and report["provider"] is None
    assert report["matmul_ok"]  # the reference BLAS: slow, still right
    assert len(lines) == 1 and lines[0].startswith(EXTRA_LINE), lines
    assert "lacks the instruction set(s) its kernels need (sse2)" in lines[0]
    assert "sudo apt-get install -y libopenblas0-pthread" in lines[0] and "KVSHELF_OPENBLAS" in lines[0]
    assert "kvshelf[openblas] is installed but was not loaded: this CPU lacks" in report["fix"]
    if blas.installed_path() is not None:  # the system's is there, only skipped: the fix says so first
        assert report["fix"].startswith("unset KVSHELF_NO_SYSTEM_OPENBLAS")


def test_the_override_comes_first_and_a_missing_one_is_said(tmp_path):
    """KVSHELF_OPENBLAS names the library to load; one that does not load is said in one line
    and the next candidate is taken."""
    missing = tmp_path / "libopenblas.so"
    report, lines = run_child({"KVSHELF_OPENBLAS": str(missing), "KVSHELF_HOME": str(tmp_path)})
    assert len(lines) == 1 and f"KVSHELF_OPENBLAS={missing} is not used" in lines[0]
    assert "cannot open shared object file" in lines[0] and report["matmul_ok"]
    if LINUX_X86:
        library = str(extra_file())
        report, lines = run_child({"KVSHELF_OPENBLAS": library, "KVSHELF_HOME": str(tmp_path)})
        assert report["source"] == "KVSHELF_OPENBLAS" and report["loaded"] == library and lines == []
        assert report["provider"] == os.path.realpath(library) and report["matmul_ok"]


def _hide(paths: list[str]) -> tuple[str, ...]:
    """A prefix that runs the child in its own mount namespace with ``paths`` replaced by an
    empty file: a machine without them (root only: CI and this project's machines run as root)."""
    assert shutil.which("unshare") is not None and os.geteuid() == 0, "needs root and util-linux's unshare"
    mounts = " && ".join(f"mount --bind /dev/null {p}" for p in paths)
    return ("unshare", "-m", "sh", "-c", f'{mounts} && exec "$0" "$@"')


def _system_fortran_runtimes() -> list[str]:
    folders = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/usr/local/lib")
    found = {os.path.realpath(p) for folder in folders for p in glob.glob(f"{folder}/libgfortran.so.5*")}
    return sorted(found) or ["/dev/null"]  # none: nothing to hide, the mount is a no-op


@pytest.mark.skipif(not LINUX_X86, reason="kvshelf[openblas] is a Linux x86-64 wheel")
def test_without_the_systems_fortran_runtime_the_extra_uses_the_mlx_wheels(tmp_path):
    """No libgfortran5 (no sudo to install it): the extra still loads, through symlinks in
    KVSHELF_HOME to the GNU Fortran runtime that the mlx[cpu] wheel bundles."""
    prefix = _hide(_system_fortran_runtimes())
    report, lines = run_child({"KVSHELF_NO_SYSTEM_OPENBLAS": "1", "KVSHELF_HOME": str(tmp_path)}, prefix=prefix)
    assert report["source"] == "kvshelf[openblas]" and lines == [] and report["matmul_ok"]
    assert report["loaded"] == str(tmp_path / "openblas" / extra_file().name)
    assert report["provider"] == os.path.realpath(extra_file())
    assert os.readlink(tmp_path / "openblas" / "libgfortran.so.5").endswith(".so.5.0.0")


@pytest.mark.skipif(not LINUX_X86, reason="kvshelf[openblas] is a Linux x86-64 wheel")
def test_with_no_fortran_runtime_at_all_the_extra_is_refused_in_one_line(tmp_path):
    bundled = pip_openblas.bundled_fortran_runtime()
    assert bundled is not None
    prefix = _hide([*_system_fortran_runtimes(), str(bundled[0])])
    code = "import json, kvshelf\nfrom kvshelf.model import blas\nprint(json.dumps({'source': blas.loaded_source}))"
    report, lines = run_child({"KVSHELF_NO_SYSTEM_OPENBLAS": "1", "KVSHELF_HOME": str(tmp_path)}, code, prefix)
    assert report["source"] is None and len(lines) == 1 and lines[0].startswith(EXTRA_LINE), lines
    assert "libgfortran.so.5" in lines[0] and "did not load" in lines[0]


@pytest.mark.skipif(not LINUX_X86, reason="kvshelf[openblas] is a Linux x86-64 wheel")
def test_doctor_names_the_candidate_it_loaded_and_measures_it(tmp_path):
    env = {**os.environ, "KVSHELF_NO_SYSTEM_OPENBLAS": "1", "KVSHELF_HOME": str(tmp_path)}
    env.pop("KVSHELF_NO_OPENBLAS", None)
    done = subprocess.run(
        [sys.executable, "-m", "kvshelf.cli", "doctor"], capture_output=True, text=True, cwd=REPO_ROOT, env=env
    )
    report = {line.split(maxsplit=1)[0]: line for line in done.stdout.splitlines() if line.strip()}
    if pip_openblas.NEEDED_FLAGS <= pip_openblas.cpu_flags():
        assert done.returncode == 0, done.stdout + done.stderr
        assert report["BLAS"].endswith("from kvshelf[openblas]") and str(pip_openblas.version()) in report["candidates"]
        assert "DYNAMIC_ARCH" in report["build"] and report["candidates"].endswith("-> loaded: kvshelf[openblas]")
        assert float(report["matmul"].split()[1]) > 0 and "GFLOP/s" in report["matmul"]
    else:
        assert done.returncode == 1 and "refused: this CPU lacks" in report["candidates"]


def test_the_reference_blas_warning_offers_the_extra_where_it_would_work():
    from kvshelf.model import blas_check

    fix = blas_check.fix_for_this_os()
    fortran = pip_openblas.system_fortran_runtime_loads() or pip_openblas.bundled_fortran_runtime() is not None
    would = LINUX_X86 and pip_openblas.NEEDED_FLAGS <= pip_openblas.cpu_flags() and fortran
    assert blas_check.extra_would_work() == would
    assert ("without sudo: pip install 'kvshelf[openblas]'" in fix) == would
