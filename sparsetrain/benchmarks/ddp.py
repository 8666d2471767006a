"""DDP communication hooks on the bandwidth-limited cluster: sparsetrain's hooks vs torch's.

    sudo .venv/bin/python -m sparsetrain.benchmarks.ddp --out results/bench     # make bench-ddp

4 ranks (default) on a netcluster (one torchrun node per tc-shaped network namespace, through
``harness.run_on_cluster``), ResNet-18 (CIFAR variant) shapes, synthetic data, batch 8 per rank, one
thread per rank. Configurations, each a list of config overrides (``CONFIGS``) built by the
trainer's own builder (``train.components.exchange_from_config``): what ``dist.ddp=true`` trains,
with DDP's buffers left unsynchronised and its buckets settled before step 0 as the trainer does:

  compute         forward + backward + optimizer, no exchange (the floor)
  ddp             torch DDP, its own AllReduce (25 MB buckets, overlapped with backward)
  ddp_noop        torch DDP with torch's noop_hook: its buckets and hook calls, nothing sent (the
                  headroom: what DDP costs beyond compute when the network is free; the
                  exchange a hook leaves exposed is its step minus this one's)
  ddp_fp16        DDP + torch's fp16_compress_hook
  ddp_bf16        DDP + torch's bf16_compress_hook
  ddp_powersgd    DDP + torch's PowerSGD hook (error feedback, warm start) at the rank whose
                  bytes come closest to the block-k hook's (1% + the whole 1-D tensors), in one
                  DDP bucket on gloo as in training (train.ddp_exchange: with several, PowerSGD on
                  gloo can issue collectives in different orders across ranks); so it does not
                  overlap backward here
  ddp_st_powersgd DDP + sparsetrain's PowerSGD hook (scheme=powersgd: error feedback, warm
                  start, 1-D tensors whole) at the rank its own rule picks (the same as torch's
                  here), in the default buckets (it issues both AllReduces from the hook)
  ddp_blockk      DDP + comm.ddp_hook (ours): block-random-k 1%, layer-wise, AllReduce
  ddp_randk       DDP + comm.ddp_hook (ours): random-k 1%, layer-wise, AllReduce
  ddp_topk        DDP + comm.ddp_hook (ours): top-k 1%, layer-wise, AllGather
  reducer_blockk  sparsetrain's own reducer (block-k 1%, layer-wise, AllReduce) after
                  backward, as the trainer runs it

Every configuration is rebuilt and timed with the trainer's step (``train.step.TrainStep``;
DDP's own ``.grad`` tensors, or sparsetrain's reducer after backward) once per round, in a
rotated round-robin order (``timing_stats.round_order``), for --rounds rounds (>= 5); a round's value is
the median of its timed steps (each step's time is the slowest rank's; ranks start every step
together after a barrier). Reported per configuration: the median over rounds and a
distribution-free confidence interval for it (``timing_stats.median_interval``: order statistics of the
round values; with 6 or more rounds at least 95%, its exact level is printed): the same
machinery as ``sparsetrain.benchmarks.step`` (``harness.timed_steps``, ``harness.summarize``).

"paper" as a rate is computed as the step benchmark does (``harness.paper_rate``: where dense
spends about 27% of its step in exchange), from a short run of the step benchmark's own worker
(dense only) at --calibrate; --paper-rate skips that run.

    sudo .venv/bin/python -m sparsetrain.benchmarks.ddp                    # paper-like, 250mbit, 4gbit
    sudo .venv/bin/python -m sparsetrain.benchmarks.ddp --rates paper --rounds 5 --steps 3 --out /tmp/b

Writes <out>/ddp.json and <out>/ddp.txt. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sys
import time
from pathlib import Path

from sparsetrain.benchmarks import harness
from sparsetrain.benchmarks.timing_stats import median_interval, round_order  # noqa: F401  (re-exported)
from sparsetrain.comm.ddp_hook import matched_powersgd_rank
from sparsetrain.compress import kernels
from sparsetrain.costmodel import mean_buckets
from sparsetrain.launch.report import grid, num

# configuration -> the config overrides that build it (on top of experiment=cpu_scale,
# model=resnet18, ratio=--ratio): every one through train.components.exchange_from_config, the
# trainer's own builder, so that each times exactly what training with those keys runs
CONFIGS = {
    "compute": ["scheme=none", "dist.overlap=false"],  # the model and buffer, no exchange
    "ddp": ["scheme=none", "dist.ddp=true"],
    "ddp_noop": ["scheme=none", "dist.ddp=true"],  # its hook replaced by torch's noop_hook (run_config)
    "ddp_fp16": ["scheme=fp16", "dist.ddp=true"],
    "ddp_bf16": ["scheme=bf16", "dist.ddp=true"],
    "ddp_powersgd": ["scheme=torch_powersgd", "dist.ddp=true"],  # torch's hook (the row's old name)
    "ddp_st_powersgd": ["scheme=powersgd", "dist.ddp=true"],
    "ddp_blockk": ["scheme=blockk", "aggregation=allreduce", "dist.ddp=true"],
    "ddp_randk": ["scheme=randk", "aggregation=allreduce", "dist.ddp=true"],
    "ddp_topk": ["scheme=topk", "aggregation=allgather", "dist.ddp=true"],
    "reducer_blockk": ["scheme=blockk", "aggregation=allreduce"],
}


# ------------------------------------------------------------------------------------ worker
def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

    from sparsetrain.timing import PhaseTimer
    from sparsetrain.train.components import exchange_from_config, optimizer_from_config
    from sparsetrain.train.step import TrainStep

    rank, world = harness.init_worker(a.threads)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(a.batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (a.batch,), generator=gen)
    base = ["experiment=cpu_scale", "model=resnet18", f"ratio={a.ratio}"]
    unknown = [c for c in a.configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    cfgs = {name: harness.study_config(base + CONFIGS[name], world) for name in {*a.configs, "ddp"}}
    shapes = [tuple(p.shape) for p in harness.model_from_config(cfgs["ddp"]).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    psgd_rank = matched_powersgd_rank(shapes, a.ratio)  # what scheme=torch_powersgd picks (scheme.rank=null)

    def run_config(name: str, steps: int) -> tuple[list[float], dict, int]:
        gc.collect()
        cfg = cfgs[name]
        model = harness.model_from_config(cfg)
        ex = exchange_from_config(cfg, model, world_size=world, rank=rank)
        net, flat, reducer = ex.net, ex.flat, ex.reducer
        if name == "ddp_noop":  # DDP's machinery, nothing on the wire
            reducer.timed.hook, reducer.timed.state = debugging_hooks.noop_hook, None
        if cfg.dist.ddp:  # DDP settles its buckets (and the hook plans them) before step 0
            reducer.settle(x)
        if name == "compute":
            reducer.detach()
            reducer = None
        opt = optimizer_from_config(cfg, model)
        timer = PhaseTimer("cpu", warmup_steps=a.warmup)
        # warm-up >= 2: DDP rebuilds its buckets after iteration 0, PowerSGD compresses from 2 on
        run_step = TrainStep(net, opt, reducer, flat, timer, "cpu")
        batches = ((x.clone(), y.clone()) for _ in itertools.count())
        times = harness.timed_steps(run_step, batches, a.warmup, steps)
        sent = 0 if reducer is None or name == "ddp_noop" else reducer.bytes_sent_per_step
        buckets = getattr(reducer, "overlap_buckets", None)  # (share, lead ms) per overlapped bucket
        dist.barrier()
        phases = timer.means()
        if reducer is not None:
            reducer.detach()
        del net, model, opt, reducer, flat, run_step
        return times, phases, sent, buckets

    run_config("ddp", 1)  # warm the process (allocator, gloo pairs); not recorded
    out = {c: {"rounds": [], "phases": []} for c in a.configs}
    sent_by, buckets_by = {}, {}
    for r in range(a.rounds):
        for name in round_order(a.configs, r):  # rotated: no configuration always first
            times, phases, sent, buckets = run_config(name, a.steps)
            out[name]["rounds"].append(times)
            out[name]["phases"].append(phases)
            sent_by[name] = sent
            buckets_by.setdefault(name, []).append(buckets)
    allr = harness.gather(out)
    if rank == 0:
        summary = harness.summarize(allr, a.configs, a.rounds)
        for c in a.configs:
            summary[c]["bytes_sent_per_step"] = sent_by[c]
            summary[c]["overlap_buckets"] = _mean_buckets(buckets_by[c])
        meta = {"world_size": world, "batch_per_rank": a.batch, "threads_per_rank": a.threads,
                "ratio": a.ratio, "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                "numel": numel, "powersgd_rank": psgd_rank, **harness.link(),
                "torch": torch.__version__, "kernels": kernels.backend()}
        Path(a.json).write_text(json.dumps({"meta": meta, "configs": summary}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def _mean_buckets(per_round: list) -> list[dict] | None:
    """Rank 0's buckets of a configuration over its rounds (``costmodel.mean_buckets``), as the
    run summary writes them; None where its exchange is not overlapped."""
    return [{"share": share, "lead_ms": lead} for share, lead in mean_buckets(per_round)] or None


# ------------------------------------------------------------------------------------ driver
def table(res: dict) -> str:
    m, s = res["meta"], res["configs"]
    comp, ddp = s.get("compute", {}).get("step_ms"), s.get("ddp", {}).get("step_ms")
    head = (f"\n== {m['rate']} ({m['label']}), {m['world_size']} ranks, batch {m['batch_per_rank']}/rank, "
            f"{m['rounds']} rounds x {m['steps']} steps, PowerSGD rank {m['powersgd_rank']} ==")
    rows = [[name, num(r["step_ms"]), f"{num(r['ci_low_ms'])}-{num(r['ci_high_ms'])}", num(r["ci_level"], 3),
             num(r["step_ms"] / comp if comp else None, 3), num(r["step_ms"] / ddp if ddp else None, 3),
             num(r["bytes_sent_per_step"] / 1e6, 3)] for name, r in s.items()]
    return head + "\n" + grid(["configuration", "step ms (median)", "interval", "level", "x compute",
                               "x ddp", "MB sent/step"], rows)


def _paired(s: dict, a: str, b: str) -> list[float]:
    """Per-round ratios a/b: rounds interleave the configurations, so a round's ratio cancels the
    machine's drift between rounds; its median interval is the comparison's uncertainty."""
    ia = median_interval([x / y for x, y in zip(s[a]["round_ms"], s[b]["round_ms"])])
    return [ia.median, ia.low, ia.high]


def goals(res: dict) -> dict:
    """Issue 25's goals for the DDP hook: block-k's hook step <= sparsetrain's own reducer doing
    the same block-k, and <= 1.10x compute-only; met when the per-round ratio's median is."""
    s, g = res["configs"], {}
    if {"ddp_blockk", "compute"} <= s.keys():
        g["ddp_blockk/compute"] = _paired(s, "ddp_blockk", "compute")
        g["ddp_blockk/compute<=1.10"] = g["ddp_blockk/compute"][0] <= 1.10
    if {"ddp_blockk", "reducer_blockk"} <= s.keys():
        g["ddp_blockk/reducer_blockk"] = _paired(s, "ddp_blockk", "reducer_blockk")
        g["ddp_blockk<=reducer_blockk"] = g["ddp_blockk/reducer_blockk"][0] <= 1.0
    if {"ddp_blockk", "ddp_powersgd"} <= s.keys():
        g["ddp_blockk/ddp_powersgd"] = _paired(s, "ddp_blockk", "ddp_powersgd")
        g["ddp_blockk<ddp_powersgd"] = g["ddp_blockk/ddp_powersgd"][0] < 1.0
        g["bytes ddp_blockk/ddp_powersgd"] = (s["ddp_blockk"]["bytes_sent_per_step"]
                                              / s["ddp_powersgd"]["bytes_sent_per_step"])
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsetrain.benchmarks.ddp", description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="paper,250mbit,4gbit",
                    help="comma list of tc rates; 'paper' = the step benchmark's paper-like rate")
    ap.add_argument("--calibrate", default="1gbit", help="rate of the short step-benchmark run that sets 'paper'")
    ap.add_argument("--paper-rate", default=None, help="use this rate for 'paper' (no calibration run)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--burst", default=None, help="tbf burst (default: netcluster's rule)")
    ap.add_argument("--batch", type=int, default=8, help="images per rank per step")
    ap.add_argument("--rounds", type=int, default=6, help="round-robin rounds (>= 5 for figures)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration per round (>= 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=str(harness.REPO / "results" / "bench"))
    ap.add_argument("--rate-timeout", type=float, default=3600)
    a = ap.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    if a.worker:
        worker(a)
        return 0
    if a.warmup < 2:
        raise SystemExit("--warmup must be >= 2 (DDP rebuilds its buckets after iteration 0; PowerSGD starts at 2)")
    if not harness.need_root("sparsetrain.benchmarks.ddp"):
        return 2
    harness.stop_on_signals()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    worker_cmd = [sys.executable, "-m", "sparsetrain.benchmarks.ddp", "--worker", "--batch", str(a.batch),
                  "--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup", str(a.warmup),
                  "--threads", str(a.threads), "--ratio", str(a.ratio), "--configs", ",".join(a.configs)]
    results, paper = [], a.paper_rate
    for i, label in enumerate(r.strip() for r in a.rates.split(",") if r.strip()):
        rate = label
        if label == "paper":
            if paper is None:  # the step benchmark's own worker, dense only, as it calibrates
                cal = [sys.executable, "-m", "sparsetrain.benchmarks.step", "--worker", "--batch",
                       str(a.batch), "--rounds", "1", "--steps", "3", "--warmup", "1", "--threads",
                       str(a.threads), "--ratio", str(a.ratio), "--schemes", "dense"]
                paper = harness.rate_str(harness.paper_rate(harness.run_on_cluster(
                    cal, nproc=a.nproc, rate=a.calibrate, tag="9", name="ddp", burst=a.burst,
                    timeout=a.rate_timeout)))
                print(f"[bench_ddp] paper-like rate: {paper} (calibrated at {a.calibrate})", flush=True)
            rate = paper
        t0 = time.time()
        res = harness.run_on_cluster(worker_cmd, nproc=a.nproc, rate=rate, tag=str(i), name="ddp",
                                     burst=a.burst, timeout=a.rate_timeout)
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
