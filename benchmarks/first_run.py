"""The first five minutes, timed: ``kvshelf demo`` as a new user runs it.

    python benchmarks/first_run.py [--model embedded] [--out benchmarks/results]

Side by side, in one run, on the same machine:
1. ``kvshelf demo --fresh`` with OpenBLAS: wall time, every reply's cache source and TTFT;
2. ``kvshelf demo`` again: the conversation continues, every agent restored warm from disk;
3. ``kvshelf demo --fresh`` without OpenBLAS (``KVSHELF_NO_OPENBLAS=1``, MLX's reference
   BLAS), stopped with SIGINT after its first reply: that reply's TTFT against run 1's;
4. Ctrl-C during a cold prefill (OpenBLAS): seconds from SIGINT to exit, and the exit status.

Prints the figures and writes them as JSON (``first-run-<time>.json``). The floor for a
cold first turn is its prefill FLOPs over the BLAS throughput ``kvshelf doctor`` measures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STATS = re.compile(r"\[(\w+) \| cached (\d+)/(\d+) \| ttft ([\d.]+) s")


class Demo:
    """A ``kvshelf demo`` child whose output is collected on a thread as it streams."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvshelf.cli", "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        )
        self.text = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read(1):
            self.text += chunk

    def wait_until(self, predicate, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.text) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def finish(self, timeout: float = 1800) -> dict:
        rc = self.proc.wait(timeout)
        wall = time.perf_counter() - self.t0
        self._reader.join(10)
        replies = [
            {"cache": m[1], "cached": int(m[2]), "prompt": int(m[3]), "ttft_s": float(m[4])}
            for m in STATS.finditer(self.text)
        ]
        return {"rc": rc, "wall_s": round(wall, 1), "replies": replies, "output": self.text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvshelf-first-run-"))
    load = {"start": open("/proc/loadavg").read().split()[:3]}
    common = ["--model", args.model]

    first = Demo([*common, "--cache-dir", str(work / "a"), "--fresh"], {}).finish()
    second = Demo([*common, "--cache-dir", str(work / "a")], {}).finish()

    slow = Demo([*common, "--cache-dir", str(work / "b"), "--fresh", "--turns", "1"], {"KVSHELF_NO_OPENBLAS": "1"})
    slow.wait_until(lambda t: STATS.search(t) is not None)
    slow.proc.send_signal(signal.SIGINT)
    no_openblas = slow.finish()

    stop = Demo([*common, "--cache-dir", str(work / "c"), "--fresh"], {})
    stop.wait_until(lambda t: "round 1\n" in t)
    time.sleep(1.0)  # inside the cold prefill of the first turn (about 2.5 s on the idle machine)
    sigint_at = time.perf_counter()
    stop.proc.send_signal(signal.SIGINT)
    stop.wait_until(lambda t: "interrupted: stopping" in t)
    noticed = time.perf_counter() - sigint_at
    stop.wait_until(lambda t: "run kvshelf demo again to continue" in t)
    reported = time.perf_counter() - sigint_at
    interrupted = stop.finish()
    ctrl_c = {
        "rc": interrupted["rc"],
        "sigint_to_message_s": round(noticed, 2),
        "sigint_to_saved_report_s": round(reported, 2),  # the reply stopped, saves flushed, what is on disk said
        "in_cold_prefill": "Ada (town planner):" not in interrupted["output"].partition("interrupted: stopping")[0],
        "sigint_to_exit_s": round(time.perf_counter() - sigint_at, 2),
        "traceback": "Traceback" in interrupted["output"],
    }
    load["end"] = open("/proc/loadavg").read().split()[:3]

    result = {
        "model": args.model,
        "loadavg": load,
        "first_run": first,
        "second_run": second,
        "no_openblas_first_reply": no_openblas,
        "ctrl_c_in_cold_prefill": ctrl_c,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"first-run-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    for name in ("first_run", "second_run"):
        r = result[name]
        print(f"{name}: rc {r['rc']}, wall {r['wall_s']} s, replies {len(r['replies'])}")
        for reply in r["replies"]:
            print(f"   {reply}")
    slow_ttft = no_openblas["replies"][0]["ttft_s"] if no_openblas["replies"] else None
    fast_ttft = first["replies"][0]["ttft_s"] if first["replies"] else None
    print(f"first reply TTFT: OpenBLAS {fast_ttft} s, reference BLAS {slow_ttft} s")
    print(f"Ctrl-C in a cold prefill: {ctrl_c}")
    print(f"load average {load}; written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
