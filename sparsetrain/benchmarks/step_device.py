"""Step time by phase on one device, one rank: dense vs every scheme and scope.

ResNet-18 (CIFAR variant, 11,173,962 parameters) on synthetic CIFAR-shaped batches, timed with
the trainer's own step (``sparsetrain.train.step.TrainStep``) over the flat gradient buffer,
reducer and optimizer the trainer builds from the studies' config (``experiment=cpu_scale`` with
the row's scheme, scope and aggregation; ``train.components``; world_size 1: no process group, so
"exchange" is what a rank does around its collective: nothing for AllReduce, the send-to-receive
copy for AllGather) and ``PhaseTimer`` (on CUDA the device is synchronised at phase boundaries
only). Rows: dense (``scheme=none``) and top-k (AllGather), random-k and block-k
(shared seed, AllReduce), each layer-wise and global, 1% kept, and PowerSGD (layer-wise, its
rank matched to those bytes), error feedback on; signSGD and QSGD (AllGather; error feedback as
their yaml files set it), each layer-wise and global. Per row:
median step over the timed steps, mean ms per phase, the phases' sum over the step, and peak
memory (CUDA: ``max_memory_allocated`` reset per row; CPU: not measured). On CUDA every
compressed row is timed again with ``train.fast_path=true`` (``compress.fused``: the fused kernels
of top-k, random-k, block-k, signSGD and QSGD, PowerSGD batched by shape; shown as
``<scheme>+F``). On the CPU the fast path changes nothing, so those rows are left out unless
``--fast-path on`` under Triton's interpreter (``TRITON_INTERPRET=1``: the kernels run in numpy,
for a check that they train, not for their times).

    python -m sparsetrain.benchmarks.step_device --device cuda --out results/bench   # gpu_step.txt/json
    python -m sparsetrain.benchmarks.step_device --device cpu --batch 2 --steps 1 --warmup 1 --out /tmp/x

Writes ``<out>/<prefix>_step.txt`` and ``.json`` (prefix ``gpu`` on CUDA, ``cpu`` on the CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sparsetrain.benchmarks import harness
from sparsetrain.benchmarks.harness import REPO
from sparsetrain.compress import fused
from sparsetrain.scheme_catalog import DENSE, is_dense
from sparsetrain.timing import PHASES, PhaseTimer
from sparsetrain.train.components import exchange_from_config, optimizer_from_config
from sparsetrain.train.step import TrainStep

ROWS = [(DENSE, "layerwise", "allreduce")] + [
    (scheme, scope, "allgather" if scheme == "topk" else "allreduce")
    for scheme in ("topk", "randk", "blockk")
    for scope in ("layerwise", "global")
] + [("powersgd", "layerwise", "allreduce")] + [  # powersgd: layer-wise only; aggregation does not apply
    (scheme, scope, "allgather") for scheme in ("signsgd", "qsgd") for scope in ("layerwise", "global")
]
# the same rows with train.fast_path=true: every scheme but dense has a fast path (on CUDA)
FAST_ROWS = [row for row in ROWS if not is_dense(row[0])]
PARTS = [p for p in PHASES if p != "step"]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def time_row(scheme, scope, agg, device, a, fast_path: bool = False) -> dict:
    """One configuration: build, run warmup + steps, return the timings."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cfg = harness.study_config(["experiment=cpu_scale", f"model={a.model}", f"ratio={a.ratio}",
                                f"scheme={scheme}", f"scope={scope}", f"aggregation={agg}",
                                f"train.fast_path={str(fast_path).lower()}"], 1)
    model = harness.model_from_config(cfg).to(device)
    ex = exchange_from_config(cfg, model, world_size=1, rank=0, device=device)
    flat, reducer = ex.flat, ex.reducer
    opt = optimizer_from_config(cfg, model)
    gen = torch.Generator().manual_seed(1)
    host_x = torch.randn(a.batch, 3, 32, 32, generator=gen)
    host_y = torch.randint(0, 10, (a.batch,), generator=gen)
    timer = PhaseTimer(device, warmup_steps=a.warmup)
    run_step = TrainStep(model, opt, reducer, flat, timer, device)  # the trainer's own step
    batches = itertools.repeat((host_x, host_y))  # copied to the device in the step's data phase
    steps = []
    for i in range(a.warmup + a.steps):
        result = run_step(batches, i)
        if i >= a.warmup:
            steps.append(timer.last["step"])
    loss = result.loss
    means = timer.means()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "scheme": scheme, "scope": scope, "aggregation": agg, "fast_path": fast_path,
        "step_ms": statistics.median(steps), "steps_ms": steps,
        "phases_ms": {p: means.get(p, 0.0) for p in PARTS},
        "step_mean_ms": means["step"],
        "phase_sum_over_step": sum(means.get(p, 0.0) for p in PARTS) / means["step"],
        "bytes_sent_per_step": reducer.bytes_sent_per_step,
        "peak_memory_mb": peak,
        "loss": float(loss.detach()),
    }


