"""Time to accuracy: a run's measured compute, the exchange the alpha-beta model predicts for a
chosen bandwidth and worker count, and the run's own accuracy curve (validation where the run held a
split, ``data.val_size``; test for runs from before it).

For each completed run that trained (runs that did not are listed, never ranked):

- **predicted step** = the run's measured phases (``data + forward + backward + compress +
  decompress + optimizer``, mean ms per step from ``summary.json``) + the exchange that
  ``costmodel`` predicts for the run's payload (``bytes_sent_per_step``) through its collective
  (dense: AllReduce; sparse: its aggregation) at ``workers`` and ``bandwidth``. AllGather's
  decompress grows with the workers (one payload each: ``decompress x workers / run's workers``,
  as ``costmodel.CostModel.step_ms`` models it). Local SGD and DiLoCo exchange once a period
  (``scheme.sync.period`` steps): one collective of a synchronisation's bytes, its time spread
  over the period (the latency once, not every step). Warm-up steps (``scheme.warmup_steps``) are
  predicted as dense steps: compute + an AllReduce of the whole buffer. An exchange that ran
  inside backward (DDP's hooks, the dense reducer's ``dist.overlap``) and recorded its buckets
  (``overlap_buckets``: each bucket's share and how long before backward's end it started) is
  charged only what backward does not hide (``costmodel.exposed_ms``: one link, buckets in
  launch order, each from when it was ready).
- **steps to target**: the first step where the accuracy (validation, else test) reaches the target, linearly
  interpolated between consecutive evaluations (the epoch records of ``metrics.jsonl``; a record
  that repeats the previous evaluation, written at an epoch without one, is skipped). A run
  whose last evaluation is below the target has not reached it: "not reached", never
  extrapolated. Reached at the first evaluation: that evaluation's step (an upper bound; the
  break-even map judges only what the bound leaves standing).
- **time to target** = warm-up steps x predicted warm-up step + the remaining steps x predicted
  step.

The alpha-beta parameters are either the cost model's defaults (``DEFAULT_ALPHA_S`` per message,
``beta = 1.062 x 8 / B``: TCP/IP framing on a link of B bit/s, no per-byte CPU floor) or a fit
from ``python -m sparsetrain.benchmarks.collectives`` (``costmodel.json``: alpha and the CPU floor of that
cluster); the table says which. Assumptions, stated under every table: the steps to target are the
run's own, measured at its worker count and global batch; at another worker count they are
assumed unchanged (how the number of steps to an accuracy moves with the global batch is not
modelled); the compute phases are the run's own, on its hardware; an overlapped run that did not
record its buckets (written before summaries did) is charged its whole exchange after backward,
an upper bound.

No torch: plain files and the cost model's floats.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D

from sparsetrain.costmodel import (
    Collective,
    CostModel,
    SchemeCost,
    exposed_ms,
    mean_buckets,
    per_payload_ms,
)

from .figures import LINESTYLES, MARKERS, _empty, _label, _new_figure, scheme_color, style
from .group import (
    _constant_note,
    _display_axis,
    as_key,
    mark_repeats,
    repeat_notes,
    sort_rows,
    varying_axes,
)
from .loader import (
    COMPUTE_PHASES,
    REPLICATE,
    _read_metrics,
    collective_of,
    completed,
    distinct_evaluations,
    not_completed,
)
from .table import LABELS, Table, _shown_path

#: assumed per-message latency of the default model (s): a small message between two hosts over
#: datacenter Ethernet with TCP; pass ``alpha_s`` or a fitted ``costmodel.json`` to change it
DEFAULT_ALPHA_S = 50e-6
COLLECTIVES = ("allreduce", "allgather")
# The default grid of predictions: a slow, a common and a fast link, a small and a large cluster
BANDWIDTHS_GBIT, WORKERS = (1, 10, 100), (8, 64)


@dataclass
class ExchangeModel:
    """The alpha-beta collectives used for prediction, and where their numbers come from."""

    collectives: dict[str, Collective]
    source: str

    def time_ms(self, collective: str, nbytes: float, workers: int, rate_bits: float) -> float:
        return 1e3 * self.collectives[collective].at_rate(rate_bits).time(nbytes, workers)

    def exposed_ms(self, collective: str, nbytes: float, workers: int, rate_bits: float, buckets) -> float:
        """What backward does not hide of an overlapped exchange of ``nbytes`` in ``buckets``
        (``(share, lead ms)`` each: ``costmodel.exposed_ms``)."""
        return exposed_ms(buckets, lambda share: self.time_ms(collective, nbytes * share, workers, rate_bits))


def default_model(alpha_s: float = DEFAULT_ALPHA_S) -> ExchangeModel:
    """Ring collectives with ``alpha_s`` per message and the wire alone per byte (no CPU floor)."""
    cols = {name: Collective(name, alpha_s, 0.0, None, floor_beta=0.0) for name in COLLECTIVES}
    return ExchangeModel(cols, f"cost model defaults: alpha {alpha_s * 1e6:g} us per message (assumed), "
                               "beta = 1.062 x 8 / bandwidth (TCP/IP framing), no CPU floor")


def fitted_model(path: str | Path) -> ExchangeModel:
    """The collectives fitted by ``python -m sparsetrain.benchmarks.collectives`` (``costmodel.json``): alpha and
    the per-byte CPU floor of that cluster kept, the wire term set by the chosen bandwidth."""
    data = json.loads(Path(path).read_text())
    cols = {name: Collective(**data["collectives"][name]) for name in COLLECTIVES}
    parts = [f"{name} alpha {c.alpha * 1e6:.1f} us, CPU floor {c.cpu_beta * 1e9:.2f} ns/B" for name, c in cols.items()]
    return ExchangeModel(cols, f"fitted alpha-beta from {path} ({'; '.join(parts)})")


# --- one run ------------------------------------------------------------------------------------


def accuracy_curve(run_dir: str | Path) -> list[tuple[float, float]]:
    """``(step, accuracy)`` of each evaluation in the run's ``metrics.jsonl``, in order: its
    ``curve`` records where it has them (``train.curve_points``: a fixed validation subset
    scored several times an epoch), else its epoch records' validation accuracy where the run
    held a validation split (a target is a choice: it reads
    validation), else the test accuracy (runs before the split existed). Epoch records of epochs
    without an evaluation repeat the last one (same accuracy and loss): they are skipped so that
    interpolation runs between real evaluations."""
    return _curve(run_dir)[0]


# which data a run's curve scores (``_curve``): one table reads one of them
VAL_SUBSET, VAL, TEST = "validation subset", "validation", "test"


def _curve(run_dir: str | Path) -> tuple[list[tuple[float, float]], str | None]:
    """``accuracy_curve`` and the data it scores (``VAL_SUBSET``, ``VAL``, ``TEST``; None: no curve)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return [], None
    records = list(_read_metrics(path))
    points = [(float(r["step"]), float(r["accuracy"])) for r in records
              if r.get("kind") == "curve" and r.get("accuracy") is not None]
    if points:  # train.curve_points: the validation subset several times an epoch
        return points, VAL_SUBSET
    records = [r for r in records if r.get("kind") == "epoch" and r.get("step") is not None]
    split = "val" if any(r.get("val_accuracy") is not None for r in records) else "test"
    curve = [(float(r["step"]), float(r[f"{split}_accuracy"])) for r in distinct_evaluations(records, split)]
    return curve, (VAL if split == "val" else TEST) if curve else None


