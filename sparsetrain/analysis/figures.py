"""Figures for the research questions, in one style, saved as PNG and PDF.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot), so they render the same
headless, in scripts and in notebooks, and never open a window. Each ``plot_*`` returns the figure;
``save_figure`` writes it.
"""

from __future__ import annotations

import colorsys
import itertools
import math
import re
import zlib
from contextlib import contextmanager
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib import colors as mcolors
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from sparsetrain import scheme_catalog as schemes

from .group import (
    as_keys,
    expand_dense,
    mark_repeats,
    one_machine_times,
    sort_rows,
    summarize,
    varying_axes,
)
from .loader import DEFAULT_SYNC, DENSE, DID_NOT_TRAIN, NOT_APPLICABLE, PHASES, REPLICATE, completed
from .table import LABELS, SCHEME_NAMES, SCHEME_ORDER

# One colour per scheme, the same in every figure (conf/schemes.yaml's ``color``): Okabe-Ito first
# (distinguishable with colour-blindness), then Paul Tol's wine and olive and two greys/browns for
# the torch hooks.
SCHEME_COLORS = {DENSE if info.get("dense") else name: info["color"] for name, info in schemes.table().items()
                 if "color" in info}
# Okabe-Ito's blue, top-k's: a new scheme's hue keeps twice the gap from it.
BLUE = "#0072B2"
# A scheme not in the table (one's own) gets a hue from its name at least this far (degrees)
# from every coloured scheme of the table, and twice that from top-k's blue.
MIN_HUE_GAP = 20.0
PHASE_COLORS = {
    "data": "#BBBBBB", "forward": "#56B4E9", "backward": "#0072B2", "compress": "#E69F00",
    "exchange": "#D55E00", "decompress": "#F0E442", "optimizer": "#009E73", "other": "#EEEEEE",
}
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P"]
STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
    "lines.markersize": 5,
    "pdf.fonttype": 42,  # embed TrueType: text stays editable and searchable in the PDF
}
MAX_PANELS = 12
# A scheme's own settings (PowerSGD's rank; a synchronising scheme's period and outer step, and
# what sends its delta) tell lines of that scheme apart, in its colour: never panels, so that local
# SGD at two periods beside the compressors adds two lines, not a row of panels per period.
LINE_AXES = ("rank", "sync", "delta")


@contextmanager
def style():
    with matplotlib.rc_context(STYLE):
        yield


