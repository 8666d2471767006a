"""The tuning study's reading: every trial (one run per search point), the choice per scheme and
scope, the committed files the tuned protocol reads, a table and a figure.

A trial is a run of experiment=tune / tune_dense (or tune_tpe): a scheme and scope at one peak
learning rate (``optim.lr``, per worker) and warm-up length (``optim.warmup_epochs``). The choice
for a scheme and scope is its trained trial with the highest final **validation** accuracy (the
test accuracy is shown, never read); ties go to the smaller learning rate, then the shorter
warm-up. A choice at the edge of the learning rates tried says so: the grid may be too narrow.

``write_tuned`` writes ``conf/tuned/<scheme>_<scope>.yaml`` (dense SGD, whose scope does nothing:
both scopes), which experiment=protocol reads through ``${st_tuned:...}``.

The second pass's tuning (a format 2 declaration with ``tuning:``: conf/declared/verdicts2.yaml,
local2.yaml) is read over its seeds by the second half of this module (``read_tuning``: a trial's
score is its seeds' mean validation accuracy, the edge rule applied round by round) and by its
command, ``python -m sparsetrain.analysis.tuning --declared <yaml>`` (docs/protocol.md, section 5),
which also writes ``conf/tuned2/<sweep>/<point>.yaml`` and gives scripts/verdict2_runs.sh each
point's overrides. The first pass's reading above is unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from sparsetrain.results import DID_NOT_TRAIN

from .group import REPEAT, as_key, as_keys, varying_axes
from .loader import AXES, DENSE, NOT_APPLICABLE, load_runs, select
from .table import _shown_path

TUNED = ("lr", "warmup_epochs")  # what a trial varies and a choice fixes
SCOPES = ("layerwise", "global")
# A trial that has run to its end (trained or not); "absent", "running", "unfinished" and "stopped"
# (a stop signal: it resumes) have not.
FINISHED = ("completed", DID_NOT_TRAIN, "failed")
TRIAL_COLUMNS = ["scheme", "scope", "lr", "warmup_epochs", "status", "stability", "val_accuracy",
                 "test_accuracy", "seed", "epochs_planned", "code", "run_dir"]


def sweeps(results: str | Path) -> list[Path]:
    """The tuning study's sweep folders under a results tree: ``tune``, ``tune_dense`` and the
    edge rule's doublings of either (``tune_edge``, ``tune_dense_edge2``, ...), as `make figures`
    reads them (``TUNE_SWEEPS``)."""
    results = Path(results)
    found = [results / "tune", results / "tune_dense", *sorted(results.glob("tune_edge*")),
             *sorted(results.glob("tune_dense_edge*"))]
    return [path for path in found if path.is_dir()]


def trials(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per trial (``load_runs`` rows), sorted by scheme, scope and point."""
    if runs.empty:
        return pd.DataFrame(columns=TRIAL_COLUMNS)
    _one_run_per_trial(runs)
    frame = runs[[c for c in TRIAL_COLUMNS if c in runs]].copy()
    if "experiment" in runs:  # a trial not run yet ("absent") names only the keys its sweep varies
        for column in ("scheme", "scope"):
            known = runs.groupby("experiment")[column].agg(lambda v: v.dropna().iloc[0] if v.notna().any() else None)
            frame[column] = frame[column].fillna(runs["experiment"].map(known))
    return frame.sort_values(["scheme", "scope", "lr", "warmup_epochs"], key=_order).reset_index(drop=True)


def _one_run_per_trial(runs: pd.DataFrame) -> None:
    """The first pass's trials are one run each, one configuration per scheme and scope but for
    the rate and warm-up: a second seed, or a run at another budget, competed as a grid point of
    its own (and could win). ValueError in one line naming the runs."""
    ran = runs[runs["status"] != "absent"] if "status" in runs else runs
    for (scheme, scope), group in ran.groupby(["scheme", "scope"], sort=True, dropna=False):
        split = varying_axes(group, exclude=(*TUNED, REPEAT))
        if split:
            raise ValueError(f"the trials of {scheme} ({scope}) differ in {', '.join(split)} ({split[0]}: "
                             f"{', '.join(map(str, group[split[0]].astype(str).unique()))}); allowed: one "
                             "configuration but for the learning rate and warm-up (move the other runs out)")
        twice = group[as_keys(group, list(TUNED)).duplicated(keep=False)]
        if len(twice):
            raise ValueError(f"{len(twice)} runs of {scheme} ({scope}) share one trial (lr={twice['lr'].iloc[0]}, "
                             f"warmup_epochs={twice['warmup_epochs'].iloc[0]}): "
                             f"{', '.join(_shown_path(d) for d in twice.get('run_dir', []))}; allowed: one run "
                             "per trial (the first pass tunes on one seed)")


def _order(column: pd.Series) -> pd.Series:
    return column.map(lambda v: (0, v) if isinstance(v, (int, float)) else (1, str(v)))


def _trained(frame: pd.DataFrame) -> pd.Series:
    return (frame["status"] == "completed") & frame["val_accuracy"].notna()


