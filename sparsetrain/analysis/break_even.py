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
compression pays at that bandwidth and worker count, below 1 it costs. It is computed on
**matched seeds** only (the seeds both configurations ran and reached the target with): the
geometric mean of the per-seed ratios, with a 95 % t interval on their logarithms. A ratio of
means over different seeds would mix seed luck into it.

With several targets (``targets_table``), a ranking is called only where it holds at all of them:
the same fastest configuration, and compression paying (interval above 1), costing (below 1) or
not told apart at each target; otherwise the table says which target decides it. No torch.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from .figures import _empty, _label, _new_figure, period_name, style
from .group import _display_axis
from .stats import ALPHA
from .table import LABELS, Table

#: the schemes that send every entry (16-bit or 32-bit): the baselines compression must beat
DENSE_BASELINES = ("dense", "fp16", "bf16")
_NOT_CONFIG = ("bandwidth_gbit", "workers", "reached", "n")


def _config_axes(data: pd.DataFrame) -> list[str]:
    return [c for c in data.columns if c not in _NOT_CONFIG and not c.endswith(("_mean", "_std"))]


def _name(row: pd.Series, axes: list[str]) -> str:
    return ", ".join(_label(a, row[a]) if a != "scheme" else _display_axis(a, row[a])
                     for a in axes if row[a] != "-")


def _reached(per_seed: pd.DataFrame, keys: list[str], config: pd.Series) -> pd.DataFrame:
    """``config``'s per-seed rows that reached the target."""
    return per_seed[(per_seed[keys] == config[keys]).all(axis=1) & (per_seed["reached"] > 0)]


def matched_speedup(per_seed: pd.DataFrame, keys: list[str], dense: pd.Series,
                    compressed: pd.Series) -> tuple[float, float, float, list]:
    """``(speed-up, low, high, seeds)``: the geometric mean over the seeds both configurations
    reached the target with (``seeds``, sorted) of dense's time / compressed's time, and its 95 %
    t interval (NaN with fewer than two such seeds; all NaN with none)."""
    from scipy import stats

    def times(config: pd.Series) -> pd.Series:
        rows = _reached(per_seed, keys, config)
        return pd.Series(rows["time_to_target_s"].to_numpy(dtype=float), index=rows["seed"].to_numpy())

    a, b = times(dense), times(compressed)
    shared = sorted(set(a.index) & set(b.index))
    if not shared:
        return math.nan, math.nan, math.nan, []
    logs = np.log(a.loc[shared].to_numpy() / b.loc[shared].to_numpy())
    centre = float(np.exp(logs.mean()))
    if len(logs) < 2 or np.allclose(logs, logs[0]):
        spread = 0.0 if len(logs) >= 2 else math.nan
        return centre, centre if spread == 0.0 else math.nan, centre if spread == 0.0 else math.nan, shared
    half = stats.t.ppf(1 - ALPHA / 2, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
    return centre, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half)), shared


# A verdict that a first-evaluation bound leaves open (``_verdict``).
FIRST_EVALUATION = "not judged: target at the first evaluation"


def _at_first_evaluation(per_seed: pd.DataFrame, keys: list[str], config: pd.Series, seeds) -> bool:
    """Whether ``config`` reached the target at its first evaluation on any of ``seeds``: its
    steps to target there are only an upper bound (it may have crossed the target any time
    before)."""
    if "at_first_evaluation" not in per_seed:
        return False
    rows = _reached(per_seed, keys, config)
    return bool((rows.loc[rows["seed"].isin(list(seeds)), "at_first_evaluation"] > 0).any())


def _verdict(speedup: float, low: float, high: float, dense_bound: bool = False,
             compressed_bound: bool = False) -> str:
    """pays / costs / not told apart from the interval. A side that reached the target at its first
    evaluation has only an upper bound on its time: the compressed side's bound leaves "pays"
    standing (the speed-up is at least this), the dense side's "costs"; any other outcome, or
    both bounded, is not judged."""
    if math.isnan(speedup):
        return "no pair"
    if math.isnan(low):
        return "one seed: not judged"
    verdict = "pays" if low > 1 else "costs" if high < 1 else "not told apart"
    if (dense_bound and compressed_bound) or (dense_bound and verdict != "costs") \
            or (compressed_bound and verdict != "pays"):
        return FIRST_EVALUATION
    return verdict


