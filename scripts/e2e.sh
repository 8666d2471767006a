#!/usr/bin/env bash
# Time to accuracy measured end to end on the emulated cluster (experiment=e2e): every point at
# every rate and seed, one netcluster run each (4 torchrun nodes in tc-shaped network namespaces),
# into $OUT/<point>-<rate>-s<seed>/, then the predicted-vs-measured check and its figure.
# Seeds outermost, then rates, then points: an interrupted grid holds whole seeds, and the
# points of one seed and rate run back to back (the same machine state). A completed run is
# skipped, so rerunning resumes the grid.
#   sudo bash scripts/e2e.sh
#   sudo RATES="1gbit" SEEDS="0" POINTS="dense frontier_fp16" OUT=/tmp/e2e bash scripts/e2e.sh
# Needs root (network namespaces) and a quiet machine (these are timings).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RATES=${RATES:-2627mbit 250mbit}   # the step benchmark's paper-like rate and a slow link
SEEDS=${SEEDS:-0 1}
POINTS=${POINTS:-dense frontier_fp16 frontier_topk_low frontier_powersgd frontier_signsgd}
OUT=${OUT:-results/e2e}
COSTMODEL=${COSTMODEL:-results/e2e_bench/costmodel.json}  # the refit at these rates (docs/performance.md)
mkdir -p "$OUT"
for seed in $SEEDS; do
  for rate in $RATES; do
    for point in $POINTS; do
      dir="$OUT/$point-$rate-s$seed"
      if grep -qs '"status": "completed"' "$dir/summary.json"; then
        echo "== $dir: completed, skipped"; continue
      fi
      select="point=$point"
      [ "$point" = dense ] && select="scheme=none"
      # the load before each run: a timing taken beside other work shows it here
      echo "== $dir: started $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
      $PY -m sparsetrain.launch.netcluster --nproc 4 --rate "$rate" -- \
        "$PY" -m sparsetrain.run experiment=e2e "$select" "seed=$seed" wandb.mode=disabled \
        "hydra.run.dir=$dir" > "$dir.log" 2>&1
      echo "== $dir: exit $?"
    done
  done
done
model=()
[ -f "$COSTMODEL" ] && model=(--costmodel "$COSTMODEL")
$PY -m sparsetrain.analysis.cluster_check --runs "$OUT" "${model[@]}" --figure figures/e2e/e2e
