"""Step-time benchmark on the bandwidth-limited cluster: every scheme as the accuracy studies
train it, interleaved rounds, medians with 95% intervals.

    sudo .venv/bin/python -m sparsetrain.benchmarks.step --out results/bench      # make bench-step
    .venv/bin/python -m sparsetrain.benchmarks.step --report results/bench/step.json

For each link rate, N ranks (default 4) run on a fresh netcluster (one torchrun node per
tc-shaped network namespace, ``sparsetrain.launch.netcluster``) and time the trainer's own step
(``train.step.TrainStep``) of ResNet-18 (CIFAR variant) on synthetic CIFAR-shaped batches. Each
row is built from the config the studies compose (``--preset``, default ``cpu_scale``: layer-wise,
1%, ``scheme.uncompressed=1d``, error feedback, the scheme's compressor node, SGD with Nesterov
momentum) plus the row's scheme / aggregation, through the trainer's own ``build_exchange`` call:

  compute    forward + backward + optimizer, no exchange (the floor)
  dense      dense SGD, one AllReduce after backward (``dist.overlap=false``)
  dense_ovl  dense SGD, bucketed AllReduce during backward (the trainer's default)
  topk_ag    top-k, AllGather (the studies' aggregation for every scheme)
  randk_ag   random-k, AllGather          randk_ar   random-k, AllReduce (shared seed; RQ3)
  blockk_ag  block-random-k, AllGather    blockk_ar  block-random-k, AllReduce (shared seed; RQ3)
  powersgd   sparsetrain's PowerSGD (P then Q AllReduced), its rank matched to the sparse rows' bytes
  signsgd_ag signSGD (scaled sign, error feedback), AllGather of packed signs and scales
  qsgd_ag    QSGD at the frontier study's s = 1 (2 bits an entry, a norm per 512), no error feedback,
             AllGather of packed levels and norms
  ddp        torch DistributedDataParallel (gloo, 25 MB buckets), the baseline

and rows of one's own (``--row NAME=OVERRIDES``), e.g. a scheme kept outside the checkout::

    sudo PYTHONPATH=examples/dgc .venv/bin/python -m sparsetrain.benchmarks.step \
      --override 'hydra.searchpath=[file://'$PWD'/examples/dgc/conf]' \
      --row 'dgc=scheme=dgc_randk optim.momentum=0 optim.nesterov=false' --schemes compute,dense,randk_ag,dgc

Every row is rebuilt and timed once per round, rows rotated round-robin, for --rounds rounds,
split over --visits visits (default 3): each visit runs every rate in turn on a fresh cluster for
its share of the rounds, so that rates interleave in time as rows do and a slow drift of the
machine's speed spreads over all of them (the first run measured the rates one after another:
compute-only drifted 5% between them);
every step starts on all ranks together (a barrier) and lasts as long as its slowest rank; a
round's value is its median step. Reported per row: the median over rounds and its 95%
distribution-free interval (order statistics of the round values, ``timing_stats.median_interval``),
the per-round ratio to compute-only (median, interval), phases (median over rounds of the median
over ranks), bytes, peak RSS. A row whose median is below compute-only's is flagged (its
interval overlaps compute-only's: a tie within noise; it lies below: suspect). Compute-only
exchanges nothing, so it must be flat across rates within its intervals: the report says
whether it is (the benchmark's own noise check).

"paper" as a rate: the bandwidth at which dense spends about 27% of its step in exchange (the
paper's 375 vs 273 ms), computed from the first rate's dense row (``harness.paper_rate``).

Writes <out>/step.json (schema 2), step.csv, step.txt (the report) and step_vs_bandwidth.png.
``--report`` re-renders them from a saved step.json.

Over 400 lines on purpose: the worker that times each row, the driver that visits rates and
rounds on fresh clusters, and the report (tables, goals, figure) of one benchmark, which read
the same step.json fields.
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import json
import sys
import time
from pathlib import Path

from sparsetrain.analysis.cluster_check import bench_collective
from sparsetrain.benchmarks import harness
from sparsetrain.benchmarks.timing_stats import (
    LEVEL,
    Interval,
    compute_flags,
    flatness,
    round_order,
)
from sparsetrain.compress import kernels
from sparsetrain.launch.report import grid, num

SCHEMA = 2
# row -> the config overrides that make it (on top of --preset, --model, --ratio, --override)
ROWS = {
    "compute": ["scheme=none", "dist.overlap=false"],
    "dense": ["scheme=none", "dist.overlap=false"],
    "dense_ovl": ["scheme=none", "dist.overlap=true"],
    "topk_ag": ["scheme=topk", "aggregation=allgather"],
    "randk_ag": ["scheme=randk", "aggregation=allgather"],
    "randk_ar": ["scheme=randk", "aggregation=allreduce"],
    "blockk_ag": ["scheme=blockk", "aggregation=allgather"],
    "blockk_ar": ["scheme=blockk", "aggregation=allreduce"],
    "powersgd": ["scheme=powersgd"],  # its rank matched to the sparse rows' bytes; two AllReduces
    "signsgd_ag": ["scheme=signsgd", "aggregation=allgather"],
    "qsgd_ag": ["scheme=qsgd", "scheme.levels=1", "aggregation=allgather"],  # as experiment=frontier trains it
    "ddp": ["scheme=none", "dist.ddp=true"],
}
PHASE_COLUMNS = ("forward", "backward", "compress", "exchange", "decompress", "skew", "optimizer")


def add_rows(specs: list[str]) -> None:
    """``--row NAME=OVERRIDES`` (space-separated Hydra overrides): a row of one's own, e.g. a
    scheme from another config folder (``--override 'hydra.searchpath=[file://DIR]'`` finds it,
    PYTHONPATH its module): ``--row 'dgc=scheme=dgc_randk optim.momentum=0 optim.nesterov=false'``."""
    for spec in specs:
        name, sep, overrides = spec.partition("=")
        name = name.strip()
        if not sep or not name or not overrides.split() or name in ("compute",):
            raise SystemExit(f"--row {spec!r} is not allowed; it takes NAME=OVERRIDES, e.g. "
                             "--row 'mine=scheme=mine aggregation=allgather' (NAME not 'compute')")
        ROWS[name] = overrides.split()


def parse_rows(text: str) -> list[str]:
    """Row names in the order given, each once; a scheme's name (``blockk``) stands for all of
    its rows (``blockk_ag, blockk_ar``)."""
    out = []
    for name in (s.strip() for s in text.split(",")):
        rows = [name] if name in ROWS else [r for r in ROWS if r.startswith(f"{name}_")]
        if name and not rows:
            raise SystemExit(f"--schemes: unknown row {name!r}; known: {', '.join(ROWS)} "
                             "(or a scheme's name for all of its rows)")
        out += [r for r in rows if r not in out]
    return out


# ------------------------------------------------------------------------------------ worker
def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from sparsetrain.timing import PhaseTimer
    from sparsetrain.train.components import exchange_from_config, optimizer_from_config
    from sparsetrain.train.step import TrainStep

    rank, world = harness.init_worker(a.threads)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(a.batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (a.batch,), generator=gen)
    base = [f"experiment={a.preset}", f"model={a.model}",
            *([f"ratio={a.ratio}"] if a.ratio is not None else []), *a.override]
    cfgs = {name: harness.study_config(base + ROWS[name], world) for name in {*a.schemes, "dense"}}

    def skew(timer):  # waiting for the slowest rank, kept out of "exchange"
        with timer.phase("skew"):
            dist.barrier()

    def run_row(name: str, steps: int, warmup: int, measure_mem: bool) -> dict:
        gc.collect()
        rss0 = harness.rss_mb("VmRSS")
        harness.reset_peak()
        cfg = cfgs[name]
        model = harness.model_from_config(cfg)
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        ex = exchange_from_config(cfg, model, world_size=world, rank=rank)
        net, flat, reducer = ex.net, ex.flat, ex.reducer
        if cfg.dist.ddp:  # DDP's own AllReduce inside backward, as dist.ddp=true trains
            reducer.settle(x)
        sent, collective = reducer.bytes_sent_per_step, reducer.collective
        if name == "compute":  # the same model and buffer, no exchange
            reducer.detach()
            reducer, sent, collective = None, 0, None
        opt = optimizer_from_config(cfg, model)
        timer = PhaseTimer("cpu", warmup_steps=warmup)
        run_step = TrainStep(net, opt, reducer, flat, timer, "cpu",
                             before_exchange=skew if a.skew_phase and reducer is not None else None)
        batches = ((x.clone(), y.clone()) for _ in itertools.count())
        times = harness.timed_steps(run_step, batches, warmup, steps)
        res = {"steps": times, "phases": timer.means(), "bytes_sent_per_step": sent, "numel": numel,
               "collective": collective}
        if measure_mem:
            res["peak_rss_mb"] = harness.rss_mb("VmHWM")
            res["peak_growth_mb"] = res["peak_rss_mb"] - rss0
        if reducer is not None:
            reducer.detach()
        del net, model, opt, reducer, flat, run_step
        return res

    run_row("dense", 1, 1, False)  # warm the process (allocator, gloo pairs); not recorded
    names = list(a.schemes)
    out = {n: {"rounds": [], "phases": []} for n in names}
    extra: dict = {}
    for r in range(a.rounds):
        for name in round_order(names, a.round_offset + r):  # offset: continue across visits
            res = run_row(name, a.steps, a.warmup, r == 0)
            out[name]["rounds"].append(res["steps"])
            out[name]["phases"].append(res["phases"])
            e = extra.setdefault(name, {})
            e["bytes_sent_per_step"], e["numel"] = res["bytes_sent_per_step"], res["numel"]
            e["collective"] = res["collective"]
            if "peak_rss_mb" in res:
                e["peak_rss_mb"], e["peak_growth_mb"] = res["peak_rss_mb"], res["peak_growth_mb"]
    allr = harness.gather({"out": out, "extra": extra})
    if rank == 0:
        summary = harness.summarize([q["out"] for q in allr], names, a.rounds)
        for n in names:
            summary[n].update({
                "bytes_sent_per_step": allr[0]["extra"][n]["bytes_sent_per_step"],
                "collective": allr[0]["extra"][n]["collective"],  # the reducer's, after warm-up
                "peak_rss_mb_per_rank": [q["extra"][n].get("peak_rss_mb") for q in allr],
                "peak_growth_mb_per_rank": [q["extra"][n].get("peak_growth_mb") for q in allr],
                "options": harness.row_options(cfgs[n]),
            })
        meta = {"schema": SCHEMA, "world_size": world, "batch_per_rank": a.batch,
                "threads_per_rank": a.threads, "ratio": cfgs["dense"].ratio, "preset": a.preset,
                "model": a.model, "overrides": a.override, "skew_phase": a.skew_phase,
                "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                "numel": allr[0]["extra"][names[0]]["numel"], **harness.link(),
                "statistic": "median over rounds of the round's median step (slowest rank per "
                             "step); interval: order statistics of the round values (sign test)",
                "torch": torch.__version__, "kernels": kernels.backend()}
        Path(a.json).write_text(json.dumps({"meta": meta, "schemes": summary}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def merge_visits(parts: list[dict]) -> dict:
    """One rate's results from its visits: their rounds concatenated and summarized together
    (``harness.summarize_rounds``); meta from the first, with the rounds and wall time summed."""
    if len(parts) == 1:
        return parts[0]
    meta = {**parts[0]["meta"], "rounds": sum(p["meta"]["rounds"] for p in parts),
            "visits": len(parts), "wall_s": sum(p["meta"].get("wall_s", 0.0) for p in parts)}
    rows = {}
    for name, first in parts[0]["schemes"].items():
        rows[name] = {**first,
                      "steps_ms": [s for p in parts for s in p["schemes"][name]["steps_ms"]],
                      "phase_rounds_ms": {ph: [x for p in parts for x in p["schemes"][name]["phase_rounds_ms"][ph]]
                                          for ph in first["phase_rounds_ms"]}}
    return {"meta": meta, "schemes": harness.summarize_rounds(rows)}


# ------------------------------------------------------------------------------------ report
def interval(r: dict) -> Interval | None:
    if r.get("ci_low_ms") is None:
        return None
    return Interval(r["step_ms"], r["ci_low_ms"], r["ci_high_ms"], r.get("ci_level", float("nan")),
                    len(r.get("round_ms", [])))


def flags(res: dict) -> dict[str, str]:
    ivs = {n: iv for n, r in res["schemes"].items() if (iv := interval(r)) is not None}
    return compute_flags(ivs)


def noise_check(results: list[dict]) -> dict:
    """Compute-only across rates: flat within its intervals?"""
    ivs = {r["meta"]["label"]: iv for r in results
           if "compute" in r["schemes"] and (iv := interval(r["schemes"]["compute"])) is not None}
    f = flatness(ivs)
    return {"compute_flat": f.flat, "common_ms": [f.low, f.high] if f.flat and ivs else None,
            "outliers": list(f.outliers),
            "compute_ms": {k: [v.low, v.median, v.high] for k, v in ivs.items()}}


def goals(res: dict) -> dict:
    s, g = res["schemes"], {}

    def ratio(a, b):
        return s[a]["step_ms"] / s[b]["step_ms"] if {a, b} <= s.keys() else None

    for name in ("blockk_ag", "blockk_ar"):
        if (v := ratio(name, "dense")) is not None:
            g[f"{name}/dense"] = v
            g[f"{name}/dense<=0.75"] = v <= 0.75
        if name in s and "x_compute" in s[name]:
            g[f"{name}/compute"] = s[name]["x_compute"]
            g[f"{name}/compute<=1.1"] = s[name]["x_compute"] <= 1.1
    for a_, b_ in (("dense", "ddp"), ("dense_ovl", "ddp")):
        if (v := ratio(a_, b_)) is not None:
            g[f"{a_}/{b_}"] = v
            g[f"{a_}/{b_}<=1.05"] = v <= 1.05
    if "dense" in s:
        g["dense_exchange_share"] = s["dense"]["phases_ms"].get("exchange", 0.0) / s["dense"]["step_ms"]
    return g


def table(res: dict) -> str:
    m, s = res["meta"], res["schemes"]
    dense = s.get("dense", {}).get("step_ms")
    fl = flags(res)
    head = (f"== {m['rate']} ({m['label']}), {m['world_size']} ranks, batch {m['batch_per_rank']}/rank, "
            f"{m['threads_per_rank']} thread/rank, {m['rounds']} rounds x {m['steps']} steps "
            f"(+{m['warmup']} warm-up), preset {m['preset']} ==")
    rows = []
    for name, r in s.items():
        ph = r["phases_ms"]
        xc = r.get("x_compute_ci")
        peak = [v for v in r.get("peak_rss_mb_per_rank", []) if v is not None]
        rows.append([
            name, bench_collective(name, r) or "-",
            num(r["step_ms"]), f"{num(r['ci_low_ms'])}-{num(r['ci_high_ms'])}",
            f"{num(r.get('x_compute'), 3)} ({num(xc[0], 3)}-{num(xc[1], 3)})" if xc else "-",
            num(r["step_ms"] / dense if dense else None, 3),
            *(num(ph.get(k, 0.0)) for k in ("compress", "exchange", "decompress", "skew")),
            num(r["bytes_sent_per_step"] / 1e6, 2), num(max(peak) if peak else None, 0),
            fl.get(name, ""),
        ])
    level = min((r.get("ci_level", 1.0) for r in s.values()), default=1.0)
    cols = ["row", "collective", "step ms", f"{level:.1%} interval", "x compute (interval)", "x dense",
            "compress", "exchange", "decompress", "skew", "MB sent", "peak MB", "flag"]
    return "\n".join([head, grid(cols, rows)])


def report(results: list[dict]) -> str:
    parts = [table(r) + "\ngoals: " + ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in goals(r).items())
        for r in results]
    nc = noise_check(results)
    if nc["compute_ms"]:
        rows = [[k, num(v[1]), f"{num(v[0])}-{num(v[2])}"] for k, v in nc["compute_ms"].items()]
        verdict = ("one rate only: flatness across bandwidths not checked" if len(rows) == 1 else
                   f"compute-only is flat across bandwidths within its intervals (every interval "
                   f"holds {num(nc['common_ms'][0])}-{num(nc['common_ms'][1])} ms)" if nc["compute_flat"]
                   else "compute-only is NOT flat across bandwidths: the intervals at "
                        f"{', '.join(nc['outliers'])} miss the others' common value; the machine's load "
                        "changed between rates, so compare rows within one rate only")
        parts.append("== noise check: compute-only (exchanges nothing) across rates ==\n"
                     + grid(["rate", "step ms", "interval"], rows) + "\n" + verdict)
    parts.append(f"intervals: distribution-free, for the median over rounds (order statistics of "
                 f"the round values, coverage >= {LEVEL:.0%} from 6 rounds on; the level column "
                 "gives the exact coverage). flag 'ties compute-only': median below compute-only's, "
                 "interval overlapping it (within noise); 'below compute-only': wholly below (suspect).")
    return "\n\n".join(parts)


def write_outputs(results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "results": results,
           "goals": {r["meta"]["label"]: goals(r) for r in results},
           "flags": {r["meta"]["label"]: flags(r) for r in results},
           "noise_check": noise_check(results)}
    (out / "step.json").write_text(json.dumps(doc, indent=2))
    (out / "step.txt").write_text(report(results) + "\n")
    with open(out / "step.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "rate_bits", "row", "scheme", "aggregation", "collective", "step_ms", "ci_low_ms",
                    "ci_high_ms", "ci_level", "x_compute", *(f"{k}_ms" for k in PHASE_COLUMNS),
                    "bytes_sent_per_step", "peak_rss_mb_max", "flag"])
        for res in results:
            m, fl = res["meta"], flags(res)
            for name, r in res["schemes"].items():
                ph, o = r["phases_ms"], r.get("options", {})
                peak = [v for v in r.get("peak_rss_mb_per_rank", []) if v is not None]
                w.writerow([m["label"], m["rate_bits"], name, o.get("scheme"), o.get("aggregation"),
                            bench_collective(name, r) or "",
                            f"{r['step_ms']:.2f}", f"{r['ci_low_ms']:.2f}", f"{r['ci_high_ms']:.2f}",
                            f"{r['ci_level']:.4f}", f"{r.get('x_compute', float('nan')):.4f}",
                            *(f"{ph.get(k, 0.0):.2f}" for k in PHASE_COLUMNS),
                            r["bytes_sent_per_step"], f"{max(peak):.1f}" if peak else "",
                            fl.get(name, "")])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        srt = sorted(results, key=lambda r: r["meta"]["rate_bits"])
        for name in ROWS:
            pts = [(r["meta"]["rate_bits"] / 1e9, r["schemes"][name]) for r in srt if name in r["schemes"]]
            if pts:
                xs = [p[0] for p in pts]
                ys = [p[1]["step_ms"] for p in pts]
                err = [[y - p[1]["ci_low_ms"] for y, p in zip(ys, pts)],
                       [p[1]["ci_high_ms"] - y for y, p in zip(ys, pts)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        harness.bandwidth_axis(ax, srt)
        ax.set_ylabel("time per step (ms): median over rounds, 95% interval")
        m = results[0]["meta"]
        ax.set_title(f"ResNet-18, {m['world_size']} ranks, batch {m['batch_per_rank']}/rank, "
                     f"ratio {m['ratio']}, {m['rounds']} rounds (dotted: paper-like)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "step_vs_bandwidth.png", dpi=120)
        plt.close(fig)
    except ImportError:
        print("matplotlib missing: no figure", file=sys.stderr)


def render(doc: dict, out: Path) -> str:
    """The report of a saved step.json; rewrites its outputs into ``out``."""
    if doc.get("schema") != SCHEMA:
        raise SystemExit(f"--report: schema {doc.get('schema')!r} is not supported; this version reads "
                         f"schema {SCHEMA} (rerun the benchmark)")
    results = doc["results"]
    write_outputs(results, out)
    return report(results)


# ------------------------------------------------------------------------------------ driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsetrain.benchmarks.step",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--round-offset", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1gbit,paper,250mbit,4gbit",
                    help="comma list of tc rates; 'paper' = where dense spends ~27%% in exchange "
                         "(computed from the first rate, which must be a number)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--burst", default=None, help="tbf burst (default: netcluster's, max(96 KiB, 1 ms at the rate))")
    ap.add_argument("--batch", type=int, default=8, help="images per rank per step")
    ap.add_argument("--rounds", dest="rounds", type=int, default=9,
                    help="interleaved rounds (>= 5; >= 6 for a 95%% interval; 9 gives [x(2), x(8)])")
    ap.add_argument("--visits", type=int, default=None,
                    help="visit the rates this many times in turn, each time for its share of the "
                         "rounds, so that a drift of the machine's speed spreads over every rate "
                         "(default: 3, or --rounds if fewer)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per row per round (after its rebuild)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--preset", default="cpu_scale", help="the studies' experiment preset the rows start from")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--ratio", type=float, default=None, help="default: the preset's (0.01)")
    ap.add_argument("--override", action="append", default=[],
                    help="Hydra override for every row, e.g. scheme.uncompressed=none (repeatable)")
    ap.add_argument("--no-skew-phase", dest="skew_phase", action="store_false",
                    help="do not time the wait for the slowest rank (a barrier before the exchange) "
                         "as its own phase 'skew'; it then shows up inside 'exchange'")
    ap.add_argument("--row", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="a row of one's own (repeatable): NAME=space-separated overrides; list it in --schemes")
    ap.add_argument("--schemes", default=",".join(ROWS),
                    help=f"rows: {', '.join(ROWS)}; topk, randk, blockk = all of that scheme's rows")
    ap.add_argument("--out", default=None,
                    help="where to write (default: results/bench; with --report, the saved step.json's folder)")
    ap.add_argument("--rate-timeout", type=float, default=7200)
    ap.add_argument("--report", default=None, metavar="STEP_JSON",
                    help="print the tables of a saved step.json and redraw its outputs next to it (or into --out)")
    a = ap.parse_args(argv)
    if a.report:  # next to the saved file unless told: never over another benchmark's outputs
        print(render(json.loads(Path(a.report).read_text()), Path(a.out) if a.out else Path(a.report).parent))
        return 0
    add_rows(a.row)
    a.schemes = parse_rows(a.schemes)
    if a.worker:
        worker(a)
        return 0
    if not harness.need_root("sparsetrain.benchmarks.step"):
        return 2
    harness.stop_on_signals()
    out = Path(a.out) if a.out else harness.REPO / "results" / "bench"
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    if rates and rates[0] == "paper":
        raise SystemExit("--rates: the first rate must be a number ('paper' is computed from it)")
    if "paper" in rates and "dense" not in a.schemes:
        raise SystemExit("--rates paper needs the dense row in --schemes")
    a.visits = min(3, a.rounds) if a.visits is None else a.visits
    if not 1 <= a.visits <= a.rounds:
        raise SystemExit(f"--visits={a.visits} is not allowed: it must be between 1 and --rounds ({a.rounds})")
    worker_cmd = [sys.executable, "-m", "sparsetrain.benchmarks.step", "--worker",
                  "--batch", str(a.batch), "--steps", str(a.steps),
                  "--warmup", str(a.warmup), "--threads", str(a.threads), "--preset", a.preset,
                  "--model", a.model, "--schemes", ",".join(a.schemes),
                  *(["--ratio", str(a.ratio)] if a.ratio is not None else []),
                  *(x for o in a.override for x in ("--override", o)),
                  *(x for r in a.row for x in ("--row", r)),
                  *([] if a.skew_phase else ["--no-skew-phase"])]
    # The rounds are split into visits; each visit runs every rate in turn (a fresh cluster per
    # rate and visit), so the rates interleave in time as the rows do within a rate.
    shares = [a.rounds // a.visits + (1 if v < a.rounds % a.visits else 0) for v in range(a.visits)]
    parts: dict[str, list[dict]] = {rate: [] for rate in rates}
    resolved: dict[str, str] = {}
    offset = 0
    for v, share in enumerate(shares):
        for i, label in enumerate(rates):
            if label not in resolved:
                resolved[label] = label
                if label == "paper":  # from the first visit of the first rate
                    resolved[label] = harness.rate_str(harness.paper_rate(parts[rates[0]][0]))
                    print(f"[bench step] paper-like rate: {resolved[label]} (dense exchange "
                          f"~{harness.PAPER_SHARE:.0%} of its step)", flush=True)
            rate = resolved[label]
            t0 = time.time()
            cmd = [*worker_cmd, "--rounds", str(share), "--round-offset", str(offset)]
            res = harness.run_on_cluster(cmd, nproc=a.nproc, rate=rate, tag=str(v * len(rates) + i),
                                         name="step", burst=a.burst, timeout=a.rate_timeout)
            res["meta"]["label"] = label
            parts[label].append(res)
            print(f"[bench step] visit {v + 1}/{a.visits}, {rate}: {share} rounds, "
                  f"{time.time() - t0:.0f} s", flush=True)
        offset += share
        results = [merge_visits(parts[label]) for label in rates if parts[label]]
        write_outputs(results, out)
    for res in results:
        print(table(res), flush=True)
        print(f"[bench step] {res['meta']['rate']}: goals {goals(res)}", flush=True)
    print("\n" + report(results).split("\n\n", len(results))[-1])
    print(f"[bench step] wrote {out}/step.json, step.csv, step.txt, step_vs_bandwidth.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
