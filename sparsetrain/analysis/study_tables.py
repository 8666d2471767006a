"""Tables mirroring the paper's research questions: mean ± std over seeds, with n.

Every table groups completed runs by its own axes plus every other axis that varies in the data,
so runs of different configurations are never averaged together. Runs that did not complete
(failed, running, no summary, absent from a sweep) are left out of the numbers and listed under
the table by their axes and status.
"""

from __future__ import annotations

import math

import pandas as pd

from .group import (
    REPEAT,
    _cell,
    _constant_note,
    _display_axis,
    _human_bytes,
    code_notes,
    expand_dense,
    fmt,
    mark_repeats,
    one_machine_times,
    pivot_table,
    repeat_notes,
    summarize,
    varying_axes,
)
from .loader import (
    DENSE,
    DID_NOT_TRAIN,
    PHASES,
    completed,
    not_completed,
)
from .table import ACCURACY_EXTRAS, LABELS, Table

# --- the research questions -------------------------------------------------------------------


def rq1_scope_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """RQ1: test accuracy per scheme and scope (rows), with bytes and stability beside it."""
    return pivot_table(
        "rq1_scope", "RQ1: test accuracy, layer-wise vs global scope", runs,
        ["scheme", "scope"], None, "test_accuracy", include_failed, extra_metrics=ACCURACY_EXTRAS,
    )


def rq2_scheme_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """RQ2: test accuracy per scheme and ratio (rows): equal ratios are equal entries, not equal
    bytes, so the bytes stand beside each number."""
    return pivot_table(
        "rq2_scheme", "RQ2: test accuracy per scheme and ratio", runs,
        ["scheme", "ratio"], None, "test_accuracy", include_failed, extra_metrics=ACCURACY_EXTRAS,
    )


def rq3_aggregation_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """RQ3: test accuracy per scheme, worker count and aggregation (rows)."""
    return pivot_table(
        "rq3_aggregation", "RQ3: test accuracy, AllReduce vs AllGather", runs,
        ["scheme", "world_size", "aggregation"], None, "test_accuracy", include_failed,
        extra_metrics=ACCURACY_EXTRAS,
    )


def rq4_workers_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """RQ4: test accuracy and time per step per scheme (rows) and worker count."""
    return pivot_table(
        "rq4_workers", "RQ4: test accuracy and time per step vs workers", runs,
        ["scheme", "world_size"], None, "test_accuracy", include_failed,
        extra_metrics=["time_step_ms", *ACCURACY_EXTRAS],
    )


def ddp_hooks_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """DDP hooks: test accuracy, final train loss, bytes and time per step per scheme (torch's
    PowerSGD and fp16 hooks are schemes here) and exchange path (trainer or DDP hook)."""
    return pivot_table(
        "ddp_hooks", "DDP hooks: test accuracy, train loss, bytes and time per step", runs,
        ["scheme"], None, "test_accuracy", include_failed,
        extra_metrics=["train_loss", "time_step_ms", *ACCURACY_EXTRAS],
    )


def plateau_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """How far each configuration was from a plateau when it stopped: the test accuracy gained
    over the last epoch, beside the final test accuracy."""
    table = pivot_table(
        "plateau", "Still climbing? Test accuracy gained over the last epoch", runs,
        ["scheme"], None, "test_accuracy_gain_last_epoch", include_failed,
        extra_metrics=["test_accuracy"],
    )
    table.notes.append(
        "gain = test accuracy at the last evaluation minus the one before, in points. The lr "
        "schedule decays within the last epoch, so part of every gain is the decay's: read a "
        "scheme's gain against dense SGD's; the budget study measures what a longer run buys.")
    return table


def runs_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """Any runs of no known study (one's own sweep): one row per configuration (the axes that
    vary), its test accuracy beside the final train loss, the epochs it ran, time per step,
    the plateau gain, bytes and how many of its runs blew up and recovered."""
    return pivot_table(
        "runs", "Runs: test accuracy per configuration", runs, ["scheme"], None, "test_accuracy",
        include_failed, extra_metrics=["train_loss", "epochs", "time_step_ms", *ACCURACY_EXTRAS],
    )


def budget_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """Test accuracy per scheme after each training budget (rows: epochs), the lr schedule
    stretched with it: how much a longer run would change each scheme's number."""
    return pivot_table(
        "budget", "Budget: test accuracy after each number of epochs", runs,
        ["scheme", "epochs_planned"], None, "test_accuracy", include_failed, extra_metrics=ACCURACY_EXTRAS,
    )