def run_curves(runs: pd.DataFrame) -> dict:
    """Each run's ``_curve`` by its index (``([], None)`` for a row without a run folder): its
    metrics.jsonl read once for both ``curve_split`` and ``predict_runs``."""
    return {index: _curve(run_dir) if isinstance(run_dir, str) else ([], None)
            for index, run_dir in runs.get("run_dir", pd.Series(dtype=object)).items()}


def curve_split(runs: pd.DataFrame, curves: dict | None = None) -> str:
    """The one data set the completed runs' curves score (``_curve``; ``curves``: ``run_curves``
    of ``runs``, read here when not given); ValueError in one line where they score several: a
    validation curve beside a test curve is not the same target (validation runs about a point
    higher), and a table of both would rank them as one."""
    curves = run_curves(runs) if curves is None else curves
    found: dict[str, str] = {}
    for index, (_, split) in curves.items():
        if split is not None:
            found.setdefault(split, runs.at[index, "run_dir"])
    if len(found) > 1:
        shown = "; ".join(f"{split} ({_shown_path(d)})" for split, d in found.items())
        raise ValueError(f"time to accuracy: the runs' curves score different data: {shown}; allowed: runs "
                         "whose curves score one (pass their sweeps apart, or narrow them with --where)")
    return next(iter(found), TEST)


