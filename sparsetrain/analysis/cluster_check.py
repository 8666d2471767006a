"""The time-to-accuracy prediction checked at one measured point: the emulated cluster.

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
from pathlib import Path

import pandas as pd

from sparsetrain.costmodel import Collective

from .loader import DENSE, collective_of
from .time_to_accuracy import COLLECTIVES, COMPUTE_PHASES, ExchangeModel

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
    return collective_of({**options, "scheme": DENSE if scheme == "none" else scheme})


def _timed_collective(row: str, result: dict) -> str | None:
    """:func:`bench_collective` for rows whose exchange is a phase of its own; None for the
    overlapped dense path and torch DDP, whose exchange runs inside backward."""
    options = result.get("options") or {}
    dense_inside_backward = options.get("scheme") == "none" and (row != "dense" or options.get("overlap"))
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


def main(argv: list[str] | None = None) -> int:
    """The predicted-vs-measured step check on a benchmark folder; prints one row per rate and
    scheme and a summary line."""
    parser = argparse.ArgumentParser(prog="python -m sparsetrain.analysis.cluster_check")
    parser.add_argument("folder", type=Path, metavar="DIR",
                        help="folder with step.json (benchmarks.step) and costmodel.json (benchmarks.collectives)")
    parser.add_argument("--costmodel", type=Path, help="the fit to use (default: DIR/costmodel.json)")
    parser.add_argument("--tolerance", type=float, default=0.2)
    args = parser.parse_args(argv)
    check = bench_check_files(args.folder, args.tolerance, args.costmodel)
    columns = ["rate", "scheme", "measured_compute_ms", "predicted_exchange_ms", "measured_exchange_ms", "skew_ms",
               "predicted_step_ms", "measured_step_ms", "ratio", "ratio_max_rank", "within"]
    print(check[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"))
    print(f"{int(check['within'].sum())}/{len(check)} within {args.tolerance:.0%}; ratio "
          f"{check['ratio'].min():.3f}..{check['ratio'].max():.3f} (median {check['ratio'].median():.3f})")
    return 0 if check["within"].all() else 1


__all__ = ["BENCH_COLLECTIVE", "bench_check", "bench_check_files", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
