"""Verdicts of a study declared before its runs: ``conf/declared/<study>.yaml``.

A declaration names the study's sweeps, its budgets (epochs), seeds, the equivalence margin of its
``=`` claims, how many looks at the data have been taken, its points (a name for a set of axis
values) and its findings: each a Holm family of comparisons between two points, with what the
paper claims (``>``, ``=``, ``?`` for no claim); optionally ``reference_sweeps``, earlier sweeps
whose runs the new points are judged against, taken as they are; optionally ``format: 2``, under
which a pair of points (in either order) may be compared only once in the whole file (``load``
refuses a pair in two findings or twice in one; a format 1 file loads, and its tables note each
pair it counts twice). It is committed before the study's first run; the analysis checks that with git (the commit that added the file must be an
ancestor of every run's commit) and says so above the verdicts, with every later change to the
file.

Every comparison is judged at each budget on its own (``findings.measure``: the difference with
its 95 % interval and paired t, Holm within the finding at that budget, each p times the looks
taken; an ``=`` claim by TOST at the margin). A comparison is **budget-dependent** only where
an interaction test says so (``budget_effects``: the last budget's paired A - B minus the first's,
paired t, Holm within the finding); one with the same outcome at every budget holds (requiring it
at both budgets is an intersection of tests: it needs no further correction). Each point's change from the first
budget to the last, paired by seed, replaces any "plateau" claim.

Beside each verdict stands the untuned one: the same comparisons, families and test applied to
the headline study's runs (``findings.HEADLINE``: one learning rate for every scheme, 4 epochs,
the same seeds) where the results tree holds them, so that what tuning and the longer budget
changed is read off one table.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from .findings import (
    HEADLINE,
    HEADLINE_SWEEPS,
    SECOND_PASS,
    Comparison,
    Finding,
    _equivalence_cell,
    _num,
    _p,
    _show,
    _side,
    images_interval_cell,
    measure,
    side_accuracy,
    verdict,
)
from .loader import AXES, COLUMNS_FIRST, STOPPED, completed, load_runs
from .stats import ALPHA, Difference, compare, holm, method_label, outside_noise
from .table import Table, write_table


@dataclass(frozen=True)
class Declaration:
    path: Path
    study: str
    sweeps: tuple[str, ...]
    budgets: tuple[int, ...]
    seeds: tuple[int, ...]
    margin: float
    looks: int
    setting: dict
    points: dict
    findings: tuple[Finding, ...]
    # Earlier sweeps whose runs the study is judged against (``reference_sweeps``): they ran before
    # the declaration, on their own commits, and are taken as they are.
    references: tuple[str, ...] = ()
    # What the tables must say of the declaration itself (a format 1 file comparing a pair twice).
    notes: tuple[str, ...] = ()
    # 1: as first written; 2 (``format: 2``): each pair of points compared once, in either order
    version: int = 1
    # each one-sided test of an "=" claim's TOST (``equivalence_alpha``; default alpha, 0.05)
    equivalence_alpha: float = ALPHA
    # a declaration with ``tuning:``: its tuning's presets (``<sweep>_tune``), which a verdict run
    # made on the tuning's own commit records as its experiment (scripts/verdict2_runs.sh with
    # TUNING_CHECKOUT); such a run counts only where it lies, in the study's own folder
    tuning_presets: tuple[str, ...] = ()
    # ``seed_rule`` (verdicts2.yaml): how many of ``seeds`` the verdicts read (``due_seeds``)
    seed_rule: dict | None = None

    @property
    def own_experiments(self) -> list[str]:
        """What the study's own runs record as ``experiment``: its sweeps (and tuning presets)."""
        return [*self.sweeps, *self.tuning_presets]

    @property
    def experiments(self) -> list[str]:
        """What a run's ``experiment`` may be: the study's own and its references'."""
        return [*self.own_experiments, *self.references]


def tuning_preset(sweep: str) -> str:
    """A declared tuning's experiment preset (conf/experiment/<sweep>_tune.yaml)."""
    return f"{sweep}_tune"


# The declaration formats: 1, the first (verdicts.yaml, local.yaml); 2 adds one rule, that a pair
# of points (in either order) is compared in one finding, once: a pair in two families is counted
# in two Holm corrections and can carry two claims (block-k vs random-k layer-wise: ">" and "=").
FORMATS = (1, 2)
# Every key a format 2 file may hold: one the analysis would not read is refused, not ignored.
# ``seed_rule`` and ``tuning`` say how many seeds run and how the rates were chosen; the runs
# carry their outcome, so the verdicts read neither.
KEYS = {"study", "format", "sweeps", "reference_sweeps", "budgets", "seeds", "alpha", "margin", "looks",
        "equivalence_alpha", "setting", "points", "findings", "seed_rule", "tuning"}


