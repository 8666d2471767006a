"""Grouping runs into a table's rows: which axes vary (``varying_axes``), dense SGD copied into
the columns of axes it ignores (``expand_dense``), mean ± std over seeds with n (``summarize``),
the paper's row order (``sort_rows``), cells (``fmt``) and the generic table builder every study
table uses (``pivot_table``)."""

from __future__ import annotations

import math

import pandas as pd

from .loader import (
    AXES,
    BLEW_UP_RECOVERED,
    DENSE,
    DENSE_IRRELEVANT,
    NOT_APPLICABLE,
    REPLICATE,
    completed,
    not_completed,
)
from .table import BYTES, LABELS, PERCENT, SCHEME_NAMES, SCHEME_ORDER, VALUE_ORDER, Table

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
        early = ran < planned - 1e-9
        # a run stops before its planned epochs at its target (train.stop_at_accuracy: summary's
        # target.reached) or, otherwise, at train.max_steps
        reached = pd.to_numeric(runs["target_reached"], errors="coerce").eq(1) if "target_reached" in runs else False
        at_target = early & reached
        for stopped, cause in ((at_target, "at the target (train.stop_at_accuracy)"),
                               (early & ~at_target, "by train.max_steps")):
            if stopped.any():
                lo, hi = ran[stopped].min(), ran[stopped].max()
                span = f"{lo:.3g}" if lo == hi else f"{lo:.3g}-{hi:.3g}"
                count = "" if stopped.all() else f"{int(stopped.sum())} of {len(runs)} "
                parts.append(f"{count}stopped {cause} at {span} epochs")
    seeds = runs[REPLICATE].nunique() if REPLICATE in runs else 0
    return [f"All runs: {', '.join(parts)}; {seeds} seed(s); mean ± std over seeds."] if parts else []
