"""The demo (the main job): it streams, persists its agents, resumes them warm, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvshelf.demo import AGENTS, Console, _after_sentences, run_demo
from kvshelf.model.loader import load
from tests.support import REPO_ROOT
from tests.support.tiny import make_tiny_model_dir


def test_demo_second_run_restores_every_agent(tiny_dirs, tmp_path, capsys):
    first = run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=2, max_tokens=4)
    assert first["requests"] == {"hot": len(AGENTS), "warm": 0, "cold": len(AGENTS)}
    second = run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=1, max_tokens=4)
    assert second["requests"] == {"hot": 0, "warm": len(AGENTS), "cold": 0}
    out = capsys.readouterr().out
    assert "continuing the conversation at round 3" in out and out.count("[warm | cached ") == len(AGENTS)


def test_a_meeting_whose_minutes_outgrow_the_context_starts_over_instead_of_failing(tiny_dirs, tmp_path, capsys):
    run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=1, max_tokens=4)
    state_file = tmp_path / "demo-state.json"
    state = json.loads(state_file.read_text())
    context = load(str(tiny_dirs["gemma3_text"])).context_length
    filler = "The council heard a long report on the state of the roads. " * (context // 12)
    state["minutes"] = {agent: text + filler for agent, text in state["minutes"].items()}
    state_file.write_text(json.dumps(state))  # as if many earlier runs had filled the minutes
    capsys.readouterr()
    again = run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=1, max_tokens=4)
    out = capsys.readouterr().out
    assert "no longer leave room for a round" in out and "the council starts a new meeting" in out
    assert again["requests"] == {"hot": 0, "warm": 0, "cold": len(AGENTS)}  # the old caches were dropped
    minutes = json.loads(state_file.read_text())["minutes"]
    assert "round 2" in out and all(filler not in text for text in minutes.values())


def test_demo_streams_each_reply_beside_its_cache_figures(tiny_dirs, tmp_path, capsys):
    run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=1, max_tokens=6)
    lines = capsys.readouterr().out.splitlines()
    for speaker in ("Ada (town planner)", "Dev (student)"):
        i = next(i for i, line in enumerate(lines) if line.startswith(f"  {speaker}: "))
        assert lines[i + 1].strip().startswith("[cold | cached 0/") and " | ttft " in lines[i + 1]


def test_a_prefill_note_has_a_line_of_its_own_and_a_speech_ends_after_two_sentences():
    shown = io.StringIO()
    console = Console(shown)
    console.write("round 1\n")
    console.progress("  (Ada: prefill 128/600 tokens, 21%, 2 s)")
    console.write("  Ada (town planner): I think")
    assert shown.getvalue() == "round 1\n  (Ada: prefill 128/600 tokens, 21%, 2 s)\n  Ada (town planner): I think"
    until = _after_sentences(2)
    assert until("we back option 2. It costs 1.5 million") == -1  # "2." and "1.5" end no sentence
    text = "we back option 2. It costs 1.5 million. Then the shed. More"
    assert text[: until(text)] == "we back option 2. It costs 1.5 million. Then the shed."


class Reader:
    """Collects a child's output on a thread, so the test can wait for a line without blocking."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(1):
            self.text += chunk

    def wait_for(self, predicate, proc: subprocess.Popen, timeout: float = 120, exited_ok: bool = False) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            if exited_ok and proc.poll() is not None:
                return
            assert proc.poll() is None, self.text
            assert time.monotonic() < deadline, self.text
            time.sleep(0.05)


# The moments a Ctrl-C can come, each named by the output line it waits for: while the
# model loads (after the BLAS line, before the engine exists), in the middle of the
# planner's streaming reply, between two replies (the planner's figures are out: its save,
# the state file and the next prefill are under way), and a second Ctrl-C during the stop.
CTRL_C_MOMENTS = {
    "loading": lambda t: "BLAS:" in t,
    "reply": lambda t: len(t.partition("Ada (town planner): ")[2]) >= 20,
    "between replies": lambda t: "[cold | cached " in t.partition("Ada (town planner): ")[2],
    "twice": lambda t: len(t.partition("Ada (town planner): ")[2]) >= 20,
}


def ignoring_sigint(cmd: list[str]) -> list[str]:
    """``cmd`` started with SIGINT ignored, as a shell or CI runner starts a background job:
    the demo must take Ctrl-C itself (exec keeps an ignored signal ignored)."""
    code = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", code, *cmd]


@pytest.mark.parametrize("moment", CTRL_C_MOMENTS)
def test_ctrl_c_saves_says_what_was_saved_and_exits_130_without_a_traceback(tmp_path, moment):
    # no EOS: the first reply runs on (to max_tokens) until it is interrupted
    model = make_tiny_model_dir(tmp_path / "model", "gemma3_text", eos=False)
    cmd = [sys.executable, "-m", "kvshelf.cli", "demo", "--model", str(model), "--cache-dir", str(tmp_path / "c")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        ignoring_sigint([*cmd, "--max-tokens", "3000"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    reader = Reader(proc)
    try:
        reader.wait_for(CTRL_C_MOMENTS[moment], proc)
        proc.send_signal(signal.SIGINT)
        if moment == "twice":  # again while it stops (or once it has stopped: 130 either way)
            reader.wait_for(lambda t: "interrupted: stopping" in t, proc, exited_ok=True)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader._thread.join(10)
    out = reader.text
    assert rc == 130, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    if moment == "twice":  # the second Ctrl-C quits at once, the listing of what is on disk perhaps unfinished
        assert "interrupted: stopping the reply in progress" in out
        return
    assert "kvshelf demo: interrupted" in out
    if moment == "loading":
        return  # nothing was generated, so nothing to save
    assert "interrupted: stopping the reply in progress" in out
    assert "demo-planner" in out and " saved" in out and "NOT saved" not in out, out
    if moment != "reply":
        return
    # the next run picks the planner up from disk, warm, with the cache the interrupted turn left
    again = subprocess.run(
        [*cmd, "--turns", "1", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    planner = again.stdout.partition("Ada (town planner): ")[2].splitlines()[1]
    assert planner.strip().startswith("[warm | cached ") and not planner.strip().startswith("[warm | cached 0/")
