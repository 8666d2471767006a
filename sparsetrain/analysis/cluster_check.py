"""The time-to-accuracy prediction checked against measurement on the emulated cluster.

Two checks. **End to end** (``--runs``): training runs launched on ``launch.netcluster`` with
``train.stop_at_accuracy`` measure their own time to the target; each is set against what
``time_to_accuracy`` predicts for it (its own steps to the target, its own measured compute
phases, the exchange the model predicts at its link's rate and its world size). **Per step**
(a benchmark folder):
``python -m sparsetrain.analysis.cluster_check results/bench`` reads ``step.json``
(``python -m sparsetrain.benchmarks.step``: step time by phase, 4 ranks on tc-shaped links, at several rates) and
``costmodel.json`` (``python -m sparsetrain.benchmarks.collectives``: the alpha-beta fit on the same cluster) and
compares, for every rate and scheme, measured compute + predicted exchange with the measured step,
exactly as ``time_to_accuracy`` predicts a run's step. Exit 0 when every row is within the
tolerance (20%). No torch.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd

from sparsetrain.costmodel import Collective
from sparsetrain.scheme_catalog import is_dense

from .loader import DENSE, collective_of
from .time_to_accuracy import (
    COLLECTIVES,
    COMPUTE_PHASES,
    ExchangeModel,
    _has,
    _ms,
    _warmup,
    compute_ms,
    default_model,
    fitted_model,
    predict_step_ms,
    time_to_target_s,
)

# Schema 1 (the first pass) names rows by scheme only; schema 2 rows carry their config options.
BENCH_COLLECTIVE = {"dense": "allreduce", "topk": "allgather", "randk": "allreduce", "blockk": "allreduce"}


def bench_collective(row: str, result: dict) -> str | None:
    """The collective that carried a step-benchmark row's exchange; None when it exchanged
    nothing (compute-only). The worker records the reducer's own (``collective``); files written
    before it did say it through the row's options, read by the studies' rule
    (``loader.collective_of``: dense SGD and PowerSGD AllReduce, a sparse scheme its aggregation),
    or, for schema 1, through the row's name."""
    if "collective" in result:
        return result["collective"]
    options = result.get("options")
    if not options:
        return BENCH_COLLECTIVE.get(row)
    if not result.get("bytes_sent_per_step"):
        return None
    scheme = options.get("scheme")
    return collective_of({**options, "scheme": DENSE if is_dense(scheme) else scheme})


def _timed_collective(row: str, result: dict) -> str | None:
    """:func:`bench_collective` for rows whose exchange is a phase of its own; None for the
    overlapped dense path and torch DDP, whose exchange runs inside backward."""
    options = result.get("options") or {}
    dense_inside_backward = is_dense(options.get("scheme")) and (row != "dense" or options.get("overlap"))
    if options.get("ddp") or dense_inside_backward:  # (`overlap` applies to dense SGD only)
        return None
    return bench_collective(row, result)


def bench_check(step: dict, costmodel: dict, tolerance: float = 0.2) -> pd.DataFrame:
    """Predicted vs measured step time on the emulated cluster (``python -m sparsetrain.benchmarks.step``'s
    ``step.json``, ``python -m sparsetrain.benchmarks.collectives``'s ``costmodel.json``): for every rate and
    scheme, the scheme's own measured compute phases (data, forward, backward, compress,
    decompress, optimizer; mean over ranks) + the exchange the fitted model predicts for its
    payload at that rate and world size, against the measured step (mean over ranks, and the
    slowest rank's). ``ratio`` = predicted / measured (mean over ranks); ``within`` = |ratio - 1|
    <= ``tolerance``. Not predicted, so in the gap: ``skew``, the wait for the slowest rank before
    the collective, which the benchmark times as its own phase."""
    collectives = {name: Collective(**costmodel["collectives"][name]) for name in COLLECTIVES}
    model = ExchangeModel(collectives, "fitted")
    rows = []
    for result in step["results"]:
        meta = result["meta"]
        world, rate = int(meta["world_size"]), float(meta["rate_bits"])
        for scheme, r in result["schemes"].items():
            collective = _timed_collective(scheme, r)
            if collective is None:
                continue
            ph = r["phases_ms"]
            compute = sum(float(ph.get(p, 0.0)) for p in (*COMPUTE_PHASES, "compress", "decompress"))
            exchange = model.time_ms(collective, float(r["bytes_sent_per_step"]), world, rate)
            rows.append({"rate": meta.get("label", meta.get("rate")), "rate_bits": rate, "workers": world,
                         "scheme": scheme, "collective": collective, "payload_bytes": r["bytes_sent_per_step"],
                         "measured_compute_ms": compute, "predicted_exchange_ms": exchange,
                         "measured_exchange_ms": float(ph.get("exchange", 0.0)), "skew_ms": float(ph.get("skew", 0.0)),
                         "predicted_step_ms": compute + exchange, "measured_step_ms": float(ph["step"]),
                         "measured_step_max_rank_ms": float(r["step_ms"])})
    out = pd.DataFrame(rows)
    out["ratio"] = out["predicted_step_ms"] / out["measured_step_ms"]
    out["ratio_max_rank"] = out["predicted_step_ms"] / out["measured_step_max_rank_ms"]
    out["within"] = (out["ratio"] - 1).abs() <= tolerance
    return out


