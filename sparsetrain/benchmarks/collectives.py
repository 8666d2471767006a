"""Collective micro-benchmark on the bandwidth-limited cluster, alpha-beta fit, model check, map.

1. For each rate, N ranks (default 4) on a netcluster (sparsetrain.launch.netcluster) time
   gloo AllReduce and AllGather (all_gather_into_tensor) of float32 messages from 4 B up to
   --max-mb per rank (default 64 MB for AllReduce; AllGather up to max/4 per rank, since every rank
   receives (N-1) x that: the 256 MB of the issue would take minutes per point at 1 Gbit/s on this
   2-core box), median of a few repetitions.
2. Fits alpha and beta per collective and rate (sparsetrain.costmodel.fit).
3. With a step benchmark's step.json (sparsetrain.benchmarks.step; --step, default <out>/step.json):
   writes the cost model (costmodel.json: the fit, each collective's latency calibrated in situ
   from the step's sparse exchanges), predicts every scheme's exchange time at each measured rate
   from the fit at --fit-rate, reports the error against the measured exchange phase (goal:
   within 20%), and draws the break-even map: step time of each sparse scheme / dense for 2..1024
   workers and 1..100 Gbit/s, from this box's measured compute and compression times.

    sudo .venv/bin/python -m sparsetrain.benchmarks.collectives --rates 1gbit,250mbit --out results/bench
    .venv/bin/python -m sparsetrain.benchmarks.collectives --model-only   # refit/redraw from saved JSON
    .venv/bin/python -m sparsetrain.benchmarks.collectives --model-only --out results/e2e_bench \
        --step results/bench/step.json     # a refit in its own folder, calibrated by the step benchmark

Writes <out>/collectives.json, and with a step.json <out>/costmodel.json and <out>/break_even.png.
The kernel here has no sch_netem: only bandwidth is emulated, latency is what veth + gloo give
(tens of microseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from sparsetrain import costmodel
from sparsetrain.benchmarks import harness
from sparsetrain.costmodel import Collective, CostModel, fit, scheme_costs

REPO = harness.REPO
# step.json rows as the cost model's schemes (random-k and block-k modelled with AllReduce) and
# the collective that carries each
STEP_ROWS = {"topk_ag": "topk", "randk_ar": "randk", "blockk_ar": "blockk"}
COLLECTIVE = {"dense": "allreduce", "topk": "allgather", "randk": "allreduce", "blockk": "allreduce"}


def worker(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = []
    s = 4
    while s <= a.max_mb * 2**20:
        sizes.append(s)
        s *= 4
    out = {"allreduce": [], "allgather": []}
    for coll in ("allreduce", "allgather"):
        for nbytes in sizes:
            if coll == "allgather" and nbytes > a.max_mb * 2**20 / 4:
                continue
            n = max(1, nbytes // 4)
            x = torch.ones(n)
            recv = torch.empty(n * world) if coll == "allgather" else None
            reps = 10 if nbytes < 2**20 else (5 if nbytes < 2**24 else 3)

            def op(x=x, recv=recv, coll=coll):
                if coll == "allreduce":
                    dist.all_reduce(x)
                else:
                    dist.all_gather_into_tensor(recv, x)

            op()
            ts = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t0)
            # a collective ends when its slowest rank ends
            tt = torch.tensor([statistics.median(ts)], dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            out[coll].append([n * 4, float(tt)])
    if rank == 0:
        Path(a.json).write_text(json.dumps({"meta": {}, "world_size": world, "rate": os.environ.get("ST_NETNS_RATE"),
                                            "rate_bits": float(os.environ["ST_NETNS_RATE_BITS"]),
                                            **out}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def measure(a, rate: str, i: int) -> dict:
    worker = [sys.executable, "-m", "sparsetrain.benchmarks.collectives", "--worker",
              "--max-mb", str(a.max_mb)]
    res = harness.run_on_cluster(worker, nproc=a.nproc, rate=rate, tag=str(i), name="coll",
                                 burst=a.burst, timeout=600, port_base=29700)
    res.pop("meta", None)
    return res


def fit_all(meas: list[dict]) -> list[dict]:
    fits = []
    for m in meas:
        for coll in ("allreduce", "allgather"):
            pts = m[coll]
            c = fit(coll, m["world_size"], [p[0] for p in pts], [p[1] for p in pts], m["rate_bits"])
            fits.append({"rate": m["rate"], "rate_bits": m["rate_bits"], "collective": coll, "alpha_us": c.alpha * 1e6,
                         "beta_ns_per_byte": c.beta * 1e9, "cpu_beta_ns_per_byte": c.cpu_beta * 1e9,
                         "effective_gbit": 8 / c.beta / 1e9 if c.beta else None, "rel_rms": c.rel_rms})
    return fits


def model_from(fits: list[dict], rate_bits: float) -> dict[str, Collective]:
    """alpha and beta from the fit at ``rate_bits``; the CPU floor per byte = the fitted beta of the
    fastest rate measured when that beta is above its wire time (the hosts, not the link, set the
    pace there)."""
    out = {}
    for f in fits:
        if abs(f["rate_bits"] - rate_bits) < 1:
            out[f["collective"]] = Collective(f["collective"], f["alpha_us"] * 1e-6, f["beta_ns_per_byte"] * 1e-9,
                                              f["rate_bits"])
    for name, c in out.items():
        fastest = max((f for f in fits if f["collective"] == name), key=lambda f: f["rate_bits"])
        # at_rate takes max(wire, floor): the floor is the whole beta of a CPU-bound fast link
        cpu_bound = fastest["rate_bits"] > rate_bits and fastest["cpu_beta_ns_per_byte"] > 0
        c.floor_beta = fastest["beta_ns_per_byte"] * 1e-9 if cpu_bound else 0.0
    return out


def step_results(step_doc: dict) -> list[dict]:
    """step.json's results with the cost model's scheme names (its rows renamed)."""
    out = []
    for r in step_doc["results"]:
        schemes = {STEP_ROWS.get(k, k): v for k, v in r["schemes"].items()
                   if k in STEP_ROWS or k in ("compute", "dense")}
        out.append({**r, "schemes": schemes})
    return out


def check_and_map(fits, step_doc, fit_rate_bits, out: Path) -> dict:
    results = step_results(step_doc)
    ref = min(results, key=lambda r: abs(r["meta"]["rate_bits"] - fit_rate_bits))
    meta, s = ref["meta"], ref["schemes"]
    world = meta["world_size"]
    # compute-only step: the median over all rates (the load on a shared box drifts between rates)
    compute = statistics.median(r["schemes"]["compute"]["step_ms"] for r in results if "compute" in r["schemes"])
    measured = {name: {"compress": s[name]["phases_ms"].get("compress", 0.0),
                       "decompress": s[name]["phases_ms"].get("decompress", 0.0)} for name in s}
    # bytes as each row's built reducer sent them (step.json), never recounted here
    sent = {name: (COLLECTIVE[name], s[name]["bytes_sent_per_step"]) for name in COLLECTIVE if name in s}
    cm = CostModel(model_from(fits, fit_rate_bits), compute, scheme_costs(sent, measured, world, meta.get("kernels")))
    # In-situ latency: on this oversubscribed box a small collective inside a training step costs
    # more than in the idle micro-benchmark (OS scheduling of 4 ranks + background load on 2 cores).
    # Calibrate alpha per collective from the sparse schemes' exchange at the fit rate only; the
    # other rates then test the calibrated model.
    insitu = {}
    for coll, name in (("allreduce", "blockk"), ("allgather", "topk")):
        if name in s and coll in cm.collectives:
            c = cm.collectives[coll]
            a_cnt, b_fac = costmodel.terms(coll, world)
            meas = s[name]["phases_ms"].get("exchange", 0.0) / 1e3
            alpha = max(0.0, (meas - b_fac * cm.schemes[name].nbytes * c.beta) / a_cnt)
            insitu[coll] = Collective(coll, alpha, c.beta, c.rate_bits, floor_beta=c.floor_beta)
    cm2 = CostModel({**cm.collectives, **insitu}, compute, cm.schemes)
    checks = []
    for r in results:
        for name, sc in cm.schemes.items():
            if name not in r["schemes"]:
                continue
            meas = r["schemes"][name]["phases_ms"].get("exchange", 0.0)
            pred = cm.exchange_ms(sc, world, r["meta"]["rate_bits"])
            checks.append({"rate": r["meta"]["rate"], "label": r["meta"].get("label"), "scheme": name,
                           "measured_exchange_ms": meas, "predicted_exchange_ms": pred,
                           "rel_error": pred / meas - 1 if meas else None,
                           "predicted_insitu_ms": cm2.exchange_ms(sc, world, r["meta"]["rate_bits"]),
                           "rel_error_insitu": cm2.exchange_ms(sc, world, r["meta"]["rate_bits"]) / meas - 1 if meas else None,
                           "measured_step_ms": r["schemes"][name]["step_ms"],
                           "predicted_step_ms": cm.step_ms(name, world, r["meta"]["rate_bits"])})
    worlds = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    rates = [1e9 * g for g in (1, 2, 5, 10, 25, 40, 100)]
    be = cm.break_even(worlds, rates)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        fig, axes = plt.subplots(1, len(be), figsize=(4.2 * len(be), 3.8), sharey=True)
        for ax, (name, grid) in zip(np.atleast_1d(axes), be.items(), strict=True):
            g = np.array(grid)
            im = ax.pcolormesh(np.arange(len(rates) + 1), np.arange(len(worlds) + 1), g, cmap="RdYlGn_r",
                               vmin=0, vmax=2, shading="flat")
            ax.contour(np.arange(len(rates)) + 0.5, np.arange(len(worlds)) + 0.5, g, levels=[1.0], colors="k")
            for i in range(len(worlds)):
                for j in range(len(rates)):
                    ax.text(j + 0.5, i + 0.5, f"{g[i, j]:.2f}", ha="center", va="center", fontsize=6)
            ax.set_xticks(np.arange(len(rates)) + 0.5, [f"{r / 1e9:g}" for r in rates])
            ax.set_yticks(np.arange(len(worlds)) + 0.5, [str(w) for w in worlds])
            ax.set_xlabel("Gbit/s per worker")
            ax.set_title(f"{name} / dense step time")
        np.atleast_1d(axes)[0].set_ylabel("workers")
        fig.colorbar(im, ax=axes, shrink=0.8, label="< 1: faster than dense")
        fig.suptitle(f"Break-even from the cost model fitted on this box (compute {compute:.0f} ms/step, gloo alpha "
                     f"{cm.collectives['allreduce'].alpha * 1e6:.0f} us, CPU floor {cm.collectives['allreduce'].cpu_beta * 1e9:.1f} ns/B; 1% kept)",
                     fontsize=8)
        fig.savefig(out / "break_even.png", dpi=120, bbox_inches="tight")
    except ImportError:
        pass
    doc = {"fit_rate_bits": fit_rate_bits, "compute_ms": compute, "schemes": {k: vars(v) for k, v in cm.schemes.items()},
           "collectives": {k: vars(v) for k, v in cm.collectives.items()},
           "collectives_insitu_alpha": {k: vars(v) for k, v in insitu.items()}, "checks": checks,
           "break_even": {"worlds": worlds, "rates_bits": rates, "ratio_to_dense": be}}
    (out / "costmodel.json").write_text(json.dumps(doc, indent=2))
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsetrain.benchmarks.collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1gbit,250mbit,500mbit,4gbit",
                    help="the first is the fit rate unless --fit-rate; the fastest gives the CPU floor")
    ap.add_argument("--fit-rate", default=None, help="rate whose fit predicts the others (default: first)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--burst", default=None, help="tbf burst (default: netcluster's, max(96 KiB, 1 ms at the rate))")
    ap.add_argument("--max-mb", type=float, default=64)
    ap.add_argument("--out", default=str(REPO / "results" / "bench"))
    ap.add_argument("--model-only", action="store_true", help="reuse <out>/collectives.json")
    ap.add_argument("--step", default=None, help="the step benchmark's step.json that calibrates the "
                    "cost model (default: <out>/step.json; without one, costmodel.json is not written)")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    out = Path(a.out)
    step = Path(a.step) if a.step else out / "step.json"
    if a.step and not step.is_file():  # before minutes of measuring, not after
        print(f"--step: {step} is not a file (the step benchmark's step.json: python -m "
              "sparsetrain.benchmarks.step)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if a.model_only:
        meas = json.loads((out / "collectives.json").read_text())["measurements"]
    else:
        if os.geteuid() != 0:
            print("needs root (network namespaces): run with sudo, or --model-only", file=sys.stderr)
            return 2
        meas = []
        for i, rate in enumerate(r for r in a.rates.split(",") if r):
            t0 = time.time()
            meas.append(measure(a, rate, i))
            print(f"[bench_collectives] {rate}: {time.time() - t0:.0f} s", flush=True)
    fits = fit_all(meas)
    (out / "collectives.json").write_text(json.dumps({"measurements": meas, "fits": fits}, indent=2))
    print(f"\n{'rate':<9}{'collective':<11}{'alpha us':>10}{'beta ns/B':>11}{'cpu ns/B':>10}{'eff Gbit/s':>11}{'fit rms':>9}")
    for f in fits:
        print(f"{f['rate']:<9}{f['collective']:<11}{f['alpha_us']:>10.1f}{f['beta_ns_per_byte']:>11.3f}"
              f"{f['cpu_beta_ns_per_byte']:>10.3f}{(f['effective_gbit'] or 0):>11.2f}{f['rel_rms']:>9.2f}")
    for m in meas:
        print(f"\n{m['rate']} measured (bytes per rank: seconds)")
        for coll in ("allreduce", "allgather"):
            print(f"  {coll:<10} " + "  ".join(f"{n}:{t * 1e3:.2f}ms" for n, t in m[coll]))
    if not step.is_file():
        print(f"\nno {step}: costmodel.json and the map not written (their in-situ latency comes from the "
              "step benchmark's exchanges: --step PATH names a step.json elsewhere)")
    else:
        fit_bits = meas[0]["rate_bits"] if a.fit_rate is None else next(
            m["rate_bits"] for m in meas if m["rate"] == a.fit_rate)
        doc = check_and_map(fits, json.loads(step.read_text()), fit_bits, out)
        print(f"\nexchange predicted from the fit at {fit_bits / 1e9:g} Gbit/s vs measured in bench_step:")
        ins = doc["collectives_insitu_alpha"]
        print("in-situ alpha (from block-k / top-k exchange at the fit rate): "
              + ", ".join(f"{k} {v['alpha'] * 1e6:.0f} us" for k, v in ins.items()))
        print(f"{'rate':<10}{'label':<9}{'scheme':<8}{'measured':>10}{'predicted':>10}{'error':>8}"
              f"{'in-situ':>9}{'error':>8}{'step meas':>10}{'step pred':>10}")
        for c in doc["checks"]:
            err = f"{100 * c['rel_error']:+.0f}%" if c["rel_error"] is not None else "-"
            err2 = f"{100 * c['rel_error_insitu']:+.0f}%" if c["rel_error_insitu"] is not None else "-"
            print(f"{c['rate']:<10}{str(c['label']):<9}{c['scheme']:<8}{c['measured_exchange_ms']:>10.1f}"
                  f"{c['predicted_exchange_ms']:>10.1f}{err:>8}{c['predicted_insitu_ms']:>9.1f}{err2:>8}"
                  f"{c['measured_step_ms']:>10.0f}{c['predicted_step_ms']:>10.0f}")
        print(f"wrote {out}/costmodel.json, {out}/break_even.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
