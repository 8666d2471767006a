"""One table: its display (``Table.display``), its tidy numbers (``data``), the runs that are
not in them (``missing``, named under it) and notes; written as Markdown, CSV and LaTeX
(``write_table``). Also the vocabulary every table and figure shares: column labels, scheme names
and orders, which metrics are percentages or bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from sparsetrain import scheme_catalog as schemes

from .loader import AXES, DENSE, NOT_APPLICABLE, REPLICATE

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
    "loss_peak": "largest batch loss from step 20",
}
# Beside every accuracy: how far from a plateau, what it cost on the wire, and how many of its
# runs blew up early and recovered (``sparsetrain.results.stability_of``).
# ``loss_peak`` says how far: just above ln 10 on one batch, or a real blow-up.
ACCURACY_EXTRAS = ["test_accuracy_gain_last_epoch", "bytes_sent_per_step", "wire_bytes_per_step", "blew_up",
                   "loss_peak"]
BYTES = ("bytes_sent_per_step", "dense_bytes_per_step", "wire_bytes_per_step")
# Each scheme's place and name in tables and figures: conf/schemes.yaml's order and ``display``
# (dense SGD under the analysis's own row name); a scheme not listed is shown by its name.
SCHEME_ORDER = {DENSE if info.get("dense") else name: i for i, (name, info) in enumerate(schemes.table().items())}
SCHEME_NAMES = {DENSE if info.get("dense") else name: info.get("display", name) for name, info in schemes.table().items()}
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
    # further tidy frames that later tables build on (time to accuracy: its per-seed rows)
    frames: dict = field(default_factory=dict)

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
            if _present(getattr(row, "run_dir", None)):
                where = f" ({_shown_path(row.run_dir)})"
            elif _present(getattr(row, "sweep_dir", None)):
                # A job that left no folder: its sweep and the overrides that name it (a point
                # given as a config group, point=..., says more than the axes read from it).
                job = getattr(row, "overrides", None)
                where = f" ({_shown_path(row.sweep_dir)}{f', job {job}' if _present(job) else ''})"
            else:
                where = ""
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