def choose(trial_rows: pd.DataFrame) -> pd.DataFrame:
    """The chosen trial per scheme and scope: ``lr``, ``warmup_epochs``, its ``val_accuracy``
    (and ``test_accuracy``, reported only), how many trials ran and trained, and ``at_edge``
    (the lowest or highest learning rate tried). A scheme none of whose trials trained with a
    validation accuracy (runs without ``data.val_size`` cannot be chosen from) gets no row;
    ``unchosen`` names them. ``ValueError`` when no scheme can be chosen."""
    out = []
    for (scheme, scope), group in trial_rows.groupby(["scheme", "scope"], sort=True):
        trained = group[_trained(group)]
        if trained.empty:
            continue
        best = trained.sort_values(["val_accuracy", "lr", "warmup_epochs"],
                                   ascending=[False, True, True]).iloc[0]
        rates = sorted(group["lr"].dropna().unique())
        ran = group["status"].isin(FINISHED)
        out.append({
            "scheme": scheme, "scope": scope, "lr": float(best["lr"]),
            "warmup_epochs": float(best["warmup_epochs"]),
            "val_accuracy": float(best["val_accuracy"]), "test_accuracy": float(best["test_accuracy"]),
            "trials": len(group), "ran": int(ran.sum()), "trained": len(trained),
            "complete": bool(ran.all()),
            "did_not_train": int((group["status"] == DID_NOT_TRAIN).sum()),
            "at_edge": len(rates) > 1 and best["lr"] in (rates[0], rates[-1]),
            "code": ";".join(sorted(set(map(str, group["code"])))),
            "seed": int(best["seed"]), "epochs": int(best["epochs_planned"]),
        })
    if not out:
        raise ValueError(f"none of the {len(trial_rows)} trials trained with a validation accuracy "
                         "(data.val_size): nothing to choose from")
    return pd.DataFrame(out)


def unchosen(trial_rows: pd.DataFrame, choices: pd.DataFrame) -> list[str]:
    """``scheme (scope)`` of every scheme with trials but no choice: none of them trained, or
    none has run yet."""
    done = set(zip(choices["scheme"], choices["scope"]))
    return [f"{scheme} ({scope})" for scheme, scope in
            dict.fromkeys(zip(trial_rows["scheme"], trial_rows["scope"])) if (scheme, scope) not in done]


def config_names(scheme: str, scope: str) -> list[str]:
    """The ``conf/tuned`` file stems a choice serves: dense SGD's scope does nothing, so both."""
    if scheme == DENSE or scope == NOT_APPLICABLE:
        return [f"none_{s}" for s in SCOPES]
    return [f"{scheme}_{scope}"]