def load(path: str | Path) -> Declaration:
    """The declaration in ``path``; ``ValueError`` (one line) naming what is wrong in it."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text()) or {}
    for key in ("study", "sweeps", "budgets", "seeds", "margin", "looks", "points", "findings"):
        if key not in doc:
            raise ValueError(f"{path}: no {key!r}")
    version = doc.get("format", 1)
    if version not in FORMATS:
        raise ValueError(f"{path}: format {version!r}; allowed: {', '.join(map(str, FORMATS))}")
    unknown = sorted(set(doc) - KEYS)
    if version >= 2 and unknown:
        raise ValueError(f"{path}: key {unknown[0]!r} is not read by the analysis; allowed: {', '.join(sorted(KEYS))}")
    if float(doc.get("alpha", ALPHA)) != ALPHA:
        raise ValueError(f"{path}: alpha {doc['alpha']!r}; allowed: {ALPHA} (every verdict's level)")
    eq_alpha = float(doc.get("equivalence_alpha", ALPHA))
    if not 0 < eq_alpha <= ALPHA:
        raise ValueError(f"{path}: equivalence_alpha {eq_alpha!r}; allowed: 0 < equivalence_alpha <= {ALPHA}")
    points = {name: dict(axes) for name, axes in doc["points"].items()}
    findings = []
    compared: dict[frozenset, list[tuple[str, str, str]]] = {}  # each pair, in either order: where
    for f in doc["findings"]:
        comparisons = []
        for a, b, expect in f["comparisons"]:
            compared.setdefault(frozenset((a, b)), []).append((f["key"], a, b))
            for name in (a, b):
                if name not in points:
                    raise ValueError(f"{path}: finding {f['key']}: no point {name!r}; points: {', '.join(points)}")
            if expect not in (">", "=", "?"):
                raise ValueError(f"{path}: finding {f['key']}: expect {expect!r}; allowed: >, =, ?")
            comparisons.append(Comparison(f"{a} vs {b}", points[a], points[b], expect))
        findings.append(Finding(f["key"], f.get("claim", ""), tuple(comparisons)))
    repeated = [where for where in compared.values() if len(where) > 1]
    notes = ()
    if repeated and version >= 2:  # one pair, two claims or two families: the declaration contradicts itself
        where = repeated[0]
        _, a, b = where[0]
        others = f" ({len(repeated) - 1} more pair(s) likewise)" if len(repeated) > 1 else ""
        raise ValueError(f"{path}: {a} vs {b} is compared {len(where)} times (in findings "
                         f"{', '.join(k for k, *_ in where)}){others}; format 2 allows each pair once, in "
                         f"either order")
    if repeated:  # a format 1 file predates the rule: it loads, and its tables say so
        notes = tuple(f"Note: {path.name} (format 1, written before a pair could be compared only once) compares "
                      f"{where[0][1]} and {where[0][2]} {len(where)} times (in {', '.join(k for k, *_ in where)}: "
                      f"{'; '.join(f'{a} vs {b}' for _, a, b in where)}); that pair counts in each of those "
                      f"Holm families." for where in repeated)
    return Declaration(path, doc["study"], tuple(doc["sweeps"]), tuple(int(b) for b in doc["budgets"]),
                       tuple(int(s) for s in doc["seeds"]), float(doc["margin"]), int(doc["looks"]),
                       dict(doc.get("setting") or {}), points, tuple(findings),
                       tuple(doc.get("reference_sweeps") or ()), notes, version, eq_alpha,
                       tuple(map(tuning_preset, doc["sweeps"])) if doc.get("tuning") else (),
                       dict(doc["seed_rule"]) if doc.get("seed_rule") else None)


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def provenance(decl: Declaration, runs: pd.DataFrame) -> str:
    """One line: the commit that declared the study, whether it precedes every run's commit (the
    study's own: its reference sweeps' runs came earlier by design, and are named as such), and
    each later change to the declaration."""
    where = decl.path.resolve().parent
    try:
        log = _git(["log", "--format=%H %cI", "--follow", "--", decl.path.name], where)
    except FileNotFoundError:
        return "Declared: not checked (no git on this machine)."
    history = [line.split() for line in log.stdout.splitlines() if line.strip()]
    if log.returncode != 0 or not history:
        return f"Declared: {decl.path.name} is not committed: the runs cannot be shown to come after it."
    first, first_date = history[-1]
    text = f"Declared in {first[:12]} ({first_date[:10]})"
    if "status" in runs:  # a job of the grid not run yet has no commit to check
        runs = runs[runs["status"] != "absent"]
    references = (runs[~runs["experiment"].isin(decl.own_experiments)] if decl.references and "experiment" in runs
                  else runs.iloc[:0])
    runs = runs.drop(index=references.index)
    commits = _commits(runs)
    if commits:
        after = [c for c in commits if _git(["merge-base", "--is-ancestor", first, c.split("-")[0]], where).returncode == 0]
        late = sorted(set(commits) - set(after))
        text += (f", before every run ({len(runs)} runs on {', '.join(commits)})" if not late else
                 f"; NOT before the runs on {', '.join(late)}: those runs are not covered by the declaration")
    else:
        text += "; no runs yet"
    if not references.empty:
        text += (f"; judged against {len(references)} earlier runs of {', '.join(decl.references)} (on "
                 f"{', '.join(_commits(references)) or 'unrecorded commits'}), taken as they are")
    amendments = [f"{c[:12]} ({d[:10]})" for c, d in history[:-1]]
    if amendments:
        text += f"; changed since in {', '.join(amendments)} (git log -p {decl.path.name})"
    return text + "."


def _commits(runs: pd.DataFrame) -> list[str]:
    return sorted({c for cell in runs.get("code_commits", pd.Series(dtype=str)).dropna()
                   for c in str(cell).split(";") if c and c != "unrecorded"})


def due_seeds(decl: Declaration, runs: pd.DataFrame) -> tuple[list[int], str]:
    """The seeds a study's verdicts read, and why. Without a ``seed_rule``: the declared seeds.
    With one (verdicts2.yaml): its first seeds until the rule's pair has ended at each of them (at
    the first budget); then ``power.seeds_by_internal_pilot`` on the SD of the pair's paired
    differences in final test accuracy (points) over the seeds where both completed, the endpoint
    that the "=" test reads and whose re-sizing the declaration simulated. The verdict runs
    (``tuning.verdict_seeds``) and the tables read the same n."""
    from .power import seeds_by_internal_pilot

    rule = decl.seed_rule
    if not rule:
        return list(decl.seeds), "the declared seeds"
    first = list(decl.seeds[: int(rule["first"])])
    a, b = rule["pair"]
    base = {"seed": first, "experiment": decl.experiments, **decl.setting, "epochs_planned": decl.budgets[0]}
    runs = _every_axis(runs)  # before any run: its columns, no rows
    accuracy = {}
    for point in (a, b):
        side = _side(runs, decl.points[point], base)
        if set(side.loc[~side["status"].isin(OPEN), "seed"]) != set(first):
            return first, (f"the seed rule's first {len(first)} seeds (the pair {a}, {b} has not ended at all "
                           f"of them)")
        done = completed(side)
        done = done[done["test_accuracy"].notna()]
        accuracy[point] = dict(zip(done["seed"].astype(int), 100 * done["test_accuracy"].astype(float), strict=True))
    paired = [accuracy[a][s] - accuracy[b][s] for s in first if s in accuracy[a] and s in accuracy[b]]
    if len(paired) < 2:
        raise ValueError(f"the seed rule needs the pair {a}, {b} trained at 2 of seeds {first} at least; "
                         f"found {len(paired)}")
    sd = float(pd.Series(paired).std(ddof=1))
    n = seeds_by_internal_pilot(sd, decl.margin, len(first), int(rule["cap"]), float(rule.get("power", 0.8)),
                                decl.equivalence_alpha, float(rule.get("sd_level", 0.8)), n_measured=len(paired))
    over = f"seeds {first[0]}-{first[-1]}" + ("" if len(paired) == len(first) else f" ({len(paired)} where both completed)")
    return list(decl.seeds[:n]), f"the seed rule: SD of {a} - {b} over {over} {sd:.3f} points -> {n} seeds"


def runs_of(decl: Declaration, results: str | Path) -> pd.DataFrame:
    """The runs of the declared sweeps and references under ``results`` (an empty frame before
    any exists)."""
    folders = [Path(results) / s for s in (*decl.sweeps, *decl.references) if (Path(results) / s).exists()]
    return load_runs(*folders) if folders else pd.DataFrame()


def untuned_runs(results: str | Path) -> pd.DataFrame:
    """The headline study's runs under ``results`` (an empty frame where it holds none)."""
    folders = [Path(results) / s for s in HEADLINE_SWEEPS if (Path(results) / s).exists()]
    return load_runs(*folders) if folders else pd.DataFrame()


