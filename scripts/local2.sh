#!/usr/bin/env bash
# Local SGD against top-k and signSGD, second pass (conf/declared/local2.yaml): the tuning runs,
# one sweep per point through scripts/reproduce.sh (so RESUME=1, DEST and PARTIAL work as there):
# results/local2_tune_<point>, 4 learning rates x 2 seeds each (48 runs, about 11 minutes each on
# 2 quiet cores). Run from a worktree on the declaring commit, results committed to the main
# checkout (as scripts/verdict2.sh):
#   git worktree add /work/wt/l2 <commit> && cd /work/wt/l2 &&
#   PY=/work/main/.venv/bin/python DEST=/work/main RESUME=1 setsid nohup bash -c \
#     'echo 19 > /proc/self/autogroup; exec nice -n 19 bash scripts/local2.sh' > local2.log 2>&1 &
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PY PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DECL=conf/declared/local2.yaml
# Each declared point's conf/point/ file (the first comparison's points, by bytes per step).
declare -A POINT_FILE=([localsgd_low]=local_localsgd_low [topk_low]=frontier_topk_low
  [localsgd_high]=local_localsgd_high [topk_high]=frontier_topk_high [signsgd]=frontier_signsgd
  [dense]=tuned_dense)
run() { bash scripts/reproduce.sh "$@" || exit 1; }

epochs=$($PY -c "import yaml; print(yaml.safe_load(open('$DECL'))['budgets'][0])")
grid=$(mktemp)
$PY - "$DECL" <<'PYEOF' > "$grid"
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
for point, (rates, warmup) in doc["tuning"]["grid"].items():
    print(point, ",".join(str(r) for r in rates), warmup)
PYEOF
while read -r -u 3 point rates warmup; do
  file=${POINT_FILE[$point]:?"no conf/point file for the declared point $point"}
  SUFFIX=_$point EXTRA="point=$file optim.lr=$rates optim.warmup_epochs=$warmup train.epochs=$epochs" \
    run local2_tune
done 3< "$grid"
rm -f "$grid"
