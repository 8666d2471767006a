"""The tuning study's reading: every trial (one run per search point), the choice per scheme and
scope, the committed files the tuned protocol reads, a table and a figure.

A trial is a run of experiment=tune / tune_dense (or tune_tpe): a scheme and scope at one peak
learning rate (``optim.lr``, per worker) and warm-up length (``optim.warmup_epochs``). The choice
for a scheme and scope is its trained trial with the highest final **validation** accuracy (the
test accuracy is shown, never read); ties go to the smaller learning rate, then the shorter
warm-up. A choice at the edge of the learning rates tried says so: the grid may be too narrow.

``write_tuned`` writes ``conf/tuned/<scheme>_<scope>.yaml`` (dense SGD, whose scope does nothing:
both scopes), which experiment=protocol reads through ``${st_tuned:...}``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from sparsetrain.results import DID_NOT_TRAIN

from .loader import DENSE, NOT_APPLICABLE

TUNED = ("lr", "warmup_epochs")  # what a trial varies and a choice fixes
SCOPES = ("layerwise", "global")
# A trial that has run to its end (trained or not); "absent", "running", "unfinished" have not.
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
    frame = runs[[c for c in TRIAL_COLUMNS if c in runs]].copy()
    if "experiment" in runs:  # a trial not run yet ("absent") names only the keys its sweep varies
        for column in ("scheme", "scope"):
            known = runs.groupby("experiment")[column].agg(lambda v: v.dropna().iloc[0] if v.notna().any() else None)
            frame[column] = frame[column].fillna(runs["experiment"].map(known))
    return frame.sort_values(["scheme", "scope", "lr", "warmup_epochs"], key=_order).reset_index(drop=True)


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
                f"lr: {c['lr']:g}\n"
                f"warmup_epochs: {c['warmup_epochs']:g}\n"
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
