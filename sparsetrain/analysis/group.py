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
    CONFIG_DIGEST,
    DENSE,
    DENSE_IRRELEVANT,
    NOT_APPLICABLE,
    REPLICATE,
    completed,
    not_completed,
)
from .table import (
    BYTES,
    LABELS,
    PERCENT,
    SCHEME_NAMES,
    SCHEME_ORDER,
    VALUE_ORDER,
    Table,
    _shown_path,
)

# --- grouping ---------------------------------------------------------------------------------

# What tells runs apart beyond AXES: the recorded config's other keys (the loader's dotted
# columns, ``optim.momentum``), the source of an out-of-tree compressor and the emulated link.
SETTINGS_BEYOND_AXES = ("compressor_code", "link_rate_bits")
# Runs that share a seed and every setting: ``repeat`` 1, 2, ... (``mark_repeats``), each its own
# row, never averaged into one seed; ``-`` for every configuration without such runs.
REPEAT = "repeat"


def config_columns(runs: pd.DataFrame) -> list[str]:
    """The columns beyond AXES that tell runs apart: the loader's config keys (``optim.momentum``)
    and ``SETTINGS_BEYOND_AXES``."""
    return [c for c in runs.columns if "." in str(c) or c in SETTINGS_BEYOND_AXES]


def as_key(column: pd.Series) -> pd.Series:
    """A column as comparable text: None and NaN alike (``-``), 0 and 0.0 alike. (Not
    ``astype(str)``: pandas 3's keeps NaN missing, which breaks a join of keys and drops the row
    from a groupby.)"""
    def text(value):
        if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
            return NOT_APPLICABLE
        if _is_number(value):
            return repr(float(value))
        return f"{type(value).__name__}:{value}"
    return column.map(text)


