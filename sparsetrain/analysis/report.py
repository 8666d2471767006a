"""One call from results folders to every table and figure: what the CLI and notebooks run."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd

from .break_even import break_even_table, plot_break_even, targets_table
from .figures import PLOTS, save_figure
from .findings import BEYOND_FINDINGS, SECOND_PASS_FINDINGS, findings_tables
from .loader import curves_of, load_runs, select
from .study_tables import TABLES, status_table
from .table import Table, write_table
from .time_to_accuracy import (
    BANDWIDTHS_GBIT,
    WORKERS,
    ExchangeModel,
    plot_time_to_accuracy,
    time_to_accuracy_table,
)

# Each study (an experiment preset, a sweep) and the tables and figures that answer it.
STUDIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rq1_scope": (("rq1_scope", "plateau"), ("accuracy_vs_epoch", "accuracy_vs_bytes")),
    "rq2_scheme": (("rq2_scheme", "plateau"), ("accuracy_vs_epoch", "accuracy_vs_bytes")),
    "rq3_aggregation": (("rq3_aggregation", "plateau"), ("accuracy_vs_epoch", "workers")),
    "rq4_workers": (("rq4_workers", "plateau"), ("accuracy_vs_epoch", "workers")),
    "budget": (("budget", "plateau"), ("accuracy_vs_epoch",)),
    "rq5_speed": (("rq5_speed",), ("time_per_phase", "accuracy_vs_bytes")),
    "stability": (("stability",), ("accuracy_vs_epoch",)),
    "ablation": (("ablation",), ("accuracy_vs_epoch",)),
    "ddp_hooks": (("ddp_hooks",), ("accuracy_vs_epoch", "accuracy_vs_bytes")),
    # The headline protocol: RQ1 and RQ2 at 1%, 4 epochs, 5 seeds (and block-k at top-k's bytes).
    "headline": (("rq1_scope", "rq2_scheme", "plateau"), ("accuracy_vs_epoch", "accuracy_vs_bytes")),
    "ddp_fair": (("ddp_hooks",), ("accuracy_vs_epoch", "accuracy_vs_bytes")),
    # Beyond the paper: the compression families at two byte levels (experiment=frontier).
    "frontier": (("runs",), ("accuracy_vs_epoch", "accuracy_vs_bytes")),
}
# Presets that add points to another study's tables.
STUDY_OF_PRESET = {"rq2_low": "rq2_scheme", "rq4_global": "rq4_workers", "rq4_steps": "rq4_workers",
                   "headline_dense": "headline", "headline_bytes": "headline", "local": "frontier"}
# What each study's tables and figures are made of: the folders under a results tree that hold its
# points (a study reuses other sweeps' runs: dense SGD from ``baseline``, 2 ranks from
# ``rq1_scope``, ...) and the runs kept from them (``select``). `make figures`, ``--studies`` and
# the notebooks all read this, so they show the same numbers.
SOURCES: dict[str, tuple[tuple[str, ...], dict[str, list[str]]]] = {
    "stability": (("stability",), {}),
    "ablation": (("ablation",), {}),
    "rq1_scope": (("baseline", "rq1_scope"), {}),
    "rq2_scheme": (("baseline", "rq1_scope", "rq2_scheme", "rq2_low"), {"scope": ["layerwise"]}),
    "rq3_aggregation": (("rq1_scope", "rq3_aggregation", "rq4_workers"),
                        {"scheme": ["randk", "blockk"], "scope": ["layerwise"]}),
    "rq4_workers": (("baseline", "rq1_scope", "rq4_workers", "rq4_global", "rq4_steps"), {}),
    "rq5_speed": (("rq5_speed",), {}),
    "ddp_hooks": (("baseline", "ddp_hooks", "ddp_hooks_trainer"), {}),
    "budget": (("baseline", "rq1_scope", "budget"), {"scope": ["layerwise"]}),
    "headline": (("headline_dense", "headline", "headline_bytes"), {}),
    "ddp_fair": (("headline_dense", "ddp_fair"), {}),
    # the frontier's own points, the headline protocol's dense SGD and layer-wise runs it reuses,
    # and ddp_fair's two points at 2.9% (torch's PowerSGD hook, block-k through the DDP hook);
    # frontier_s34: seeds 3-4 of its points at 1.5% and 3.6%; local: local SGD and DiLoCo at the
    # same two byte levels (issue 38), in the same tables, time to accuracy and break-even map
    "frontier": (("headline_dense", "headline", "ddp_fair", "frontier", "frontier_s34", "local"),
                 {"scope": ["layerwise"]}),
}
# Studies that also get the time to a test accuracy and the break-even map across their
# configurations (``time_to_accuracy``: measured compute + the default cost model's exchange at
# its default BANDWIDTHS_GBIT and WORKERS), written beside the study as ``<study>_time_to_accuracy/``.
# A study's time-to-accuracy targets: several, so that a ranking is called only where it holds at
# every one (break_even.md), each target's own tables beside it.
TIME_TO_ACCURACY = {"frontier": (0.84, 0.85, 0.86)}
# A study's time to accuracy from runs made for it (experiment=tta_frontier: validation curves 8
# points an epoch, timed on a quiet machine), at the study's targets, into ``<out>/<folder>/``
# once ``<results>/<folder>`` is there: the break-even map that the study's own runs (evaluated
# once an epoch on the test set, timed beside other work) can only approximate.
TIME_TO_ACCURACY_RUNS = {"frontier": "tta_frontier"}
ALL = (tuple(TABLES), tuple(PLOTS))
# Runs of no known study (one's own sweep): one table of every configuration, not every study's
RUNS = (("runs",), ("accuracy_vs_epoch", "accuracy_vs_bytes"))


def write_time_to_accuracy(runs: pd.DataFrame, target, out: str | Path, bandwidths_gbit=BANDWIDTHS_GBIT,
                           workers=WORKERS, model: ExchangeModel | None = None, echo=None) -> list[Path]:
    """``time_to_accuracy.*`` and ``break_even.*`` (which configuration reaches ``target`` first
    at each bandwidth and worker count, against the best dense baseline) into ``out``. Several
    targets (a tuple): each target's ``time_to_accuracy_<pct>.*`` and ``break_even_<pct>.*``,
    and ``break_even.*`` with the rankings that hold at every target (``targets_table``); the
    figures at the middle target."""
    targets = tuple(target) if isinstance(target, (tuple, list)) else (target,)
    written, evens, shown = [], {}, []
    for t in targets:
        suffix = f"_{round(100 * t)}" if len(targets) > 1 else ""
        table = time_to_accuracy_table(runs, t, bandwidths_gbit, workers, model)
        even = break_even_table(table)
        evens[t] = even
        written += [*write_table(replace(table, name=table.name + suffix), out).values(),
                    *write_table(replace(even, name=even.name + suffix), out).values()]
        if t == targets[len(targets) // 2]:
            written += [*save_figure(plot_time_to_accuracy(table), out, "time_to_accuracy").values(),
                        *save_figure(plot_break_even(even), out, "break_even").values()]
        shown += [table, even]
    if len(targets) > 1:
        summary = targets_table(evens)
        written += write_table(summary, out).values()
        shown.append(summary)
    for table in shown if echo else ():
        echo(table.to_markdown())
    return written


def study_of(experiment) -> str | None:
    """``paper/rq1_scope`` and ``rq1_scope`` both answer RQ1."""
    if not isinstance(experiment, str) or not experiment:
        return None
    name = experiment.rsplit("/", 1)[-1]
    for prefix in ("paper_", "cpu_"):
        name = name.removeprefix(prefix)
    name = STUDY_OF_PRESET.get(name, name)
    return name if name in STUDIES else None


def study_folders(results: str | Path, study: str) -> list[Path]:
    """The folders of ``results`` that hold ``study``'s points; ``[results]`` when it holds none
    of them (``results`` is then one sweep, e.g. a single study's folder)."""
    results = Path(results)
    found = [results / name for name in SOURCES[study][0] if (results / name).is_dir()]
    return found or [results]


def load_study(results: str | Path, study: str, include_failed: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(runs, curves)`` of one study from a results tree, as ``SOURCES`` assembles them."""
    folders = study_folders(results, study)
    where = SOURCES[study][1]
    runs = select(load_runs(*folders), where)
    return runs, curves_of(runs, include_failed=include_failed)


def studies_present(results: str | Path) -> list[str]:
    """The studies with one of their own sweeps in ``results``: ``results/<study>``, or a preset
    that adds to it (``rq4_global`` to ``rq4_workers``, ...)."""
    results = Path(results)
    present = []
    for study in SOURCES:
        own = [study, *(preset for preset, of in STUDY_OF_PRESET.items() if of == study)]
        if any((results / sweep).is_dir() for sweep in own):
            present.append(study)
    return present


def write_studies(results: str | Path, out: str | Path, include_failed: bool = False, echo=None) -> list[Path]:
    """Every study with one of its own sweeps there (``studies_present``) into ``out/<study>/``;
    ``out/findings/``: the paper's findings judged from the tree's runs (``findings``); and
    ``out/status.*``: every run of the tree counted by status, the ones not in any number named.

    ``out/<study>/`` is emptied first, and removed for a study whose sweep is not there (yet), so
    that no figure of an earlier set of results survives beside the new ones."""
    results, out = Path(results), Path(out)
    written: list[Path] = []
    present = studies_present(results)
    for study in SOURCES:
        shutil.rmtree(out / study, ignore_errors=True)
        shutil.rmtree(out / f"{study}_time_to_accuracy", ignore_errors=True)
        if study not in present:
            continue
        runs, curves = load_study(results, study, include_failed)
        tables, files = report_group(runs, curves, out / study, study, include_failed)
        written += files
        if study in TIME_TO_ACCURACY:
            written += write_time_to_accuracy(runs, TIME_TO_ACCURACY[study], out / f"{study}_time_to_accuracy")
        for table in tables if echo else ():
            echo(table.to_markdown())
    for study, folder in TIME_TO_ACCURACY_RUNS.items():
        shutil.rmtree(out / folder, ignore_errors=True)
        if (results / folder).is_dir():
            written += write_time_to_accuracy(load_runs(results / folder), TIME_TO_ACCURACY[study], out / folder)
    if not written:
        raise LookupError(f"no study folder under {results} (expected one of: {', '.join(SOURCES)})")
    everything = load_runs(results)  # every sweep of the tree, studies or not
    status = status_table(everything)
    shutil.rmtree(out / "findings", ignore_errors=True)
    tables = all_findings_tables(everything)
    for table in tables:
        written += write_table(table, out / "findings").values()
    written += write_table(status, out).values()
    if echo:
        for table in (*tables[:2], status):
            echo(table.to_markdown())
    return written


def all_findings_tables(runs: pd.DataFrame) -> list[Table]:
    """Verdicts and comparisons of the paper's findings (each judged from the runs of its setting:
    the headline protocol for RQ1 and RQ2 at 1%, the second pass's for the rest), then of the
    second pass's own comparisons judged by the same test (to read what changed), then of the
    comparisons beyond the paper (no claim): ``figures/findings/``."""
    return [*findings_tables(runs), *findings_tables(runs, SECOND_PASS_FINDINGS, name="second_pass_"),
            *findings_tables(runs, BEYOND_FINDINGS, name="beyond_")]


def build_tables(runs: pd.DataFrame, names=None, include_failed: bool = False) -> list[Table]:
    return [TABLES[name](runs, include_failed=include_failed) for name in (names or TABLES)]


def build_figures(runs: pd.DataFrame, curves: pd.DataFrame, names=None) -> dict:
    figures = {}
    for name in names or PLOTS:
        figures[name] = PLOTS[name](curves if name == "accuracy_vs_epoch" else runs)
    return figures


def report_group(runs: pd.DataFrame, curves: pd.DataFrame, out: Path, study: str | None,
                 include_failed: bool = False) -> tuple[list[Table], list[Path]]:
    """Tables and figures of one study (all of them for runs of no known study) into ``out``."""
    table_names, figure_names = STUDIES.get(study, RUNS) if study else RUNS
    tables = build_tables(runs, table_names, include_failed)
    written: list[Path] = []
    for table in tables:
        written += write_table(table, out).values()
    for name, fig in build_figures(runs, curves, figure_names).items():
        written += save_figure(fig, out, name).values()
    return tables, written


def _group_name(row) -> str:
    return study_of(row) or (row if isinstance(row, str) and row else "runs")


def write_report(*paths: str | Path, out: str | Path, include_failed: bool = False,
                 study: str | None = None, echo=None, where: dict[str, list[str]] | None = None) -> list[Path]:
    """Tables (md/csv/tex) and figures (png/pdf) for the runs under ``paths``, into ``out``.

    Runs are grouped by experiment preset; with one group the files go straight into ``out``,
    with several each group gets ``out/<study>/`` and ``out/status.md`` counts runs by status.
    ``study`` forces one study's tables and figures on all runs; ``where`` keeps the runs whose
    axes take the given values (``select``). ``echo`` (e.g. ``print``) gets
    every table's Markdown. Raises ``LookupError`` when no runs are found.
    """
    out = Path(out)
    runs = select(load_runs(*paths), where)
    if runs.empty:
        raise LookupError(f"no runs found under {', '.join(map(str, paths))}")
    curves = curves_of(runs, include_failed=include_failed)
    if study:
        groups = {study: (runs, curves)}
    else:
        names = runs["experiment"].map(_group_name)
        curve_names = curves["experiment"].map(_group_name) if not curves.empty else pd.Series(dtype=str)
        groups = {name: (runs[names == name], curves[curve_names == name] if not curves.empty else curves)
                  for name in sorted(names.unique())}
    written: list[Path] = []
    for name, (group_runs, group_curves) in groups.items():
        target = out if len(groups) == 1 else out / name
        tables, files = report_group(group_runs, group_curves, target, study_of(name) or study, include_failed)
        written += files
        if echo:
            for table in tables:
                echo(table.to_markdown())
    status = status_table(runs)
    written += write_table(status, out).values()
    if echo:
        if len(groups) == 1:  # its tables already named every run not in the numbers
            status = Table(status.name, status.title, status.display, status.data, notes=status.notes)
        echo(status.to_markdown())
    return written