# The label of the untuned counterpart's columns: the headline protocol's setting (lr 0.05 per
# worker for every scheme, 0.3 epochs of warm-up, 4 epochs) with the declaration's axes and seeds.
UNTUNED = "untuned, 4 epochs"


def _untuned(decl: Declaration, before: pd.DataFrame) -> dict[str, list[dict]]:
    """Each finding's comparisons measured on the headline runs, judged as the declaration judges
    (its families, margin and looks); {} where the headline study measured none of them (a
    study of points it never ran)."""
    if before.empty:
        return {}
    base = {**SECOND_PASS, **HEADLINE, **decl.setting, "seed": list(decl.seeds)}
    before = _every_axis(before)
    measured = {f.key: measure(before, f, base, decl.margin, decl.looks, equivalence_alpha=decl.equivalence_alpha,
                               pair_common=True)
                for f in decl.findings}
    if all(m["outcome"] == "pending" for ms in measured.values() for m in ms):
        return {}
    return measured


def tables(decl: Declaration, runs: pd.DataFrame, before: pd.DataFrame | None = None) -> tuple[Table, ...]:
    """``(verdicts, comparisons, budget change)``, the last only for a study of two budgets or
    more; ``before``: the headline study's runs (``untuned_runs``), whose verdicts stand beside
    the declared ones."""
    note = provenance(decl, runs)
    untuned = _untuned(decl, pd.DataFrame() if before is None else before)
    seeds, why = due_seeds(decl, runs)
    rule = (f"A − B in points of final test accuracy, its 95% interval unadjusted; paired t over the "
            f"declared seeds ({', '.join(map(str, seeds))}); p two-sided, Holm-adjusted within each "
            f"finding at each budget, times the {decl.looks} look(s) taken (capped at 1); outside the noise: "
            f"adjusted p < 0.05. An A = B claim agrees only when TOST shows equivalence within "
            f"±{decl.margin:g} point (90% interval inside the margin), else it is 'not told apart'; a comparison "
            f"with no claim gets the same TOST, Holm over the finding's unclaimed comparisons, shown beside its "
            f"outcome. Across the budgets ({', '.join(map(str, decl.budgets))} epochs) a comparison is "
            f"budget-dependent only where its A − B changes outside the noise (the interaction test: "
            f"budget_effect); 'A > B in seeds': the seeds whose A − B is above 0; an adjusted p within "
            f"[{THRESHOLD_BAND[0]:g}, {THRESHOLD_BAND[1]:g}] is flagged 'at the threshold'."
            if len(decl.budgets) > 1 else
            f"Final test accuracy at {decl.budgets[0]} epochs.")
    if untuned:
        rule += (f" '{UNTUNED}': the same comparisons, families and test on the headline study's runs (lr 0.05 "
                 "per worker and 0.3 epochs of warm-up for every scheme, 4 epochs, the same seeds, no validation "
                 "split).")
    if decl.seed_rule:
        rule += f" The seeds: {why}."
    rows, verdict_rows, effect_rows = [], [], []
    base_seeds = {"seed": seeds, "experiment": decl.experiments, **decl.setting}
    runs = _every_axis(runs)
    for finding in decl.findings:
        by_budget, waiting, judged_at, directions = {}, {}, {}, {}
        claimed = any(c.expect != "?" for c in finding.comparisons)
        for budget in decl.budgets:
            base = {**base_seeds, "epochs_planned": budget}
            ended, needed = _ended(runs, [side for c in finding.comparisons for side in (c.a, c.b)], base)
            if ended < needed:  # judged only whole: Holm needs the family, and part of the seeds is a look
                waiting[budget] = f"pending ({ended} of {needed} runs ended)"
                by_budget[budget] = ["pending"] * len(finding.comparisons)
                rows += [{**_row(decl, finding, budget, c), **_untuned_cells(untuned, finding.key, i)}
                         for i, c in enumerate(finding.comparisons)]
                continue
            measured = measure(runs, finding, base, decl.margin, decl.looks, equivalence_unclaimed=True, pair_common=True,
                               equivalence_alpha=decl.equivalence_alpha)
            judged_at[budget] = measured
            by_budget[budget] = [m["outcome"] for m in measured]
            directions[budget] = [_relation(m, decl.margin) for m in measured]
            rows += [{**_row(decl, finding, budget, m["comparison"], m), **_untuned_cells(untuned, finding.key, i)}
                     for i, m in enumerate(measured)]
        each = {b: waiting.get(b) or verdict(o, claimed) for b, o in by_budget.items()}
        effects = budget_effects(decl, judged_at) if len(judged_at) == len(decl.budgets) > 1 else None
        if len(decl.budgets) > 1:
            effect_rows += _effect_rows(decl, finding, judged_at, effects)
        verdict_rows.append({"finding": finding.key, "the paper": finding.claim,
                             **({UNTUNED: verdict([m["outcome"] for m in untuned[finding.key]], claimed)}
                                if untuned else {}),
                             **{f"{b} epochs": each[b] for b in decl.budgets}, "verdict": _overall(each, by_budget, directions),
                             **(_held_cells(decl, judged_at, effects) if len(decl.budgets) > 1 else {})})
    title = f"{decl.study}: declared comparisons"
    verdicts = pd.DataFrame(verdict_rows)
    comparisons = pd.DataFrame(rows)
    notes = [note, *decl.notes, rule]
    judged = (Table("verdicts", f"{title}, verdicts", verdicts, verdicts, notes=notes),
              Table("comparisons", f"{title}, every comparison", comparisons, comparisons, notes=notes))
    if len(decl.budgets) == 1:
        return judged
    change = _budget_change(decl, runs, seeds)
    effect = pd.DataFrame(effect_rows)
    first, last = decl.budgets[0], decl.budgets[-1]
    return (*judged,
            Table("budget_change", f"{decl.study}: each point from {first} to {last} epochs",
                  change, change, notes=[note, "Test accuracy at the last budget minus the first, paired by seed "
                                         "(paired t, 95% interval unadjusted, Holm over the points" + (
                                             f", times the {decl.looks} looks taken, capped at 1" if decl.looks > 1
                                             else "") + ")."]),
            Table("budget_effect", f"{decl.study}: each comparison across the budgets", effect, effect,
                  notes=[note, *decl.notes, _effect_rule(decl)]))