def rq5_speed_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """RQ5: mean time per phase, time per step and speed-up over dense of the same setting."""
    counted = runs if include_failed else completed(runs)
    done = mark_repeats(counted)
    missing = pd.DataFrame() if include_failed else not_completed(runs)
    title = "RQ5: time per step by phase (ms) and speed-up over dense SGD"
    phases = [p for p in PHASES if f"time_{p}_ms" in done]
    metrics = [f"time_{p}_ms" for p in phases] + ["test_accuracy", "bytes_sent_per_step"]
    if done.empty:
        return Table("rq5_speed", title, pd.DataFrame(), pd.DataFrame(), missing.reset_index(drop=True))
    by = ["scheme", *[a for a in varying_axes(done) if a != "scheme"]]
    expanded, machines = one_machine_times(expand_dense(done, by), by, metrics)
    data = summarize(expanded, by, metrics)
    # Speed-up is relative to dense runs that share every axis but the scheme's own knobs.
    context = [a for a in by if a not in ("scheme", "ratio", "scope", "aggregation", "error_feedback", "block_size",
                                          REPEAT)]
    dense = data[data["scheme"] == DENSE]
    speedups = []
    for row in data.to_dict("records"):  # not itertuples: a config key's column has dots in its name
        match = dense
        for axis in context:
            match = match[match[axis] == row[axis]]
        if "scope" in by:
            match = match[match["scope"] == row["scope"]]
        if "aggregation" in by:
            match = match[match["aggregation"] == row["aggregation"]]
        base = match["time_step_ms_mean"].mean() if len(match) else math.nan
        speedups.append(base / row["time_step_ms_mean"] if row["time_step_ms_mean"] else math.nan)
    data["speedup"] = speedups
    display_rows = []
    for _, row in data.iterrows():
        entry = {LABELS.get(a, a): _display_axis(a, row[a]) for a in by}
        for phase in phases:
            mean = row[f"time_{phase}_ms_mean"]
            entry[phase] = "n/a" if math.isnan(mean) else f"{mean:.1f}"
        step_std = row["time_step_ms_std"]
        entry["step"] = fmt(row["time_step_ms_mean"], step_std, int(row["time_step_ms_n"]), "time_step_ms")
        entry[LABELS["speedup"]] = "n/a" if math.isnan(row["speedup"]) else f"{row['speedup']:.2f}x"
        entry[LABELS["test_accuracy"]] = _cell(pd.DataFrame([row]), "test_accuracy")
        display_rows.append(entry)
    notes = _constant_note(done, by) + repeat_notes(counted) + machines + code_notes(expanded, by) + [
        "Phases are mean ms per step after warm-up; speed-up = dense step time / step time."]
    return Table("rq5_speed", title, pd.DataFrame(display_rows), data, missing.reset_index(drop=True), notes)


def stability_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """Stabiliser ablation: per scheme, with and without whole 1-D tensors and warm-up, how many
    seeds trained, the final train loss, test accuracy (with and without batch-norm
    recalibration), the largest error-feedback memory norm and the bytes actually sent.

    Unlike the research-question tables this one keeps the runs that did not train in its
    numbers (counted in the ``trained`` column): what a stabiliser buys is whether runs train.
    """
    # include_failed adds the runs that did not complete; it must never drop those that did not train.
    keep = runs if include_failed else runs[runs["status"].isin(("completed", DID_NOT_TRAIN))]
    missing = pd.DataFrame() if include_failed else runs[~runs.index.isin(keep.index)]
    notes_of_seeds = repeat_notes(keep)
    keep = mark_repeats(keep)
    title = "Stabilisers: what whole 1-D tensors and a compression warm-up change"
    by = ["scheme", "uncompressed", "warmup_steps", *[a for a in varying_axes(keep)
                                                     if a not in ("scheme", "uncompressed", "warmup_steps")]]
    metrics = ["train_loss", "test_accuracy", "test_accuracy_running_bn", "memory_norm_max",
               "bytes_mean_per_step"]
    notes = _constant_note(keep, by) + notes_of_seeds + [
        "trained = final train loss below ln 10 (a uniform guess) and final test accuracy of 20% or more; "
        "max memory norm: the largest "
        "logged norm of rank 0's error-feedback memory, max over seeds; bytes: mean per step over "
        "the run, warm-up steps included."]
    if keep.empty:
        return Table("stability", title, pd.DataFrame(), pd.DataFrame(), missing.reset_index(drop=True), notes)
    frame = keep.assign(trained=(keep["status"] == "completed").astype(float))
    data = summarize(frame, by, [*metrics, "trained"])
    peak = frame.groupby(by, dropna=False, sort=False)["memory_norm_max"].max()
    rows = []
    for _, row in data.iterrows():
        entry = {LABELS.get(a, a): _display_axis(a, row[a]) for a in by}
        n = int(row["trained_n"])
        entry["trained"] = f"{round(row['trained_mean'] * n)}/{n}"
        for metric in ("train_loss", "test_accuracy", "test_accuracy_running_bn"):
            entry[LABELS[metric]] = _cell(pd.DataFrame([row]), metric)
        top = peak.loc[tuple(row[a] for a in by)] if len(by) > 1 else peak.loc[row[by[0]]]
        entry[LABELS["memory_norm_max"]] = "n/a" if pd.isna(top) else f"{top:.3g}"
        entry[LABELS["bytes_mean_per_step"]] = _human_bytes(row["bytes_mean_per_step_mean"])
        rows.append(entry)
    return Table("stability", title, pd.DataFrame(rows), data, missing.reset_index(drop=True), notes)