def bench_check_files(folder: str | Path, tolerance: float = 0.2, costmodel: str | Path | None = None) -> pd.DataFrame:
    """:func:`bench_check` on ``folder/step.json`` and ``costmodel`` (default ``folder/costmodel.json``)."""
    folder = Path(folder)
    return bench_check(json.loads((folder / "step.json").read_text()),
                       json.loads(Path(costmodel or folder / "costmodel.json").read_text()), tolerance)


#: the collective that carries each configuration of ``sparsetrain.benchmarks.ddp`` (its hooks'
#: rounds counted as one: PowerSGD's two AllReduces share the latency term here)
DDP_COLLECTIVE = {"ddp": "allreduce", "ddp_fp16": "allreduce", "ddp_bf16": "allreduce",
                  "ddp_powersgd": "allreduce", "ddp_st_powersgd": "allreduce", "ddp_blockk": "allreduce",
                  "ddp_randk": "allreduce", "ddp_topk": "allgather", "reducer_blockk": "allreduce"}


def ddp_overlap(ddp: dict, model: ExchangeModel) -> pd.DataFrame:
    """How much of each configuration's exchange the DDP path hides behind backward, per rate of
    ``python -m sparsetrain.benchmarks.ddp``'s ``ddp.json``: ``predicted_exchange_ms`` (the model's
    collective time for the configuration's bytes at that rate and world size, as time to
    accuracy charges it, after backward), ``exposed_ms`` (measured: what backward waited after the
    last bucket was handed to the hook, decompression left out: the ``exchange`` phase),
    ``hidden_ms`` = predicted - exposed (negative: the exchange cost more than the model says, e.g.
    per-bucket waits), ``hidden_share`` = hidden / predicted. ``headroom_ms``: DDP with a hook
    that sends nothing (``ddp_noop``) minus compute alone, where the file has both: what DDP's
    machinery costs when the network is free. ``reducer_blockk`` (the trainer's reducer after
    backward) is the no-overlap reference. ``modelled_exposed_ms``: where the file recorded the
    configuration's buckets (``overlap_buckets``), what the model charges a run of it
    (``costmodel.exposed_ms``: the buckets' collectives from when each was ready), to set
    against ``exposed_ms``; ``modelled_to_exposed`` their ratio."""
    rows = []
    for result in ddp["results"]:
        meta, configs = result["meta"], result["configs"]
        world, rate = int(meta["world_size"]), float(meta["rate_bits"])
        compute = configs.get("compute", {}).get("step_ms", math.nan)
        noop = configs.get("ddp_noop", {}).get("step_ms", math.nan)
        for name, c in configs.items():
            collective = DDP_COLLECTIVE.get(name)
            if collective is None:
                continue
            nbytes = float(c["bytes_sent_per_step"])
            predicted = model.time_ms(collective, nbytes, world, rate)
            exposed = float(c["phases_ms"].get("exchange", 0.0))
            buckets = [(b["share"], b["lead_ms"]) for b in c.get("overlap_buckets") or ()]
            modelled = model.exposed_ms(collective, nbytes, world, rate, buckets) if buckets else math.nan
            rows.append({"rate": meta.get("label", meta.get("rate")), "rate_bits": rate, "workers": world,
                         "configuration": name, "bytes_sent_per_step": c["bytes_sent_per_step"],
                         "predicted_exchange_ms": predicted, "exposed_ms": exposed,
                         "hidden_ms": predicted - exposed,
                         "hidden_share": (predicted - exposed) / predicted if predicted > 0 else math.nan,
                         "modelled_exposed_ms": modelled,
                         "modelled_to_exposed": modelled / exposed if exposed > 0 else math.nan,
                         "step_ms": c["step_ms"], "compute_ms": compute, "headroom_ms": noop - compute})
    return pd.DataFrame(rows)


