#!/usr/bin/env bash
# Run the CPU-scale studies of REPRODUCTION.md one after another into results/<study>/ and
# commit each study's small result files (summary.json, metrics.jsonl, .hydra/) as it completes.
#   bash scripts/reproduce.sh                       # the accuracy studies of REPRODUCTION.md, in order
#   bash scripts/reproduce.sh rq1_scope rq3_aggregation
#   COMMIT=0 bash scripts/reproduce.sh baseline     # without git commits
#   SUFFIX=_s2 EXTRA="seed=2" bash scripts/reproduce.sh rq1_scope   # more seeds, own folder
#   DEST=/path/to/checkout bash scripts/reproduce.sh  # run here (e.g. a git worktree, so edits
#                                                   # to the checkout cannot touch running jobs),
#                                                   # copy results to DEST and commit them there
#   RESUME=1 bash scripts/reproduce.sh rq1_scope    # rerun into the existing folder: completed jobs
#                                                   # are skipped, interrupted ones resume from
#                                                   # their checkpoint (a study spread over sessions;
#                                                   # with DEST, the jobs completed there are skipped
#                                                   # too, so a fresh worktree on the same commit
#                                                   # goes on where the last one stopped)
#   PARTIAL=1 DEST=... bash scripts/reproduce.sh rq1_scope  # copy the completed jobs of a study
#                                                   # still running to DEST and commit them there
#   WORKDIR=/work/wt/x DEST=$PWD EXPERIMENT=local2_tune SUFFIX=/dense bash scripts/reproduce.sh local2
#                                                   # run in another checkout (its code: PYTHONPATH
#                                                   # must name it) the preset EXPERIMENT into
#                                                   # results/<study><SUFFIX> (scripts/verdict2_runs.sh)
set -uo pipefail
cd "${WORKDIR:-$(dirname "$0")/..}" || exit 1
PY=${PY:-.venv/bin/python}
STUDIES=("$@")
# the second pass, then the third (the headline protocol, its equal-bytes points, the fair DDP
# comparison) and RQ5's one-machine phases on current code
[ ${#STUDIES[@]} -gt 0 ] || STUDIES=(baseline rq1_scope ablation rq2_scheme rq3_aggregation rq4_global rq2_low budget
  rq4_workers rq4_steps headline_dense headline headline_bytes ddp_fair rq5_speed)
mkdir -p results
# The job folders under $1 whose run completed.
completed_jobs() { grep -l '"status": "completed"' "$1"/*/summary.json 2>/dev/null | xargs -r -n1 dirname; }
if [ "${PARTIAL:-0}" = 1 ]; then
  for study in "${STUDIES[@]}"; do
    study=$study${SUFFIX:-}
    repo=${DEST:-.}
    done_jobs=$(completed_jobs "results/$study")
    [ -n "$done_jobs" ] || { echo "== $study: no completed job yet"; continue; }
    mkdir -p "$repo/results/$study"
    cp results/"$study"/multirun.yaml "$repo/results/$study/"
    # shellcheck disable=SC2086  # one folder per job
    tar --exclude=checkpoint.pt --exclude=model.pt --exclude=wandb --exclude=ranks -cf - $done_jobs |
      tar -C "$repo" -xf -
    n=$(echo "$done_jobs" | wc -l)
    echo "== $study: $n completed jobs copied to $repo"
    $PY scripts/strip_paths.py "$repo/results/$study" --root "$repo"  # no paths of this machine
    if [ "${COMMIT:-1}" = 1 ]; then
      (cd "$repo" && git add "results/$study" &&
        git commit -q -m "results: $study, partial ($n completed jobs; RESUME=1 runs the rest)" -- "results/$study")
    fi
  done
  exit 0
fi
for preset in "${STUDIES[@]}"; do
  study=$preset${SUFFIX:-}
  start=$(date +%s)
  echo "== $study: started $(date -u +%FT%TZ)"
  [ "${RESUME:-0}" = 1 ] || rm -rf "results/$study"
  if [ "${RESUME:-0}" = 1 ] && [ -n "${DEST:-}" ] && [ "$(cd "$DEST" && pwd -P)" != "$(pwd -P)" ]; then
    # A fresh worktree (a new machine, a new session) lacks the jobs that completed before and
    # were copied to DEST: bring them back, so that they are skipped rather than run again.
    here=$(completed_jobs "results/$study" | xargs -r -n1 basename)
    for job in $(completed_jobs "$DEST/results/$study"); do
      name=$(basename "$job")
      grep -qFx "$name" <<<"$here" && continue
      mkdir -p "results/$study" && rm -rf "results/$study/$name" && cp -r "$job" "results/$study/"
      echo "== $study: $name completed in $DEST: not run again"
    done
  fi
  before=$(completed_jobs "results/$study" | wc -l)
  # shellcheck disable=SC2086  # EXTRA holds several overrides
  $PY -m sparsetrain.run -m "experiment=${EXPERIMENT:-$preset}" wandb.mode=disabled ${EXTRA:-} \
    "hydra.sweep.dir=results/$study" > "results/$study.log" 2>&1
  code=$?
  took=$(( $(date +%s) - start ))
  ran=$(( $(completed_jobs "results/$study" | wc -l) - before ))
  if [ "$code" = 0 ] && [ "$ran" = 0 ] && [ "${RESUME:-0}" = 1 ]; then
    # every job had completed: no cost to record (timings.txt sums what the studies took)
    echo "== $study: every job had completed; nothing ran"
    continue
  fi
  line="$study exit=$code seconds=$took jobs=$ran finished=$(date -u +%FT%TZ)"
  echo "$line" >> results/timings.txt
  echo "== $study: exit $code after ${took}s"
  repo=.
  if [ -n "${DEST:-}" ]; then
    repo=$DEST
    mkdir -p "$DEST/results"
    [ "${RESUME:-0}" = 1 ] || rm -rf "${DEST:?}/results/$study"
    tar -C results --exclude=checkpoint.pt --exclude=model.pt --exclude=wandb --exclude=ranks \
      -cf - "$study" | tar -C "$DEST/results" -xf -
    echo "$line" >> "$DEST/results/timings.txt"  # DEST's own list may hold more studies
  fi
  # Hydra's files name this machine's folders (runtime.cwd, output_dir): relative to the repo.
  $PY scripts/strip_paths.py "$repo/results/$study" --root "$repo"
  if [ "${COMMIT:-1}" = 1 ]; then
    for attempt in 1 2 3 4 5; do  # another git process may hold the index lock for a moment
      (cd "$repo" && git add results/timings.txt "results/$study" 2>/dev/null &&
        git commit -q -m "results: $study (${took}s, exit $code)" -- results/timings.txt "results/$study") &&
        break
      sleep 5
    done
  fi
done
