#!/usr/bin/env bash
# The verdict runs of a declared, tuned study (conf/declared/verdicts2.yaml by default, or
# local2.yaml), each point at its tuned choice (conf/tuned2/<sweep>/<point>.yaml), one sweep per
# point through scripts/reproduce.sh (RESUME=1 always, so DEST and PARTIAL work as there) into
# results/<sweep>/<point>/, where the declaration's analysis reads them:
#   1. the seeds due first (verdicts2.yaml: its seed rule's first 6, 0-5; local2.yaml: its seeds);
#   2. then the seeds due after them (verdicts2.yaml: seeds_by_internal_pilot's n, from the SD of
#      the rule's pair over seeds 0-5; a no-op where nothing more is due).
# It refuses to start before every point's tuned file exists (python -m sparsetrain.analysis.tuning
# --declared <yaml> --write-tuned, committed).
#
# The runs go on the tuning's own commit (the declarations: every run of a study on one commit):
# from this checkout (the tuned files, the analysis, results committed here), each point runs in
# TUNING_CHECKOUT, a clean worktree on the commit the tuned files record (`code:`), as its tuning
# preset (<sweep>_tune: the verdict preset's config but for the rate, which the tuned overrides give
# on the command line; tests/test_tuning2.py composes both) into results/<sweep>/<point>/:
#   git worktree add --detach /work/wt/l2 <tuning commit>   # if it is not there any more
#   cd /work/main && TUNING_CHECKOUT=/work/wt/l2 setsid nohup bash -c 'echo 19 > /proc/self/autogroup;
#     exec nice -n 19 bash scripts/verdict2_runs.sh conf/declared/local2.yaml' > verdict_runs.log 2>&1 &
# Without TUNING_CHECKOUT the runs go on this checkout's commit as the preset <sweep>.
# A partial study: WORKDIR=<TUNING_CHECKOUT> SUFFIX=/<point> PARTIAL=1 DEST=$PWD bash scripts/reproduce.sh <sweep>
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
PY=${PY:-$HERE/.venv/bin/python}
DECL=${1:-conf/declared/verdicts2.yaml}
study=$($PY -c "import yaml; print(yaml.safe_load(open('$DECL'))['sweeps'][0])") || exit 1
preset=$study
if [ -n "${TUNING_CHECKOUT:-}" ]; then
  # the commit every tuned file records, and the checkout's: the same, and nothing uncommitted there
  want=$($PY - "conf/tuned2/$study" <<'PYEOF'
import pathlib, sys, yaml
codes = {str(yaml.safe_load(p.read_text()).get("code", "")) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.yaml"))}
print(codes.pop() if len(codes) == 1 else "")
PYEOF
  )
  have=$(git -C "$TUNING_CHECKOUT" rev-parse HEAD 2>/dev/null)
  dirty=$(git -C "$TUNING_CHECKOUT" status --porcelain -- sparsetrain conf hydra_plugins pyproject.toml 2>/dev/null)
  if [ -z "$want" ] || [ -z "$have" ] || [[ $want == *";"* ]] || [ "${have#"$want"}" = "$have" ] || [ -n "$dirty" ]; then
    echo "error: TUNING_CHECKOUT=$TUNING_CHECKOUT is at ${have:-no git commit}${dirty:+ with uncommitted code}; allowed: a clean checkout on the tuning's commit (conf/tuned2/$study/*.yaml code: ${want:-none or several})" >&2
    exit 2
  fi
  preset=${study}_tune
  export WORKDIR=$TUNING_CHECKOUT DEST=$HERE
fi
# the runs import the code they run on (the tuning checkout's, or this one's)
export PY PYTHONPATH=${TUNING_CHECKOUT:-$HERE}${PYTHONPATH:+:$PYTHONPATH} EXPERIMENT=$preset
run() { RESUME=1 bash scripts/reproduce.sh "$@" || exit 1; }

for phase in first after; do
  # "POINT OVERRIDES" per point; exits 2 (one line) while a tuned file is missing
  lines=$(PYTHONPATH=$HERE $PY -m sparsetrain.analysis.tuning --declared "$DECL" --results results --verdict-runs "conf/tuned2/$study") || exit 1
  echo "== $study, seeds due ($phase), as experiment=$preset in ${TUNING_CHECKOUT:-$HERE}:"
  # fd 3: the runs inside must not read the lines from stdin
  while read -r -u 3 point extra; do
    mkdir -p "${WORKDIR:-.}/results/$study"
    SUFFIX=/$point EXTRA="$extra" run "$study"
  done 3<<<"$lines"
done