#: the run's axes shown beside each end-to-end point
E2E_AXES = ("scheme", "scope", "aggregation", "ratio", "exchange", "seed")


def e2e_check(runs: pd.DataFrame, model: ExchangeModel, tolerance: float = 0.15) -> pd.DataFrame:
    """Measured against predicted time to the target, one row per completed run that stopped at
    ``train.stop_at_accuracy`` on an emulated link (``link_rate_bits``). Measured: the run's
    training time to the curve point that crossed the target (``target_train_s``: curve points
    and start-up left out; ``target_wall_s``, from process start, beside it). Predicted: that
    many steps (the run's own ``target_step``; warm-up steps as dense steps) at the step time
    ``time_to_accuracy.predict_step_ms`` gives at the run's link rate and world size, from the
    run's own compute phases (its slowest rank's, where the run recorded every rank's; with the
    spread between its ranks beside it); beside it the model's exchange per step (``modelled_exchange_ms``,
    the exposed part where the run recorded its buckets) and the run's measured exchange phase
    (``measured_exchange_ms``), where a residual usually lies. ``predicted_to_measured`` =
    predicted / measured; ``within``:
    it is within ``tolerance`` of 1. Runs that did not reach the target, did not complete or did not train (loss
    above a uniform guess: not a result) are listed with their status and not compared."""
    rows = []
    for _, run in runs.iterrows():
        row = run.to_dict()
        rate = row.get("link_rate_bits")
        if pd.isna(rate) or pd.isna(row.get("target_accuracy")):
            continue
        entry = {k: row.get(k) for k in E2E_AXES if k in row}
        entry.update(status=row["status"], rate_bits=rate, workers=int(row["world_size"]), load_mean=row.get("load_mean"),
                     target=row["target_accuracy"], reached=row["target_reached"], steps=row["target_step"],
                     measured_s=row["target_train_s"], measured_wall_s=row["target_wall_s"])
        if row["target_reached"] == 1 and row["status"] == "completed":
            step_ms, warm_ms = predict_step_ms(row, int(row["world_size"]), float(rate), model)
            local = compute_ms(row) + _ms(row, "compress") + _ms(row, "decompress")
            ranks = row.get("compute_ms_ranks")
            spread = max(ranks) - min(ranks) if _has(ranks) else math.nan
            entry.update(predicted_step_ms=step_ms,
                         # how far apart the ranks' compute was (the model takes the slowest's)
                         rank_compute_spread_ms=spread,
                         measured_step_ms=1e3 * row["target_train_s"] / row["target_step"],
                         # where a residual lies: the model's exchange (exposed part) against the
                         # run's exchange phase (the wait after backward, the slowest rank's included)
                         modelled_exchange_ms=step_ms - local, measured_exchange_ms=_ms(row, "exchange"),
                         predicted_s=time_to_target_s(row["target_step"], _warmup(row), step_ms, warm_ms))
        rows.append(entry)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["predicted_to_measured"] = out.get("predicted_s", math.nan) / out["measured_s"]
    out["within"] = (out["predicted_to_measured"] - 1).abs() <= tolerance
    return out


def plot_e2e(check: pd.DataFrame, tolerance: float = 0.15):
    """Predicted against measured time to the target, one point per run (marker by link rate),
    the line of agreement and the ``tolerance`` band."""
    from .figures import _new_figure, scheme_color, style

    with style():
        fig, axes = _new_figure(1, 1, 5.0, 4.6)
        ax = axes[0, 0]
        hit = check.dropna(subset=["predicted_s"])
        markers = dict(zip(sorted(hit["rate_bits"].unique()), "os^Dv"))
        for (scheme, rate), group in hit.groupby(["scheme", "rate_bits"]):
            ax.scatter(group["measured_s"], group["predicted_s"], color=scheme_color(scheme),
                       marker=markers[rate], label=f"{scheme}, {rate / 1e6:g} Mbit/s")
        top = 1.1 * max(hit["measured_s"].max(), hit["predicted_s"].max()) if len(hit) else 1.0
        line = [0, top]
        ax.plot(line, line, color="0.3", lw=1)
        ax.fill_between(line, [v * (1 - tolerance) for v in line], [v * (1 + tolerance) for v in line],
                        color="0.85", alpha=0.5, lw=0, label=f"within {tolerance:.0%}")
        ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured time to target (s)",
               ylabel="predicted time to target (s)")
        ax.legend(fontsize=7, loc="upper left")
        return fig


