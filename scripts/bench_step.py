#!/usr/bin/env python3
"""Step-time benchmark on the bandwidth-limited cluster (scripts/netns_cluster.py).

For each link rate, N ranks (default 4) run in rate-limited network namespaces and time a
training step of ResNet-18 (CIFAR variant, 11,173,962 parameters) on synthetic CIFAR-shaped
data, by phase, for:

  compute  forward + backward + optimizer, no exchange (the floor)
  dense    the trainer's dense path: one AllReduce of the flat gradient (DenseReducer)
  dense_ovl  the same reducer with ``attach``: bucketed AllReduces started during backward
           (what the trainer gets with the one-line change in docs/performance.md)
  topk     exact top-k 1%, layer-wise, error feedback, AllGather (values + int32 positions)
  randk    random-k 1%, layer-wise, error feedback, shared seed, AllReduce of the values
  blockk   block-random-k 1%, layer-wise, error feedback, shared seed, AllReduce of the values
  ddp      torch DistributedDataParallel (gloo, 25 MB buckets, overlaps backward) as baseline

The workers run the trainer's own step (sparsetrain.train.step.TrainStep over sparsetrain.models,
the flat gradient buffer and reducer of sparsetrain.comm.build_exchange, PhaseTimer, SGD with
Nesterov momentum), in one process group per rate; each scheme is timed in two passes (ABC..ABC..) and the
median per-step time is reported. Peak memory per rank: peak RSS (VmHWM, reset per scheme through
/proc/self/clear_refs) and its growth over the RSS before the scheme was built.

"paper" as a rate means: the bandwidth at which dense spends about 27% of its step in exchange
(the paper's 375 vs 273 ms), computed from the first rate's measured compute step and dense
exchange: wire bits of the ring AllReduce / (0.27/0.73 x compute step - CPU-bound exchange
overhead at that rate).

    sudo .venv/bin/python scripts/bench_step.py                       # defaults: ~8-9 min here
    sudo .venv/bin/python scripts/bench_step.py --rates 1gbit,paper,100mbit,300mbit,3gbit \
        --batch 8 --steps 4 --warmup 2 --out results/bench

Writes <out>/step.json, <out>/step.csv and <out>/step_vs_bandwidth.png. Needs root (namespaces);
the kernel here has no sch_netem, so only bandwidth (tbf) is emulated, not latency.
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


NETNS = REPO / "scripts" / "netns_cluster.py"
SCHEMES = ("compute", "dense", "dense_ovl", "topk", "randk", "blockk", "ddp")
PAPER_SHARE = 0.27  # exchange / step for dense in the paper: (375 - 273) / 375


# ------------------------------------------------------------------------------------ worker
def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from sparsetrain.comm import build_exchange
    from sparsetrain.models import build_model, param_groups_for_weight_decay
    from sparsetrain.timing import PhaseTimer
    from sparsetrain.train.step import TrainStep

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(a.batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (a.batch,), generator=gen)

    def run_scheme(name: str, steps: int, warmup: int, measure_mem: bool) -> dict:
        gc.collect()
        rss0 = _rss_mb("VmRSS")
        _reset_peak()
        torch.manual_seed(0)
        model = build_model("resnet18", 3, 10)
        params = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in params)
        reducer = None
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model)
            opt = torch.optim.SGD(param_groups_for_weight_decay(model, 1e-4), lr=0.01,
                                  momentum=0.9, nesterov=True)
        else:
            net = model
            scheme = "none" if name.startswith("dense") or name == "compute" else name
            agg = "allgather" if name == "topk" else "allreduce"
            flat, params, reducer = build_exchange(params, scheme, "layerwise", agg, a.ratio,
                                                   world_size=world, rank=rank, seed=0, stats_every=0)
            if name == "compute":
                reducer = None
            elif name == "dense_ovl":
                reducer.attach(params, flat)
            opt = torch.optim.SGD(param_groups_for_weight_decay(model, 1e-4), lr=0.01,
                                  momentum=0.9, nesterov=True)
        timer = PhaseTimer("cpu", warmup_steps=warmup)

        def skew(timer):  # waiting for the slowest rank, kept out of "exchange"
            with timer.phase("skew"):
                dist.barrier()

        # the trainer's own step; ddp: the model's own .grad (no flat buffer), exchanged in backward
        run_step = TrainStep(net, opt, reducer, None if name == "ddp" else flat, timer, "cpu",
                             before_exchange=skew if a.skew_phase else None)
        batches = ((x.clone(), y.clone()) for _ in itertools.count())
        steps_ms = []
        dist.barrier()
        for i in range(warmup + steps):
            run_step(batches, i)
            if i >= warmup:
                steps_ms.append(timer.last["step"])
        dist.barrier()
        res = {"phases_ms": timer.means(), "steps_ms": steps_ms,
               "bytes_sent_per_step": getattr(reducer, "bytes_sent_per_step", 0 if name == "compute" else n * 4)}
        if measure_mem:
            res["peak_rss_mb"] = _rss_mb("VmHWM")
            res["peak_growth_mb"] = res["peak_rss_mb"] - rss0
        if hasattr(reducer, "detach"):
            reducer.detach()
        del net, model, opt, reducer
        return res

    # warm the process (allocator, gloo pairs) with one short compute + dense run
    run_scheme("dense", 1, 1, False)
    out: dict = {s: {"steps_ms": [], "phases": []} for s in a.schemes}
    for p in range(a.passes):
        for s in a.schemes:
            r = run_scheme(s, a.steps, a.warmup, p == 0)
            o = out[s]
            o["steps_ms"] += r["steps_ms"]
            o["phases"].append(r["phases_ms"])
            o["bytes_sent_per_step"] = r["bytes_sent_per_step"]
            if "peak_rss_mb" in r:
                o["peak_rss_mb"], o["peak_growth_mb"] = r["peak_rss_mb"], r["peak_growth_mb"]
    # gather every rank's results; rank 0 writes
    allr = [None] * world
    dist.all_gather_object(allr, out)
    if rank == 0:
        summary = {}
        for s in a.schemes:
            per_rank_step = [statistics.median(allr[r][s]["steps_ms"]) for r in range(world)]
            phases = {}
            for ph in allr[0][s]["phases"][0]:
                phases[ph] = statistics.median(
                    statistics.mean(pp.get(ph, 0.0) for pp in allr[r][s]["phases"]) for r in range(world))
            summary[s] = {
                "step_ms": max(per_rank_step),  # the step is synchronous: slowest rank
                "step_ms_per_rank": per_rank_step,
                "phases_ms": phases,
                "bytes_sent_per_step": allr[0][s]["bytes_sent_per_step"],
                "peak_rss_mb_per_rank": [allr[r][s].get("peak_rss_mb") for r in range(world)],
                "peak_growth_mb_per_rank": [allr[r][s].get("peak_growth_mb") for r in range(world)],
            }
        meta = {"world_size": world, "batch_per_rank": a.batch, "threads_per_rank": a.threads,
                "ratio": a.ratio, "skew_phase": a.skew_phase, "steps": a.steps, "warmup": a.warmup, "passes": a.passes,
                "numel": sum(p.numel() for p in build_model("resnet18", 3, 10).parameters()),
                "rate": os.environ.get("ST_NETNS_RATE"),
                "rate_bits": float(os.environ.get("ST_NETNS_RATE_BITS", "nan")),
                "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"meta": meta, "schemes": summary}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ driver
def rate_str(bits: float) -> str:
    return f"{bits / 1e6:.0f}mbit"


def run_rate(a, rate: str, tag: str, worker: list[str] | None = None) -> dict:
    """Run the ranks at one rate on a fresh netns cluster; return the JSON rank 0 wrote.

    ``worker``: the command every rank runs, to which ``--json PATH`` is appended (default: this
    script's worker with ``a``'s options; scripts/bench_ddp.py passes its own)."""
    tmp = Path(tempfile.gettempdir()) / f"st_bench_step_{os.getpid()}_{tag}.json"
    tmp.unlink(missing_ok=True)
    worker = worker or [
        sys.executable, str(Path(__file__).resolve()), "--worker",
        "--batch", str(a.batch), "--steps", str(a.steps),
        "--warmup", str(a.warmup), "--passes", str(a.passes), "--threads", str(a.threads),
        "--ratio", str(a.ratio), "--schemes", ",".join(a.schemes)] + ([] if a.skew_phase else ["--no-skew-phase"])
    cmd = [sys.executable, str(NETNS), "--nproc", str(a.nproc), "--rate", rate,
           "--prefix", f"sb{os.getpid() % 10000}{tag}"[:9], "--kill-timeout", "5", *(["--burst", a.burst] if a.burst else []),
           "--master-port", str(29600 + int(tag)),
           "--", *worker, "--json", str(tmp)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=a.rate_timeout)
    except BaseException:  # timeout, Ctrl-C, SIGTERM: netns_cluster.py stops its ranks and cleans up
        p.terminate()
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        raise
    if p.returncode != 0 or not tmp.exists():
        raise RuntimeError(f"rate {rate}: netns_cluster exited {p.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    res = json.loads(tmp.read_text())
    tmp.unlink()
    res["meta"]["wall_s"] = time.time() - t0
    return res


def dense_wire_bits(numel: int, world: int) -> float:
    """Bits one rank sends in a ring AllReduce of numel float32: 2(N-1)/N x 4 numel bytes."""
    return 2 * (world - 1) / world * numel * 4 * 8


def paper_rate(first: dict) -> float:
    """Bandwidth B where dense's exchange ~ 0.27 x its step, from a run at a known rate R.

    exchange(B) = overhead + wire_bits / B with overhead = exchange(R) - wire_bits / R (the
    CPU-bound part of the collective), and dense step = compute + exchange. Solve
    exchange = share/(1-share) x (dense step - exchange(R)).
    """
    m, s = first["meta"], first["schemes"]
    bits = dense_wire_bits(m["numel"], m["world_size"])
    ex_r = s["dense"]["phases_ms"]["exchange"] / 1e3
    rest = s["dense"]["step_ms"] / 1e3 - ex_r
    overhead = max(0.0, ex_r - bits / m["rate_bits"])
    target = PAPER_SHARE / (1 - PAPER_SHARE) * rest
    avail = max(target - overhead, 1e-3)
    return bits / avail


def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        m, s = res["meta"], res["schemes"]
        base = s.get("dense", {}).get("step_ms")
        lines.append(f"\n== {m['rate']} ({m['label']}), {m['world_size']} ranks, batch {m['batch_per_rank']}/rank, "
                     f"{m['threads_per_rank']} thread/rank ==")
        lines.append(f"{'scheme':<8}{'step ms':>9}{'x dense':>8}{'fwd':>7}{'bwd':>7}{'compr':>7}{'exch':>8}"
                     f"{'decomp':>7}{'skew':>6}{'optim':>7}{'exch %':>7}{'MB sent':>9}{'peak MB':>9}{'+MB':>7}")
        for name, r in s.items():
            ph = r["phases_ms"]
            peak = max(v for v in r["peak_rss_mb_per_rank"] if v is not None)
            grow = max(v for v in r["peak_growth_mb_per_rank"] if v is not None)
            lines.append(
                f"{name:<8}{r['step_ms']:>9.1f}{r['step_ms'] / base if base else float('nan'):>8.2f}"
                f"{ph.get('forward', 0):>7.0f}{ph.get('backward', 0):>7.0f}{ph.get('compress', 0):>7.1f}"
                f"{ph.get('exchange', 0):>8.1f}{ph.get('decompress', 0):>7.1f}{ph.get('skew', 0):>6.0f}{ph.get('optimizer', 0):>7.1f}"
                f"{100 * ph.get('exchange', 0) / r['step_ms']:>7.1f}{r['bytes_sent_per_step'] / 1e6:>9.2f}"
                f"{peak:>9.0f}{grow:>7.0f}")
    return "\n".join(lines)


def goals(res: dict) -> dict:
    s = res["schemes"]
    g = {}
    if {"blockk", "dense"} <= s.keys():
        g["blockk/dense"] = s["blockk"]["step_ms"] / s["dense"]["step_ms"]
        g["blockk/dense<=0.75"] = g["blockk/dense"] <= 0.75
    if {"blockk", "compute"} <= s.keys():
        g["blockk/compute"] = s["blockk"]["step_ms"] / s["compute"]["step_ms"]
        g["blockk/compute<=1.1"] = g["blockk/compute"] <= 1.1
    if {"blockk", "compute"} <= s.keys() and "skew" in s["blockk"]["phases_ms"]:
        # the wait for the slowest rank is paid by every synchronous scheme (on this shared box it
        # is 5-10% of a step) but not by compute-only, which never synchronises
        b = s["blockk"]
        g["(blockk-skew)/compute"] = (b["step_ms"] - b["phases_ms"]["skew"]) / s["compute"]["step_ms"]
    if {"dense", "ddp"} <= s.keys():
        g["dense/ddp"] = s["dense"]["step_ms"] / s["ddp"]["step_ms"]
        g["dense/ddp<=1.05"] = g["dense/ddp"] <= 1.05
    if {"dense_ovl", "ddp"} <= s.keys():
        g["dense_ovl/ddp"] = s["dense_ovl"]["step_ms"] / s["ddp"]["step_ms"]
        g["dense_ovl/ddp<=1.05"] = g["dense_ovl/ddp"] <= 1.05
    if {"blockk", "dense_ovl"} <= s.keys():
        g["blockk/dense_ovl"] = s["blockk"]["step_ms"] / s["dense_ovl"]["step_ms"]
    if "dense" in s:
        g["dense_exchange_share"] = s["dense"]["phases_ms"]["exchange"] / s["dense"]["step_ms"]
    return g


def write_outputs(results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"results": results, "goals": {r["meta"]["label"]: goals(r) for r in results}}
    (out / "step.json").write_text(json.dumps(doc, indent=2))
    with open(out / "step.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "rate_bits", "scheme", "step_ms", "forward_ms", "backward_ms", "compress_ms",
                    "exchange_ms", "decompress_ms", "skew_ms", "optimizer_ms", "bytes_sent_per_step",
                    "peak_rss_mb_max", "peak_growth_mb_max"])
        for res in results:
            m = res["meta"]
            for name, r in res["schemes"].items():
                ph = r["phases_ms"]
                w.writerow([m["label"], m["rate_bits"], name, f"{r['step_ms']:.2f}",
                            *(f"{ph.get(k, 0.0):.2f}" for k in ("forward", "backward", "compress", "exchange",
                                                               "decompress", "skew", "optimizer")),
                            r["bytes_sent_per_step"],
                            f"{max(v for v in r['peak_rss_mb_per_rank'] if v is not None):.1f}",
                            f"{max(v for v in r['peak_growth_mb_per_rank'] if v is not None):.1f}"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        srt = sorted(results, key=lambda r: r["meta"]["rate_bits"])
        for name in SCHEMES:
            pts = [(r["meta"]["rate_bits"] / 1e9, r["schemes"][name]["step_ms"]) for r in srt if name in r["schemes"]]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        for r in srt:
            if r["meta"]["label"] == "paper":
                ax.axvline(r["meta"]["rate_bits"] / 1e9, color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        ticks = sorted({r["meta"]["rate_bits"] / 1e9 for r in srt})
        ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("link bandwidth per rank, each way (Gbit/s, tc tbf; no added latency)")
        ax.set_ylabel("time per step (ms)")
        m = results[0]["meta"]
        ax.set_title(f"ResNet-18, {m['world_size']} ranks, batch {m['batch_per_rank']}/rank, 1% kept (dotted: paper-like)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "step_vs_bandwidth.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no figure", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1gbit,paper,250mbit,4gbit",
                    help="comma list of tc rates; 'paper' = where dense spends ~27%% in exchange "
                         "(computed from the first rate, which must be a number)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--burst", default=None, help="tbf burst passed to netns_cluster.py (default: netns_cluster.py's, max(96 KiB, 1 ms at the rate))")
    ap.add_argument("--batch", type=int, default=8, help="images per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per scheme per pass")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--no-skew-phase", dest="skew_phase", action="store_false",
                    help="do not time the wait for the slowest rank (a barrier before the exchange) "
                         "as its own phase 'skew'; it then shows up inside 'exchange'")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out", default=str(REPO / "results" / "bench"))
    ap.add_argument("--rate-timeout", type=float, default=400)
    ap.add_argument("--report", default=None, metavar="STEP_JSON",
                    help="print the tables and goals of a saved step.json and redraw its figure into --out")
    a = ap.parse_args(argv)
    a.schemes = [s for s in a.schemes.split(",") if s]
    if a.report:
        results = json.loads(Path(a.report).read_text())["results"]
        print(table(results))
        for r in results:
            print(f"goals at {r['meta']['rate']} ({r['meta']['label']}): " + ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in goals(r).items()))
        write_outputs(results, Path(a.out))
        return 0
    if a.worker:
        worker(a)
        return 0
    if os.geteuid() != 0:
        print("bench_step.py needs root (network namespaces): run with sudo", file=sys.stderr)
        return 2
    import signal

    def _stop(signum, _frame):  # turn SIGTERM/SIGHUP into an exception: run_rate cleans up
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    if rates and rates[0] == "paper":
        raise SystemExit("--rates: the first rate must be a number ('paper' is computed from it)")
    results = []
    try:
        for i, rate in enumerate(rates):
            label = rate
            if rate == "paper":
                bits = paper_rate(results[0])
                rate = rate_str(bits)
                print(f"[bench_step] paper-like rate: {rate} (dense exchange ~{PAPER_SHARE:.0%} of its step)", flush=True)
            t0 = time.time()
            res = run_rate(a, rate, str(i))
            res["meta"]["label"] = label
            results.append(res)
            print(table([res]), flush=True)
            print(f"[bench_step] {rate}: {time.time() - t0:.0f} s; goals {goals(res)}", flush=True)
            write_outputs(results, out)
    finally:
        # netns_cluster.py removes its namespaces on every exit path; check nothing of ours is left
        left = [n for n in os.listdir("/sys/class/net") if n.startswith(f"sb{os.getpid() % 10000}")]
        if left:
            print(f"[bench_step] WARNING: leftover links {left}", file=sys.stderr)
    print(f"[bench_step] wrote {out}/step.json, step.csv, step_vs_bandwidth.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