def steps_to_target(curve: list[tuple[float, float]], target: float) -> float:
    """First step where the curve reaches ``target``, linear between evaluations; NaN when it
    never does (no extrapolation past the last evaluation)."""
    previous = None
    for step, acc in curve:
        if acc >= target:
            if previous is None:
                return step
            (s0, a0) = previous
            return s0 + (target - a0) / (acc - a0) * (step - s0)
        previous = (step, acc)
    return math.nan


def _ms(row, phase: str) -> float:
    value = row.get(f"time_{phase}_ms", math.nan)
    return math.nan if value is None else float(value)


def compute_ms(row) -> float:
    """The run's measured compute per step (``COMPUTE_PHASES``, ms): its slowest rank's where the
    summary recorded every rank's (``compute_ms_ranks``), since a synchronous step waits for it;
    rank 0's (``time_ms``) for a run written before."""
    ranks = row.get("compute_ms_ranks")
    if _has(ranks):
        return max(ranks)
    return sum(_ms(row, p) for p in COMPUTE_PHASES)


def shared_compute_ms(runs: pd.DataFrame) -> pd.Series:
    """Per run, the median measured compute of all runs with its model, data and batch size.

    The same model and batch is the same work whatever the scheme, but runs timed on a shared
    machine measure it anywhere from 160 to 450 ms per step as the load changes (the second
    pass's 2-rank ResNet-20 runs): a scheme would win or lose by the load it met. The median over
    every run of that work is what each prediction uses (``compute="shared"``). It is one
    constant across machines too (``machines_note`` names them): a ranking of schemes then
    never reads which machine a scheme's runs met, though the time is no one machine's."""
    keys = [k for k in ("model", "data", "batch_size") if k in runs]
    values = runs.apply(compute_ms, axis=1)
    if not keys:
        return pd.Series(values.median(), index=runs.index)
    return values.groupby([as_key(runs[k]) for k in keys]).transform("median")


def predict_step_ms(row: dict, workers: int, rate_bits: float, model: ExchangeModel,
                    compute: float | None = None) -> tuple[float, float]:
    """``(compressing step, warm-up step)`` in ms for a loader row at ``workers`` and ``rate_bits``:
    measured compute phases (or ``compute`` ms given) + predicted exchange
    (``costmodel.CostModel.step_ms``)."""
    collective = collective_of(row)
    world_ref = int(row["world_size"])
    own = compute_ms(row)
    compute = own if compute is None else compute
    decompress = _ms(row, "decompress")
    growing = per_payload_ms(row.get("scheme"), collective, decompress, world_ref, row.get("kernels"))
    schemes = {
        "run": SchemeCost("run", collective, float(row["bytes_sent_per_step"]), _ms(row, "compress"), decompress,
                          growing, world_ref,
                          period=_sync_period(row), buckets=_buckets(row, compute, own)),
        "warmup": SchemeCost("warmup", "allreduce", float(row["dense_bytes_per_step"]), 0.0, 0.0, 0.0, world_ref),
    }
    if collective is None:
        return math.nan, math.nan
    cm = CostModel({c: model.collectives[c] for c in COLLECTIVES}, compute_ms=compute, schemes=schemes)
    return cm.step_ms("run", workers, rate_bits), cm.step_ms("warmup", workers, rate_bits)


