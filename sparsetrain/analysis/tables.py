"""Tables mirroring the paper's research questions: mean ± std over seeds, with n.

Every table groups completed runs by its own axes plus every other axis that varies in the data,
so runs of different configurations are never averaged together. Runs that did not complete
(failed, running, no summary, absent from a sweep) are left out of the numbers and listed under
the table by their axes and status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from .loader import (
    AXES,
    BLEW_UP_RECOVERED,
    DENSE,
    DENSE_IRRELEVANT,
    DID_NOT_TRAIN,
    NOT_APPLICABLE,
    PHASES,
    REPLICATE,
    completed,
    not_completed,
)

# Readable names for columns and metrics.
LABELS = {
    "scheme": "scheme",
    "scope": "scope",
    "aggregation": "aggregation",
    "ratio": "ratio",
    "world_size": "workers",
    "test_accuracy": "test accuracy (%)",
    "time_step_ms": "time/step (ms)",
    "bytes_sent_per_step": "bytes/step/worker",
    "compression": "compression (x)",
    "speedup": "speed-up over dense",
    "uncompressed": "whole tensors",
    "warmup_steps": "warm-up steps",
    "train_loss": "final train loss",
    "test_accuracy_running_bn": "test acc., running BN (%)",
    "memory_norm_max": "max memory norm",
    "bytes_mean_per_step": "bytes/step/worker (run mean)",
    "test_accuracy_gain_last_epoch": "gain over the last epoch (points)",
    "epochs_planned": "epochs",
    "epochs": "epochs run",
    "train_size": "training images",
    "bn_recalibrate": "BN recalibration batches",
    "wire_bytes_per_step": "wire bytes/step/worker",
    "blew_up": "blew up, recovered",
}
# Beside every accuracy: how far from a plateau, what it cost on the wire, and how many of its
# runs blew up early and recovered (``sparsetrain.results.stability_of``).
ACCURACY_EXTRAS = ["test_accuracy_gain_last_epoch", "bytes_sent_per_step", "wire_bytes_per_step", "blew_up"]
BYTES = ("bytes_sent_per_step", "dense_bytes_per_step", "wire_bytes_per_step")
SCHEME_ORDER = {DENSE: 0, "topk": 1, "randk": 2, "blockk": 3, "powersgd": 4, "fp16": 5}
SCHEME_NAMES = {DENSE: "dense SGD", "topk": "top-k", "randk": "random-k", "blockk": "block-random-k",
                "powersgd": "PowerSGD (torch hook)", "fp16": "fp16 (torch hook)"}
PERCENT = {"test_accuracy", "train_accuracy", "test_accuracy_running_bn", "test_accuracy_gain_last_epoch"}
# The grid coordinates that name a missing run.
MISSING_AXES = ("scheme", "scope", "aggregation", "ratio", "uncompressed", "warmup_steps", "world_size",
                "model", "data")
# Stabiliser settings are named only where they differ from the defaults.
MISSING_DEFAULTS = {"uncompressed": "1d", "warmup_steps": 0, "bn_recalibrate": 0}
# Order of values in rows and columns: the paper's order, not the alphabet's.
VALUE_ORDER = {"layerwise": 0, "global": 1, "allreduce": 0, "allgather": 1, "none": 0, "1d": 1,
               "trainer": 0, "ddp hook": 1}


@dataclass
class Table:
    """A formatted table (``display``), its numbers (``data``, tidy) and what is missing."""

    name: str
    title: str
    display: pd.DataFrame
    data: pd.DataFrame
    missing: pd.DataFrame = field(default_factory=pd.DataFrame)
    notes: list[str] = field(default_factory=list)

    def missing_lines(self) -> list[str]:
        lines = []
        for row in self.missing.itertuples(index=False):
            axes = ", ".join(
                f"{axis}={getattr(row, axis)}"
                for axis in (*MISSING_AXES, REPLICATE)
                if axis in self.missing.columns and _present(getattr(row, axis))
                and getattr(row, axis) != NOT_APPLICABLE
                and getattr(row, axis) != MISSING_DEFAULTS.get(axis)
            )
            where = f" ({_shown_path(row.run_dir)})" if _present(getattr(row, "run_dir", None)) else ""
            error = f": {_one_line(row.error)}" if _present(getattr(row, "error", None)) else ""
            lines.append(f"{row.status}: {axes}{where}{error}")
        return lines

    def to_markdown(self) -> str:
        out = [f"### {self.title}", ""]
        if self.display.empty:
            out.append("_No completed runs._")
        else:
            out.append(self.display.to_markdown(index=False))
        for note in self.notes:
            out += ["", f"_{note}_"]
        if len(self.missing):
            out += ["", f"**Missing ({len(self.missing)} runs not in the numbers):**", ""]
            out += [f"- {line}" for line in self.missing_lines()]
        return "\n".join(out) + "\n"

    def to_latex(self) -> str:
        columns = list(self.display.columns)
        lines = [
            "% " + self.title,
            "\\begin{tabular}{" + "l" * len(columns) + "}",
            "\\toprule",
            " & ".join(_latex_escape(str(c)) for c in columns) + " \\\\",
            "\\midrule",
        ]
        for row in self.display.itertuples(index=False):
            lines.append(" & ".join(_latex_escape(str(v)) for v in row) + " \\\\")
        lines += ["\\bottomrule", "\\end{tabular}"]
        for note in self.notes:
            lines.append("% " + note)
        for line in self.missing_lines():
            lines.append("% missing " + line)
        if len(self.missing):
            lines.append(
                f"\\par\\smallskip\\footnotesize Missing ({len(self.missing)}): "
                + "; ".join(_latex_escape(line.split(" (")[0]) for line in self.missing_lines())
            )
        return "\n".join(lines) + "\n"

    def to_csv_frame(self) -> pd.DataFrame:
        """The numbers, one row per configuration, then one row per missing run with its status."""
        data = self.data.copy()
        data.insert(0, "status", "ok")
        if len(self.missing):
            keep = [c for c in (*AXES, REPLICATE, "status", "error", "run_dir") if c in self.missing]
            missing = self.missing[keep].copy()
            if "run_dir" in missing:
                missing["run_dir"] = missing["run_dir"].map(lambda d: _shown_path(d) if _present(d) else d)
            data = pd.concat([data, missing], ignore_index=True)
        return data

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def __str__(self) -> str:
        return self.to_markdown()


def _present(value) -> bool:
    if value is None or value is pd.NA:
        return False
    if isinstance(value, float) and math.isnan(value):
        return False
    return str(value) != ""


def _shown_path(path) -> str:
    """A run folder relative to the working directory when it lies inside it: tables that
    ``make figures`` writes from the repository root then read the same on every clone."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _one_line(text) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _latex_escape(text: str) -> str:
    for char, escaped in (
        ("\\", "\\textbackslash{}"),
        ("&", "\\&"),
        ("%", "\\%"),
        ("$", "\\$"),
        ("#", "\\#"),
        ("_", "\\_"),
        ("{", "\\{"),
        ("}", "\\}"),
        ("~", "\\textasciitilde{}"),
        ("^", "\\textasciicircum{}"),
    ):
        text = text.replace(char, escaped)
    return text.replace("±", "$\\pm$")