def _overall(each: dict[int, str], by_budget: dict[int, list[str]],
             directions: dict[int, list[str | None]]) -> str:
    """A finding's verdict over its budgets (``each``: its verdict at each, ``by_budget``: its
    comparisons' outcomes at each, ``directions``: their relations, ``_relation``): pending while
    any budget is; the verdict where every comparison has the same outcome, in the same
    direction, at every budget; else "not the same at every budget", with each budget's verdict.
    Whether a comparison depends on the budget is the interaction test's to say
    (``budget_effects``), not a label that differs: see the columns beside it."""
    first = next(iter(each))
    unjudged = [b for b, v in each.items() if v.startswith(("pending", "not judged"))]
    if unjudged:
        return each[first] if len(each) == 1 else "pending: " + "; ".join(
            f"{b} epochs {each[b].removeprefix('pending ')}" for b in unjudged)
    if all(len(set(outcomes)) == 1 for outcomes in zip(*by_budget.values())) and all(
            len(set(ways)) == 1 for ways in zip(*directions.values())):
        return each[first]
    return f"not the same at {_every(each)}: " + "; ".join(f"{b} epochs: {v}" for b, v in each.items())


def _every(budgets) -> str:
    return "both budgets" if len(budgets) == 2 else "every budget"


# An adjusted p this close to alpha is flagged "at the threshold": the verdict on either side of
# alpha rests on a hair (block-k's scope at 8 epochs: Holm p 0.04996).
THRESHOLD_BAND = (0.04, 0.06)