def _buckets(row, compute: float, own: float) -> tuple[tuple[float, float], ...]:
    """The run's overlapped buckets (``overlap_buckets``: share, lead ms), leads scaled by
    ``compute / own`` (the compute the prediction uses over the run's own: a backward that takes
    longer leaves each bucket more time); empty where the exchange ran after backward or was not
    recorded."""
    if not _has(row.get("overlap_buckets")) or not own > 0 or not math.isfinite(compute / own):
        return ()
    return tuple((share, lead * compute / own) for share, lead in row["overlap_buckets"])


def _sync_period(row) -> int:
    """Steps between a run's exchanges: ``scheme.sync.period`` for local SGD / DiLoCo (summary's
    ``sync``), else 1."""
    value = row.get("sync_period")
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return 1


def time_to_target_s(steps: float, warmup_steps: int, step_ms: float, warmup_step_ms: float) -> float:
    """Warm-up steps at the dense step time, the rest at the scheme's (seconds; NaN if not reached)."""
    if math.isnan(steps):
        return math.nan
    warm = min(float(warmup_steps), steps)
    return (warm * warmup_step_ms + (steps - warm) * step_ms) / 1e3


def _warmup(row) -> int:
    value = row.get("warmup_steps")
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


#: what must match for a run to take another's buckets: the same model, data and batch (the
#: same gradients in the same order), path and scheme (the same buckets), dense overlap setting
BUCKET_KEYS = ("model", "data", "batch_size", "exchange", "scheme", "dist_overlap")


def _has(values) -> bool:
    """A recorded tuple (a run's buckets, its ranks' compute), not None / NaN / empty."""
    return isinstance(values, tuple) and len(values) > 0


def borrowed_buckets(runs: pd.DataFrame) -> pd.Series:
    """Per run, its overlapped buckets: its own (``overlap_buckets``), or, for a run written
    before summaries recorded them, those of the runs that did with the same ``BUCKET_KEYS``:
    their shares (the same layout) and each lead as the same fraction of compute (a lead is part
    of backward, and backward scales with the load), averaged over those runs. Empty where
    neither exists: the whole exchange after backward."""
    out = pd.Series([()] * len(runs), index=runs.index, dtype=object)
    if "overlap_buckets" not in runs:
        return out
    keys = [k for k in BUCKET_KEYS if k in runs]
    compute = runs.apply(compute_ms, axis=1)
    own = runs["overlap_buckets"].apply(_has)
    donors: dict[tuple, list] = {}  # per kind: each recording, leads as fractions of compute
    for index in runs.index[own]:
        buckets = runs.at[index, "overlap_buckets"]
        out.at[index] = buckets
        if compute[index] > 0:
            key = tuple(str(runs.at[index, k]) for k in keys)
            donors.setdefault(key, []).append([(share, lead / compute[index]) for share, lead in buckets])
    for index in runs.index[~own]:
        if int(runs.at[index, "world_size"]) < 2 or not compute[index] > 0:
            continue
        fractions = mean_buckets(donors.get(tuple(str(runs.at[index, k]) for k in keys), ()))
        out.at[index] = tuple((share, f * compute[index]) for share, f in fractions)
    return out


