#!/usr/bin/env bash
# The verdict runs of a declared, tuned study (conf/declared/verdicts2.yaml by default, or
# local2.yaml), each point at its tuned choice (conf/tuned2/<sweep>/<point>.yaml), one sweep per
# point through scripts/reproduce.sh (RESUME=1 always, so DEST and PARTIAL work as there) into
# results/<sweep>/<point>/, where the declaration's analysis reads them:
#   1. the seeds due first (verdicts2.yaml: its seed rule's first 6, 0-5; local2.yaml: its seeds);
#   2. then the seeds due after them (verdicts2.yaml: seeds_by_internal_pilot's n, from the SD of
#      the rule's pair over seeds 0-5; a no-op where nothing more is due).
# It refuses to start before every point's tuned file exists (python -m sparsetrain.analysis.tuning
# --declared <yaml> --write-tuned, committed). Run from a worktree on the commit that adds the tuned
# files, results committed to the main checkout:
#   git worktree add /work/wt/v2v <commit> --detach && cd /work/wt/v2v &&
#   PY=/work/main/.venv/bin/python DEST=/work/main setsid nohup bash -c \
#     'echo 19 > /proc/self/autogroup; exec nice -n 19 bash scripts/verdict2_runs.sh' > verdict2_runs.log 2>&1 &
# A partial study: SUFFIX=/<point> PARTIAL=1 DEST=... bash scripts/reproduce.sh verdict2
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PY PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DECL=${1:-conf/declared/verdicts2.yaml}
study=$($PY -c "import yaml; print(yaml.safe_load(open('$DECL'))['sweeps'][0])") || exit 1
run() { RESUME=1 bash scripts/reproduce.sh "$@" || exit 1; }

for phase in first after; do
  # "POINT OVERRIDES" per point; exits 2 (one line) while a tuned file is missing
  lines=$($PY -m sparsetrain.analysis.tuning --declared "$DECL" --results results --verdict-runs) || exit 1
  echo "== $study, seeds due ($phase):"
  # fd 3: the runs inside must not read the lines from stdin
  while read -r -u 3 point extra; do
    mkdir -p "results/$study"
    SUFFIX=/$point EXTRA="$extra" run "$study"
  done 3<<<"$lines"
done