def at_threshold(p: float) -> bool:
    """Whether ``p`` (adjusted) lies in ``THRESHOLD_BAND``, ends included."""
    return not math.isnan(p) and THRESHOLD_BAND[0] <= p <= THRESHOLD_BAND[1]


def _threshold_cell(**ps: float) -> str:
    """The comparisons table's flag: each named adjusted p inside ``THRESHOLD_BAND``, to 5 places."""
    near = [f"{name} {p:.5f}" for name, p in ps.items() if at_threshold(p)]
    return "at the threshold: " + ", ".join(near) if near else "—"


def paired_differences(m: dict) -> pd.Series:
    """A comparison's A - B per seed (``findings.measure``'s per-seed accuracies), the seeds both
    sides hold."""
    return (m["acc_a"] - m["acc_b"]).dropna()


def _seeds_cell(m: dict) -> str:
    d = paired_differences(m)
    return f"{int((d > 0).sum())} of {len(d)}" if len(d) else "—"


def _seeds_toward(m: dict, margin: float) -> str:
    """How many seeds go a held relation's way: A - B above 0 (``>``), below 0 (``<``), or inside
    the margin (an equivalence)."""
    d = paired_differences(m)
    if m["outcome"] == "agrees" and m["comparison"].expect == "=":
        k = (d.abs() < margin).sum()
    else:
        k = (d > 0).sum() if m["d"].diff > 0 else (d < 0).sum()
    return f"{int(k)} of {len(d)}"