def break_even_table(tta: Table, baselines: tuple[str, ...] = DENSE_BASELINES) -> Table:
    """One row per (bandwidth, workers) of a time-to-accuracy table: the fastest configuration,
    the best dense baseline and the best compressed configuration with their mean times to the
    target, and the speed-up of the second over the first on matched seeds, with its interval."""
    title = tta.title.replace("Time to", "Break-even map: time to", 1)
    notes = ["Speed-up = best dense baseline's time / best compressed configuration's time (> 1: "
             "compression pays), on matched seeds: the geometric mean of the per-seed ratios over the "
             "seeds both reached the target with, and its 95% t interval on their logarithms; pays / costs: "
             "the interval above / below 1. Dense baselines: " + ", ".join(_display_axis("scheme", s) for s in baselines)
             + ". A configuration competes only where every seed reached the target; the best of each "
             "kind is the one with the lowest mean time over its seeds. A side that reached the target at "
             "its first evaluation on a matched seed has only an upper bound on its time: then only \"pays\" "
             "(the compressed side bounded) or \"costs\" (the dense side bounded) stands, anything else is "
             f"\"{FIRST_EVALUATION}\".",
             *tta.notes]
    per_seed, keys = tta.frames.get("per_seed"), tta.frames.get("keys")
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
        speedup = low = high = math.nan
        shared, bounds = [], (False, False)
        if per_seed is not None and not dense.empty and not compressed.empty:
            sides = (dense.loc[dense["time_to_target_s_mean"].idxmin()],
                     compressed.loc[compressed["time_to_target_s_mean"].idxmin()])
            speedup, low, high, shared = matched_speedup(per_seed, keys, *sides)
            bounds = tuple(_at_first_evaluation(per_seed, keys, side, shared) for side in sides)
        elif per_seed is None:  # a table built without its per-seed rows: the ratio of means
            speedup = best["dense"][1] / best["compressed"][1]
        seeds = len(shared)
        verdict = _verdict(speedup, low, high, *bounds)
        rows.append({"bandwidth_gbit": float(gbit), "workers": int(workers),
                     "fastest": best["fastest"][0], "fastest_s": best["fastest"][1],
                     "best_dense": best["dense"][0], "best_dense_s": best["dense"][1],
                     "best_compressed": best["compressed"][0], "best_compressed_s": best["compressed"][1],
                     "speedup": speedup, "speedup_low": low, "speedup_high": high, "matched_seeds": seeds,
                     "compression": verdict,
                     "configurations": len(cell), "competing": len(cell_ok)})
        shown = "—" if math.isnan(speedup) else f"{speedup:.2f}x" + (
            f" [{low:.2f}, {high:.2f}]" if not math.isnan(low) else "") + f" (n={seeds})"
        display.append({
            "bandwidth (Gbit/s)": f"{gbit:g}", LABELS.get("workers", "workers"): int(workers),
            "fastest": best["fastest"][0] or "none reached",
            "best dense baseline (s)": _with_time(*best["dense"]),
            "best compressed (s)": _with_time(*best["compressed"]),
            "speed-up (matched seeds)": shown,
            "compression": verdict,
        })
    return Table("break_even", title, pd.DataFrame(display), pd.DataFrame(rows), tta.missing, notes)


