"""Results files into tables and figures for the paper's research questions.

    >>> from sparsetrain import analysis as sa
    >>> runs = sa.load_runs("results/rq1_scope")          # one row per run, failed ones flagged
    >>> sa.rq1_scope_table(runs)                           # mean ± std (n) over seeds, missing named
    >>> sa.write_report("results", out="figures")          # every table and figure
    >>> sa.time_to_accuracy_table(runs, 0.85, [1, 10, 100], [8, 64])  # predicted time to 85%

Imports no torch: everything here reads the files that the trainer's rank 0 writes.
"""

from . import report
from .figures import (
    plot_accuracy_vs_bytes,
    plot_accuracy_vs_epoch,
    plot_time_per_phase,
    plot_workers,
    save_figure,
    style,
)
from .findings import FINDINGS, findings_tables
from .group import summarize
from .loader import (
    AXES,
    DENSE,
    PHASES,
    completed,
    curves_of,
    expected_grid,
    find_run_dirs,
    load_curves,
    load_runs,
    not_completed,
    row_from_summary,
)
from .report import (
    SOURCES,
    STUDIES,
    TIME_TO_ACCURACY,
    TIME_TO_ACCURACY_RUNS,
    all_findings_tables,
    build_figures,
    build_tables,
    load_study,
    studies_present,
    study_folders,
    study_of,
    write_report,
    write_studies,
    write_time_to_accuracy,
)
from .study_tables import (
    TABLES,
    budget_table,
    plateau_table,
    rq1_scope_table,
    rq2_scheme_table,
    rq3_aggregation_table,
    rq4_workers_table,
    rq5_speed_table,
    status_table,
)
from .table import Table, write_table
from .time_to_accuracy import plot_time_to_accuracy, time_to_accuracy_table
from .wandb_runs import load_wandb_runs

__all__ = [
    "AXES", "DENSE", "FINDINGS", "PHASES", "SOURCES", "STUDIES", "TABLES", "TIME_TO_ACCURACY", "TIME_TO_ACCURACY_RUNS", "Table",
    "report",
    "all_findings_tables", "write_time_to_accuracy",
    "budget_table", "build_figures", "build_tables", "completed", "curves_of", "expected_grid",
    "find_run_dirs", "findings_tables", "load_curves", "load_runs", "load_study",
    "load_wandb_runs", "not_completed", "plateau_table", "plot_accuracy_vs_bytes",
    "plot_accuracy_vs_epoch", "plot_time_per_phase", "plot_time_to_accuracy", "plot_workers",
    "row_from_summary", "rq1_scope_table", "rq2_scheme_table", "rq3_aggregation_table",
    "rq4_workers_table", "rq5_speed_table", "save_figure", "status_table", "studies_present",
    "study_folders", "study_of", "style", "summarize", "time_to_accuracy_table", "write_report",
    "write_studies", "write_table",
]