@dataclass(frozen=True)
class BudgetEffect:
    """One comparison across the budgets: ``change`` is the interaction, (A - B at the last budget)
    minus (A - B at the first), paired by seed (``stats.compare``: paired t on the per-seed
    differences of differences, 95 % interval), ``p_holm`` its p Holm-adjusted over the finding's
    comparisons (times the looks); ``dependent``: that adjusted p is below alpha."""

    change: Difference
    p_holm: float

    @property
    def dependent(self) -> bool:
        return outside_noise(self.p_holm)


def budget_effects(decl: Declaration, judged_at: dict[int, list[dict]]) -> list[BudgetEffect]:
    """The interaction test of each of a finding's comparisons (``judged_at``: ``measure``'s
    output at each budget): a comparison is budget-dependent only where A - B itself changes
    between the first budget and the last, outside the noise, not where a label crosses 0.05."""
    first, last = judged_at[decl.budgets[0]], judged_at[decl.budgets[-1]]
    changes = [compare(paired_differences(b), paired_differences(a), pair_common=True)
               for a, b in zip(first, last, strict=True)]
    adjusted = [min(1.0, decl.looks * p) if not math.isnan(p) else p for p in holm([c.p for c in changes])]
    return [BudgetEffect(c, p) for c, p in zip(changes, adjusted, strict=True)]


def _relation(m: dict, margin: float) -> str | None:
    """What a judged comparison shows, as a relation between its points (None: nothing outside
    the noise): ``a > b``, ``a < b``, or ``a = b (±margin)`` for an equivalence shown."""
    a, b = m["comparison"].label.split(" vs ")
    outcome = m["outcome"]
    if outcome == "agrees" and m["comparison"].expect == "=":
        return f"{a} = {b} (±{margin:g})"
    if outcome in ("agrees", "reversed", "differs", "A higher", "B higher"):
        return f"{a} > {b}" if m["d"].diff > 0 else f"{a} < {b}"
    return None


def _same_at_every_budget(at: list[dict], margin: float) -> bool:
    """One comparison's outcome and direction alike at every budget: "differs" above at one budget
    and below at another is not the same result (the outcome names no direction)."""
    return len({(m["outcome"], _relation(m, margin)) for m in at}) == 1


def _equivalent_unclaimed(m: dict) -> bool:
    return m["comparison"].expect == "?" and outside_noise(m["p_equivalent"], m["equivalence"].alpha)


def _held_cells(decl: Declaration, judged_at: dict[int, list[dict]], effects: list[BudgetEffect] | None) -> dict:
    """The verdicts table's columns across the budgets: what held at every budget (the same
    outcome at each, or for a ``?`` comparison equivalence at each), with how many seeds go its way
    at each budget, and what depends on the budget by the interaction test."""
    every = _every(decl.budgets)
    held_col, dependent_col = f"held at {every}", "budget-dependent (interaction test)"
    if effects is None:
        return {held_col: "—", dependent_col: "—"}
    held, dependent = [], []
    for i, effect in enumerate(effects):
        at = [judged_at[b][i] for b in decl.budgets]
        change = effect.change
        size = (f"A − B {change.diff:+.2f} [{change.low:+.2f}, {change.high:+.2f}] from {decl.budgets[0]} to "
                f"{decl.budgets[-1]} epochs, {_p_is(change.p)}, Holm {_p(effect.p_holm)}")
        relations = {_relation(m, decl.margin) for m in at}
        if _same_at_every_budget(at, decl.margin) and None not in relations:
            seeds = [_seeds_toward(m, decl.margin) for m in at]
            seeds_text = f"{seeds[0]} seeds at {every}" if len(set(seeds)) == 1 else "seeds " + ", ".join(
                f"{s} at {b}" for s, b in zip(seeds, decl.budgets, strict=True))
            held.append(f"{relations.pop()} ({seeds_text}" + ("; its size depends on the budget" if effect.dependent
                                                               else "") + ")")
        if all(_equivalent_unclaimed(m) for m in at):
            a, b = at[0]["comparison"].label.split(" vs ")
            held.append(f"{a} = {b} within ±{decl.margin:g} (TOST p " + ", ".join(
                f"{_p(m['equivalence'].p)} at {bu}" for m, bu in zip(at, decl.budgets, strict=True)) + ", Holm " +
                ", ".join(_p(m["p_equivalent"]) for m in at) + ")")
        if effect.dependent:
            dependent.append(f"{at[0]['comparison'].label}: {size}")
    return {held_col: "; ".join(held) or "none", dependent_col: "; ".join(dependent) or "none"}


