"""The first five minutes, timed: ``kvshelf demo`` as a new user runs it.

    python benchmarks/first_run.py [--model embedded] [--out benchmarks/results]

Side by side, in one run, on the same machine:
1. ``kvshelf demo --fresh`` with OpenBLAS: wall time, every reply's cache source and TTFT;
2. ``kvshelf demo`` again: the conversation continues, every agent restored warm from disk;
3. ``kvshelf demo --fresh`` without OpenBLAS (``KVSHELF_NO_OPENBLAS=1``, MLX's reference
   BLAS), stopped with SIGINT after its first reply: that reply's TTFT against run 1's;
4. Ctrl-C during a cold prefill (OpenBLAS): seconds from SIGINT to exit, and the exit status.

How much the agents copy each other: the share of each speech's word 8-grams that an
earlier speech of the conversation (run 1, then run 2) already said, over all speeches
(0: every speech says something new; 1: every speech is a copy), and the speeches that
are mostly (half or more) copied. ``--share-of RESULT.json`` prints these figures for a
result written earlier (a run before a change to the demo).

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
SPEECH = re.compile(r"^  ([A-Z][a-z]+ \([^)]*\)): (.*)$", re.M)  # "  Ada (town planner): ..."
WORD = re.compile(r"[a-z0-9']+")


def speeches(output: str) -> list[str]:
    """The speeches a demo run printed, in order, each as the user read it (opening included)."""
    return [m[2] for m in SPEECH.finditer(output)]


def repeated_ngrams(said: list[str], n: int = 8) -> dict:
    """How much of each speech repeats an earlier one: the share of its word ``n``-grams
    (lowercased words) that an earlier speech holds, over all speeches, and per speech."""
    seen: set[tuple[str, ...]] = set()
    total = repeated = 0
    per_speech = []
    for text in said:
        words = WORD.findall(text.lower())
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        old = sum(g in seen for g in grams)
        total, repeated = total + len(grams), repeated + old
        per_speech.append(round(old / len(grams), 3) if grams else 0.0)
        seen.update(grams)
    return {
        "n": n,
        "speeches": len(said),
        "ngrams": total,
        "repeated": repeated,
        "share": round(repeated / total, 3) if total else 0.0,
        "mostly_copied_speeches": sum(s >= 0.5 for s in per_speech),
        "per_speech": per_speech,
    }


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
    ap.add_argument("--share-of", type=Path, help="print the repeated 8-gram figures of an earlier result and exit")
    args = ap.parse_args()
    if args.share_of is not None:
        earlier = json.loads(args.share_of.read_text())
        said = speeches(earlier["first_run"]["output"]) + speeches(earlier["second_run"]["output"])
        print(json.dumps(repeated_ngrams(said)))
        return 0
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
        "repeated_8grams": repeated_ngrams(speeches(first["output"]) + speeches(second["output"])),
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
    copied = result["repeated_8grams"]
    print(
        f"repeated 8-grams across the {copied['speeches']} speeches: {copied['repeated']}/{copied['ngrams']} "
        f"({copied['share']:.1%}); speeches mostly copied: {copied['mostly_copied_speeches']}"
    )
    print(f"load average {load}; written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