def predict_runs(runs: pd.DataFrame, target: float, bandwidths_gbit, workers, model: ExchangeModel,
                 compute: str = "shared", buckets: pd.Series | None = None,
                 curves: dict | None = None) -> pd.DataFrame:
    """One row per (completed run, bandwidth, workers): predicted step ms, steps and seconds to
    ``target`` (NaN: not reached), with the run's axes. ``compute``: ``"shared"`` (the median of
    the runs of the same work, ``shared_compute_ms``) or ``"own"`` (each run's measurement).
    ``curves``: ``run_curves`` of the completed runs, where already read."""
    if compute not in ("shared", "own"):
        raise ValueError(f"compute={compute!r} is not allowed; allowed: shared, own")
    rows = []
    done = completed(runs)
    shared = shared_compute_ms(done) if compute == "shared" else None
    buckets = borrowed_buckets(done) if buckets is None else buckets
    for index, run in done.iterrows():
        run = {**run.to_dict(), "overlap_buckets": buckets[index]}
        own = None if shared is None else float(shared[index])
        curve = curves[index][0] if curves is not None else \
            accuracy_curve(run["run_dir"]) if isinstance(run.get("run_dir"), str) else []
        steps = steps_to_target(curve, target)
        # reached at the first evaluation: its step is only an upper bound on the steps to target
        first = float(bool(curve) and steps == curve[0][0])
        for gbit in bandwidths_gbit:
            for w in workers:
                step_ms, warm_ms = predict_step_ms(run, int(w), float(gbit) * 1e9, model, own)
                rows.append({**run, "bandwidth_gbit": float(gbit), "workers": int(w),
                             "predicted_step_ms": step_ms, "predicted_warmup_step_ms": warm_ms,
                             "steps_to_target": steps, "reached": float(not math.isnan(steps)),
                             "at_first_evaluation": first,
                             "time_to_target_s": time_to_target_s(steps, _warmup(run), step_ms, warm_ms)})
    return pd.DataFrame(rows)


# --- the table ----------------------------------------------------------------------------------


def _mean_std(values: pd.Series, digits: str) -> str:
    values = values.dropna()
    if values.empty:
        return "not reached"
    text = format(values.mean(), digits)
    if len(values) > 1:
        spread = values.std(ddof=1)
        if spread <= 1e-9 * abs(values.mean()):  # equal values summed in another order: no spread
            spread = 0.0
        text += f" ± {format(spread, digits)}"
    return text


def load_note(runs: pd.DataFrame) -> str | None:
    """How loaded the machine was while the runs were timed (summary.json's ``load``: the node's
    1-minute load average, mean over each run), against the ranks each run kept busy there."""
    if "load_mean" not in runs or runs["load_mean"].isna().all():
        return None
    timed = runs.dropna(subset=["load_mean"])
    excess = timed["load_mean"] - timed["load_local_ranks"]
    return (f"Machine load while timed ({len(timed)} of {len(runs)} runs recorded it): 1-minute load average "
            f"{timed['load_mean'].min():.2f}-{timed['load_mean'].max():.2f} over each run, "
            f"{excess.min():+.2f} to {excess.max():+.2f} beyond the run's own ranks "
            f"({int(timed['load_cpus'].min())} CPUs).")


def machines_note(runs: pd.DataFrame) -> str | None:
    """Which machines the runs were timed on (summary.json's ``hosts``, the loader's ``host``),
    with how many runs each: measured compute from two machines is not the same work's time."""
    if "host" not in runs:
        return None
    hosts = runs["host"].fillna("unrecorded")
    counts = hosts[hosts != "unrecorded"].value_counts()
    if counts.empty:
        return None
    named = "; ".join(f"{host} ({n} runs)" for host, n in counts.items())
    missing = int((hosts == "unrecorded").sum())
    unrecorded = f", {missing} runs from before it was recorded" if missing else ""
    if len(counts) == 1 and not unrecorded:
        return f"Timed on one machine: {named}."
    return (f"Timed on {len(counts)} machine(s){unrecorded}: {named}. Compute measured on different "
            "machines is not the same work's time: compare within one machine.")