def as_keys(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``frame``'s ``columns``, each ``as_key``: a table of comparable text to group or join on."""
    return pd.DataFrame({c: as_key(frame[c]) for c in columns}, index=frame.index)


def _splitting(runs: pd.DataFrame, base: list[str], candidates: list[str]) -> list[str]:
    """``candidates`` that take more than one value within some group of ``base``."""
    if runs.empty:
        return []
    keys = as_keys(runs, [*base, *candidates])
    out = []
    for column in candidates:
        counts = keys.groupby(base, sort=False)[column].nunique() if base else [keys[column].nunique()]
        if (pd.Series(counts) > 1).any():
            out.append(column)
    return out


def varying_axes(runs: pd.DataFrame, exclude: tuple[str, ...] = ()) -> list[str]:
    """Axes that take more than one value among ``runs`` (dense's ``-`` does not count), then the
    other recorded settings (``config_columns``) that differ between runs those axes put together,
    then ``repeat`` where ``mark_repeats`` set one."""
    out, base = [], []
    for axis in AXES:
        if axis not in runs:
            continue
        column = runs[axis]
        if axis == "ratio" and (runs["scheme"] != DENSE).any():
            # Dense always sends everything (ratio 1); that alone does not make ratio an axis.
            column = column[runs["scheme"] != DENSE]
        values = {v for v in column.dropna().astype(str) if v != NOT_APPLICABLE}
        if len(values) > 1:
            base.append(axis)
            if axis not in exclude:
                out.append(axis)
    out += [c for c in _splitting(runs, base, config_columns(runs)) if c not in exclude]
    if REPEAT in runs and REPEAT not in exclude and runs[REPEAT].nunique() > 1:
        out.append(REPEAT)
    return out


def _run_keys(runs: pd.DataFrame) -> pd.Series:
    """Which run each row is (a curve has a row per epoch): its folder, else the row itself."""
    if "run_dir" not in runs:
        return pd.Series([f"#{i}" for i in runs.index], index=runs.index)
    return runs["run_dir"].where(runs["run_dir"].notna(), pd.Series([f"#{i}" for i in runs.index], index=runs.index))


def _same_seed_sets(runs: pd.DataFrame) -> list[pd.DataFrame]:
    """Each set of two or more runs that share a seed and every setting (AXES and
    ``config_columns``): one frame of their rows (one per run), in run-folder order."""
    if runs.empty or REPLICATE not in runs:
        return []
    # a job a sweep promised that left no folder has no numbers to average: never a repeat
    runs = runs[runs["run_dir"].notna()] if "run_dir" in runs else runs
    if runs.empty:
        return []
    per_run = runs.assign(_run=_run_keys(runs)).drop_duplicates("_run")
    identity = [a for a in AXES if a in per_run] + config_columns(per_run) + [REPLICATE]
    table = as_keys(per_run, identity)
    sizes = table.groupby(identity, sort=False)[REPLICATE].transform("size")
    repeated = per_run[sizes > 1]
    if repeated.empty:
        return []
    groups = table.loc[repeated.index].groupby(identity, sort=False).groups
    return [per_run.loc[index].sort_values("_run").drop(columns="_run") for index in groups.values()]


def _copies(group: pd.DataFrame) -> bool:
    """Runs of one seed whose recorded configs all differ, though only in keys their scheme
    ignores (dense SGD swept over scope=layerwise,global): one computation, made twice by a grid,
    so they must also have ended alike (status and final test accuracy). Copies that did not
    (another machine, another commit) are repeats: shown apart, and refused by a verdict, never
    one dropped for the other without a word."""
    digests = group[CONFIG_DIGEST] if CONFIG_DIGEST in group else pd.Series(dtype=object)
    if not (len(digests) == len(group) and digests.notna().all() and digests.nunique() == len(group)):
        return False
    return all(column not in group or group[column].nunique(dropna=False) == 1
               for column in ("status", "test_accuracy"))


def repeated_runs(runs: pd.DataFrame) -> list[pd.DataFrame]:
    """Each set of runs that share a seed and their whole recorded config (bookkeeping aside):
    one configuration run more than once, shown apart as repeats (``mark_repeats``)."""
    return [group for group in _same_seed_sets(runs) if not _copies(group)]


def copied_runs(runs: pd.DataFrame) -> list[pd.DataFrame]:
    """Each set of runs of one seed that differ only in keys their scheme ignores (``_copies``):
    counted once, from the first (``mark_repeats``)."""
    return [group for group in _same_seed_sets(runs) if _copies(group)]


def without_copies(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with each ``copied_runs`` set (one computation made twice by a grid: dense SGD at
    two scopes) counted once, from its first run."""
    dropped = {key for group in copied_runs(runs) for key in _run_keys(group).iloc[1:]}
    return runs[~_run_keys(runs).isin(dropped)] if dropped else runs


def one_configuration(runs: pd.DataFrame, what: str) -> None:
    """Refuse ``runs`` (seeds of ``what``) that differ in any axis or recorded setting: their mean
    would be one number made of two configurations (a stray smoke run, another rate). ValueError
    in one line, naming the settings, their values and a run of each."""
    split = varying_axes(runs, exclude=(REPEAT,))
    if not split:
        return
    key = split[0]
    values = as_key(runs[key])
    where = [f"{_display_value(runs.loc[i, key])} ({_shown_path(runs.loc[i, 'run_dir']) if 'run_dir' in runs else '?'})"
             for i in values.drop_duplicates().index[:3]]
    raise ValueError(f"{what} holds runs that differ in {', '.join(split)}: {key} = {'; '.join(where)}; "
                     "allowed: one configuration per side (move the other runs out of the results folder, "
                     "or name the setting in the comparison)")


def _display_value(value) -> str:
    return NOT_APPLICABLE if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def mark_repeats(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` in which no seed is counted twice in one configuration.

    Two runs of one seed are not two samples: averaged, they would show as one seed (n=1) and
    hide how far apart they ended. Runs of one configuration and seed (``repeated_runs``) get
    ``repeat`` 1, 2, ... (run-folder order), each its own row, and ``-`` goes to the other
    configurations' runs; runs that differ only in keys their scheme ignores (``copied_runs``:
    dense SGD at two scopes) are one computation: the first is kept, the others left out.
    Unchanged where neither happens."""
    runs = without_copies(runs)
    keys = _run_keys(runs)
    if not repeated_runs(runs):
        return runs
    per_run = runs.assign(_run=keys).drop_duplicates("_run")
    if "run_dir" in per_run:
        per_run = per_run[per_run["run_dir"].notna()]
    identity = [a for a in AXES if a in per_run] + config_columns(per_run)
    table = as_keys(per_run, [*identity, REPLICATE])
    table["_run"] = per_run["_run"]
    table = table.sort_values("_run")
    table[REPEAT] = table.groupby([*identity, REPLICATE], sort=False).cumcount() + 1
    repeats_of = table.groupby(identity, sort=False)[REPEAT].transform("max")
    table[REPEAT] = table[REPEAT].astype(object).where(repeats_of > 1, NOT_APPLICABLE)
    marks = keys.map(dict(zip(table["_run"], table[REPEAT], strict=True))).fillna(NOT_APPLICABLE)
    return runs.assign(**{REPEAT: marks})


def repeat_notes(runs: pd.DataFrame) -> list[str]:
    """One line per seed that ran more than once in one configuration: the runs, and what to do
    (give each its own seed); and per seed that a grid ran again under keys its scheme ignores."""
    def shown(group: pd.DataFrame) -> list[str]:
        return [_shown_path(d) if isinstance(d, str) else "?" for d in group.get("run_dir", [])]

    lines = []
    for group in repeated_runs(runs):
        first = group.iloc[0]
        differ = [c for c in ("experiment", "code", "host") if c in group and group[c].astype(str).nunique() > 1]
        also = f"; they differ only in {', '.join(differ)}, which no table groups by" if differ else ""
        lines.append(f"{len(group)} runs share seed={first[REPLICATE]} and every recorded setting "
                     f"({', '.join(shown(group))}){also}: shown apart as repeats 1-{len(group)}, never "
                     "averaged as one seed; give each run its own seed (seed=...)")
    for group in copied_runs(runs):
        where = shown(group)
        lines.append(f"{len(group)} runs of seed={group.iloc[0][REPLICATE]} differ only in settings "
                     f"{_display_axis('scheme', group.iloc[0]['scheme'])} ignores ({', '.join(where)}): "
                     f"one computation, counted once, from {where[0]}")
    return lines


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

    ``n`` counts seeds: two runs of one seed in a group are refused (ValueError naming them);
    ``mark_repeats`` first and ``repeat`` in ``by`` shows them apart.
    """
    runs = runs.copy()
    for column in by:
        runs[column] = runs[column].astype(object).where(runs[column].notna(), NOT_APPLICABLE)
    twice = runs.duplicated([*by, REPLICATE], keep=False)
    if "run_dir" in runs:  # a promised job that left no folder has no numbers (NaN): n never counts it
        twice &= runs["run_dir"].notna()
    if twice.any():
        shown = ", ".join(str(d) for d in runs.loc[twice].get("run_dir", runs.loc[twice].index))
        raise ValueError(f"runs {shown} share seed and {', '.join(by)}: one seed is never averaged over "
                         "runs; mark_repeats, then group by repeat")
    grouped = runs.groupby(by, dropna=False, sort=False)[metrics]
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
    """Rows = ``rows`` + other varying axes, columns = values of ``column``, cells = metric;
    ``extra_metrics``: one cell each per row, so only without a ``column`` (with one, a row's
    cells would be its first column's)."""
    if column and extra_metrics:
        raise ValueError(f"pivot_table({name!r}): extra_metrics {extra_metrics} with column={column!r}: "
                         "an extra metric is one cell per row and would show the first column's; "
                         "allowed: extra metrics without a column, or the metric as the column's cells")
    counted = runs if include_failed else completed(runs)
    done = mark_repeats(counted)
    missing = pd.DataFrame() if include_failed else not_completed(runs)
    fixed = [*rows, *([column] if column else [])]
    others = [a for a in varying_axes(done) if a not in fixed]
    by_rows = [*rows, *others]
    metrics = [metric, *(extra_metrics or [])]
    notes = _constant_note(done, [*by_rows, *([column] if column else [])]) + repeat_notes(counted)
    if done.empty:
        return Table(name, title, pd.DataFrame(), pd.DataFrame(), missing.reset_index(drop=True), notes)
    # Dense SGD ignores scope, aggregation, ...: one row of its own ("-"), or copied into each
    # column of such an axis so that every column has its baseline.
    expanded = expand_dense(with_blew_up(done), [column] if column else [])
    metrics = [m for m in metrics if m in expanded]
    expanded, machines = one_machine_times(expanded, [*by_rows, *([column] if column else [])], metrics)
    notes += machines + code_notes(expanded, [*by_rows, *([column] if column else [])])
    data = summarize(expanded, [*by_rows, *([column] if column else [])], metrics)
    display_rows = []
    row_keys = data[by_rows].drop_duplicates()
    column_values = list(sort_rows(data[[column]].drop_duplicates(), [column])[column]) if column else []
    for key in row_keys.itertuples(index=False, name=None):  # by position: a config key's name has dots
        mask = (data[by_rows] == pd.Series(dict(zip(by_rows, key, strict=True)))).all(axis=1)
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


#: What a time depends on besides the configuration (loader columns): the machine, the device
#: type, torch's threads a rank and the collectives' backend. Unrecorded is unknown (NaN), never
#: a difference; ``;`` in a value: a resumed run that changed it, itself on two.
MACHINE = ("host", "device", "threads", "backend")


def _machine(runs: pd.DataFrame) -> pd.DataFrame:
    """Each run's recorded ``MACHINE`` (NaN where unrecorded): the device as its type (``cpu``,
    ``cuda``; from ``cuda:0``)."""
    def column(name):
        return runs[name].where(runs[name].notna(), None) if name in runs else pd.Series(None, index=runs.index)

    frame = pd.DataFrame({name: column(name) for name in MACHINE}, index=runs.index, dtype=object)
    frame["host"] = frame["host"].where(frame["host"] != "unrecorded", None)
    frame["device"] = frame["device"].map(lambda d: str(d).split(":")[0] if isinstance(d, str) else None)
    return frame


def one_machine_times(runs: pd.DataFrame, by: list[str], metrics: list[str]) -> tuple[pd.DataFrame, list[str]]:
    """``runs`` with the timings (``time_*`` metrics) of each ``by`` group whose runs ran on more
    than one machine, device, thread count or backend (``MACHINE``; one resumed run on two
    counts) left out (NaN), and a note naming those groups: a mean of a CPU's and a GPU's step
    time, or of 1 and 2 threads a rank, is neither's time. Accuracy and bytes stay."""
    timed = [m for m in metrics if m.startswith("time_")]
    if runs.empty or not timed:
        return runs, []
    machine = _machine(runs)
    keys = as_keys(runs, by)
    spans = pd.Series(False, index=runs.index)
    for _, group in machine.groupby([keys[c] for c in by], sort=False, dropna=False) if by else [(None, machine)]:
        if any(group[name].nunique() > 1 or group[name].dropna().astype(str).str.contains(";").any()
               for name in MACHINE):
            spans[group.index] = True
    if not spans.any():
        return runs, []
    seen = machine[spans]
    where = sorted({f"{name}={v}" if name in ("threads", "backend") else str(v)
                    for name in MACHINE for v in seen[name].dropna()})
    rows = keys[spans].drop_duplicates()
    return runs.assign(**{m: runs[m].where(~spans) for m in timed}), [
        f"Time left out for {len(rows)} configuration(s) whose runs ran on different machines, devices, "
        f"threads or backends ({'; '.join(where)}): a time is one machine's: analyse each machine's runs apart."]


def code_versions(runs: pd.DataFrame) -> list[str]:
    """The code versions ``runs`` ran (``code``, and every version a resumed run ran on:
    ``code_commits``), unrecorded left out: more than one, and a mean of them mixes two programs."""
    versions: set[str] = set()
    for column in ("code", "code_commits"):
        if column in runs:
            versions |= {v for value in runs[column].dropna() for v in str(value).split(";")}
    return sorted(versions - {"unrecorded", "unknown"})


def code_notes(runs: pd.DataFrame, by: list[str]) -> list[str]:
    """A note naming the ``by`` groups of ``runs`` that ran more than one code version
    (``code_versions``; short hashes): a study runs on one commit, so their means are shown,
    said to mix versions, for the reader to judge (or rerun on one)."""
    if runs.empty:
        return []
    keys = as_keys(runs, by) if by else pd.DataFrame(index=runs.index)
    mixed, seen = 0, set()
    for _, group in runs.groupby([keys[c] for c in by], sort=False, dropna=False) if by else [(None, runs)]:
        versions = code_versions(group)
        if len(versions) > 1:
            mixed += 1
            seen |= {v[:12] for v in versions}
    if not mixed:
        return []
    return [f"{mixed} configuration(s) hold runs of more than one code version ({', '.join(sorted(seen))}): "
            "each such mean mixes them; a study runs on one commit (rerun them on one, or check that the "
            "versions train alike)."]


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