def exact(value: float) -> str:
    """A rate as a run will read it back, every digit kept (``:g`` keeps six: a halving's seventh
    digit would train at a rounded rate); whole numbers without ``.0``.

    >>> exact(0.05), exact(4.0), exact(0.0123456789), exact(1e-05)
    ('0.05', '4', '0.0123456789', '1e-05')
    """
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def write_tuned(choices: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """One ``<scheme>_<scope>.yaml`` per choice: the values experiment=protocol reads, and where
    they come from (as comments and keys that nothing but a reader uses)."""
    partial = [f"{c['scheme']} ({c['scope']}): {c['ran']} of {c['trials']}" for c in choices.to_dict("records")
               if not c["complete"]]
    if partial:  # a choice from part of the grid is not the study's choice
        raise ValueError(f"the tuning study is not complete ({'; '.join(partial)} trials ran): "
                         "no tuned file written; resume it (RESUME=1) first")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for c in choices.to_dict("records"):
        for stem in config_names(c["scheme"], c["scope"]):
            edge = ("\n# At the edge of the learning rates tried: a wider grid may choose otherwise."
                    if c["at_edge"] else "")
            text = (
                f"# Tuned by the tuning study (python -m sparsetrain.analysis --tuning ... --write-tuned):\n"
                f"# the trained trial of {c['trials']} with the highest final validation accuracy, seed "
                f"{c['seed']}, {c['epochs']} epochs.{edge}\n"
                f"# experiment=protocol reads lr and warmup_epochs; a command-line value wins.\n"
                f"lr: {exact(c['lr'])}\n"
                f"warmup_epochs: {exact(c['warmup_epochs'])}\n"
                f"val_accuracy: {c['val_accuracy']:.4f}\n"
                f"trials: {c['trials']}\n"
                f"trained: {c['trained']}\n"
                f"code: {c['code']}\n"
            )
            path = out_dir / f"{stem}.yaml"
            path.write_text(text)
            written.append(path)
    return written


def markdown(trial_rows: pd.DataFrame, choices: pd.DataFrame) -> str:
    """The trials' table (the chosen one marked) and the choices, as Markdown."""
    chosen = {(c["scheme"], c["scope"], c["lr"], c["warmup_epochs"]) for c in choices.to_dict("records")}
    lines = [
        "# Tuning: every trial, picked by validation accuracy",
        "",
        "Each trial is one run; the choice per scheme and scope is its trained trial with the highest",
        "final validation accuracy (ties: the smaller learning rate, then the shorter warm-up). The",
        "test accuracy is shown for the record and never read. `lr` is per worker (x 2 ranks).",
        "",
        "## Choices",
        "",
        "| scheme | scope | lr | warm-up (epochs) | val acc % | test acc % | trials: ran / of the grid (trained) | at the grid's edge |",
        "|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for c in choices.to_dict("records"):
        ran = f"{c['ran']} / {c['trials']} ({c['trained']})" + ("" if c["complete"] else ": **partial, not a choice yet**")
        lines.append(f"| {c['scheme']} | {c['scope']} | {c['lr']:g} | {c['warmup_epochs']:g} | "
                     f"{100 * c['val_accuracy']:.2f} | {100 * c['test_accuracy']:.2f} | "
                     f"{ran} | {'yes' if c['at_edge'] else 'no'} |")
    for name in unchosen(trial_rows, choices):
        scheme, _, scope = name.partition(" (")
        rows = trial_rows[(trial_rows["scheme"] == scheme) & (trial_rows["scope"] == scope.rstrip(")"))]
        ran = int(rows["status"].isin(FINISHED).sum())
        why = (f"{ran} / {len(rows)} ran, none trained" if ran else f"0 / {len(rows)}: no trial has run yet")
        lines.append(f"| {name} | | | | | | {why}: no choice, no tuned file | |")
    lines += ["", "## Trials", "",
              "| scheme | scope | lr | warm-up | status | stability | val acc % | test acc % | chosen |",
              "|---|---|--:|--:|---|---|--:|--:|---|"]
    for t in trial_rows.to_dict("records"):
        mark = "**chosen**" if (t["scheme"], t["scope"], t["lr"], t["warmup_epochs"]) in chosen else ""
        lines.append(f"| {t['scheme']} | {t['scope']} | {t['lr']:g} | {t['warmup_epochs']:g} | {t['status']} | "
                     f"{t['stability'] if isinstance(t.get('stability'), str) else '-'} | {_pct(t['val_accuracy'])} | {_pct(t['test_accuracy'])} | {mark} |")
    codes = sorted(set(map(str, trial_rows["code"])))
    lines += ["", f"Code: {', '.join(codes)}" + (" (more than one version)" if len(codes) > 1 else ""), ""]
    return "\n".join(lines)


def _pct(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def plot(trial_rows: pd.DataFrame, choices: pd.DataFrame, path: str | Path) -> None:
    """Validation accuracy against the learning rate, one panel per scheme, one line per scope
    and warm-up; the chosen points ringed; runs that did not train at the bottom, as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(trial_rows["scheme"]))
    fig, axes = plt.subplots(1, len(schemes), figsize=(max(5.0, 3.2 * len(schemes)), 3.6), squeeze=False,
                             sharey=True)
    floor = 0.0
    trained = trial_rows[_trained(trial_rows)]
    if not trained.empty:
        floor = max(0.0, trained["val_accuracy"].min() - 0.05)
    for ax, scheme in zip(axes[0], schemes):
        rows = trial_rows[trial_rows["scheme"] == scheme]
        for (scope, warmup), line in rows.groupby(["scope", "warmup_epochs"], sort=True):
            ok = line[_trained(line)].sort_values("lr")
            label = f"{scope if scope != NOT_APPLICABLE else 'dense'}, warm-up {warmup:g} ep"
            style = "-" if scope in ("layerwise", NOT_APPLICABLE) else "--"
            ax.plot(ok["lr"], 100 * ok["val_accuracy"], style, marker="o", label=label)
            bad = line[~_trained(line) & line["status"].isin(FINISHED)]  # ran, did not train
            if not bad.empty:
                ax.plot(bad["lr"], [100 * floor] * len(bad), "x", color="black")
        for c in choices[choices["scheme"] == scheme].to_dict("records"):
            ax.plot([c["lr"]], [100 * c["val_accuracy"]], "o", ms=12, mfc="none", mec="red")
        ax.set_xscale("log", base=2)
        rates = sorted(rows["lr"].dropna().unique())  # the grid's own values as ticks
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_title(scheme)
        ax.set_xlabel("peak lr per worker")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final validation accuracy %")
    fig.suptitle("Tuning: final validation accuracy vs learning rate\n(red ring: chosen; x: ran, did not train)",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def write(runs: pd.DataFrame, out: str | Path, tuned_dir: str | Path | None = None) -> list[Path]:
    """``trials.md``, ``trials.csv``, ``val_vs_lr.png/.pdf`` into ``out`` and, with ``tuned_dir``,
    the tuned files; returns what was written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = trials(runs)
    choices = choose(rows)
    (out / "trials.md").write_text(markdown(rows, choices))
    rows.to_csv(out / "trials.csv", index=False)
    plot(rows, choices, out / "val_vs_lr.png")
    written = [out / "trials.md", out / "trials.csv", out / "val_vs_lr.png", out / "val_vs_lr.pdf"]
    if tuned_dir is not None:
        written += write_tuned(choices, tuned_dir)
    return written


# --- The second pass's reading: a declared tuning, several seeds a trial -----------------------
# A format 2 declaration (conf/declared/verdicts2.yaml, local2.yaml) with a ``tuning:`` section
# fixes the grid per point (learning rates, one warm-up), the seeds of every trial and the budget
# (its ``budgets``' first). Its runs: one sweep per point, ``results/<sweep>_tune_<point>``
# (scripts/verdict2.sh, local2.sh), and one more per round of the edge rule,
# ``..._<point>_edge<k>``. A trial is a point at one learning rate: its runs over the declared
# seeds, grouped by every axis and config key that differs between the runs except the seed. Its
# score is the mean final validation accuracy over those seeds; a trial with a declared seed that
# has not ended is incomplete and never chosen; one with a seed that did not train loses. Ties go
# to the smaller rate. Edge rule: while any point's choice is the highest (lowest) rate tried,
# every point gets one more doubling (halving), and every choice is read again.

INCOMPLETE, LOST, SCORED = "incomplete", "lost", "scored"
COMPLETE, RUNNING, NO_CHOICE = "complete", "running", "no choice"
EDGE_SWEEP = re.compile(r"_edge(\d+)$")
# Overrides a tuning job records that the next round's sweep gets from elsewhere (reproduce.sh
# gives the experiment and wandb.mode, the sweep its rates and seeds).
NOT_CARRIED = ("seed", "experiment", "wandb.mode", "optim.lr")
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DeclaredTuning:
    """The ``tuning:`` section of a declaration, with what reading it needs."""

    path: Path
    sweep: str  # the study's sweep (verdict2): its tuning sweeps are <sweep>_tune_<point>
    budget: int  # epochs
    seeds: tuple[int, ...]
    grid: dict  # point: (learning rates, warm-up epochs)

    @property
    def preset(self) -> str:
        """The tuning's experiment preset (conf/experiment/<sweep>_tune.yaml)."""
        from .declared import tuning_preset

        return tuning_preset(self.sweep)

    def folder(self, point: str, round_: int = 0) -> str:
        """The sweep folder (under results/) of ``point``'s trials added in ``round_`` of the edge rule."""
        return f"{self.preset}_{point}" + (f"_edge{round_}" if round_ else "")


def declared_tuning(path: str | Path) -> DeclaredTuning:
    """The tuning a declaration fixes; ``ValueError`` (one line) where it has none or a bad one."""
    from .declared import load

    decl = load(path)
    doc = yaml.safe_load(Path(path).read_text())
    tuning = doc.get("tuning")
    if decl.version < 2 or not isinstance(tuning, dict) or not {"seeds", "grid"} <= set(tuning):
        raise ValueError(f"{path}: tuning {tuning!r}; allowed: a format 2 declaration with "
                         "tuning: {seeds: [...], grid: {point: [[rates], warm-up]}}")
    grid = {}
    for point, entry in tuning["grid"].items():
        if point not in decl.points:
            raise ValueError(f"{path}: tuning grid point {point!r} is not declared; points: {', '.join(decl.points)}")
        rates, warmup = entry
        grid[point] = (tuple(sorted(float(r) for r in rates)), float(warmup))
    return DeclaredTuning(Path(path), decl.sweeps[0], decl.budgets[0], tuple(int(s) for s in tuning["seeds"]), grid)


def tuning_runs(plan: DeclaredTuning, results: str | Path) -> pd.DataFrame:
    """Every run of the declared tuning under ``results`` (its points' sweeps and their edge rounds),
    with a ``point`` column; promised jobs not run yet are left out (the grid says what is due)."""
    folders = {}
    for point in plan.grid:
        for path in Path(results).glob(f"{plan.folder(point)}*"):
            if path.is_dir() and re.fullmatch(re.escape(plan.folder(point)) + r"(_edge\d+)?", path.name):
                folders[path.name] = point
    if not folders:
        return pd.DataFrame(columns=["point", "lr", "warmup_epochs", "epochs_planned", "seed", "status"])
    runs = load_runs(*(Path(results) / name for name in sorted(folders)))
    runs = runs[runs["status"] != "absent"].copy()
    runs["point"] = [folders[Path(d).parent.name] for d in runs["run_dir"]]
    _check_points(plan, runs)
    return runs.reset_index(drop=True)


def _check_points(plan: DeclaredTuning, runs: pd.DataFrame) -> None:
    """Every run a point's folder holds is that point at the declared setting: the folder's name
    alone decided, so another point's runs placed there were ranked as its trials. ValueError in
    one line naming the run and the setting it differs in."""
    from .declared import _every_axis, load

    decl = load(plan.path)
    runs = _every_axis(runs)
    for point, rows in runs.groupby("point", sort=False):
        want = {**decl.setting, **decl.points[point]}
        for axis, value in want.items():
            wrong = rows.index.difference(select(rows, {axis: [value]}).index)
            if len(wrong):
                run = rows.loc[wrong[0]]
                raise ValueError(f"{_shown_path(run['run_dir'])}: {axis}={run[axis]} in the folder of tuning point "
                                 f"{point!r}; allowed: {axis}={value} ({plan.path}'s point and setting)")


def _trial_keys(runs: pd.DataFrame) -> list[str]:
    """The columns that tell trials apart: every axis and config key that differs, but the seed."""
    return ["point", *(c for c in AXES if c in runs), *sorted(c for c in runs.columns if "." in str(c))]


def _same_rate(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-9)


def seed_trials(runs: pd.DataFrame, seeds: tuple[int, ...]) -> pd.DataFrame:
    """One row per trial: ``point``, ``lr``, ``warmup_epochs``, ``epochs_planned``, ``n`` (declared
    seeds ended), ``val_by_seed`` ({seed: val accuracy or the status}), ``state`` (``scored``:
    every declared seed trained; ``lost``: every seed ended, one did not train; ``incomplete``),
    ``score`` (the mean validation accuracy, scored trials only), ``code``. ``ValueError`` where a
    seed ran twice in one trial."""
    rows = []
    if runs.empty:
        return pd.DataFrame(columns=["point", "lr", "warmup_epochs", "epochs_planned", "n", "val_by_seed",
                                     "state", "score", "code", "overrides"])
    keys = _trial_keys(runs)
    labels = as_keys(runs, keys).agg("|".join, axis=1)
    for _, trial in runs.groupby(labels, sort=False):
        first = trial.iloc[0]
        twice = trial["seed"][trial["seed"].duplicated()].tolist()
        if twice:
            raise ValueError(f"{first['point']} lr {first['lr']:g}: seed {twice[0]} ran twice in one trial "
                             f"({', '.join(map(str, trial['run_dir'] if 'run_dir' in trial else []))}); keep one")
        by_seed = {int(s): r for s, r in zip(trial["seed"], trial.to_dict("records"))}
        ended = [s for s in seeds if s in by_seed and by_seed[s]["status"] in FINISHED]
        trained = [s for s in ended if _trained(pd.DataFrame([by_seed[s]])).iloc[0]]
        state = INCOMPLETE if len(ended) < len(seeds) else SCORED if len(trained) == len(seeds) else LOST
        rows.append({
            "point": first["point"], "lr": float(first["lr"]), "warmup_epochs": float(first["warmup_epochs"]),
            "epochs_planned": int(first["epochs_planned"]), "n": len(ended),
            "val_by_seed": {s: (float(by_seed[s]["val_accuracy"]) if s in trained else
                                by_seed[s]["status"] if s in by_seed else "absent") for s in seeds},
            "state": state,
            # the mean, rounded so that equal means tie whatever the order of the sum
            "score": round(sum(by_seed[s]["val_accuracy"] for s in seeds) / len(seeds), 12)
            if state == SCORED else math.nan,
            "code": ";".join(sorted({str(c) for c in trial.get("code", pd.Series(dtype=str)).dropna()})),
            "overrides": str(first.get("overrides", "") or ""),
            "other_seeds": sorted(int(s) for s in by_seed if s not in seeds),
        })
    return pd.DataFrame(rows)


def choose_seeded(trial_rows: pd.DataFrame) -> pd.Series | None:
    """One point's choice among its trials: the scored trial with the highest mean validation
    accuracy, ties to the smaller rate (then the shorter warm-up); None while any trial is
    incomplete (a choice from part of the grid is not the grid's) or when none scored."""
    if trial_rows.empty or (trial_rows["state"] == INCOMPLETE).any():
        return None
    scored = trial_rows[trial_rows["state"] == SCORED]
    if scored.empty:
        return None
    return scored.sort_values(["score", "lr", "warmup_epochs"], ascending=[False, True, True]).iloc[0]


@dataclass
class TuningReading:
    """What the declared tuning's runs say: every trial due (``trials``, ``due`` marks those the
    grid and the edge rule asked for), each point's choice, and the state: ``complete``;
    ``running`` (trials due have not ended: ``asks`` names their sweeps: {round: {point: rates}});
    ``no choice`` (a point none of whose trials trained)."""

    plan: DeclaredTuning
    trials: pd.DataFrame
    choices: dict
    state: str
    asks: dict
    rounds: list  # each round of the edge rule: (points at the top, points at the bottom)
    codes: list


def read_tuning(plan: DeclaredTuning, runs: pd.DataFrame) -> TuningReading:
    """The declared tuning read from its runs, the edge rule applied round by round."""
    found = seed_trials(runs, plan.seeds)
    rates = {p: list(r) for p, (r, _) in plan.grid.items()}
    added = {p: {r: 0 for r in rs} for p, rs in rates.items()}  # rate: the round that added it
    rounds: list = []
    while True:
        due, choices = [], {}
        for point, (_, warmup) in plan.grid.items():
            for lr in sorted(rates[point]):
                match = found[(found["point"] == point) & found["lr"].map(lambda v, lr=lr: _same_rate(v, lr))
                              & (found["warmup_epochs"] == warmup) & (found["epochs_planned"] == plan.budget)] \
                    if not found.empty else found
                if len(match) > 1:
                    raise ValueError(f"{point} lr {lr:g}: {len(match)} trials differ beyond the seed (in "
                                     f"{', '.join(_differing(runs, point, lr))}); a trial is one configuration")
                row = match.iloc[0].to_dict() if len(match) else {
                    "point": point, "lr": lr, "warmup_epochs": warmup, "epochs_planned": plan.budget, "n": 0,
                    "val_by_seed": {s: "absent" for s in plan.seeds}, "state": INCOMPLETE, "score": math.nan,
                    "code": "", "overrides": "", "other_seeds": []}
                due.append({**row, "round": added[point][lr]})
        due = pd.DataFrame(due)
        for point in plan.grid:
            choices[point] = choose_seeded(due[due["point"] == point])
        waiting = due[due["state"] == INCOMPLETE]
        if not waiting.empty:
            asks: dict = {}
            for t in waiting.to_dict("records"):
                asks.setdefault(t["round"], {}).setdefault(t["point"], []).append(t["lr"])
            state = RUNNING
            break
        if any(c is None for c in choices.values()):
            state, asks = NO_CHOICE, {}
            break
        top = [p for p, c in choices.items() if _same_rate(c["lr"], max(rates[p]))]
        bottom = [p for p, c in choices.items() if _same_rate(c["lr"], min(rates[p]))]
        if not top and not bottom:
            state, asks = COMPLETE, {}
            break
        rounds.append((top, bottom))
        for point in plan.grid:  # every point, not only those at the edge: one search for all
            new = ([max(rates[point]) * 2] if top else []) + ([min(rates[point]) / 2] if bottom else [])
            for lr in new:
                rates[point].append(lr)
                added[point][lr] = len(rounds)
    keyed = due.set_index(["point", "lr"]).index
    extra = found[~found.set_index(["point", "lr"]).index.isin(keyed)] if not found.empty else found
    trials_ = pd.concat([due.assign(due=True), extra.assign(due=False, round=-1)], ignore_index=True) \
        if not extra.empty else due.assign(due=True)
    codes = sorted({c for cell in due["code"] for c in str(cell).split(";") if c})
    return TuningReading(plan, trials_, choices, state, asks, rounds, codes)


def _differing(runs: pd.DataFrame, point: str, lr: float) -> list[str]:
    rows = runs[(runs["point"] == point) & runs["lr"].map(lambda v: _same_rate(v, lr))]
    return [k for k in _trial_keys(rows) if as_key(rows[k]).nunique() > 1] or ["?"]


def _carried(overrides: str) -> str:
    """A tuning job's own overrides that the next round's sweep repeats (its point, warm-up, budget)."""
    kept = [o for o in overrides.split() if o.partition("=")[0].lstrip("+~") not in NOT_CARRIED]
    return " ".join(kept)


def commands(reading: TuningReading) -> list[str]:
    """The command lines that run what the reading still needs (each resumes: RESUME=1)."""
    plan, lines = reading.plan, []
    script = f"scripts/{plan.sweep}.sh"
    for round_, points in sorted(reading.asks.items()):
        if round_ == 0:
            lines.append(f"RESUME=1 bash {script}   # the declared grid (PY and DEST as in its header)")
            continue
        for point, rates in points.items():
            known = reading.trials[(reading.trials["point"] == point) & (reading.trials["overrides"] != "")]
            carried = _carried(known["overrides"].iloc[0]) if not known.empty else "<as the point's other sweeps>"
            lines.append(f"PYTHONPATH=$PWD RESUME=1 SUFFIX=_{point}_edge{round_} EXTRA=\"{carried} optim.lr="
                         f"{','.join(exact(r) for r in sorted(rates))}\" bash scripts/reproduce.sh {plan.preset}")
    return lines


def _score_text(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def tuning_text(reading: TuningReading) -> str:
    """The reading for a terminal and a commit message: each point's trials, its choice, the
    state, and the commands that run what is still due."""
    plan, t = reading.plan, reading.trials
    seeds = ", ".join(map(str, plan.seeds))
    lines = [f"{plan.path}: the declared tuning, {plan.budget} epochs, seeds {seeds} a trial; score: the mean "
             f"final validation accuracy over them (the test set is not read); a trial with a seed that did "
             f"not train loses; ties to the smaller rate. Runs: results/{plan.preset}_<point>[_edge<k>].", ""]
    for point, (_, warmup) in plan.grid.items():
        rows = t[(t["point"] == point)].sort_values("lr")
        choice = reading.choices.get(point)
        lines.append(f"{point} (warm-up {warmup:g} epochs)")
        lines.append("  lr        n   val acc % by seed            mean %   trial")
        for r in rows.to_dict("records"):
            per_seed = ", ".join(f"{s}: {_score_text(v) if isinstance(v, float) else v}"
                                 for s, v in r["val_by_seed"].items())
            what = {SCORED: "", LOST: "lost (a seed did not train)",
                    INCOMPLETE: "incomplete: never chosen"}[r["state"]]
            if not r["due"]:
                what = "not asked for by the grid or the edge rule: not read"
            elif r["round"] > 0:
                what = f"edge round {r['round']}" + (f"; {what}" if what else "")
            if choice is not None and r["due"] and _same_rate(r["lr"], choice["lr"]):
                what = ("CHOSEN" if reading.state == COMPLETE else "best so far") + (f"; {what}" if what else "")
            lines.append(f"  {r['lr']:<8g} {r['n']}/{len(plan.seeds)} {per_seed:<28} {_score_text(r['score']):>6}   {what}")
        if choice is None:
            lines.append("  choice: none yet" + (" (no trial trained)" if reading.state == NO_CHOICE and
                                                  not (rows['state'] == INCOMPLETE).any() else
                                                  " (a trial is incomplete)"))
        else:
            due = rows[rows["due"]]
            edge = (" (the highest rate tried)" if _same_rate(choice["lr"], due["lr"].max()) else
                    " (the lowest rate tried)" if _same_rate(choice["lr"], due["lr"].min()) else "")
            if edge and reading.state == RUNNING:  # the rule reads every point's choice together
                edge = edge[:-1] + ": the edge rule is read once every point's trials have ended)"
            lines.append(f"  {'choice' if reading.state == COMPLETE else 'best so far (not a choice yet)'}: "
                         f"lr {choice['lr']:g}, warm-up {choice['warmup_epochs']:g}, mean val acc "
                         f"{_score_text(choice['score'])}%{edge}")
        lines.append("")
    for i, (top, bottom) in enumerate(reading.rounds, 1):
        why = [f"{', '.join(top)} at the highest rate tried: every point doubled" if top else "",
               f"{', '.join(bottom)} at the lowest rate tried: every point halved" if bottom else ""]
        lines.append(f"Edge rule, round {i}: {'; '.join(w for w in why if w)}.")
    lines.append(f"Code: {', '.join(reading.codes) or 'no run yet'}"
                 + (" (more than one commit: the declaration runs every trial on one)" if len(reading.codes) > 1 else ""))
    if reading.state == COMPLETE:
        lines.append("Tuning: COMPLETE (no choice at the edge of its rates); write the choices with --write-tuned.")
    elif reading.state == NO_CHOICE:
        lines.append("Tuning: NOT COMPLETE: no trial of " + ", ".join(p for p, c in reading.choices.items() if c is None)
                     + " trained; the declaration does not say what follows.")
    else:
        due = sum(len(v) for points in reading.asks.values() for v in points.values())
        lines.append(f"Tuning: NOT COMPLETE: {due} trial(s) due have not ended. Run, from a worktree on the "
                     f"tuning's commit ({', '.join(reading.codes) or 'the declaring commit'}):")
        lines += [f"  {line}" for line in commands(reading)]
    return "\n".join(lines) + "\n"


def tuned2_dir(plan: DeclaredTuning, root: str | Path = ROOT) -> Path:
    """Where a declared tuning's choices go: ``conf/tuned2/<sweep>/`` (two studies may share a point name)."""
    return Path(root) / "conf" / "tuned2" / plan.sweep


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_tuned2(reading: TuningReading, out_dir: str | Path) -> list[Path]:
    """One ``<point>.yaml`` per declared point: its lr and warm-up (what the verdict runs read),
    its ``point_config`` (the conf/point file its tuning ran), every trial's scores, the commit
    the tuning ran on and the declaration. ``ValueError`` while the tuning is not complete."""
    plan = reading.plan
    if reading.state != COMPLETE:
        raise ValueError(f"{plan.path}: the tuning is {reading.state} (python -m sparsetrain.analysis.tuning "
                         f"--declared {plan.path} says what is due): no tuned file written")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for point, choice in reading.choices.items():
        rows = reading.trials[(reading.trials["point"] == point) & reading.trials["due"]].sort_values("lr")
        config = [o.partition("=")[2] for o in str(choice["overrides"]).split() if o.startswith("point=")]
        trials_ = [{"lr": float(r["lr"]), "val_accuracy": {int(s): v for s, v in r["val_by_seed"].items()},
                    "mean": None if math.isnan(r["score"]) else round(float(r["score"]), 6), "state": r["state"]}
                   for r in rows.to_dict("records")]
        doc = {"declaration": _relative(plan.path), "point": point, "point_config": config[0] if config else None,
               "lr": float(choice["lr"]), "warmup_epochs": float(choice["warmup_epochs"]),
               "epochs": plan.budget, "seeds": list(plan.seeds), "val_accuracy": round(float(choice["score"]), 6),
               "trials": trials_, "code": ";".join(reading.codes)}
        header = (f"# Tuned by python -m sparsetrain.analysis.tuning --declared {_relative(plan.path)} --write-tuned:\n"
                  f"# of {len(trials_)} trials ({len(plan.seeds)} seeds each, {plan.budget} epochs), the highest mean "
                  "final validation accuracy.\n# The verdict runs (scripts/verdict2_runs.sh) read point_config, lr "
                  "and warmup_epochs; the rest says where they come from.\n")
        path = out_dir / f"{point}.yaml"
        path.write_text(header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100))
        written.append(path)
    return written


# --- The verdict runs at the tuned choice ----------------------------------------------------


def tuned2_files(plan: DeclaredTuning, tuned_dir: str | Path) -> dict[str, dict]:
    """Each declared point's tuned file (``write_tuned2``); ``ValueError`` naming every point
    without one: the verdict runs do not start before the tuning's choice is committed."""
    tuned_dir = Path(tuned_dir)
    missing = [p for p in plan.grid if not (tuned_dir / f"{p}.yaml").is_file()]
    if missing:
        raise ValueError(f"{_relative(tuned_dir)}: no tuned file for {', '.join(missing)}; allowed: the verdict runs start "
                         f"once every point's choice is written (python -m sparsetrain.analysis.tuning --declared "
                         f"{_relative(plan.path)} --write-tuned) and committed")
    return {p: yaml.safe_load((tuned_dir / f"{p}.yaml").read_text()) for p in plan.grid}


def verdict_seeds(path: str | Path, results: str | Path) -> tuple[list[int], str]:
    """The seeds the verdict runs need now, and why: ``declared.due_seeds`` on the study's runs
    under ``results`` (the declared seeds, or the seed rule's first seeds and then its n), the
    same seeds that its tables read."""
    from .declared import due_seeds, load, runs_of

    decl = load(path)
    return due_seeds(decl, runs_of(decl, results) if decl.seed_rule else pd.DataFrame())


def verdict_overrides(plan: DeclaredTuning, tuned_dir: str | Path, seeds: list[int]) -> dict[str, str]:
    """Each point's overrides for ``experiment=<sweep>`` at its tuned choice and ``seeds``."""
    files = tuned2_files(plan, tuned_dir)
    out = {}
    for point, tuned in files.items():
        if tuned.get("declaration") != _relative(plan.path) or not tuned.get("point_config"):
            raise ValueError(f"{Path(tuned_dir) / point}.yaml: declaration {tuned.get('declaration')!r}, point_config "
                             f"{tuned.get('point_config')!r}; allowed: {_relative(plan.path)} and a conf/point file")
        out[point] = (f"point={tuned['point_config']} optim.lr={exact(tuned['lr'])} optim.warmup_epochs="
                      f"{exact(tuned['warmup_epochs'])} train.epochs={plan.budget} seed={','.join(map(str, seeds))}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m sparsetrain.analysis.tuning --declared conf/declared/verdicts2.yaml``: exit 0 when
    the declared tuning is complete, 3 while runs are due (printed), 2 on bad input."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m sparsetrain.analysis.tuning",
                                     description="Read a declared tuning (format 2: several seeds a trial), "
                                                 "apply its edge rule, write its choices, give the verdict runs.")
    parser.add_argument("--declared", type=Path, required=True, metavar="YAML", help="a format 2 declaration with tuning:")
    parser.add_argument("--results", type=Path, default=Path("results"), help="the results tree (default results)")
    parser.add_argument("--write-tuned", nargs="?", type=Path, const=True, metavar="DIR",
                        help="once complete: each point's choice into DIR (default conf/tuned2/<sweep>)")
    parser.add_argument("--verdict-runs", nargs="?", type=Path, const=True, metavar="DIR",
                        help="print one line per point, 'POINT OVERRIDES', for experiment=<sweep> at the tuned "
                             "choice in DIR (default conf/tuned2/<sweep>) and the seeds due now; exit 2 before "
                             "every point's choice is written")
    parser.add_argument("--commands", action="store_true",
                        help="print only the command lines that run what is due, one a line (scripts/study.sh "
                             "runs them); exit 0 when complete, 3 while due, 2 where the declaration says "
                             "nothing can follow (a point none of whose trials trained)")
    args = parser.parse_args(argv)
    if not args.declared.is_file():
        parser.error(f"no such declaration: {args.declared}")
    try:
        plan = declared_tuning(args.declared)
        if args.verdict_runs is not None:
            tuned_dir = tuned2_dir(plan) if args.verdict_runs is True else args.verdict_runs
            seeds, why = verdict_seeds(args.declared, args.results)
            print(f"seeds {seeds[0]}-{seeds[-1]}: {why}", file=sys.stderr)
            for point, overrides in verdict_overrides(plan, tuned_dir, seeds).items():
                print(point, overrides)
            return 0
        if not args.results.is_dir():
            parser.error(f"no such results folder: {args.results}")
        reading = read_tuning(plan, tuning_runs(plan, args.results))
        if args.commands:
            if reading.state == NO_CHOICE:
                raise ValueError(f"no trial of {', '.join(p for p, c in reading.choices.items() if c is None)} "
                                 f"trained; the declaration does not say what follows")
            print("\n".join(commands(reading)), end="\n" if reading.state != COMPLETE else "")
            return 0 if reading.state == COMPLETE else 3
        print(tuning_text(reading), end="")
        if args.write_tuned is not None:
            out = tuned2_dir(plan) if args.write_tuned is True else args.write_tuned
            written = write_tuned2(reading, out)
            print(f"wrote {len(written)} files to {out}", file=sys.stderr)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if reading.state == COMPLETE else 3


if __name__ == "__main__":
    raise SystemExit(main())