def _effect_rows(decl: Declaration, finding: Finding, judged_at: dict[int, list[dict]],
                 effects: list[BudgetEffect] | None) -> list[dict]:
    """The budget-effect table's rows for one finding: each comparison's A - B with its interval
    at every budget, the interaction test, and what it means across the budgets."""
    rows = []
    for i, comparison in enumerate(finding.comparisons):
        row = {"finding": finding.key, "comparison (A vs B)": comparison.label,
               "paper": {">": "A > B", "=": "A = B"}.get(comparison.expect, "no claim")}
        for b in decl.budgets:
            m = judged_at[b][i] if b in judged_at else None
            row[f"{b} epochs: A − B [95%]"] = _effect_cell(m["d"]) if m else "pending"
            row[f"{b} epochs: outcome"] = m["outcome"] if m else "pending"
            row[f"{b} epochs: A > B in seeds"] = _seeds_cell(m) if m else "—"
        if effects is None:
            row.update({"change (points)": "—", "95% interval": "—", "test": "pending", "p": "—",
                        f"p (Holm, x{decl.looks} looks)": "—", "across the budgets": "pending"})
        else:
            effect = effects[i]
            c = effect.change
            at = [judged_at[b][i] for b in decl.budgets]
            same = _same_at_every_budget(at, decl.margin)
            reading = (("the same at " + _every(decl.budgets) + ": " + at[0]["outcome"]
                        + ("; its size depends on the budget" if effect.dependent else ""))
                       if same else "budget-dependent" if effect.dependent else
                       "not the same at " + _every(decl.budgets) + ", but the change is within the noise")
            if at_threshold(effect.p_holm):
                reading += f" (at the threshold: Holm p {effect.p_holm:.5f})"
            row.update({"change (points)": _num(c.diff, signed=True),
                        "95% interval": "—" if math.isnan(c.low) else f"[{c.low:+.2f}, {c.high:+.2f}]",
                        "test": method_label(c), "p": _p(c.p),
                        f"p (Holm, x{decl.looks} looks)": _p(effect.p_holm), "across the budgets": reading})
        rows.append(row)
    return rows


def _p_is(p: float) -> str:
    shown = _p(p)
    return "p" + ("" if shown.startswith("<") else "=") + shown


def _effect_cell(d: Difference) -> str:
    if math.isnan(d.diff):
        return "—"
    return f"{d.diff:+.2f}" + ("" if math.isnan(d.low) else f" [{d.low:+.2f}, {d.high:+.2f}]")


def _effect_rule(decl: Declaration) -> str:
    first, last = decl.budgets[0], decl.budgets[-1]
    return (f"change: (A − B at {last} epochs) minus (A − B at {first}), paired by seed: a paired t on the "
            f"per-seed differences of differences, its 95% interval unadjusted, p Holm-adjusted within the "
            f"finding, times the {decl.looks} look(s) taken. A comparison is budget-dependent only where that "
            f"change is outside the noise (adjusted p < 0.05); an outcome that differs between the budgets "
            f"with the change inside the noise is 'not the same at {_every(decl.budgets)}', and one that is the "
            f"same at each holds. 'A > B in seeds': the seeds whose A − B is above 0. An adjusted p within "
            f"[{THRESHOLD_BAND[0]:g}, {THRESHOLD_BAND[1]:g}] is flagged 'at the threshold'.")


# A run the study still holds open: resuming it (RESUME=1) ends it. Failed runs and runs that did
# not train have ended (the comparison counts them in brackets).
OPEN = ("running", "absent", "no summary", "unfinished", STOPPED)


def _ended(runs: pd.DataFrame, sides: list[dict], base: dict) -> tuple[int, int]:
    """How many of the runs that ``sides`` (points' axes, each counted once) need at ``base`` have
    ended, and how many they need: one per declared seed each."""
    distinct = list({tuple(sorted(axes.items())): axes for axes in sides}.values())
    ended = 0
    for axes in distinct:
        side = _side(runs, axes, base)
        ended += side.loc[~side["status"].isin(OPEN), "seed"].nunique()
    return ended, len(distinct) * len(base["seed"])