def table(doc: dict) -> str:
    m = doc["meta"]
    lines = [
        f"device: {m['device']} ({m['device_name']}); torch {m['torch']}, CUDA {m['cuda']}",
        f"{m['model']}, batch {m['batch']}, 1 rank, ratio {m['ratio']}, {m['steps']} timed steps after "
        f"{m['warmup']} warm-up, per row; ms per step (median) and per phase (mean)",
        "",
        f"{'scheme':<11}{'scope':<11}{'step':>8}{'x dense':>8}{'data':>7}{'fwd':>7}{'bwd':>7}"
        f"{'compr':>7}{'exch':>7}{'decomp':>7}{'optim':>7}{'sum/step':>9}{'peak MB':>9}",
    ]
    dense = doc["rows"][0]["step_ms"]
    for r in doc["rows"]:
        ph = r["phases_ms"]
        peak = f"{r['peak_memory_mb']:>9.0f}" if r["peak_memory_mb"] is not None else f"{'-':>9}"
        scope = r["scope"] if not is_dense(r["scheme"]) else "-"
        name = (r["scheme"] + ("+F" if r.get("fast_path") else "")) if not is_dense(r["scheme"]) else "dense"
        lines.append(
            f"{name:<11}{scope:<11}{r['step_ms']:>8.2f}{r['step_ms'] / dense:>8.2f}"
            + "".join(f"{ph[p]:>7.2f}" for p in PARTS)
            + f"{r['phase_sum_over_step']:>9.3f}{peak}"
        )
    lines.append("")
    lines.append("phases add up to the step within 10%: " + ", ".join(
        f"{(r['scheme'] + ('+F' if r.get('fast_path') else '')) if not is_dense(r['scheme']) else 'dense'}/{r['scope']}={'yes' if r['phase_sum_over_step'] >= 0.9 else 'NO'}"
        for r in doc["rows"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=128, help="images per step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench"))
    ap.add_argument("--prefix", default=None, help="file name prefix (default gpu on CUDA, cpu on CPU)")
    ap.add_argument("--fast-path", choices=("auto", "on", "off"), default="auto",
                    help="the <scheme>+F rows (train.fast_path=true): auto = on CUDA only; on the CPU "
                         "they need TRITON_INTERPRET=1")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("sparsetrain.benchmarks.step_device: --device cuda: no CUDA GPU here (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    fast = a.fast_path == "on" or (a.fast_path == "auto" and a.device == "cuda")
    if fast and a.device == "cpu" and not fused.interpreting():
        print("sparsetrain.benchmarks.step_device: --fast-path on --device cpu: the kernels run on CPU "
              "tensors under Triton's interpreter only (set TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    t0 = time.time()
    rows = [time_row(s, sc, ag, device, a) for s, sc, ag in ROWS]
    if fast:
        rows += [time_row(s, sc, ag, device, a, fast_path=True) for s, sc, ag in FAST_ROWS]
    doc = {
        "meta": {"device": str(device), "device_name": device_name(device), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "model": a.model, "batch": a.batch, "steps": a.steps,
                 "warmup": a.warmup, "ratio": a.ratio, "wall_s": time.time() - t0},
        "rows": rows,
    }
    text = table(doc)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = a.prefix or ("gpu" if device.type == "cuda" else "cpu")
    (out / f"{prefix}_step.txt").write_text(text + "\n")
    (out / f"{prefix}_step.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {out / f'{prefix}_step.txt'}, {out / f'{prefix}_step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
