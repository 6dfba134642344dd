#!/bin/sh
cd /work/wt/structured3
T0=$(date +%s)
echo "=== start $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
OLD=$(ls benchmarks/results/structured-full-20261201/structured-2026*/structured-rows.jsonl)
NEW=$(ls benchmarks/results/structured-20261201-1[78]*/structured-rows.jsonl 2>/dev/null)
PYTHONPATH=$PWD/.typecheck /work/main/.venv/bin/python benchmarks/grammar_libs.py export --rows $OLD $NEW --out /tmp/grammar-cases.json 2>&1 | grep -v -i warn
OUT=benchmarks/results/grammar-libs-$(date -u +%Y%m%d-%H%M%S).json
timeout 230 /tmp/gramvenv/bin/python benchmarks/grammar_libs.py measure --cases /tmp/grammar-cases.json --tokenizer /root/.cache/kvshelf/models/gemma3-270m/tokenizer.json --out $OUT --timeout-s 20 --budget-s 30
echo "=== grammar end rc $? $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
# the cases the two structured runs left out (their deadline), if the 22-minute budget still has room
MISSING=$(/work/main/.venv/bin/python - <<'PY'
import glob, json
done = set()
for f in glob.glob("benchmarks/results/structured-20261201-1[78]*/structured-rows.jsonl"):
    for line in open(f):
        r = json.loads(line); done.add((r["kind"], r["fields"]))
want = [("tool", k) for k in range(1, 21)] + [("json", k) for k in range(1, 21)]
print(",".join(f"{k}:{n}" for k, n in want if (k, n) not in done))
PY
)
BEND=$(date -d "$(grep '=== end' /tmp/runB.log | sed 's/.*rc [0-9]* \([^ ]*\) .*/\1/')" +%s)
BSTART=$(date -d 2026-12-01T18:14:43Z +%s)
USED=$((492 + BEND - BSTART + $(date +%s) - T0))
LEFT=$((1320 - USED - 15))
echo "=== missing: '$MISSING'; budget used ${USED} s, left ${LEFT} s"
if [ -n "$MISSING" ] && [ $LEFT -ge 100 ]; then
  cd benchmarks && PYTHONPATH=/work/wt/structured3/.typecheck:. timeout $LEFT /work/main/.venv/bin/python structured.py --cases $MISSING --reference-tokens 32 --deadline-s $((LEFT - 60))
  echo "=== structured rest end rc $? $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
fi
echo "=== end $(date -u +%FT%TZ) load $(cat /proc/loadavg)"
