#!/usr/bin/env bash
# Drive a declared, tuned study (conf/declared/<study>.yaml with a tuning: section) as far as it goes
# without a person: from this checkout (the analysis, the results, the commits), it runs in
# TUNING_CHECKOUT (a clean worktree on the tuning's commit) whatever the tuning still needs:
#   1. the declared grid and every round of the edge rule, as `python -m sparsetrain.analysis.tuning
#      --declared <yaml> --commands` gives them, until the tuning is complete;
#   2. writes and commits the choices (conf/tuned2/<sweep>/; a folder already there must hold them);
#   3. with VERDICTS=tuning-commit (local2.yaml: every run on one commit), the verdict runs there too
#      (scripts/verdict2_runs.sh with TUNING_CHECKOUT); otherwise it stops and says what runs them
#      (verdicts2.yaml: on a later commit, docs/protocol.md section 5).
# Every step resumes (RESUME=1), so the same command goes on in the next session:
#   cd /work/main && TUNING_CHECKOUT=/work/wt/l2 VERDICTS=tuning-commit setsid nohup bash -c \
#     'echo 19 > /proc/self/autogroup; exec nice -n 19 bash scripts/study.sh conf/declared/local2.yaml' >> study.log 2>&1 &
# Before a session ends, commit the sweep that is running: WORKDIR=<TUNING_CHECKOUT> PARTIAL=1 DEST=$PWD
# SUFFIX=_<point> bash scripts/reproduce.sh <sweep>_tune (the verdict runs: SUFFIX=/<point> ... <sweep>).
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
PY=${PY:-$HERE/.venv/bin/python}
DECL=${1:?"usage: TUNING_CHECKOUT=<worktree on the tuning's commit> [VERDICTS=tuning-commit] bash scripts/study.sh conf/declared/<study>.yaml"}
WT=${TUNING_CHECKOUT:?"TUNING_CHECKOUT is not set; allowed: a clean worktree on the tuning's commit (git worktree add --detach <path> <commit>)"}
study=$($PY -c "import yaml; print(yaml.safe_load(open('$DECL'))['sweeps'][0])") || exit 2
tuning() { PYTHONPATH=$HERE $PY -m sparsetrain.analysis.tuning --declared "$DECL" --results results "$@"; }

last=""
while :; do
  lines=$(tuning --commands)
  code=$?
  [ "$code" = 0 ] && break
  [ "$code" = 3 ] || exit "$code"
  if [ "$lines" = "$last" ]; then  # the same runs asked for again: they ran and changed nothing
    echo "error: $DECL: the tuning asks again for what just ran ($(head -n1 <<<"$lines")); allowed: runs that end (see results/*.log)" >&2
    exit 2
  fi
  last=$lines
  # fd 3: the runs must not read the lines from stdin
  while read -r -u 3 line; do
    echo "== $study, tuning ($(date -u +%FT%TZ)): $line"
    (cd "$WT" && export PY DEST=$HERE && eval "$line") || exit 1
  done 3<<<"$lines"
done
echo "== $study: the tuning is complete"
# The choices as the tuning gives them now; a folder already there must hold the same (one left
# from another declaration or an earlier round would send the verdict runs to other rates).
fresh=$(mktemp -d) || exit 1
said=$(tuning --write-tuned "$fresh/$study" 2>&1 > /dev/null) || { echo "$said" >&2; exit 1; }
apart=""
if [ ! -d "conf/tuned2/$study" ]; then
  mkdir -p conf/tuned2 && cp -r "$fresh/$study" "conf/tuned2/$study" || exit 1
  git add "conf/tuned2/$study" && git commit -q -m "conf/tuned2/$study: the choices of $DECL's tuning" -- "conf/tuned2/$study" || exit 1
  echo "== $study: the choices committed in conf/tuned2/$study"
else
  apart=$(diff -rq "$fresh/$study" "conf/tuned2/$study" | sed "s|$fresh/||" | head -n1)
fi
rm -rf "$fresh"
if [ -n "$apart" ]; then
  echo "error: conf/tuned2/$study holds other choices than $DECL's tuning gives ($apart); allowed: the tuning's own (git checkout the committed folder, or remove it to write them)" >&2
  exit 2
fi
if [ "${VERDICTS:-}" = tuning-commit ]; then
  exec env TUNING_CHECKOUT="$WT" bash scripts/verdict2_runs.sh "$DECL"
fi
echo "== $study: next, the verdict runs: bash scripts/verdict2_runs.sh $DECL (docs/protocol.md)"