def _new_figure(ncols: int = 1, nrows: int = 1, width: float = 4.2, height: float = 3.2) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def save_figure(fig: Figure, out: str | Path, name: str) -> dict[str, Path]:
    """Write ``<name>.png`` and ``<name>.pdf`` into ``out``; return their paths.

    No creation date in the PDF: the same results give byte-identical files, so regenerating
    figures changes only those whose data changed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    with style():
        for ext in ("png", "pdf"):
            paths[ext] = out / f"{name}.{ext}"
            fig.savefig(paths[ext], metadata={"CreationDate": None} if ext == "pdf" else None)
    return paths


def _hue(color: str) -> tuple[float, float]:
    """(hue in degrees, saturation) of a colour."""
    h, _, sat = colorsys.rgb_to_hls(*mcolors.to_rgb(color))
    return h * 360.0, sat


def _hue_gap(a: float, b: float) -> float:
    return min(abs(a - b), 360.0 - abs(a - b))


def scheme_color(scheme: str) -> str:
    """The scheme's colour in every figure: the table's (``SCHEME_COLORS``), else one derived from
    its name alone (the same in every figure and session; crc32, not Python's salted hash) whose
    hue keeps clear of the table's coloured schemes and far from top-k's blue, its lightness one
    of three. Two new schemes can still land close by chance: a scheme that stays gets its own
    entry in the table."""
    if scheme in SCHEME_COLORS:
        return SCHEME_COLORS[scheme]
    taken = [_hue(c) for c in SCHEME_COLORS.values()]
    taken = [h for h, sat in taken if sat > 0.2]  # greys have no hue to keep clear of
    blue = _hue(BLUE)[0]
    start = zlib.crc32(str(scheme).encode()) / 2**32
    lightness = (0.32, 0.44, 0.56)[zlib.adler32(str(scheme).encode()) % 3]
    for i in range(360):
        hue = (start + i * 0.618034) % 1.0 * 360.0  # golden-ratio steps: every hue is reached
        color = mcolors.to_hex(colorsys.hls_to_rgb(hue / 360.0, lightness, 0.75))
        hue = _hue(color)[0]  # the gaps of the colour as written (8 bits a channel), not as meant
        if _hue_gap(hue, blue) >= 2 * MIN_HUE_GAP and all(_hue_gap(hue, h) >= MIN_HUE_GAP for h in taken):
            return color
    raise AssertionError("no free hue")  # unreachable while the table leaves gaps


def _scheme_sort(values) -> list:
    return sorted(values, key=lambda v: (SCHEME_ORDER.get(v, 9), str(v)))


# Axes whose values are on/off: a legend says "error feedback: off", never a bare "False".
SWITCHES = {"error_feedback": "error feedback"}


def _label(axis: str, value) -> str:
    """A legend entry or panel title for one axis value that says what it is."""
    if axis == "scheme":
        return SCHEME_NAMES.get(value, str(value))
    if axis in ("scope", "aggregation"):
        return str(value)
    if axis in SWITCHES or str(value) in ("True", "False"):  # also values read back as text
        on = {"True": "on", "False": "off"}.get(str(value), str(value))
        return f"{SWITCHES.get(axis, LABELS.get(axis, axis))}: {on}"
    return f"{LABELS.get(axis, axis)}={value}"


def _empty(fig: Figure, ax, message: str) -> Figure:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


def _natural(text: str) -> list:
    """Sort key that puts "H=8" before "H=14"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _synchronises(frame: pd.DataFrame) -> pd.Series:
    if "sync" not in frame:
        return pd.Series(False, frame.index)
    return frame["sync"].notna() & ~frame["sync"].astype(str).isin((DEFAULT_SYNC, NOT_APPLICABLE))


def period_name(sync) -> str | None:
    """``H=66`` for a synchronising scheme's sync node (its text, with its ``period``); None for a
    text without one (``every step``). The figures' lines and the break-even map's short names."""
    period = re.search(r"period=(\d+)", str(sync))
    return f"H={period.group(1)}" if period else None


def _variant(row, axes: list[str], full: bool = False) -> str:
    """A line's settings beyond its scheme (``axes``: the LINE_AXES that vary): ``H=66``,
    ``H=14, TopK delta (ratio=0.1)``, ``rank=1``; ``full``: each axis's whole value, for lines
    whose short names would coincide."""
    parts = []
    for axis in axes:
        value = row[axis]
        if value is None or (isinstance(value, float) and math.isnan(value)) or str(value) in (NOT_APPLICABLE, DEFAULT_SYNC):
            continue
        if axis == "sync" and not full:
            parts.append(period_name(value) or str(value))
        elif axis == "delta":
            if str(value) != "dense":  # a synchronising scheme sends its delta dense unless told
                ratio = row.get("delta_ratio", NOT_APPLICABLE)
                parts.append(f"{value} delta" + (f" (ratio={ratio:g})" if isinstance(ratio, float) else ""))
        else:
            parts.append(_label(axis, value))
    return ", ".join(parts)


def _with_lines(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``line`` column: the scheme's name and its own settings that vary
    (``LINE_AXES``), those settings alone in ``variant`` ("" where none vary). A synchronising
    run's ratio is its delta's: it moves from ``ratio`` (a panel or marker axis of the per-step
    compressors) into its line."""
    frame = frame.copy()
    syncing = _synchronises(frame)
    if syncing.any() and "ratio" in frame:
        frame["ratio"] = frame["ratio"].astype(object)
        frame["delta_ratio"] = frame["ratio"].where(syncing, NOT_APPLICABLE)
        frame.loc[syncing, "ratio"] = NOT_APPLICABLE
    axes = [a for a in LINE_AXES if a in varying_axes(frame)]
    names = frame["scheme"].map(lambda s: SCHEME_NAMES.get(s, str(s)))

    def variants(full: bool) -> pd.Series:
        if not axes or frame.empty:
            return pd.Series("", index=frame.index, dtype=object)
        return frame.apply(lambda row: _variant(row, axes, full), axis=1).astype(str).str.strip()

    def set_lines(full: bool) -> None:
        frame["variant"] = variants(full)
        frame["line"] = (names + " " + frame["variant"]).str.strip()

    set_lines(full=False)
    if axes:  # two settings with one short name (outer steps at one period): say each in full
        keys = as_keys(frame, ["scheme", *axes]).agg("|".join, axis=1)
        if (keys.groupby(frame["line"]).nunique() > 1).any():
            set_lines(full=True)
    return frame


def _wrap(title: str, width: int = 50) -> str:
    """A long panel title over lines, broken between its ``axis=value`` parts, so that it never
    runs into the next panel's."""
    lines: list[str] = []
    for part in title.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += ", " + part
        else:
            lines.append(part)
    return ",\n".join(lines)


def _facets(frame: pd.DataFrame, axes: list[str]) -> list[tuple[str, pd.DataFrame]]:
    if not axes:
        return [("", frame)]
    out = []
    keys = sort_rows(frame[axes].drop_duplicates(), axes)
    for key in keys.itertuples(index=False):
        mask = (frame[axes] == pd.Series(dict(zip(axes, key, strict=False)))).all(axis=1)
        out.append((", ".join(_label(a, v) for a, v in zip(axes, key, strict=False)), frame[mask]))
    # expand_dense copies dense SGD to every value of each axis it ignores, also to combinations
    # that no other run has: a panel of dense alone is left out when each of its runs already
    # shows in another panel (beside other schemes first), so that no run's curve is lost
    if "run_dir" in frame:
        alone = [bool((panel["scheme"] == DENSE).all()) for _, panel in out]
        shown = set().union(*(set(panel["run_dir"]) for lone, (_, panel) in zip(alone, out, strict=True) if not lone))
        kept = []
        for lone, (title, panel) in zip(alone, out, strict=True):
            if lone and set(panel["run_dir"]) <= shown:
                continue
            shown |= set(panel["run_dir"])
            kept.append((title, panel))
        out = kept
    if len(out) > MAX_PANELS:
        raise ValueError(
            f"{len(out)} panels (one per {', '.join(axes)}): select fewer runs before plotting"
        )
    return out


def plot_accuracy_vs_epoch(curves: pd.DataFrame, metric: str = "test_accuracy", facet: list[str] | None = None) -> Figure:
    """Test accuracy vs epoch, one line per scheme (mean over seeds, band = ±1 std).

    One panel per value of the other axes that vary (scope, ratio, ...), or of ``facet``.
    """
    with style():
        if curves.empty or metric not in curves:
            fig, axes = _new_figure()
            return _empty(fig, axes[0, 0], "no epoch records")
        curves = _with_lines(mark_repeats(curves.dropna(subset=[metric])))
        facet = facet if facet is not None else varying_axes(curves, exclude=("scheme", *LINE_AXES))
        curves = expand_dense(curves, facet)
        panels = _facets(curves, facet)
        ncols = min(len(panels), 3)
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = _new_figure(ncols, nrows)
        scale = 100.0 if "accuracy" in metric else 1.0
        untrained = curves["status"] == DID_NOT_TRAIN if "status" in curves else pd.Series(False, curves.index)
        for ax, (title, panel) in zip(axes.flat, panels, strict=False):
            for scheme in _scheme_sort(panel["scheme"].unique()):
                variants = sorted(panel.loc[panel["scheme"] == scheme, "line"].unique(), key=_natural)
                # runs that did not train: their own dashed line, never averaged with the others
                for (i, line), failed in itertools.product(enumerate(variants), (False, True)):
                    lines = panel[(panel["line"] == line) & (untrained[panel.index] == failed)]
                    if lines.empty:
                        continue
                    per_seed = lines.groupby([REPLICATE, "epoch"], dropna=False)[metric].mean().reset_index()
                    stats = per_seed.groupby("epoch")[metric].agg(["mean", "std", "count"]).reset_index()
                    color = scheme_color(scheme)
                    n = int(stats["count"].max())
                    note = ", did not train" if failed else ""
                    ax.plot(stats["epoch"], stats["mean"] * scale, color=color, marker=MARKERS[i % len(MARKERS)],
                            markersize=3, linestyle="--" if failed else "-", label=f"{line} (n={n}{note})")
                    std = stats["std"].fillna(0.0)
                    ax.fill_between(stats["epoch"], (stats["mean"] - std) * scale,
                                    (stats["mean"] + std) * scale, color=color, alpha=0.15, linewidth=0)
            ax.set_title(_wrap(title))
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(LABELS.get(metric, metric))
            ax.legend(loc="lower right")
        for ax in list(axes.flat)[len(panels):]:
            ax.set_axis_off()
        return fig


def _config_labels(frame: pd.DataFrame, axes: list[str]) -> list[str]:
    return [", ".join(_label(a, row[a]) for a in axes if row[a] != NOT_APPLICABLE) for _, row in frame.iterrows()]


def plot_time_per_phase(runs: pd.DataFrame) -> Figure:
    """Stacked horizontal bars: mean ms per step in each phase, per configuration.

    The step's time not covered by a named phase shows as ``other``; the error bar is ±1 std of
    the step time over seeds.
    """
    with style():
        done = completed(runs)
        phases = [p for p in PHASES if p != "step" and f"time_{p}_ms" in done]
        if done.empty or "time_step_ms" not in done or done["time_step_ms"].isna().all():
            fig, axes = _new_figure()
            return _empty(fig, axes[0, 0], "no timings")
        done = mark_repeats(done)
        by = ["scheme", *varying_axes(done, exclude=("scheme",))]
        metrics = [f"time_{p}_ms" for p in phases] + ["time_step_ms"]
        # a configuration timed on two machines (threads, backends) has no time: no bar (the
        # table's note says which)
        done, _ = one_machine_times(done, by, metrics)
        data = summarize(done, by, metrics)
        data = data[data["time_step_ms_mean"].notna()].reset_index(drop=True)
        if data.empty:
            fig, axes = _new_figure()
            return _empty(fig, axes[0, 0], "no timings of one machine")
        labels = _config_labels(data, by)
        fig, axes = _new_figure(width=7.0, height=max(2.8, 0.9 + 0.38 * len(data)))  # room for the legend
        ax = axes[0, 0]
        y = np.arange(len(data))[::-1]
        left = np.zeros(len(data))
        for phase in phases:
            values = data[f"time_{phase}_ms_mean"].fillna(0.0).to_numpy()
            ax.barh(y, values, left=left, color=PHASE_COLORS[phase], label=phase, edgecolor="white", linewidth=0.5)
            left += values
        step = data["time_step_ms_mean"].to_numpy()
        other = np.clip(step - left, 0.0, None)
        if (other > 0.01 * np.nanmax(step)).any():
            ax.barh(y, other, left=left, color=PHASE_COLORS["other"], label="other", edgecolor="white", linewidth=0.5)
        spread = data["time_step_ms_std"].fillna(0.0).to_numpy()
        ax.errorbar(step, y, xerr=spread, fmt="none", ecolor="black", capsize=3, linewidth=1)
        for yi, total, error in zip(y, step, spread, strict=False):
            ax.text(total + error, yi, f"  {total:.0f} ms", va="center", fontsize=8)
        ax.set_yticks(y, labels)
        ax.set_xlabel("time per step (ms, mean after warm-up)")
        ax.set_xlim(0, np.nanmax(step + spread) * 1.2)
        ax.grid(axis="y", visible=False)
        ax.legend(ncols=min(len(phases) + 1, 8), loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(len(data), 1)))
        return fig


def _style_keys(frame: pd.DataFrame, axes: list[str]) -> dict:
    # each value as str gives it, NaN as "nan" (astype(str) keeps it missing in pandas 3), so that
    # the styles' order stays that of the values' text
    text = frame[axes].apply(lambda column: column.map(str))
    values = sorted({tuple(row) for row in text.itertuples(index=False)}) if axes else [()]
    return {v: i for i, v in enumerate(values)}


def plot_accuracy_vs_bytes(runs: pd.DataFrame) -> Figure:
    """Test accuracy vs the bytes each worker puts on its link per step (log scale), colour =
    scheme. Wire bytes (``wire_bytes_per_step``: ring AllReduce 2(W-1)/W x the buffer, ring
    AllGather (W-1) x the message), so that AllGather's traffic is not understated next to
    AllReduce's; payload bytes only where no run has wire bytes (the axis label says which)."""
    with style():
        metric = "wire_bytes_per_step"
        if metric not in runs or completed(runs)[metric].isna().all():
            metric = "bytes_sent_per_step"
        done = completed(runs).dropna(subset=["test_accuracy", metric])
        fig, axes = _new_figure(width=5.5, height=3.8)
        ax = axes[0, 0]
        if done.empty:
            return _empty(fig, ax, "no completed runs with accuracy and bytes")
        done = _with_lines(mark_repeats(done))
        others = varying_axes(done, exclude=("scheme", *LINE_AXES))
        data = summarize(done, ["scheme", "line", "variant", *others], ["test_accuracy", metric])
        marker_axes = [a for a in others if a != "ratio"]
        markers = _style_keys(data, marker_axes)
        for _, row in data.iterrows():
            key = tuple(str(row[a]) for a in marker_axes)
            ax.errorbar(row[f"{metric}_mean"], row["test_accuracy_mean"] * 100,
                        yerr=0.0 if math.isnan(row["test_accuracy_std"]) else row["test_accuracy_std"] * 100,
                        fmt=MARKERS[markers[key] % len(MARKERS)], color=scheme_color(row["scheme"]),
                        capsize=3, markersize=6)
            # beside the point: its ratio where ratios vary, and its own settings (line) where they do
            ratio = [f"{row['ratio']:g}"] if ("ratio" in others and row["scheme"] != DENSE
                                               and row["ratio"] != NOT_APPLICABLE) else []
            text = ", ".join(ratio + ([row["variant"]] if row["variant"] else []))
            if text:
                ax.annotate(text, (row[f"{metric}_mean"], row["test_accuracy_mean"] * 100),
                            textcoords="offset points", xytext=(5, 3), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("wire bytes per step per worker (ring: AllReduce 2(W-1)/W x buffer, "
                      "AllGather (W-1) x message; log)" if metric == "wire_bytes_per_step"
                      else "payload bytes per step per worker (no wire bytes in these runs; log)")
        ax.set_ylabel(LABELS["test_accuracy"])
        handles = [Line2D([], [], color=scheme_color(s), marker="o", linestyle="", label=SCHEME_NAMES.get(s, s))
                   for s in _scheme_sort(data["scheme"].unique())]
        if marker_axes:
            handles += [Line2D([], [], color="grey", marker=MARKERS[i % len(MARKERS)], linestyle="",
                               label=", ".join(_label(a, k) for a, k in zip(marker_axes, key, strict=True)
                                            if k != NOT_APPLICABLE) or "dense")
                        for key, i in markers.items()]
        if len(handles) > 8:  # a long legend beside the points, never on top of them
            fig.set_figwidth(fig.get_figwidth() + 3.5)
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        else:
            ax.legend(handles=handles, loc="best")
        return fig


def plot_workers(runs: pd.DataFrame) -> Figure:
    """Test accuracy (left) and time per step (right) vs number of workers, one line per setting."""
    with style():
        done = completed(runs)
        fig, axes = _new_figure(ncols=2)
        if done.empty:
            _empty(fig, axes[0, 1], "")
            return _empty(fig, axes[0, 0], "no completed runs")
        done = mark_repeats(done)
        others = [a for a in varying_axes(done, exclude=("scheme", "world_size"))]
        by = ["scheme", *others, "world_size"]
        expanded, _ = one_machine_times(expand_dense(done, others), by, ["time_step_ms"])  # one machine's
        data = summarize(expanded, by, ["test_accuracy", "time_step_ms"])
        data["world_size"] = pd.to_numeric(data["world_size"], errors="coerce")
        styles = _style_keys(data, others)
        panels = (("test_accuracy", 100.0, LABELS["test_accuracy"]), ("time_step_ms", 1.0, LABELS["time_step_ms"]))
        for ax, (metric, scale, ylabel) in zip(axes[0], panels, strict=False):
            for key, group in data.groupby(["scheme", *others], sort=False, dropna=False):
                key = key if isinstance(key, tuple) else (key,)
                group = group.sort_values("world_size")
                index = styles[tuple(str(k) for k in key[1:])]
                label = ", ".join(_label(a, v) for a, v in zip(["scheme", *others], key, strict=False) if v != NOT_APPLICABLE)
                std = group[f"{metric}_std"].fillna(0.0) * scale
                ax.errorbar(group["world_size"], group[f"{metric}_mean"] * scale, yerr=std, label=label,
                            color=scheme_color(key[0]), linestyle=LINESTYLES[index % len(LINESTYLES)],
                            marker=MARKERS[index % len(MARKERS)], capsize=3)
            ax.set_xscale("log", base=2)
            ticks = sorted(data["world_size"].dropna().unique())
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_xlabel("workers")
            ax.set_ylabel(ylabel)
        axes[0, 0].legend(loc="best")
        return fig


FIGURES = {
    "accuracy_vs_epoch": "curves",
    "time_per_phase": "runs",
    "accuracy_vs_bytes": "runs",
    "workers": "runs",
}
PLOTS = {
    "accuracy_vs_epoch": plot_accuracy_vs_epoch,
    "time_per_phase": plot_time_per_phase,
    "accuracy_vs_bytes": plot_accuracy_vs_bytes,
    "workers": plot_workers,
}
