#!/usr/bin/env bash
# Run the CPU-scale studies of REPRODUCTION.md one after another into results/<study>/ and
# commit each study's small result files (summary.json, metrics.jsonl, .hydra/) as it completes.
#   bash scripts/reproduce.sh                       # all studies
#   bash scripts/reproduce.sh rq1_scope rq3_aggregation
#   COMMIT=0 bash scripts/reproduce.sh baseline     # without git commits
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STUDIES=("$@")
[ ${#STUDIES[@]} -gt 0 ] || STUDIES=(baseline rq1_scope rq3_aggregation rq4_workers rq2_scheme rq5_speed)
mkdir -p results
for study in "${STUDIES[@]}"; do
  start=$(date +%s)
  echo "== $study: started $(date -u +%FT%TZ)"
  rm -rf "results/$study"
  $PY -m sparsetrain.run -m "experiment=$study" wandb.mode=disabled > "results/$study.log" 2>&1
  code=$?
  took=$(( $(date +%s) - start ))
  echo "$study exit=$code seconds=$took finished=$(date -u +%FT%TZ)" >> results/timings.txt
  echo "== $study: exit $code after ${took}s"
  if [ "${COMMIT:-1}" = 1 ]; then
    for attempt in 1 2 3 4 5; do  # another git process may hold the index lock for a moment
      git add results/timings.txt "results/$study" 2>/dev/null &&
        git commit -q -m "results: $study (${took}s, exit $code)" -- results/timings.txt "results/$study" &&
        break
      sleep 5
    done
  fi
done