def write_table(table: Table, out: str | Path) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.csv`` and ``<name>.tex`` into ``out``; return their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"{table.name}.{ext}" for ext in ("md", "csv", "tex")}
    paths["md"].write_text(table.to_markdown())
    table.to_csv_frame().to_csv(paths["csv"], index=False)
    paths["tex"].write_text(table.to_latex())
    return paths


# --- grouping ---------------------------------------------------------------------------------


def varying_axes(runs: pd.DataFrame, exclude: tuple[str, ...] = ()) -> list[str]:
    """Axes that take more than one value among ``runs`` (dense's ``-`` does not count)."""
    out = []
    for axis in AXES:
        if axis in exclude or axis not in runs:
            continue
        column = runs[axis]
        if axis == "ratio" and (runs["scheme"] != DENSE).any():
            # Dense always sends everything (ratio 1); that alone does not make ratio an axis.
            column = column[runs["scheme"] != DENSE]
        values = {v for v in column.dropna().astype(str) if v != NOT_APPLICABLE}
        if len(values) > 1:
            out.append(axis)
    return out


def expand_dense(runs: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """Copy each dense row to every value that sparse rows take on the axes dense ignores.

    Dense SGD is the baseline of every scope, aggregation and ratio: in a table with scope columns
    its row shows in each column.
    """
    if runs.empty:
        return runs
    dense = runs[runs["scheme"] == DENSE]
    sparse = runs[runs["scheme"] != DENSE]
    if dense.empty or sparse.empty:
        return runs
    for axis in axes:
        if axis not in runs or axis not in DENSE_IRRELEVANT:
            continue
        values = sorted({v for v in sparse[axis].dropna().unique() if v != NOT_APPLICABLE}, key=str)
        if not values:
            continue
        pieces = []
        for value in values:
            copy = dense.copy()
            mask = copy[axis] == NOT_APPLICABLE
            copy.loc[mask, axis] = value
            pieces.append(copy)
        dense = pd.concat(pieces, ignore_index=True)
    return pd.concat([dense, sparse], ignore_index=True)


def summarize(runs: pd.DataFrame, by: list[str], metrics: list[str]) -> pd.DataFrame:
    """Mean, std and n over seeds of each metric for each combination of ``by``.

    Runs repeated with the same configuration and seed are averaged first, so ``n`` counts seeds.
    """
    runs = runs.copy()
    for column in by:
        runs[column] = runs[column].astype(object).where(runs[column].notna(), NOT_APPLICABLE)
    per_seed = runs.groupby([*by, REPLICATE], dropna=False, sort=False)[metrics].mean().reset_index()
    grouped = per_seed.groupby(by, dropna=False, sort=False)[metrics]
    mean, std, n = grouped.mean(), grouped.std(ddof=1), grouped.count()
    out = mean.add_suffix("_mean").join(std.add_suffix("_std")).join(n.add_suffix("_n"))
    out = out.reset_index()
    return sort_rows(out, by)


def sort_rows(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    def key(column: pd.Series):
        if column.name == "scheme":
            return column.map(lambda v: SCHEME_ORDER.get(v, 9))
        return column.map(
            lambda v: (0, float(v), "") if _is_number(v) else (1, VALUE_ORDER.get(v, 9), str(v))
        )

    return frame.sort_values(by=list(by), key=key, kind="stable").reset_index(drop=True)


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


def fmt(mean: float, std: float, n: int, metric: str) -> str:
    """``91.23 ± 0.15 (n=3)``; accuracies in percent."""
    if n == 0 or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    scale = 100.0 if metric in PERCENT else 1.0
    digits = 2 if metric in PERCENT or metric.startswith("time_") or metric == "speedup" else 3
    if metric in BYTES:  # the same for every seed of a configuration: no spread to show
        return f"{mean:,.0f} B"
    if metric == "blew_up":  # the share of seeds, as a count
        return f"{round(mean * n)}/{n}"
    text = f"{mean * scale:.{digits}f}"
    if n > 1 and not math.isnan(std):
        text += f" ± {std * scale:.{digits}f}"
    return f"{text} (n={n})"


def _human_bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.3g} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1000
    return f"{value:.3g} GB"


def _display_axis(axis: str, value) -> str:
    if axis == "scheme":
        return SCHEME_NAMES.get(value, str(value))
    return str(value)


def pivot_table(
    name: str,
    title: str,
    runs: pd.DataFrame,
    rows: list[str],
    column: str | None,
    metric: str,
    include_failed: bool = False,
    extra_metrics: list[str] | None = None,
) -> Table:
    """Rows = ``rows`` + other varying axes, columns = values of ``column``, cells = metric."""
    done = runs if include_failed else completed(runs)
    missing = pd.DataFrame() if include_failed else not_completed(runs)
    fixed = [*rows, *([column] if column else [])]
    others = [a for a in varying_axes(done) if a not in fixed]
    by_rows = [*rows, *others]
    metrics = [metric, *(extra_metrics or [])]
    notes = _constant_note(done, [*by_rows, *([column] if column else [])])
    if done.empty:
        return Table(name, title, pd.DataFrame(), pd.DataFrame(), missing.reset_index(drop=True), notes)
    # Dense SGD ignores scope, aggregation, ...: one row of its own ("-"), or copied into each
    # column of such an axis so that every column has its baseline.
    expanded = expand_dense(with_blew_up(done), [column] if column else [])
    metrics = [m for m in metrics if m in expanded]
    data = summarize(expanded, [*by_rows, *([column] if column else [])], metrics)
    display_rows = []
    row_keys = data[by_rows].drop_duplicates()
    column_values = list(sort_rows(data[[column]].drop_duplicates(), [column])[column]) if column else []
    for key in row_keys.itertuples(index=False):
        mask = (data[by_rows] == pd.Series(key._asdict())).all(axis=1)
        entry = {LABELS.get(a, a): _display_axis(a, v) for a, v in zip(by_rows, key, strict=False)}
        if column:
            for value in column_values:
                cell = data[mask & (data[column] == value)]
                label = f"{LABELS.get(column, column)}={value}" if column != "scope" else str(value)
                entry[label] = _cell(cell, metric)
        else:
            entry[LABELS.get(metric, metric)] = _cell(data[mask], metric)
        for extra in extra_metrics or []:
            if extra in metrics:
                entry[LABELS.get(extra, extra)] = _cell(data[mask].head(1), extra)
        display_rows.append(entry)
    return Table(name, title, pd.DataFrame(display_rows), data, missing.reset_index(drop=True), notes)


def with_blew_up(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with ``blew_up``: 1 for a run that blew up early and recovered, 0 for one that
    trained throughout (NaN where unknown), so that tables can count them."""
    if "stability" not in runs:
        return runs
    flag = runs["stability"].map({BLEW_UP_RECOVERED: 1.0}).where(runs["stability"].notna())
    return runs.assign(blew_up=flag.fillna(0.0).where(runs["stability"].notna()))


def _cell(frame: pd.DataFrame, metric: str) -> str:
    if frame.empty:
        return "—"
    row = frame.iloc[0]
    return fmt(row[f"{metric}_mean"], row[f"{metric}_std"], int(row[f"{metric}_n"]), metric)


def _constant_note(runs: pd.DataFrame, shown: list[str]) -> list[str]:
    """Say which settings all runs share, so a table is readable on its own."""
    if runs.empty:
        return []
    parts = []
    for axis in ("model", "data", "world_size", "ratio", "scope", "aggregation", "epochs_planned"):
        if axis in shown or axis not in runs:
            continue
        values = {v for v in runs[axis].dropna().astype(str) if v != NOT_APPLICABLE}
        if len(values) == 1:
            parts.append(f"{LABELS.get(axis, axis)}={values.pop()}")
    if "epochs" in runs and "epochs_planned" in runs and "epochs_planned" not in shown:
        ran = pd.to_numeric(runs["epochs"], errors="coerce")
        planned = pd.to_numeric(runs["epochs_planned"], errors="coerce")
        if (ran < planned - 1e-9).any():  # train.max_steps stopped them first
            span = f"{ran.min():.3g}" if ran.min() == ran.max() else f"{ran.min():.3g}-{ran.max():.3g}"
            parts.append(f"stopped by train.max_steps at {span} epochs")
    seeds = runs[REPLICATE].nunique() if REPLICATE in runs else 0
    return [f"All runs: {', '.join(parts)}; {seeds} seed(s); mean ± std over seeds."] if parts else []


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
    done = runs if include_failed else completed(runs)
    missing = pd.DataFrame() if include_failed else not_completed(runs)
    title = "RQ5: time per step by phase (ms) and speed-up over dense SGD"
    phases = [p for p in PHASES if f"time_{p}_ms" in done]
    metrics = [f"time_{p}_ms" for p in phases] + ["test_accuracy", "bytes_sent_per_step"]
    if done.empty:
        return Table("rq5_speed", title, pd.DataFrame(), pd.DataFrame(), missing.reset_index(drop=True))
    by = ["scheme", *[a for a in varying_axes(done) if a != "scheme"]]
    expanded = expand_dense(done, by)
    data = summarize(expanded, by, metrics)
    # Speed-up is relative to dense runs that share every axis but the scheme's own knobs.
    context = [a for a in by if a not in ("scheme", "ratio", "scope", "aggregation", "error_feedback", "block_size")]
    dense = data[data["scheme"] == DENSE]
    speedups = []
    for row in data.itertuples(index=False):
        match = dense
        for axis in context:
            match = match[match[axis] == getattr(row, axis)]
        if "scope" in by:
            match = match[match["scope"] == row.scope]
        if "aggregation" in by:
            match = match[match["aggregation"] == row.aggregation]
        base = match["time_step_ms_mean"].mean() if len(match) else math.nan
        speedups.append(base / row.time_step_ms_mean if row.time_step_ms_mean else math.nan)
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
    notes = _constant_note(done, by) + ["Phases are mean ms per step after warm-up; speed-up = dense step time / step time."]
    return Table("rq5_speed", title, pd.DataFrame(display_rows), data, missing.reset_index(drop=True), notes)


def stability_table(runs: pd.DataFrame, include_failed: bool = False) -> Table:
    """Stabiliser ablation: per scheme, with and without whole 1-D tensors and warm-up, how many
    seeds trained, the final train loss, test accuracy (with and without batch-norm
    recalibration), the largest error-feedback memory norm and the bytes actually sent.

    Unlike the research-question tables this one keeps the runs that did not train in its
    numbers (counted in the ``trained`` column): what a stabiliser buys is whether runs train.
    """
    keep = completed(runs) if include_failed else runs[runs["status"].isin(("completed", DID_NOT_TRAIN))]
    missing = pd.DataFrame() if include_failed else runs[~runs.index.isin(keep.index)]
    title = "Stabilisers: what whole 1-D tensors and a compression warm-up change"
    by = ["scheme", "uncompressed", "warmup_steps", *[a for a in varying_axes(keep)
                                                     if a not in ("scheme", "uncompressed", "warmup_steps")]]
    metrics = ["train_loss", "test_accuracy", "test_accuracy_running_bn", "memory_norm_max",
               "bytes_mean_per_step"]
    notes = _constant_note(keep, by) + [
        "trained = final train loss below ln 10 (a uniform guess); max memory norm: the largest "
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
    ``code_commits`` name more than one."""
    if runs.empty:
        return Table("status", "Runs by status", pd.DataFrame(), pd.DataFrame())
    runs = runs.fillna({"experiment": "-"})
    detail = runs["status"]
    if "stability" in runs:
        detail = runs["stability"].where(runs["status"] == "completed", runs["status"]).fillna(runs["status"])
    counts = runs.assign(status=detail).groupby(["experiment", "status"]).size()
    data = counts.unstack(fill_value=0).reset_index()
    data.columns.name = None
    notes = ["A completed run blew up and recovered when its batch loss rose above ln 10 (a uniform "
             "guess) from step 20 on; runs written before the per-step record are read from their "
             "logged steps (every 20th). A run whose final train loss is not below ln 10, or whose "
             "final test accuracy is below 20%, did not train."]
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