def time_to_accuracy_table(runs: pd.DataFrame, target: float, bandwidths_gbit=BANDWIDTHS_GBIT, workers=WORKERS,
                           model: ExchangeModel | None = None, compute: str = "shared") -> Table:
    """Configuration (scheme + the axes that vary) x bandwidth x workers: predicted step ms,
    steps to ``target`` and time to ``target`` (mean ± std over the seeds that reached it, and
    how many of the seeds did). Runs that did not complete or did not train are listed under it.
    ``compute``: see ``predict_runs``."""
    model = model or default_model()
    done = mark_repeats(completed(runs))
    seed_notes = repeat_notes(completed(runs))
    missing = not_completed(runs).reset_index(drop=True)
    # the one data set the completed runs' curves score (a run that never completed has none)
    curves = run_curves(done)
    split = TEST if curve_split(done, curves) == TEST else VAL
    title = f"Time to {target * 100:g}% {split} accuracy: measured compute + predicted exchange"
    notes = [
        f"Exchange: {model.source}.",
        ("Predicted step = the median measured data + forward + backward + optimizer of all runs of the "
         "same model, data and batch (the same work for every scheme; on a shared machine its timing "
         "follows the load, not the scheme) + the run's own compress + decompress" if compute == "shared" else
         "Predicted step = the run's measured data + forward + backward + compress + decompress + optimizer")
        + " (ms/step) + the predicted exchange of its payload through its collective; "
        "AllGather's decompress scales with workers; warm-up steps as dense steps. An exchange run "
        "inside backward is charged what backward does not hide of it, from the buckets the run "
        "recorded or, for a run from before they were recorded, those of runs of the same model, "
        "data, batch, path and scheme (leads as the same fraction of compute); with neither, all "
        "of it (an upper bound).",
        "Steps to target: linear between the run's evaluations, not extrapolated; measured at the "
        "run's own workers and global batch and assumed unchanged at other worker counts. "
        "Mean ± std over the seeds that reached the target; reached = seeds that did / seeds.",
    ]
    if done.empty:
        return Table("time_to_accuracy", title, pd.DataFrame(), pd.DataFrame(), missing, notes)
    by = ["scheme", *[a for a in varying_axes(done) if a != "scheme"]]
    notes = _constant_note(done, by) + seed_notes + notes
    buckets = borrowed_buckets(done)
    recorded = int(done["overlap_buckets"].apply(_has).sum()) if "overlap_buckets" in done else 0
    borrowed = int(buckets.apply(_has).sum()) - recorded
    if recorded or borrowed:
        notes.append(f"Overlap with backward: {recorded} runs' own buckets, {borrowed} borrowed "
                     "from runs of their kind.")
    slowest = int(done["compute_ms_ranks"].apply(_has).sum()) if "compute_ms_ranks" in done else 0
    if slowest:
        notes.append(f"Compute: the slowest rank's for the {slowest} of {len(done)} runs that recorded every "
                     "rank's (a synchronous step waits for it), rank 0's for the others.")
    for note in (load_note(done), machines_note(done)):
        if note:
            notes.append(note)
    data = predict_runs(done, target, bandwidths_gbit, workers, model, compute, buckets, curves)
    keys = [*by, "bandwidth_gbit", "workers"]
    for column in by:
        data[column] = data[column].astype(object).where(data[column].notna(), "-")
    per_seed = data.groupby([*keys, REPLICATE], dropna=False, sort=False)[
        ["predicted_step_ms", "steps_to_target", "time_to_target_s", "reached", "at_first_evaluation"]].mean().reset_index()
    groups = per_seed.groupby(keys, dropna=False, sort=False)
    out_rows, display = [], []
    for key, group in groups:
        entry = dict(zip(keys, key, strict=True))
        reached = int((group["reached"] > 0).sum())
        n = len(group)
        times = group.loc[group["reached"] > 0, "time_to_target_s"]
        steps = group.loc[group["reached"] > 0, "steps_to_target"]
        out_rows.append({**entry, "predicted_step_ms_mean": group["predicted_step_ms"].mean(),
                         "predicted_step_ms_std": group["predicted_step_ms"].std(ddof=1),
                         "steps_to_target_mean": steps.mean() if reached else math.nan,
                         "steps_to_target_std": steps.std(ddof=1) if reached > 1 else math.nan,
                         "time_to_target_s_mean": times.mean() if reached else math.nan,
                         "time_to_target_s_std": times.std(ddof=1) if reached > 1 else math.nan,
                         "reached": reached, "n": n})
    data_out = sort_rows(pd.DataFrame(out_rows), keys)
    for _, row in data_out.iterrows():
        mask = (per_seed[keys] == row[keys]).all(axis=1)
        group = per_seed[mask]
        hit = group[group["reached"] > 0]
        # the runs' own worker count, where it varies, beside the workers the prediction is for
        entry = {("measured at workers" if a == "world_size" else LABELS.get(a, a)): _display_axis(a, row[a])
                 for a in by}
        entry["bandwidth (Gbit/s)"] = f"{row['bandwidth_gbit']:g}"
        entry["workers"] = int(row["workers"])
        entry["predicted step (ms)"] = _mean_std(group["predicted_step_ms"], ".1f")
        entry["steps to target"] = _mean_std(hit["steps_to_target"], ".0f")
        if not hit.empty and (hit["at_first_evaluation"] > 0).any():  # crossed before it: at most
            entry["steps to target"] = f"≤ {entry['steps to target']} (first evaluation)"
        entry["time to target (s)"] = _mean_std(hit["time_to_target_s"], ".3g")
        entry["reached"] = f"{int(row['reached'])}/{int(row['n'])}"
        display.append(entry)
    return Table("time_to_accuracy", title, pd.DataFrame(display), data_out, missing, notes,
                 frames={"per_seed": per_seed, "keys": keys})


