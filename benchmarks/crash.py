"""Crash safety: SIGKILL a kvshelf process again and again during saves, evictions and
erasures, and check every record after each kill (the harness is tests/support/crashkit.py, which
says exactly what "acknowledged" means and what is checked).

Each round starts a child on the same cache directory that carries on the four agents'
conversations with a durable engine, kills it (at a random moment, as soon as a record
write is seen in progress, or as soon as an erasure starts), and checks the directory
with a fresh engine. At the end every agent with an acknowledged turn is continued in a
new process and must come back warm.

Runs on a tiny random-weight llama by default (a child starts in about a second, so 60
rounds take a few minutes); the records are real records of the same format and code.

    python benchmarks/crash.py [--rounds 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness and tiny models live with the tests

from common import write_json  # noqa: E402

from tests.support.crashkit import KILL_MODES, Ledger, crash_once, warm_restore_check  # noqa: E402
from tests.support.tiny import make_tiny_model_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="kills (at least 50 for the issue's bar)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvshelf-crash-") as tmp:
        model = make_tiny_model_dir(Path(tmp) / "llama", "llama")
        cache = Path(tmp) / "cache"
        ledger = Ledger()
        outcomes = []
        t0 = time.perf_counter()
        for i in range(args.rounds):
            mode = KILL_MODES[i % len(KILL_MODES)]
            o = crash_once(model, cache, ledger, seed=args.seed * 100_000 + i, mode=mode)
            outcomes.append(o)
            states = " ".join(f"{a[-1]}={s}" for a, s in o.records.items())
            print(
                f"round {i + 1:3d} {mode:9s} acked {o.ops_acked:3d}  in flight: {o.in_flight or '-':16s} "
                f"temp left: {o.temp_files_left}  {states}  {'OK' if not o.failures else o.failures}",
                flush=True,
            )
        restored = warm_restore_check(model, cache, ledger)
        elapsed = time.perf_counter() - t0

    failures = [f for o in outcomes for f in o.failures]
    summary = {
        "rounds": len(outcomes),
        "failures": len(failures),
        "acknowledged_ops": sum(o.ops_acked for o in outcomes),
        "kills_by_mode": dict(Counter(o.mode for o in outcomes)),
        "kills_inside_a_record_write": sum(o.temp_files_left > 0 for o in outcomes),
        "in_flight_at_kill": dict(Counter((o.in_flight or "nothing").split(" ")[0] for o in outcomes)),
        "record_states_after_kill": dict(Counter(s for o in outcomes for s in o.records.values())),
        "warm_restores_at_end": restored,
        "seconds": round(elapsed, 1),
    }
    print("\n" + "\n".join(f"{k}: {v}" for k, v in summary.items()))
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures))
    path = write_json(
        "crash", {"summary": summary, "failure_messages": failures, "rounds": [asdict(o) for o in outcomes]}
    )
    print(f"wrote {path}")
    sys.exit(1 if failures or set(restored.values()) - {"warm"} else 0)


if __name__ == "__main__":
    main()