def ablation_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """The stabilisers again at the second pass's scale (``experiment=ablation``): the stability
    table's columns, its own name, so that it never averages with the first pass's runs."""
    table = stability_table(runs, include_failed)
    table.name, table.title = "ablation", "Ablation at the second pass's scale: whole 1-D tensors and warm-up"
    return table


def status_table(runs: pd.DataFrame) -> Table:
    """How many runs of each experiment ended in each status, completed runs split into
    ``trained throughout`` and ``blew up, recovered``; and which code they ran: ``code`` lists
    the versions (a study should run on one), ``resumed on other code`` counts runs whose
    ``code_commits`` name more than one; ``machines`` how many machines its runs ran on."""
    if runs.empty:
        return Table("status", "Runs by status", pd.DataFrame(), pd.DataFrame())
    runs = runs.fillna({"experiment": "-"})
    detail = runs["status"]
    if "stability" in runs:
        detail = runs["stability"].where(runs["status"] == "completed", runs["status"]).fillna(runs["status"])
    counts = runs.assign(status=detail).groupby(["experiment", "status"]).size()
    data = counts.unstack(fill_value=0).reset_index()
    data.columns.name = None
    notes = ["A completed run blew up and recovered when a batch loss from step 20 on rose above 2 ln 10, or "
             "above ln 10 (a uniform guess) and twice the lowest logged loss before it "
             "(sparsetrain.results.blow_up; an early blip just past ln 10 is not one); runs written before the "
             "per-step record are read from their logged steps (every 20th). A run whose final train loss is "
             "not below ln 10, or whose final test accuracy is below 20%, did not train."]
    if "code" in runs:
        versions = runs[runs["status"] != "absent"].groupby("experiment")["code"].agg(
            lambda codes: ", ".join(sorted(set(codes))))
        data["code"] = data["experiment"].map(versions).fillna("-")
        spans = data["code"].str.contains(",")
        data["code"] = data["code"].where(~spans, "SPANS COMMITS: " + data["code"])
        if "code_commits" in runs:
            moved = runs["code_commits"].fillna("").str.contains(";")
            data["resumed on other code"] = data["experiment"].map(
                runs[moved].groupby("experiment").size()).fillna(0).astype(int)
        notes.append("code: the commit each run ran (+dirty: uncommitted changes; unrecorded: run "
                     "before summaries recorded it); a study whose runs span commits is marked.")
    if "host" in runs:
        machines = runs[runs["status"] != "absent"].groupby("experiment")["host"].agg(
            lambda hosts: len({m for h in hosts.dropna() for m in h.split(";")} - {"unrecorded"}))
        data["machines"] = data["experiment"].map(machines).fillna(0).astype(int)
        notes.append("machines: how many machines its runs ran on (rank 0's processor and CPUs, and "
                     "GPU; 0: not recorded, runs from before summaries said): timings taken on "
                     "different machines do not compare.")
    return Table("status", "Runs by status", data, data, not_completed(runs).reset_index(drop=True), notes)


TABLES = {
    "rq1_scope": rq1_scope_table,
    "rq2_scheme": rq2_scheme_table,
    "rq3_aggregation": rq3_aggregation_table,
    "rq4_workers": rq4_workers_table,
    "rq5_speed": rq5_speed_table,
    "stability": stability_table,
    "ablation": ablation_table,
    "ddp_hooks": ddp_hooks_table,
    "plateau": plateau_table,
    "budget": budget_table,
    "runs": runs_table,
}