def targets_table(evens: dict[float, Table]) -> Table:
    """Break-even maps at several targets side by side: per (bandwidth, workers), the fastest
    configuration and what compression does at each target, and the ranking where it holds at
    every target (else the target that decides it)."""
    targets = sorted(evens)
    names = [f"{100 * t:g}%" for t in targets]
    first = evens[targets[0]]
    title = re.sub(r"\d+(\.\d+)?%", "/".join(names), first.title, count=1) + \
        ": a ranking only where it holds at every target"
    notes = [f"Each target's own map: {', '.join(f'break_even_{round(100 * t)}.md' for t in targets)}. A ranking is called where the fastest "
             "configuration and what compression does (pays / costs / not told apart, on matched seeds) are "
             "the same at every target; otherwise the targets are listed.", *first.notes]
    data = pd.concat([evens[t].data.assign(target=t) for t in targets], ignore_index=True) \
        if any(not evens[t].data.empty for t in targets) else pd.DataFrame()
    if data.empty:
        return Table("break_even", title, pd.DataFrame(), pd.DataFrame(), first.missing, notes)
    rows, display = [], []
    for (gbit, workers), cell in data.groupby(["bandwidth_gbit", "workers"], sort=True):
        cell = cell.set_index("target").reindex(targets)
        fastest, does = list(cell["fastest"]), list(cell["compression"])
        # a fastest configuration that only a first evaluation ranks is no ranking
        holds = len(set(map(str, fastest))) == 1 and len(set(does)) == 1 and does[0] != FIRST_EVALUATION
        entry = {"bandwidth (Gbit/s)": f"{gbit:g}", LABELS.get("workers", "workers"): int(workers)}
        for t, name in zip(targets, names, strict=True):
            row = cell.loc[t]
            sp = row["speedup"]
            entry[f"{name}: fastest; best compressed"] = (
                f"{_short(row['fastest'])}; " + ("—" if pd.isna(sp) else
                f"{_short(row['best_compressed'])} {sp:.2f}x, {row['compression']}"))
        entry["ranking"] = (f"holds: {_short(fastest[0])} fastest, compression {does[0]}" if holds
                            else FIRST_EVALUATION if set(does) == {FIRST_EVALUATION}
                            else "decided by the target")
        rows.append({"bandwidth_gbit": float(gbit), "workers": int(workers), "holds": holds,
                     **{f"fastest_{round(100 * t)}": f for t, f in zip(targets, fastest, strict=True)},
                     **{f"compression_{round(100 * t)}": d for t, d in zip(targets, does, strict=True)}})
        display.append(entry)
    return Table("break_even", title, pd.DataFrame(display), pd.DataFrame(rows), first.missing, notes)


def _short(name) -> str:
    """A configuration's name as the summary shows it: its scheme, its ratio where it sends part
    of the entries, and a synchronising scheme's period and compressed delta (``local SGD, H=66``;
    the full names are in each target's own map)."""
    if not isinstance(name, str) or not name:
        return "none reached"
    parts = re.split(r", (?![^()]*\))", name)  # commas inside a scheme's parentheses stay
    kept = [parts[0]]
    for part in parts[1:]:
        period = period_name(part) if part.startswith("sync=") else None
        if part.startswith("ratio=") and part != "ratio=1.0":
            kept.append(part)
        elif period:
            kept.append(period)
        elif part.startswith("delta=") and part not in ("delta=dense", "delta=-"):
            kept.append(f"{part.removeprefix('delta=')} delta")
    return ", ".join(kept)


def _with_time(name: str | None, seconds: float) -> str:
    return "none reached" if name is None else f"{name}: {seconds:.3g}"


def plot_break_even(table: Table) -> object:
    """Workers (rows) x bandwidth (columns); each cell coloured by log2 of the speed-up of the
    best compressed configuration over the best dense baseline (blue: compression pays, red: it
    costs) and labelled with that configuration's short name (``_short``) and the speed-up, "not
    judged" where a first evaluation leaves it open."""
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
                f"{_short(row['best_compressed']).replace(', ', chr(10))}\n{row['speedup']:.2f}x"
                + ("\nnot judged" if row["compression"] == FIRST_EVALUATION else ""))
            ax.text(x, y, text, ha="center", va="center", fontsize=7)
        ax.grid(False)
        ax.set_xticks(range(len(bandwidths)), [f"{b:g}" for b in bandwidths])
        ax.set_yticks(range(len(workers)), [str(w) for w in workers])
        ax.set_xlabel("bandwidth per link (Gbit/s)")
        ax.set_ylabel("workers")
        fig.colorbar(image, ax=ax, label="log2 speed-up over the best dense baseline")
        fig.suptitle(table.title, fontsize=9)
        return fig


__all__ = ["DENSE_BASELINES", "break_even_table", "matched_speedup", "plot_break_even", "targets_table"]
