"""What the command line prints when a run or a sweep ends: the folder, one short table (the one
`make run` prints), and a warning for every run that did not train. No torch.

``grid`` is the one table formatter of the command line, the benchmarks and ``make run``: a
Markdown pipe table with columns padded to their width, readable as plain text and pasteable
into the docs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from sparsetrain.results import (
    DID_NOT_TRAIN,
    SUMMARY,
    read_summary,
    relative_run_dir,
    untrained_reason,
)

# Column heads of the per-phase times (summary.json's time_ms).
PHASE_HEADS = {"forward": "fwd ms", "backward": "bwd ms", "compress": "compress ms",
               "exchange": "exchange ms", "decompress": "decompress ms", "step": "step ms"}


def grid(columns: Sequence[str], rows: Sequence[Sequence], right: Sequence[bool] | None = None) -> str:
    """``columns`` and ``rows`` (cells as str, or anything ``str()`` turns into one) as a Markdown
    table. ``right``: right-align this column (default: every column but the first)."""
    cells = [[str(c) for c in columns]] + [["" if v is None else str(v) for v in row] for row in rows]
    for row in cells[1:]:
        if len(row) != len(columns):
            raise ValueError(f"row of {len(row)} cells for {len(columns)} columns: {row}")
    right = list(right) if right is not None else [i > 0 for i in range(len(columns))]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(columns))]

    def line(row):
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(row, widths, right)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2))
                          for w, r in zip(widths, right)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def num(value, digits: int = 1) -> str:
    """A number with ``digits`` decimals; '-' for None / NaN."""
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"


def status_of(summary: dict | None) -> str:
    """``completed``, ``did not train``, ``failed``, ``running``, or ``absent`` (no summary)."""
    if not summary:
        return "absent"
    return DID_NOT_TRAIN if untrained_reason(summary) else str(summary.get("status"))


def runs_table(rows: Sequence[tuple[Sequence[str], dict | None]], head: Sequence[str] = ("run",),
               phases: Sequence[str] = ("step",)) -> str:
    """One row per run: its leading cells (under ``head``), then status, steps, final train loss,
    test accuracy, ms per phase (``phases``), bytes sent per step and that share of dense."""
    columns = [*head, "status", "steps", "train loss", "test acc %",
               *(PHASE_HEADS[p] for p in phases), "bytes/step", "vs dense"]
    out = []
    for cells, s in rows:
        s = s or {}
        t = s.get("time_ms") or {}
        acc, sent, dense = s.get("test_accuracy"), s.get("bytes_sent_per_step"), s.get("dense_bytes_per_step")
        out.append([
            *cells, status_of(s or None), str(s["steps"]) if s.get("steps") is not None else "-",
            num(s.get("train_loss"), 3), num(100 * acc if acc is not None else None, 2),
            *(num(t.get(p)) for p in phases),
            f"{sent:,.0f}" if sent is not None else "-",  # a mean over a period (local SGD) is fractional
            f"{sent / dense:.4f}" if sent is not None and dense else "-",
        ])
    return grid(columns, out, right=[False] * len(head) + [False] + [True] * (len(columns) - len(head) - 1))


def _overrides(run_dir: Path) -> list[str]:
    from omegaconf import OmegaConf

    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        return [str(o) for o in OmegaConf.load(path)]
    except (OSError, ValueError, TypeError):
        return []


def _untrained_lines(rows: Sequence[tuple[Path, dict | None]]) -> list[str]:
    return [f"warning: {relative_run_dir(run_dir)} did not train: {untrained_reason(s)}"
            for run_dir, s in rows if s and untrained_reason(s)]


def end_of_run(run_dir: str | Path) -> str:
    """The lines a finished run ends with: its folder, a one-row table, a did-not-train warning."""
    run_dir = Path(run_dir)
    s = read_summary(run_dir) or {}
    resumed = f", resumed from step {s['resumed_from_step']}" if s.get("resumed_from_step") else ""
    label = " ".join(o for o in _overrides(run_dir) if not o.startswith("hydra.")) or "(defaults)"
    lines = [f"run folder: {relative_run_dir(run_dir)} ({status_of(s)}{resumed})",
             runs_table([([label], s)], head=("overrides",))]
    return "\n".join(lines + _untrained_lines([(run_dir, s)]))


def sweep_jobs(sweep_dir: str | Path) -> list[Path]:
    """The job folders of a sweep (``0``, ``1``, ..., or named by their point where the preset
    sets ``hydra.sweep.subdir``, as experiment=tune does), in job order."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and (
        p.name.isdigit() or (p / ".hydra").is_dir() or (p / SUMMARY).is_file())]
    return sorted(jobs, key=_job_order)


def _job_order(job: Path) -> tuple[int, str]:
    """A job folder's place: its number (``N``, or Hydra's ``hydra.job.num`` for a named one)."""
    if job.name.isdigit():
        return int(job.name), ""
    hydra_yaml = job / ".hydra" / "hydra.yaml"
    num = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.job.num") if hydra_yaml.is_file() else None
    return (num if isinstance(num, int) else 1 << 30), job.name


def end_of_sweep(sweep_dir: str | Path, errors: dict[str, str] | None = None) -> str:
    """The lines a sweep ends with: its folder and counts, one row per job (the overrides that
    differ between jobs), a warning per job that did not train. ``errors``: this sweep's own
    account of jobs it refused or that failed ({resolved run folder: error}); it wins over what
    the folder holds, which may be an older run's."""
    errors = errors or {}
    jobs = sweep_jobs(sweep_dir)
    summaries = []
    for job in jobs:
        error = errors.get(str(job.resolve()))
        summaries.append({"status": "failed", "error": error} if error else read_summary(job))
    overrides = [_overrides(job) for job in jobs]
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    rows = [([job.name, " ".join(o for o in ovr if o not in common) or "-"], s)
            for job, ovr, s in zip(jobs, overrides, summaries)]
    counts: dict[str, int] = {}
    for s in summaries:
        counts[status_of(s)] = counts.get(status_of(s), 0) + 1
    tally = ", ".join(f"{n} {status}" for status, n in counts.items())
    runs = f"{len(jobs)} run{'' if len(jobs) == 1 else 's'}"
    lines = [f"sweep folder: {relative_run_dir(sweep_dir)} ({runs}: {tally or 'none'})"]
    if rows:
        lines.append(runs_table(rows, head=("job", "overrides")))
    return "\n".join(lines + _untrained_lines(list(zip(jobs, summaries))))
