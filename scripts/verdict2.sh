#!/usr/bin/env bash
# The verdicts' second pass (conf/declared/verdicts2.yaml), its runs before the verdict runs, each
# sweep through scripts/reproduce.sh (so RESUME=1 and DEST work as there), in declared order:
#   1. the re-tuning at 16 epochs, one sweep per point: results/verdict2_tune_<point> (48 runs);
#   2. the pilot (experiment=verdict2_pilot, 6 runs) and its reading: how much dense SGD still
#      gains from 16 to 32 epochs.
# Run from a worktree on the declaring commit, results committed to the main checkout:
#   git worktree add /work/wt/v2 <commit> && cd /work/wt/v2 &&
#   PY=/work/main/.venv/bin/python DEST=/work/main RESUME=1 setsid nohup bash -c \
#     'echo 19 > /proc/self/autogroup; exec nice -n 19 bash scripts/verdict2.sh' > verdict2.log 2>&1 &
# (setsid puts it in its own scheduler autogroup, where `nice` alone changes nothing against other
# sessions: the autogroup's own nice is what lets tests and benchmarks beside it have the cores.)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# This checkout's code, not whatever the venv was installed from (a worktree shares its venv).
export PY PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DECL=conf/declared/verdicts2.yaml
run() { bash scripts/reproduce.sh "$@" || exit 1; }

epochs=$($PY -c "import yaml; print(yaml.safe_load(open('$DECL'))['budgets'][0])")
# One sweep per point of the tuning grid: "point lr1,lr2,lr3 warmup" lines.
grid=$(mktemp)
$PY - "$DECL" <<'PYEOF' > "$grid"
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for point, (rates, warmup) in doc["tuning"]["grid"].items():
    print(point, ",".join(str(r) for r in rates), warmup)
PYEOF
# fd 3: the runs inside must not read the grid from stdin
while read -r -u 3 point rates warmup; do
  SUFFIX=_$point EXTRA="point=tuned_$point optim.lr=$rates optim.warmup_epochs=$warmup train.epochs=$epochs" \
    run verdict2_tune
done 3< "$grid"
rm -f "$grid"
run verdict2_pilot
$PY -m sparsetrain.analysis.power --endpoint results/verdict2_pilot