def _row(decl: Declaration, finding: Finding, budget: int, comparison: Comparison, m: dict | None = None) -> dict:
    """One comparison's row of the comparisons table; ``m`` (``findings.measure``'s) None: pending."""
    d = m["d"] if m else None
    return {
        "finding": finding.key, "budget (epochs)": budget, "comparison (A vs B)": comparison.label,
        "paper": {">": "A > B", "=": "A = B"}.get(comparison.expect, "no claim"),
        "A: test accuracy (%)": _show(m["acc_a"], m["side_a"]) if m else "—",
        "B: test accuracy (%)": _show(m["acc_b"], m["side_b"]) if m else "—",
        "A − B (points)": _num(d.diff, signed=True) if m else "—",
        "95% interval (unadjusted)": "—" if not m or math.isnan(d.low) else f"[{d.low:+.2f}, {d.high:+.2f}]",
        # format 2's runs save each test image's prediction: the interval that adds the test
        # set's sampling error to the seeds' (the first pass's runs predate the files)
        **({"95% interval with test-set error": images_interval_cell(m) if m else "—"} if decl.version >= 2 else {}),
        "test": method_label(d) if m else "not judged",
        "p": _p(d.p) if m else "—", f"p (Holm, x{decl.looks} looks)": _p(m["p_holm"]) if m else "—",
        f"equivalence (TOST, ±{decl.margin:g} pt)": _equivalence_cell(m["equivalence"], m["p_equivalent"]) if m else "—",
        "outcome": m["outcome"] if m else "pending",
        "A > B in seeds": _seeds_cell(m) if m else "—",
        "how close to the threshold": _threshold_cell(**{"p (Holm)": m["p_holm"], "TOST p (Holm)": m["p_equivalent"]})
        if m else "—",
    }


def _untuned_cells(untuned: dict[str, list[dict]], key: str, index: int) -> dict:
    """The comparisons table's untuned columns for the ``index``-th comparison of finding ``key``."""
    if not untuned:
        return {}
    m = untuned[key][index]
    d = m["d"]
    shown = "—" if math.isnan(d.diff) else f"{d.diff:+.2f} [{d.low:+.2f}, {d.high:+.2f}]"
    return {f"{UNTUNED}: A − B (95%)": shown, f"{UNTUNED}: outcome": m["outcome"]}


def _every_axis(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with every column a side selects on: an axis no run has (``sync`` before the first
    local SGD run) is empty, so a point that names it selects nothing yet. Before any run exists:
    those columns and no rows."""
    if runs.empty:
        return pd.DataFrame(columns=list(dict.fromkeys([*COLUMNS_FIRST, *AXES, "test_accuracy", "stability"])))
    return runs.assign(**{axis: None for axis in AXES if axis not in runs})


def _budget_change(decl: Declaration, runs: pd.DataFrame, seeds: list[int]) -> pd.DataFrame:
    first, last = decl.budgets[0], decl.budgets[-1]
    source = _every_axis(runs)
    base = {"seed": seeds, "experiment": decl.experiments, **decl.setting}
    counts = {b: _ended(source, list(decl.points.values()), {**base, "epochs_planned": b}) for b in (first, last)}
    if any(ended < needed for ended, needed in counts.values()):  # Holm over every point: all or none
        return pd.DataFrame([{"point": name, **{f"{b} epochs (%)": "—" for b in (first, last)},
                              "change (points)": "—", "test": "pending (" + "; ".join(
                                  f"{b} epochs: {ended} of {needed} runs ended" for b, (ended, needed) in counts.items()) + ")"}
                             for name in decl.points])
    measured = []
    for name, axes in decl.points.items():
        at = {b: _side(source, axes, {**base, "epochs_planned": b}) for b in (first, last)}
        acc = {b: side_accuracy(side) for b, side in at.items()}
        measured.append((name, at, acc, compare(acc[last], acc[first], pair_common=True)))
    # times the looks taken, as every stated p (capped at 1)
    adjusted = [min(1.0, decl.looks * p) if not math.isnan(p) else p for p in holm([d.p for *_, d in measured])]
    rows = []
    for (name, at, acc, d), p_adj in zip(measured, adjusted, strict=True):
        rows.append({"point": name, f"{first} epochs (%)": _show(acc[first], at[first]),
                     f"{last} epochs (%)": _show(acc[last], at[last]),
                     "change (points)": _num(d.diff, signed=True),
                     "95% interval (unadjusted)": "—" if math.isnan(d.low) else f"[{d.low:+.2f}, {d.high:+.2f}]",
                     "test": method_label(d), "p": _p(d.p), "p (Holm)": _p(p_adj)})
    return pd.DataFrame(rows)


def write(decl_path: str | Path, results: str | Path, out: str | Path, echo=None) -> list[Path]:
    """The declared study's tables into ``out`` (Markdown, CSV, LaTeX)."""
    decl = load(decl_path)
    runs = runs_of(decl, results)
    written: list[Path] = []
    for table in tables(decl, runs, untuned_runs(results)):
        written += write_table(table, out).values()
        if echo is not None:
            echo(table.to_markdown())
    return written
