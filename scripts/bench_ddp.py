#!/usr/bin/env python3
"""DDP communication hooks on the bandwidth-limited cluster: sparsetrain's hooks vs torch's.

4 ranks (default) in tc-shaped network namespaces (scripts/netns_cluster.py, through
bench_step.run_rate), ResNet-18 (CIFAR variant) shapes, synthetic data, batch 8 per rank, one
thread per rank. Configurations:

  compute         forward + backward + optimizer, no exchange (the floor)
  ddp             torch DDP, its own AllReduce (25 MB buckets, overlapped with backward)
  ddp_fp16        DDP + torch's fp16_compress_hook
  ddp_powersgd    DDP + torch's PowerSGD hook (error feedback, warm start) at the rank whose
                  bytes come closest to the block-k hook's (1% + the whole 1-D tensors), in one
                  DDP bucket: with several, PowerSGD on gloo fails (it starts its second AllReduce
                  from a future callback, so ranks can issue collectives in different orders:
                  "Received data size doesn't match expected size"); so it does not overlap
                  backward here
  ddp_blockk      DDP + sparsetrain.ddp hook: block-random-k 1%, layer-wise, AllReduce
  ddp_randk       DDP + sparsetrain.ddp hook: random-k 1%, layer-wise, AllReduce
  ddp_topk        DDP + sparsetrain.ddp hook: top-k 1%, layer-wise, AllGather
  reducer_blockk  sparsetrain's own reducer (build_exchange, block-k 1%, layer-wise, AllReduce)
                  after backward, as the trainer runs it

Every configuration is rebuilt and timed once per round, in a rotated round-robin order, for
--rounds rounds (>= 5); a round's value is the median of its timed steps (each step's time is the
slowest rank's; ranks start every step together after a barrier). Reported per configuration: the
median over rounds and a distribution-free confidence interval for it (order statistics of the
round values; with 6 or more rounds at least 95%, its exact level is printed).

"paper" as a rate is computed as bench_step.py does (bench_step.paper_rate: where dense spends
about 27% of its step in exchange), from a short run of bench_step's own worker at --calibrate;
--paper-rate skips that run.

    sudo .venv/bin/python scripts/bench_ddp.py                        # paper-like, 250mbit, 4gbit
    sudo .venv/bin/python scripts/bench_ddp.py --rates paper --rounds 5 --steps 3 --out /tmp/b

Writes <out>/ddp.json and <out>/ddp.txt. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_step  # noqa: E402  (the netns runner, the paper-like rate, the burst rule)

CONFIGS = ("compute", "ddp", "ddp_fp16", "ddp_powersgd", "ddp_blockk", "ddp_randk", "ddp_topk",
           "reducer_blockk")
HOOKS = {"ddp_blockk": ("blockk", "allreduce"), "ddp_randk": ("randk", "allreduce"),
         "ddp_topk": ("topk", "allgather")}


# ------------------------------------------------------------------------------------ sizes
def powersgd_numel(shapes, rank: int, min_compression_rate: float = 2.0) -> int:
    """Entries torch's PowerSGD hook sends per step: rank x (n + m) for each tensor viewed as an
    n x m matrix (n = shape[0]) that it compresses, the others (1-D ones, small ones) whole; the
    same test as torch's ``_should_compress``."""
    total = 0
    for shape in shapes:
        n = shape[0]
        numel = math.prod(shape)
        m = numel // n
        r = min(n, m, rank)
        total += r * (n + m) if (n + m) * r * min_compression_rate < numel else numel
    return total


def hook_numel(shapes, ratio: float) -> int:
    """Entries the layer-wise block-k / random-k hook sends: k_i per n-D tensor, 1-D whole."""
    from sparsetrain.compress import k_for

    return sum(math.prod(s) if len(s) <= 1 else k_for(ratio, math.prod(s)) for s in shapes)


def matched_powersgd_rank(shapes, ratio: float) -> int:
    target = hook_numel(shapes, ratio)
    return min(range(1, 65), key=lambda r: abs(powersgd_numel(shapes, r) - target))


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """Median and the narrowest symmetric order-statistic interval [x_(j), x_(n+1-j)] whose
    coverage of the true median is >= level (binomial(n, 1/2)); with too few values, [min, max]
    and its coverage. Returns (median, low, high, coverage)."""
    xs = sorted(values)
    n = len(xs)
    cover = lambda j: 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n  # noqa: E731
    j = 1
    while j + 1 <= n // 2 and cover(j + 1) >= level:
        j += 1
    return statistics.median(xs), xs[j - 1], xs[n - j], cover(j)