def plot_time_to_accuracy(table: Table) -> object:
    """Time to target vs bandwidth (log-log), one line per configuration, one panel per worker
    count; error bars ±1 std over the seeds that reached it; configurations that never reach it
    are named in the legend."""
    with style():
        data = table.data
        if data.empty:
            fig, axes = _new_figure()
            return _empty(fig, axes[0, 0], "no completed runs")
        workers = sorted(data["workers"].unique())
        fig, axes = _new_figure(ncols=len(workers), width=4.4, height=3.4)
        config_axes = [c for c in data.columns if c not in ("bandwidth_gbit", "workers") and not c.endswith(
            ("_mean", "_std")) and c not in ("reached", "n")]
        others = [a for a in config_axes if a != "scheme"]
        configs = data[config_axes].drop_duplicates()
        configs = sort_rows(configs, config_axes)
        styles = {tuple(str(v) for v in row[others]): i for i, (_, row) in enumerate(
            configs[others].drop_duplicates().iterrows())} if others else {(): 0}
        legend: dict[str, object] = {}
        for ax, w in zip(axes[0], workers, strict=True):
            panel = data[data["workers"] == w]
            for _, config in configs.iterrows():
                mask = (panel[config_axes] == config[config_axes]).all(axis=1)
                lines = panel[mask].sort_values("bandwidth_gbit")
                index = styles[tuple(str(config[a]) for a in others)]
                label = ", ".join(_label(a, config[a]) for a in config_axes if config[a] != "-")
                color = scheme_color(config["scheme"])
                ok = lines.dropna(subset=["time_to_target_s_mean"])
                if ok.empty:
                    legend.setdefault(f"{label} (not reached)",
                                      Line2D([], [], color=color, linestyle="", marker="x"))
                    continue
                legend[label] = ax.errorbar(ok["bandwidth_gbit"], ok["time_to_target_s_mean"],
                            yerr=ok["time_to_target_s_std"].fillna(0.0), color=color, capsize=3,
                            linestyle=LINESTYLES[index % len(LINESTYLES)], marker=MARKERS[index % len(MARKERS)],
                            label=label)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ticks = sorted(data["bandwidth_gbit"].unique())
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_xlabel("bandwidth per link (Gbit/s)")
            ax.set_ylabel("predicted time to target (s)")
            ax.set_title(f"{w} workers")
        fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=2)
        fig.suptitle(table.title, fontsize=10)
        return fig


__all__ = [
    "BUCKET_KEYS", "COMPUTE_PHASES", "DEFAULT_ALPHA_S", "ExchangeModel", "accuracy_curve", "borrowed_buckets",
    "compute_ms", "default_model",
    "fitted_model", "plot_time_to_accuracy", "predict_runs", "predict_step_ms", "shared_compute_ms", "steps_to_target",
    "time_to_accuracy_table", "time_to_target_s",
]
