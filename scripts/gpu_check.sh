#!/usr/bin/env bash
# make gpu-check: the CUDA path on one GPU in a few minutes (at most 9: the stages' limits, 240 + 150
# + 150 s; a lent machine runs a command for at most 10). Estimate: the H200 run of 2026-12-04 took
# 118 + 16 + 36 s; since then the fast path's cuda tests and rows (Triton compiles each kernel once,
# seconds), torch's hook (one NCCL init) and ~100 more timed calls of a few ms: about 4 minutes.
#   1. the tests marked `cuda` (pytest -m cuda): compressors on CUDA vs CPU, error feedback,
#      reducers over gloo-on-CUDA (and NCCL with 2 GPUs), a world_size=1 CUDA run whose phases
#      add up to its step within 10%, peak memory from CUDA;
#   2. the compressor benchmark on CUDA (ResNet-18 gradient, 1%, every scheme and scope, against
#      torch.topk and a copy of the gradient; the fast path (train.fast_path: rows <scheme>_fast,
#      top-k, random-k, block-k, signSGD and QSGD's kernels, PowerSGD batched by shape) beside the
#      torch path, and torch's powerSGD_hook (row torch_powersgd_hook, a one-rank NCCL group, the
#      matched rank) beside PowerSGD; goals printed), then each timed call profiled (kernel
#      launches and host waits per call: what sets a call's time on a fast GPU). The new rows
#      add seconds (one NCCL init, three Triton compilations, ~100 calls of a few ms at most);
#   3. the ResNet-18 CIFAR-shape step-time table (dense vs each scheme and scope, one rank, phases;
#      every compressed row again with train.fast_path=true, rows <scheme>+F).
# The cuda tests include tests/test_fused.py's: the fast path's kernels compiled on the GPU
# against the torch path (on a machine without one they run under Triton's interpreter).
# Writes $OUT/gpu_tests.txt, gpu_compress.txt/.json, gpu_profile.txt, gpu_step.txt/.json (+ gpu_step_log.txt, the
# run's output), gpu_check.txt (summary),
# each naming the GPU. Exit 0 only when every stage ran and every test passed (the performance
# goals are printed, not enforced: they are findings). Without a CUDA GPU: one line, exit 2.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/bench}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False in $PY); run it where a GPU is" >&2
    exit 2
fi
mkdir -p "$OUT"
GPU=$("$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}")')
# COMMIT names the code where the checkout travels without its .git (a lent GPU machine)
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
HEAD="GPU: $GPU; $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $COMMIT"
echo "$HEAD"
t0=$SECONDS
status=0

stage() {  # stage NAME FILE TIMEOUT CMD...: run CMD, tee its output under the header into FILE
    local name=$1 file=$2 limit=$3
    shift 3
    local s=$SECONDS
    echo "== $name ($*)"
    { echo "$HEAD"; echo "\$ $*"; echo; } >"$file"
    timeout "$limit" "$@" 2>&1 | tee -a "$file"
    local rc=${PIPESTATUS[0]}
    echo "$name: exit $rc, $((SECONDS - s)) s" | tee -a "$file"
    [ "$rc" -eq 0 ] || status=1
    return 0
}

# Only the modules that hold cuda tests are collected: the others import what a GPU machine
# need not have (notebook runners, the SLURM launcher), and one failed import stops a session.
mapfile -t CUDA_TESTS < <(grep -l "pytest.mark.cuda" tests/test_*.py)
stage "cuda tests" "$OUT/gpu_tests.txt" 240 "$PY" -m pytest -m cuda -rs -q -p no:cacheprovider "${CUDA_TESTS[@]}"
stage "compressor benchmark" "$OUT/gpu_compress.txt" 150 \
    "$PY" -m sparsetrain.benchmarks.compress --device cuda --repeats 15 --rounds 3 --json "$OUT/gpu_compress.json" \
    --profile "$OUT/gpu_profile.txt"
stage "step-time table" "$OUT/gpu_step_log.txt" 150 \
    "$PY" -m sparsetrain.benchmarks.step_device --device cuda --out "$OUT"

{
    echo "$HEAD"
    echo "gpu-check: $([ $status -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s"
    grep -E "passed|failed|error" "$OUT/gpu_tests.txt" | tail -n 1 | sed 's/^/tests: /'
    echo "compressor goals (ResNet-18 gradient, 1%; copies = time / one gradient copy):"
    sed -n '/^goals:/,$p' "$OUT/gpu_compress.txt" | grep -E "^\s+(met|MISS)"
    echo "step time (ms, one rank):"
    sed -n '/^scheme/,/^$/p' "$OUT/gpu_step.txt" 2>/dev/null
    grep "^phases add up" "$OUT/gpu_step.txt" 2>/dev/null
} | tee "$OUT/gpu_check.txt"
exit $status
