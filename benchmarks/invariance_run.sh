#!/usr/bin/env bash
# The issue-21 identity run: benchmarks/invariance.py's 50 conversations, their stages packed
# into processes (``--plan``), each under the shared test lock (never more than ~5 minutes at a time), so
# benchmarks and others' tests get the machine between them. Resumable: rerun it with the
# same run directory and it goes on where it stopped (finished stages are skipped).
#
#   setsid nohup benchmarks/invariance_run.sh [RUN_DIR] >/dev/null 2>&1 &
#   (INVARIANCE_BY_CONVERSATION=1: one process per conversation, one model load each, longer
#   holds of the lock; INVARIANCE_NICE=0 to run at normal priority: a machine nobody else benchmarks on)
#   (or from a frozen copy: git archive HEAD | tar -x -C DIR; git rev-parse HEAD >DIR/FROZEN_COMMIT)
#   python benchmarks/invariance.py --report RUN_DIR     # pool what is done
#
# Logs to RUN_DIR/run.log. Stops after two failures in a row of the same group.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RUN_DIR="${1:-$ROOT/benchmarks/results/invariance-50-$(date -u +%Y%m%d-%H%M%S)}"
PY="${PYTHON:-/work/main/.venv/bin/python}"
export PYTHONPATH="${PYTHONPATH:-$ROOT/.typecheck}"
# Run from a frozen copy (``git archive``) so that editing the checkout cannot change a run
# under way; it has no git, so it is told its commit.
if ! git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
  export INVARIANCE_COMMIT="${INVARIANCE_COMMIT:-$(cat "$ROOT/FROZEN_COMMIT" 2>/dev/null || echo unknown)}"
fi
mkdir -p "$RUN_DIR"
LOG="$RUN_DIR/run.log"
cd "$ROOT"
echo "$(date -u +%FT%TZ) start: run dir $RUN_DIR, pid $$, commit ${INVARIANCE_COMMIT:-$(git rev-parse HEAD)}" >>"$LOG"
while read -r work; do
  for attempt in 1 2; do
    echo "$(date -u +%FT%TZ) process for $work, attempt $attempt; load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$LOG"
    start=$(date +%s)
    if /work/bin/kv-test nice -n "${INVARIANCE_NICE:-10}" env PYTHONPATH="$PYTHONPATH" "$PY" benchmarks/invariance.py \
      --run-dir "$RUN_DIR" --work "$work" </dev/null >>"$LOG" 2>&1; then
      echo "$(date -u +%FT%TZ) $work done in $(($(date +%s) - start)) s" >>"$LOG"
      break
    fi
    echo "$(date -u +%FT%TZ) $work FAILED after $(($(date +%s) - start)) s" >>"$LOG"
    [ "$attempt" = 2 ] && { echo "$(date -u +%FT%TZ) giving up" >>"$LOG"; exit 1; }
  done
done < <("$PY" benchmarks/invariance.py --plan ${INVARIANCE_BY_CONVERSATION:+--by-conversation})
echo "$(date -u +%FT%TZ) all conversations done" >>"$LOG"