# ------------------------------------------------------------------------------------ worker
def worker(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(REPO))
    from sparsetrain.ddp import SparseHookState, sparse_hook
    from sparsetrain.exchange import build_exchange
    from sparsetrain.models import build_model, param_groups_for_weight_decay
    from sparsetrain.timing import PhaseTimer

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(a.batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (a.batch,), generator=gen)
    shapes = [tuple(p.shape) for p in build_model("resnet18", 3, 10).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    psgd_rank = matched_powersgd_rank(shapes, a.ratio)
    timer = PhaseTimer("cpu")

    def run_config(name: str, steps: int) -> tuple[list[float], int]:
        gc.collect()
        torch.manual_seed(0)
        model = build_model("resnet18", 3, 10)
        net, flat, reducer, sent = model, None, None, 4 * numel
        if name == "compute":
            sent = 0
        elif name == "reducer_blockk":
            flat, _, reducer = build_exchange(model.parameters(), "blockk", "layerwise", "allreduce",
                                              a.ratio, world_size=world, rank=rank, seed=0, stats_every=0)
            sent = reducer.bytes_sent_per_step
        elif name.startswith("ddp"):
            # PowerSGD in one bucket: it starts its second AllReduce from a future callback, so with
            # several buckets gloo ranks can issue collectives in different orders (size mismatch)
            net = DDP(model, bucket_cap_mb=a.powersgd_bucket_mb) if name == "ddp_powersgd" else DDP(model)
            if name == "ddp_fp16":
                net.register_comm_hook(None, default_hooks.fp16_compress_hook)
                sent = 2 * numel
            elif name == "ddp_powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=psgd_rank, start_powerSGD_iter=2,
                    use_error_feedback=True, warm_start=True)
                net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
                sent = 4 * powersgd_numel(shapes, psgd_rank)
            elif name in HOOKS:
                scheme, agg = HOOKS[name]
                hook_state = SparseHookState(net, scheme, "layerwise", agg, a.ratio, seed=0)
                net.register_comm_hook(hook_state, sparse_hook)
        elif name != "ddp":
            raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
        opt = torch.optim.SGD(param_groups_for_weight_decay(model, 1e-4), lr=0.01, momentum=0.9,
                              nesterov=True)
        times = []
        # warm-up >= 2: DDP rebuilds its buckets after iteration 0, PowerSGD compresses from 2 on
        for i in range(a.warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(net(x), y).backward()
            if reducer is not None:
                reducer.reduce(flat, i, timer)
            opt.step()
            if i >= a.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        if name in HOOKS:
            sent = hook_state.bytes_sent_per_step
        dist.barrier()
        del net, model, opt, reducer, flat
        return times, sent

    run_config("ddp", 1)  # warm the process (allocator, gloo pairs); not recorded
    out = {c: {"rounds": []} for c in a.configs}
    for r in range(a.rounds):
        k = r % len(a.configs)
        for name in a.configs[k:] + a.configs[:k]:  # rotated: no configuration always first
            times, sent = run_config(name, a.steps)
            out[name]["rounds"].append(times)
            out[name]["bytes_sent_per_step"] = sent
    allr = [None] * world
    dist.all_gather_object(allr, out)
    if rank == 0:
        summary = {}
        for c in a.configs:
            # a step ends when its slowest rank ends; a round's value is its median step
            steps = [[max(allr[q][c]["rounds"][r][i] for q in range(world)) for i in range(a.steps)]
                     for r in range(a.rounds)]
            med, lo, hi, cover = median_interval([statistics.median(s) for s in steps])
            summary[c] = {"step_ms": med, "ci_low_ms": lo, "ci_high_ms": hi, "ci_level": cover,
                          "round_ms": [statistics.median(s) for s in steps], "steps_ms": steps,
                          "bytes_sent_per_step": allr[0][c]["bytes_sent_per_step"]}
        meta = {"world_size": world, "batch_per_rank": a.batch, "threads_per_rank": a.threads,
                "ratio": a.ratio, "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                "numel": numel, "powersgd_rank": psgd_rank,
                "rate": os.environ.get("ST_NETNS_RATE"),
                "rate_bits": float(os.environ.get("ST_NETNS_RATE_BITS", "nan")),
                "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"meta": meta, "configs": summary}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ driver
def table(res: dict) -> str:
    m, s = res["meta"], res["configs"]
    comp, ddp = s.get("compute", {}).get("step_ms"), s.get("ddp", {}).get("step_ms")
    lines = [f"\n== {m['rate']} ({m['label']}), {m['world_size']} ranks, batch {m['batch_per_rank']}/rank, "
             f"{m['rounds']} rounds x {m['steps']} steps, PowerSGD rank {m['powersgd_rank']} ==",
             "| configuration | step ms (median) | interval | level | x compute | x ddp | MB sent/step |",
             "|---|---|---|---|---|---|---|"]
    for name, r in s.items():
        lines.append(
            f"| {name} | {r['step_ms']:.1f} | {r['ci_low_ms']:.1f}-{r['ci_high_ms']:.1f} | {r['ci_level']:.3f} | "
            f"{r['step_ms'] / comp if comp else float('nan'):.3f} | {r['step_ms'] / ddp if ddp else float('nan'):.3f} | "
            f"{r['bytes_sent_per_step'] / 1e6:.3f} |")
    return "\n".join(lines)


def goals(res: dict) -> dict:
    s, g = res["configs"], {}
    if {"ddp_blockk", "compute"} <= s.keys():
        g["ddp_blockk/compute"] = s["ddp_blockk"]["step_ms"] / s["compute"]["step_ms"]
        g["ddp_blockk/compute<=1.05"] = g["ddp_blockk/compute"] <= 1.05
    if {"ddp_blockk", "ddp_powersgd"} <= s.keys():
        g["ddp_blockk/ddp_powersgd"] = s["ddp_blockk"]["step_ms"] / s["ddp_powersgd"]["step_ms"]
        g["ddp_blockk<ddp_powersgd"] = g["ddp_blockk/ddp_powersgd"] < 1.0
        g["bytes ddp_blockk/ddp_powersgd"] = (s["ddp_blockk"]["bytes_sent_per_step"]
                                              / s["ddp_powersgd"]["bytes_sent_per_step"])
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="paper,250mbit,4gbit",
                    help="comma list of tc rates; 'paper' = bench_step's paper-like rate")
    ap.add_argument("--calibrate", default="1gbit", help="rate of the short bench_step run that sets 'paper'")
    ap.add_argument("--paper-rate", default=None, help="use this rate for 'paper' (no calibration run)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--burst", default=None, help="tbf burst (default: bench_step's rule)")
    ap.add_argument("--batch", type=int, default=8, help="images per rank per step")
    ap.add_argument("--rounds", type=int, default=6, help="round-robin rounds (>= 5 for figures)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration per round (>= 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--powersgd-bucket-mb", type=float, default=1000.0,
                    help="DDP bucket size for ddp_powersgd (default: one bucket; with several, torch's "
                         "PowerSGD hook on gloo fails with a collective size mismatch)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench"))
    ap.add_argument("--rate-timeout", type=float, default=3600)
    a = ap.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    if a.worker:
        worker(a)
        return 0
    if a.warmup < 2:
        raise SystemExit("--warmup must be >= 2 (DDP rebuilds its buckets after iteration 0; PowerSGD starts at 2)")
    if os.geteuid() != 0:
        print("bench_ddp.py needs root (network namespaces): run with sudo", file=sys.stderr)
        return 2
    import signal

    def _stop(signum, _frame):  # an exception: bench_step.run_rate stops the cluster and cleans up
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    worker_cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--batch", str(a.batch),
                  "--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup),
                  "--threads", str(a.threads), "--ratio", str(a.ratio), "--configs", ",".join(a.configs),
                  "--powersgd-bucket-mb", str(a.powersgd_bucket_mb)]
    results, paper = [], a.paper_rate
    for i, label in enumerate(r.strip() for r in a.rates.split(",") if r.strip()):
        rate = label
        if label == "paper":
            if paper is None:  # bench_step's own worker, dense only, as bench_step calibrates
                cal = argparse.Namespace(nproc=a.nproc, burst=a.burst, batch=a.batch, steps=3, warmup=1,
                                         passes=1, threads=a.threads, ratio=a.ratio, schemes=["dense"],
                                         skew_phase=True, rate_timeout=a.rate_timeout)
                paper = bench_step.rate_str(bench_step.paper_rate(bench_step.run_rate(cal, a.calibrate, "9")))
                print(f"[bench_ddp] paper-like rate: {paper} (calibrated at {a.calibrate})", flush=True)
            rate = paper
        t0 = time.time()
        res = bench_step.run_rate(a, rate, str(i), worker=worker_cmd)
        res["meta"]["label"] = label
        res["meta"]["wall_s"] = time.time() - t0
        results.append(res)
        print(table(res), flush=True)
        print(f"[bench_ddp] {rate}: {time.time() - t0:.0f} s; goals {goals(res)}", flush=True)
        doc = {"results": results, "goals": {r["meta"]["label"]: goals(r) for r in results}}
        (out / "ddp.json").write_text(json.dumps(doc, indent=2))
        (out / "ddp.txt").write_text("\n".join(table(r) + f"\ngoals: {goals(r)}" for r in results) + "\n")
    print(f"[bench_ddp] wrote {out}/ddp.json, ddp.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