def _fmt(value: float) -> str:
    """Three decimals under 10, one above: the tables' numbers."""
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    """The predicted-vs-measured step check on a benchmark folder, or (``--runs``) the
    end-to-end check of runs that stopped at a target; prints one row each and a summary line."""
    parser = argparse.ArgumentParser(prog="python -m sparsetrain.analysis.cluster_check")
    parser.add_argument("folder", type=Path, metavar="DIR", nargs="?",
                        help="folder with step.json (benchmarks.step) and costmodel.json (benchmarks.collectives)")
    parser.add_argument("--runs", type=Path, nargs="+", metavar="RUNS",
                        help="run folders (or sweeps) launched on netcluster with train.stop_at_accuracy")
    parser.add_argument("--costmodel", type=Path, help="the fit to use (default: DIR/costmodel.json; "
                        "with --runs and no fit: the default model)")
    parser.add_argument("--tolerance", type=float, default=None, help="default 0.2 per step, 0.15 end to end")
    parser.add_argument("--ddp", type=Path, metavar="DDP_JSON",
                        help="the overlap table of a DDP benchmark's ddp.json (benchmarks.ddp) instead")
    parser.add_argument("--figure", type=Path, help="with --runs: write predicted-vs-measured as FIGURE.png and .pdf, "
                        "the table as FIGURE.txt")
    args = parser.parse_args(argv)
    if args.ddp or args.runs:  # a fit given, else the model's defaults
        model = fitted_model(args.costmodel) if args.costmodel else default_model()
    if args.ddp:
        table = ddp_overlap(json.loads(args.ddp.read_text()), model)
        print(f"DDP overlap, exchange model: {model.source}")
        print(table.drop(columns=["rate_bits"]).to_string(index=False, float_format=_fmt))
        return 0
    if args.runs:
        from .figures import save_figure
        from .loader import load_runs

        tolerance = 0.15 if args.tolerance is None else args.tolerance
        check = e2e_check(load_runs(*args.runs), model, tolerance)
        if check.empty:
            raise SystemExit("no run with train.stop_at_accuracy on an emulated link (launch.netcluster) under "
                             + ", ".join(map(str, args.runs)))
        shown = [c for c in (*E2E_AXES, "status", "rate_bits", "workers", "target", "reached", "steps", "measured_s",
                             "measured_wall_s", "predicted_s", "predicted_to_measured", "within", "modelled_exchange_ms",
                             "measured_exchange_ms", "rank_compute_spread_ms", "load_mean") if c in check]
        hit = check.dropna(subset=["predicted_to_measured"])
        pm = hit["predicted_to_measured"]
        report = "\n".join([f"end to end, exchange model: {model.source}",
                            check[shown].to_string(index=False, float_format=_fmt),
                            f"{int(hit['within'].sum())}/{len(hit)} within {tolerance:.0%}"
                            + (f"; predicted / measured {pm.min():.3f}..{pm.max():.3f}" if len(hit) else "")])
        print(report)
        if args.figure:  # the figure, and the table it draws beside it (FIGURE.txt)
            save_figure(plot_e2e(check, tolerance), args.figure.parent, args.figure.stem)
            args.figure.with_suffix(".txt").write_text(report + "\n")
            print(f"wrote {args.figure}.png, .pdf, .txt")
        return 0 if len(hit) and hit["within"].all() else 1
    if args.folder is None:
        parser.error("give a benchmark folder, or --runs")
    args.tolerance = 0.2 if args.tolerance is None else args.tolerance
    check = bench_check_files(args.folder, args.tolerance, args.costmodel)
    columns = ["rate", "scheme", "measured_compute_ms", "predicted_exchange_ms", "measured_exchange_ms", "skew_ms",
               "predicted_step_ms", "measured_step_ms", "ratio", "ratio_max_rank", "within"]
    print(check[columns].to_string(index=False, float_format=_fmt))
    print(f"{int(check['within'].sum())}/{len(check)} within {args.tolerance:.0%}; ratio "
          f"{check['ratio'].min():.3f}..{check['ratio'].max():.3f} (median {check['ratio'].median():.3f})")
    return 0 if check["within"].all() else 1


__all__ = ["BENCH_COLLECTIVE", "DDP_COLLECTIVE", "bench_check", "bench_check_files", "ddp_overlap", "e2e_check", "main",
           "plot_e2e"]

if __name__ == "__main__":
    raise SystemExit(main())
