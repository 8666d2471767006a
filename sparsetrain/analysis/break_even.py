"""Break-even map: for each bandwidth and worker count, which configuration reaches the target
accuracy first, and by how much the best compressed one beats (or loses to) the best dense
baseline.

Built on the time-to-accuracy table (``analysis.time_to_accuracy``: measured compute phases +
predicted exchange + each run's own steps to the target), so it inherits its assumptions, stated
under that table. Dense baselines are the schemes that send every entry (``DENSE_BASELINES``:
dense SGD and the 16-bit dense schemes); every other scheme is "compressed". A configuration
competes only where **every** seed reached the target (one seed that did not is a configuration
that does not reliably get there); its time is the mean over its seeds.

Speed-up = best dense baseline's time / best compressed configuration's time: above 1
compression pays at that bandwidth and worker count, below 1 it costs. No torch.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .figures import _empty, _label, _new_figure, style
from .group import _display_axis
from .table import LABELS, Table

#: the schemes that send every entry (16-bit or 32-bit): the baselines compression must beat
DENSE_BASELINES = ("dense", "fp16", "bf16")
_NOT_CONFIG = ("bandwidth_gbit", "workers", "reached", "n")


def _config_axes(data: pd.DataFrame) -> list[str]:
    return [c for c in data.columns if c not in _NOT_CONFIG and not c.endswith(("_mean", "_std"))]


def _name(row: pd.Series, axes: list[str]) -> str:
    return ", ".join(_label(a, row[a]) if a != "scheme" else _display_axis(a, row[a])
                     for a in axes if row[a] != "-")


def break_even_table(tta: Table, baselines: tuple[str, ...] = DENSE_BASELINES) -> Table:
    """One row per (bandwidth, workers) of a time-to-accuracy table: the fastest configuration,
    the best dense baseline and the best compressed configuration with their mean times to the
    target, and the speed-up of the second over the first."""
    title = tta.title.replace("Time to", "Break-even map: time to", 1)
    notes = ["Speed-up = best dense baseline's time / best compressed configuration's time (> 1: "
             "compression pays). Dense baselines: " + ", ".join(_display_axis("scheme", s) for s in baselines)
             + ". A configuration competes only where every seed reached the target (mean over its seeds).",
             *tta.notes]
    data = tta.data
    if data.empty:
        return Table("break_even", title, pd.DataFrame(), pd.DataFrame(), tta.missing, notes)
    axes = _config_axes(data)
    ok = data[(data["reached"] == data["n"]) & data["time_to_target_s_mean"].notna()]
    rows, display = [], []
    for (gbit, workers), cell in data.groupby(["bandwidth_gbit", "workers"], sort=True):
        cell_ok = ok[(ok["bandwidth_gbit"] == gbit) & (ok["workers"] == workers)]
        dense = cell_ok[cell_ok["scheme"].isin(baselines)]
        compressed = cell_ok[~cell_ok["scheme"].isin(baselines)]
        best = {}
        for key, part in (("fastest", cell_ok), ("dense", dense), ("compressed", compressed)):
            if part.empty:
                best[key] = (None, math.nan)
            else:
                row = part.loc[part["time_to_target_s_mean"].idxmin()]
                best[key] = (_name(row, axes), float(row["time_to_target_s_mean"]))
        speedup = best["dense"][1] / best["compressed"][1]
        rows.append({"bandwidth_gbit": float(gbit), "workers": int(workers),
                     "fastest": best["fastest"][0], "fastest_s": best["fastest"][1],
                     "best_dense": best["dense"][0], "best_dense_s": best["dense"][1],
                     "best_compressed": best["compressed"][0], "best_compressed_s": best["compressed"][1],
                     "speedup": speedup, "configurations": len(cell), "competing": len(cell_ok)})
        display.append({
            "bandwidth (Gbit/s)": f"{gbit:g}", LABELS.get("workers", "workers"): int(workers),
            "fastest": best["fastest"][0] or "none reached",
            "best dense baseline (s)": _with_time(*best["dense"]),
            "best compressed (s)": _with_time(*best["compressed"]),
            "speed-up": "—" if math.isnan(speedup) else f"{speedup:.2f}x",
        })
    return Table("break_even", title, pd.DataFrame(display), pd.DataFrame(rows), tta.missing, notes)


def _with_time(name: str | None, seconds: float) -> str:
    return "none reached" if name is None else f"{name}: {seconds:.3g}"


def plot_break_even(table: Table) -> object:
    """Workers (rows) x bandwidth (columns); each cell coloured by log2 of the speed-up of the
    best compressed configuration over the best dense baseline (blue: compression pays, red: it
    costs) and labelled with that configuration's scheme and the speed-up."""
    with style():
        data = table.data
        fig, axes = _new_figure(width=6.4, height=3.6)
        ax = axes[0, 0]
        if data.empty:
            return _empty(fig, ax, "no completed runs")
        bandwidths = sorted(data["bandwidth_gbit"].unique())
        workers = sorted(data["workers"].unique())
        grid = np.full((len(workers), len(bandwidths)), np.nan)
        for _, row in data.iterrows():
            grid[workers.index(row["workers"]), bandwidths.index(row["bandwidth_gbit"])] = math.log2(row["speedup"]) \
                if row["speedup"] > 0 else np.nan
        limit = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
        image = ax.imshow(grid, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto", origin="lower")
        for _, row in data.iterrows():
            y, x = workers.index(row["workers"]), bandwidths.index(row["bandwidth_gbit"])
            text = "no pair" if math.isnan(row["speedup"]) else (
                f"{str(row['best_compressed']).replace(', ', chr(10))}\n{row['speedup']:.2f}x")
            ax.text(x, y, text, ha="center", va="center", fontsize=7)
        ax.grid(False)
        ax.set_xticks(range(len(bandwidths)), [f"{b:g}" for b in bandwidths])
        ax.set_yticks(range(len(workers)), [str(w) for w in workers])
        ax.set_xlabel("bandwidth per link (Gbit/s)")
        ax.set_ylabel("workers")
        fig.colorbar(image, ax=ax, label="log2 speed-up over the best dense baseline")
        fig.suptitle(table.title, fontsize=9)
        return fig


__all__ = ["DENSE_BASELINES", "break_even_table", "plot_break_even"]
