"""A study declared before its runs: its comparisons judged at each budget, budget-dependent
verdicts, the equivalence test of an '=' claim, and the git check that the declaration came first."""

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from test_analysis import make_config, write_run

from sparsetrain.analysis import declared
from sparsetrain.analysis.stats import equivalence

ROOT = Path(__file__).resolve().parent.parent
DECLARATION = ROOT / "conf" / "declared" / "verdicts.yaml"
POINTS = {"tuned_dense": ("none", "layerwise", 0.01), "tuned_topk_layerwise": ("topk", "layerwise", 0.01),
          "tuned_topk_global": ("topk", "global", 0.01), "tuned_randk_layerwise": ("randk", "layerwise", 0.01),
          "tuned_randk_global": ("randk", "global", 0.01), "tuned_blockk_layerwise": ("blockk", "layerwise", 0.01),
          "tuned_blockk_global": ("blockk", "global", 0.01), "tuned_blockk_bytes": ("blockk", "layerwise", 0.01992)}
# final test accuracy (%) by point and budget; seed s adds 0.3 s and a wobble so that t is defined
ACC = {4: {"tuned_dense": 92.0, "tuned_topk_layerwise": 91.0, "tuned_topk_global": 88.0,
           "tuned_randk_layerwise": 86.0, "tuned_randk_global": 85.9, "tuned_blockk_layerwise": 86.1,
           "tuned_blockk_global": 80.0, "tuned_blockk_bytes": 86.5},
       8: {"tuned_dense": 92.5, "tuned_topk_layerwise": 91.5, "tuned_topk_global": 91.45,
           "tuned_randk_layerwise": 88.0, "tuned_randk_global": 87.9, "tuned_blockk_layerwise": 88.05,
           "tuned_blockk_global": 84.0, "tuned_blockk_bytes": 88.5}}


def _study(root: Path) -> Path:
    for budget in (4, 8):
        sweep = root / f"verdict_e{budget}"
        for seed in range(5):
            for i, (point, (scheme, scope, ratio)) in enumerate(POINTS.items()):
                config = make_config(scheme=scheme, scope=scope, ratio=ratio, seed=seed, train__epochs=budget,
                                     train__batch_size=64, scheme__uncompressed="1d")
                run = write_run(sweep / f"{seed * 8 + i}", config, experiment=f"verdict_e{budget}")
                summary = json.loads((run / "summary.json").read_text())
                wobble = (0.05, -0.04, 0.02, -0.03, 0.01)[(seed + i) % 5]
                summary["test_accuracy"] = (ACC[budget][point] + 0.3 * seed + wobble) / 100
                (run / "summary.json").write_text(json.dumps(summary))
    return root


def test_the_committed_declaration_reads(tmp_path):
    decl = declared.load(DECLARATION)
    assert decl.budgets == (4, 8) and decl.seeds == (0, 1, 2, 3, 4) and decl.margin == 1.0
    assert [f.key for f in decl.findings] == ["rq1_scope", "rq2_order", "rq2_random", "dense_cost"]
    verdicts, comparisons, change, effect = declared.tables(decl, pd.DataFrame())  # before any run: pending
    assert verdicts.data["verdict"].str.startswith("pending").all()
    assert len(comparisons.data) == 2 * 16 and len(change.data) == 8 and len(effect.data) == 16


def test_declared_verdicts_per_budget_and_budget_dependence(tmp_path):
    decl = declared.load(DECLARATION)
    runs = declared.runs_of(decl, _study(tmp_path))
    assert len(runs) == 80
    verdicts, comparisons, change, effect = declared.tables(decl, runs)
    v = verdicts.data.set_index("finding")
    # top-k's scope gap is 3 points at 4 epochs and 0.05 at 8: not the same verdict at both, and
    # the interaction test finds the gap itself changed (every seed by -2.95): budget-dependent
    assert v.loc["rq1_scope", "verdict"].startswith("not the same at both budgets")
    assert "4 epochs: reproduced; 8 epochs: partly" in v.loc["rq1_scope", "verdict"]
    assert v.loc["rq1_scope", "budget-dependent (interaction test)"].startswith(
        "topk_layerwise vs topk_global: A − B -2.95 [-2.95, -2.95] from 4 to 8 epochs")
    e = effect.data.set_index("comparison (A vs B)")
    assert e.loc["topk_layerwise vs topk_global", "across the budgets"] == "budget-dependent"
    assert e.loc["randk_layerwise vs randk_global", "change (points)"] == "+0.00"
    # random-k ~ block-k layer-wise within 0.1 point: equivalent within +-1 at both budgets
    rows = comparisons.data
    equal = rows[rows["comparison (A vs B)"] == "randk_layerwise vs blockk_layerwise"]
    assert list(equal["outcome"]) == ["agrees", "agrees"]
    assert all(cell.startswith("p=") for cell in equal["equivalence (TOST, ±1 pt)"])
    assert v.loc["dense_cost", "verdict"].startswith("measured")
    c = change.data.set_index("point")
    assert c.loc["topk_global", "change (points)"] == "+3.45"
    assert c.loc["dense", "test"] == "paired t (n=5), no spread: p is 0 or 1 by convention"  # synthetic: +0.5 every seed


def test_a_budget_not_run_yet_leaves_the_verdict_pending(tmp_path):
    # the 4-epoch half complete, the 8-epoch half not started: pending, never "budget-dependent"
    import shutil

    root = _study(tmp_path)
    shutil.rmtree(root / "verdict_e8")
    decl = declared.load(DECLARATION)
    verdicts = declared.tables(decl, declared.runs_of(decl, root))[0].data.set_index("finding")
    assert verdicts.loc["rq1_scope", "4 epochs"] == "reproduced"
    assert verdicts.loc["rq1_scope", "verdict"] == "pending: 8 epochs (0 of 30 runs ended)"
    # a family is judged whole: with one seed's run missing its comparisons wait, unread
    (root / "verdict_e4" / "0" / "summary.json").unlink()  # tuned_dense, seed 0: "no summary"
    verdicts, comparisons, change, effect = declared.tables(decl, declared.runs_of(decl, root))
    v = verdicts.data.set_index("finding")
    assert set(effect.data.loc[effect.data["finding"] == "dense_cost", "across the budgets"]) == {"pending"}
    assert v.loc["dense_cost", "4 epochs"] == "pending (39 of 40 runs ended)"
    assert v.loc["rq1_scope", "4 epochs"] == "reproduced"  # no dense SGD in that family
    waiting = comparisons.data[comparisons.data["finding"] == "dense_cost"]
    assert set(waiting["outcome"]) == {"pending"} and set(waiting["A − B (points)"]) == {"—"}
    assert set(waiting["A: test accuracy (%)"]) == {"—"}  # not shown either: no look at part of the seeds
    assert set(change.data["change (points)"]) == {"—"}
    assert change.data["test"].iloc[0] == "pending (4 epochs: 39 of 40 runs ended; 8 epochs: 0 of 40 runs ended)"


def test_the_equivalence_test_is_two_one_sided_tests():
    from scipy import stats

    a = pd.Series([91.0, 91.4, 90.7, 91.2, 90.9], index=range(5))
    b = pd.Series([90.8, 91.5, 90.3, 91.1, 91.0], index=range(5))
    e = equivalence(a, b, margin=1.0)
    d = (a - b).to_numpy()
    # by hand: t statistics of the mean difference against -1 and +1, one-sided
    n, mean, se = len(d), d.mean(), d.std(ddof=1) / len(d) ** 0.5
    p_low = stats.t.sf((mean + 1.0) / se, n - 1)
    p_high = stats.t.cdf((mean - 1.0) / se, n - 1)
    assert e.p == pytest.approx(max(p_low, p_high), rel=1e-12)
    half = stats.t.ppf(0.95, n - 1) * se
    assert (e.low, e.high) == pytest.approx((mean - half, mean + half), rel=1e-12)
    # a difference of about 2 points is not equivalent within 1, however tight
    assert equivalence(a + 2, b, margin=1.0).p > 0.5


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


def _declared_in_a_repo(tmp_path: Path, declaration: Path) -> tuple[Path, str, str]:
    """A git repository with a commit of code, then one adding ``declaration``: (the
    declaration's path there, the early commit, the declaring one)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    _git(repo, "add", "code.py")
    _git(repo, "commit", "-qm", "code")
    early = _git(repo, "rev-parse", "HEAD")
    path = repo / declaration.name
    path.write_text(declaration.read_text())
    _git(repo, "add", path.name)
    _git(repo, "commit", "-qm", "declare")
    return path, early, _git(repo, "rev-parse", "HEAD")


def test_the_declaration_must_come_before_the_runs(tmp_path):
    path, early, late = _declared_in_a_repo(tmp_path, DECLARATION)
    repo = path.parent
    decl = declared.load(path)
    after = pd.DataFrame({"code_commits": [late[:12]] * 3})
    text = declared.provenance(decl, after)
    assert text.startswith(f"Declared in {late[:12]}") and "before every run (3 runs" in text
    # a job of the grid not run yet (absent) is not a run
    grid = pd.DataFrame({"code_commits": [late[:12]] * 3 + [None], "status": ["completed"] * 3 + ["absent"]})
    assert "before every run (3 runs" in declared.provenance(decl, grid)
    before = pd.DataFrame({"code_commits": [early[:12], late[:12]]})
    assert f"NOT before the runs on {early[:12]}" in declared.provenance(decl, before)
    path.write_text(path.read_text().replace("looks: 1", "looks: 2"))
    _git(repo, "commit", "-qam", "a second look")
    assert "changed since in" in declared.provenance(declared.load(path), after)
    uncommitted = tmp_path / "loose.yaml"
    uncommitted.write_text(DECLARATION.read_text())
    assert "not committed" in declared.provenance(declared.load(uncommitted), after)


@pytest.mark.slow  # 20 written runs; the declared verdicts themselves are in the fast tier
def test_the_untuned_verdicts_stand_beside_the_declared_ones(tmp_path):
    # the headline study's runs (one lr for every scheme, 4 epochs): top-k global 1.1 points above
    # layer-wise, as measured there; random-k and block-k layer-wise 2 points apart
    root = _study(tmp_path)
    untuned = {"tuned_topk_layerwise": 91.0, "tuned_topk_global": 92.1, "tuned_randk_layerwise": 86.8,
               "tuned_blockk_layerwise": 84.8}
    for seed in range(5):
        for i, (point, acc) in enumerate(untuned.items()):
            scheme, scope, ratio = POINTS[point]
            config = make_config(scheme=scheme, scope=scope, ratio=ratio, seed=seed, train__epochs=4,
                                 train__batch_size=64, scheme__uncompressed="1d", optim__lr=0.05,
                                 data__train_size=None)
            run = write_run(root / "headline" / f"{seed * 4 + i}", config, experiment="headline")
            summary = json.loads((run / "summary.json").read_text())
            summary["test_accuracy"] = (acc + 0.3 * seed + (0.05, -0.04, 0.02, -0.03, 0.01)[(seed + i) % 5]) / 100
            (run / "summary.json").write_text(json.dumps(summary))
    decl = declared.load(DECLARATION)
    before = declared.untuned_runs(root)
    assert len(before) == 20
    verdicts, comparisons, *_ = declared.tables(decl, declared.runs_of(decl, root), before)
    v = verdicts.data.set_index("finding")
    assert v.loc["rq1_scope", "untuned, 4 epochs"].startswith("pending (1 of 3")
    rows = comparisons.data.set_index(["comparison (A vs B)", "budget (epochs)"])
    scope = rows.loc[("topk_layerwise vs topk_global", 4)]
    assert scope["untuned, 4 epochs: A − B (95%)"].startswith("-1.10 [")
    assert scope["untuned, 4 epochs: outcome"] == "reversed"
    assert scope["outcome"] == "agrees"  # the declared runs: layer-wise 3 points above global
    # the same untuned cell beside each budget's row; the rule says what the column is
    assert rows.loc[("topk_layerwise vs topk_global", 8), "untuned, 4 epochs: outcome"] == "reversed"
    assert "headline study's runs" in verdicts.notes[-1]
    # without the headline runs the columns are left out, not shown empty
    assert "untuned, 4 epochs" not in declared.tables(decl, declared.runs_of(decl, root))[0].data.columns


LOCAL = ROOT / "conf" / "declared" / "local.yaml"
_PERIODIC = {"_target_": "sparsetrain.comm.periodic.PeriodicSync", "_partial_": True}


def test_a_study_judged_against_earlier_runs(tmp_path):
    """Issue 38's declaration: new points (local SGD, DiLoCo) against the frontier's runs, which
    ran earlier (reference_sweeps); one budget, so no budget-change table."""
    import yaml
    decl = declared.load(LOCAL)
    assert decl.references == ("frontier", "frontier_s34", "headline", "headline_dense") and decl.budgets == (4,)
    protocol = {"seed": 0, "train__epochs": 4, "train__batch_size": 64, "scheme__uncompressed": "1d",
                "optim__lr": 0.05, "optim__warmup_epochs": 0.3, "data__train_size": None}
    sides = {  # sweep, scheme, its sync node (None: every step), ratio, test accuracy (%)
        "topk_low": ("frontier", "topk", None, 0.00504, 91.0),
        "localsgd_low": ("local", "localsgd", {"period": 66, "outer_lr": 1.0, "outer_momentum": 0.0}, 0.01, 89.0),
        "diloco_low": ("local", "diloco", {"period": 66, "outer_lr": 0.7, "outer_momentum": 0.9,
                                           "nesterov": True}, 0.01, 90.5),
        "localsgd_high": ("local", "localsgd", {"period": 28, "outer_lr": 1.0, "outer_momentum": 0.0}, 0.01, 89.5),
        "diloco_high": ("local", "diloco", {"period": 28, "outer_lr": 0.7, "outer_momentum": 0.9,
                                            "nesterov": True}, 0.01, 90.6),
        "diloco_topk_low": ("local", "diloco", {"period": 14, "outer_lr": 0.7, "outer_momentum": 0.9,
                                                "nesterov": True}, 0.1, 90.4),
    }
    for i, (sweep, scheme, sync, ratio, acc) in enumerate(sides.values()):
        for seed in range(5):
            # written as top-k (the fake runs' formulas know the per-step schemes), then named
            config = make_config(**{**protocol, "seed": seed}, scheme="topk", ratio=ratio)
            run = write_run(tmp_path / sweep / f"{i}_{seed}", config, experiment=sweep)
            config["scheme"] = {**config["scheme"], "name": scheme, **({"sync": {**_PERIODIC, **sync}} if sync else {})}
            if ratio == 0.1:  # the delta sent by top-k
                config["scheme"]["compressor"] = {"_target_": "sparsetrain.compress.TopK", "_partial_": True}
            (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
            summary = json.loads((run / "summary.json").read_text())
            summary["config"] = config
            summary["test_accuracy"] = (acc + 0.3 * seed + (0.05, -0.04, 0.02, -0.03, 0.01)[(seed + i) % 5]) / 100
            (run / "summary.json").write_text(json.dumps(summary))
    runs = declared.runs_of(decl, tmp_path)
    assert len(runs) == 30
    # the frontier's tables, time to accuracy and break-even map take the new points too
    from sparsetrain.analysis.report import load_study

    frontier, _ = load_study(tmp_path, "frontier")
    assert sorted(frontier["scheme"].unique()) == ["diloco", "localsgd", "topk"]
    judged = declared.tables(decl, runs, declared.untuned_runs(tmp_path))
    assert [t.name for t in judged] == ["verdicts", "comparisons"]  # one budget: no budget change
    rows = judged[1].data.set_index("comparison (A vs B)")
    # the sync axis tells local SGD from DiLoCo at the same period, the delta axis a top-k delta
    # from a dense one
    outer = rows.loc["diloco_low vs localsgd_low"]
    assert (outer["A − B (points)"], outer["test"], outer["outcome"]) == ("+1.50", "paired t (n=5)", "A higher")
    assert rows.loc["diloco_topk_low vs diloco_low", "A − B (points)"] == "-0.10"
    # the 1.5% family waits for block-k's and random-k's references (not in this tree)
    assert rows.loc["localsgd_low vs topk_low", "outcome"] == "pending"
    assert judged[0].data.set_index("finding").loc["local_low", "verdict"] == "pending (20 of 30 runs ended)"
    assert "untuned, 4 epochs" not in judged[0].data.columns  # the headline study never ran these points
    # provenance: the study's own runs are checked; the references are named as earlier
    path, early, late = _declared_in_a_repo(tmp_path, LOCAL)
    early, late = early[:12], late[:12]
    frame = pd.DataFrame({"experiment": ["local", "frontier", "frontier"], "code_commits": [late, early, early]})
    text = declared.provenance(declared.load(path), frame)
    assert f"before every run (1 runs on {late})" in text and "NOT before" not in text
    assert f"judged against 2 earlier runs of frontier, frontier_s34, headline, headline_dense (on {early})" in text


def _two_point_study(tmp_path: Path, diffs: dict[int, list[float]], expect: str = ">",
                     extra: str = "") -> tuple[declared.Declaration, pd.DataFrame]:
    """A declaration of two points, x (top-k) and y (random-k), one finding [x, y, expect], judged
    at 4 and 8 epochs over seeds 0-4, whose runs give A - B = ``diffs[budget][seed]`` (y at 85 %)."""
    decl_path = tmp_path / "two.yaml"
    decl_path.write_text(
        "study: two\nsweeps: [two_e4, two_e8]\nbudgets: [4, 8]\nseeds: [0, 1, 2, 3, 4]\nmargin: 1.0\n"
        "looks: 1\nsetting: {world_size: 2}\n" + extra +
        "points:\n  x: {scheme: topk, scope: layerwise, ratio: 0.01}\n"
        "  y: {scheme: randk, scope: layerwise, ratio: 0.01}\n"
        f"findings:\n  - key: f\n    claim: x above y\n    comparisons:\n      - [x, y, \"{expect}\"]\n")
    for budget, per_seed in diffs.items():
        for seed, d in enumerate(per_seed):
            for i, (scheme, acc) in enumerate((("topk", 85.0 + d), ("randk", 85.0))):
                config = make_config(scheme=scheme, scope="layerwise", ratio=0.01, seed=seed, train__epochs=budget)
                run = write_run(tmp_path / f"two_e{budget}" / f"{seed * 2 + i}", config, experiment=f"two_e{budget}")
                summary = json.loads((run / "summary.json").read_text())
                summary["test_accuracy"] = acc / 100
                (run / "summary.json").write_text(json.dumps(summary))
    decl = declared.load(decl_path)
    return decl, declared.runs_of(decl, tmp_path)


def test_budget_dependence_is_an_interaction_test_not_labels_that_differ(tmp_path):
    from scipy import stats

    # x beats y clearly at 4 epochs; at 8 the gap is noisy (within the noise), yet the change of
    # the gap between the budgets is well inside its own noise: not budget-dependent
    at4, at8 = [1.0, 1.2, 0.9, 1.1, 1.05], [1.3, -0.2, 2.1, 0.1, 0.4]
    decl, runs = _two_point_study(tmp_path, {4: at4, 8: at8})
    verdicts, comparisons, _, effect = declared.tables(decl, runs)
    outcomes = comparisons.data.set_index("budget (epochs)")["outcome"]
    assert (outcomes[4], outcomes[8]) == ("agrees", "within noise")
    row = effect.data.iloc[0]
    assert row["across the budgets"] == "not the same at both budgets, but the change is within the noise"
    # the change is the paired t of (A - B at 8) - (A - B at 4), by hand
    by_hand = stats.ttest_rel(at8, at4)
    assert row["p"] == f"{by_hand.pvalue:.3f}" and row["change (points)"] == f"{(sum(at8) - sum(at4)) / 5:+.2f}"
    low, high = by_hand.confidence_interval(0.95)
    assert row["95% interval"] == f"[{low:+.2f}, {high:+.2f}]"
    v = verdicts.data.iloc[0]
    assert v["budget-dependent (interaction test)"] == "none" and v["held at both budgets"] == "none"
    assert (row["4 epochs: A > B in seeds"], row["8 epochs: A > B in seeds"]) == ("5 of 5", "4 of 5")


def test_a_result_held_at_both_budgets_is_reported_with_its_seeds_and_its_change(tmp_path):
    # x above y at both budgets, in every seed; the gap halves, outside the noise: it holds, and
    # its size depends on the budget
    decl, runs = _two_point_study(tmp_path, {4: [4.0, 4.2, 3.9, 4.1, 4.05], 8: [2.0, 2.3, 1.8, 2.2, 2.0]})
    verdicts, _, _, effect = declared.tables(decl, runs)
    v = verdicts.data.iloc[0]
    assert v["verdict"] == "reproduced"
    assert v["held at both budgets"] == "x > y (5 of 5 seeds at both budgets; its size depends on the budget)"
    assert v["budget-dependent (interaction test)"].startswith("x vs y: A − B -1.99 [")
    assert effect.data.iloc[0]["across the budgets"] == "the same at both budgets: agrees; its size depends on the budget"


def test_an_unclaimed_comparison_held_equal_at_both_budgets(tmp_path):
    # no claim ("?"): inside +-1 point at both budgets, shown equivalent by TOST at each
    decl, runs = _two_point_study(tmp_path, {4: [0.1, 0.2, -0.1, 0.0, 0.15], 8: [0.05, -0.1, 0.1, 0.0, 0.2]},
                                  expect="?")
    verdicts, comparisons, _, _ = declared.tables(decl, runs)
    assert all(cell.startswith("p=") for cell in comparisons.data["equivalence (TOST, ±1 pt)"])
    held = verdicts.data.iloc[0]["held at both budgets"]
    assert held.startswith("x = y within ±1 (TOST p <0.001 at 4, <0.001 at 8")


def test_a_p_value_near_alpha_is_flagged_at_the_threshold():
    assert declared.at_threshold(0.04996) and declared.at_threshold(0.04) and declared.at_threshold(0.06)
    assert not declared.at_threshold(0.0399) and not declared.at_threshold(0.0601)
    assert not declared.at_threshold(float("nan"))
    assert declared._threshold_cell(**{"p (Holm)": 0.04996, "TOST p (Holm)": 0.2}) == \
        "at the threshold: p (Holm) 0.04996"


def _with_format(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "v2.yaml"
    path.write_text(text)
    return path


def test_format_2_refuses_a_pair_compared_twice(tmp_path):
    # the committed file compares block-k and random-k layer-wise in rq2_order (">") and, reversed,
    # in rq2_random ("="): under format 2 that is one clear error naming the pair and the findings
    text = DECLARATION.read_text()
    with pytest.raises(ValueError) as refused:
        declared.load(_with_format(tmp_path, "format: 2\n" + text))
    message = str(refused.value)
    assert "\n" not in message
    assert ("blockk_layerwise vs randk_layerwise is compared 2 times (in findings rq2_order, rq2_random); "
            "format 2 allows each pair once, in either order") in message
    # twice in one finding, in the same order, is refused too
    once = text.replace("      - [randk_layerwise, blockk_layerwise, \"=\"]\n", "")
    twice = once.replace("      - [topk_layerwise, topk_global, \">\"]\n",
                         "      - [topk_layerwise, topk_global, \">\"]\n      - [topk_layerwise, topk_global, \"?\"]\n")
    with pytest.raises(ValueError, match="topk_layerwise vs topk_global is compared 2 times .in findings "
                                         "rq1_scope, rq1_scope."):
        declared.load(_with_format(tmp_path, "format: 2\n" + twice))
    # each pair once: it loads, with no note
    decl = declared.load(_with_format(tmp_path, "format: 2\n" + once))
    assert decl.version == 2 and decl.notes == ()
    with pytest.raises(ValueError, match="format 3; allowed: 1, 2"):
        declared.load(_with_format(tmp_path, "format: 3\n" + once))


def test_the_format_1_declaration_loads_and_says_a_pair_counts_twice(tmp_path):
    decl = declared.load(DECLARATION)
    assert decl.version == 1
    assert decl.notes == ("Note: verdicts.yaml (format 1, written before a pair could be compared only once) "
                          "compares blockk_layerwise and randk_layerwise 2 times (in rq2_order, rq2_random: "
                          "blockk_layerwise vs randk_layerwise; randk_layerwise vs blockk_layerwise); that pair "
                          "counts in each of those Holm families.",)
    verdicts, comparisons, _, effect = declared.tables(decl, pd.DataFrame())
    assert all(decl.notes[0] in table.notes for table in (verdicts, comparisons, effect))


def test_equivalence_alpha_decides_an_equal_claim():
    # verdicts2.yaml tests its "=" claim at 0.035 a side: a TOST p between 0.035 and 0.05 agrees at
    # the default level and is "not told apart" at the declared one; the interval widens to match.
    from sparsetrain.analysis.findings import Comparison, Finding, measure

    finding = Finding("eq", "", (Comparison("a vs b", {"scheme": "topk"}, {"scheme": "randk"}, "="),))
    rows = []
    for seed, d in enumerate([0.33, -0.825, 1.485, -0.165, 0.99, -1.155]):  # TOST p 0.0435
        for scheme, acc in (("topk", 90 + d / 2), ("randk", 90 - d / 2)):
            rows.append({"scheme": scheme, "seed": seed, "status": "completed", "test_accuracy": acc / 100})
    runs = pd.DataFrame(rows)
    at_default, = measure(runs, finding, {})
    at_declared, = measure(runs, finding, {}, equivalence_alpha=0.035)
    p = at_default["p_equivalent"]
    assert 0.035 < p < 0.05, p  # the data sit between the two levels
    assert at_default["outcome"] == "agrees" and at_declared["outcome"] == "not told apart"
    assert at_declared["equivalence"].high - at_declared["equivalence"].low > \
        at_default["equivalence"].high - at_default["equivalence"].low


def test_the_second_pass_declaration_loads_with_its_keys(tmp_path):
    path = DECLARATION.parent / "verdicts2.yaml"
    decl = declared.load(path)
    assert decl.version == 2 and decl.equivalence_alpha == 0.035 and decl.budgets == (16,)
    # a format 2 file may not hold a key the analysis would silently ignore
    with pytest.raises(ValueError, match="key 'equivalence_alfa' is not read by the analysis"):
        declared.load(_with_format(tmp_path, path.read_text() + "equivalence_alfa: 0.01\n"))
    with pytest.raises(ValueError, match="alpha 0.1; allowed: 0.05"):
        declared.load(_with_format(tmp_path, path.read_text().replace("alpha: 0.05", "alpha: 0.1")))


def test_differing_in_opposite_directions_is_not_held_at_both_budgets(tmp_path):
    # an "=" claim that differs at both budgets, x above y at 4 epochs and below at 8: the
    # outcome's label is the same ("differs"), the result is not (it named a random direction)
    decl, runs = _two_point_study(tmp_path, {4: [2.0, 2.2, 1.9, 2.1, 2.05], 8: [-2.0, -2.3, -1.8, -2.2, -2.0]},
                                  expect="=")
    verdicts, comparisons, _, effect = declared.tables(decl, runs)
    assert list(comparisons.data["outcome"]) == ["differs", "differs"]
    v = verdicts.data.iloc[0]
    assert v["held at both budgets"] == "none" and v["verdict"].startswith("not the same at both budgets")
    assert effect.data.iloc[0]["across the budgets"] == "budget-dependent"


def test_a_seed_on_one_side_only_is_left_out_of_the_pairs_and_named(tmp_path):
    # y's seed 4 failed at 4 epochs: the paired test reads seeds 0-3 (A - B their mean difference),
    # never Welch over 5 and 4 seeds, and says which seed it left out; the interaction test too
    at4, at8 = [1.0, 1.2, 0.9, 1.1, 3.0], [0.5, 0.4, 0.6, 0.7, 0.5]
    decl, runs = _two_point_study(tmp_path, {4: at4, 8: at8})
    failed = (runs["scheme"] == "randk") & (runs["seed"] == 4) & (runs["epochs_planned"] == 4)
    assert failed.sum() == 1
    runs.loc[failed, ["status", "test_accuracy"]] = ["failed", None]
    _, comparisons, _, effect = declared.tables(decl, runs)
    row = comparisons.data.set_index("budget (epochs)").loc[4]
    assert row["test"] == "paired t (n=4; seed 4 on one side only, left out)"
    assert row["A − B (points)"] == f"{sum(at4[:4]) / 4:+.2f}"
    change = effect.data.iloc[0]
    assert change["test"] == "paired t (n=4; seed 4 on one side only, left out)"
    assert change["change (points)"] == f"{sum(b - a for a, b in zip(at4[:4], at8[:4], strict=True)) / 4:+.2f}"


def _seed_rule_study(tmp_path: Path, diffs: list[float], cap: int = 6, predictions: bool = False):
    """A format 2 declaration of two points x, y at one budget with a seed rule (first 3 seeds of
    0-5, the pair x, y), whose runs at seeds 0..len(diffs)-1 give A - B = ``diffs[seed]``."""
    import numpy as np

    from sparsetrain.results import write_test_predictions

    tmp_path.mkdir(parents=True, exist_ok=True)
    decl_path = tmp_path / "rule.yaml"
    decl_path.write_text(
        "study: rule\nformat: 2\nsweeps: [rule]\nbudgets: [4]\nseeds: [0, 1, 2, 3, 4, 5]\nmargin: 1.0\nlooks: 1\n"
        f"seed_rule: {{first: 3, cap: {cap}, sd_level: 0.8, power: 0.8, pair: [x, y]}}\n"
        "setting: {world_size: 2}\npoints:\n  x: {scheme: topk, scope: layerwise, ratio: 0.01}\n"
        "  y: {scheme: randk, scope: layerwise, ratio: 0.01}\n"
        "findings:\n  - key: f\n    claim: x as y\n    comparisons:\n      - [x, y, \"=\"]\n")
    rng = np.random.default_rng(0)
    label = rng.integers(0, 10, 200)
    for seed, d in enumerate(diffs):
        for i, (scheme, acc) in enumerate((("topk", 85.0 + d), ("randk", 85.0))):
            config = make_config(scheme=scheme, scope="layerwise", ratio=0.01, seed=seed, train__epochs=4)
            run = write_run(tmp_path / "rule" / f"{seed * 2 + i}", config, experiment="rule")
            summary = json.loads((run / "summary.json").read_text())
            summary["test_accuracy"] = acc / 100
            (run / "summary.json").write_text(json.dumps(summary))
            if predictions:
                predicted = np.where(rng.random(200) < acc / 100, label, (label + 1) % 10)
                write_test_predictions(run, predicted, label, num_classes=10)
    decl = declared.load(decl_path)
    return decl, declared.runs_of(decl, tmp_path)


def test_a_seed_rule_decides_how_many_seeds_the_verdicts_read(tmp_path):
    from sparsetrain.analysis.power import seeds_by_internal_pilot

    # the first 3 seeds agree closely: the rule asks for no more, and the study is judged on them
    # (it waited for all 6 declared seeds before, pending for ever)
    close = [0.1, 0.15, 0.05]
    decl, runs = _seed_rule_study(tmp_path / "close", close)
    seeds, why = declared.due_seeds(decl, runs)
    assert seeds == [0, 1, 2] and why.startswith("the seed rule: SD of x - y over seeds 0-2")
    verdicts, comparisons, *_ = declared.tables(decl, runs)
    assert comparisons.data.iloc[0]["test"] == "paired t (n=3)"
    assert "The seeds: the seed rule" in comparisons.notes[-1]
    # they spread: the rule asks for more, and the verdict waits for them
    spread = [1.5, -0.5, 0.4]
    decl, runs = _seed_rule_study(tmp_path / "spread", spread)
    n = seeds_by_internal_pilot(float(pd.Series(spread).std(ddof=1)), 1.0, 3, 6, 0.8, 0.05, 0.8)
    assert n > 3 and declared.due_seeds(decl, runs)[0] == list(range(n))
    verdicts, *_ = declared.tables(decl, runs)
    assert verdicts.data.iloc[0]["4 epochs"] == f"pending (6 of {2 * n} runs ended)"


def test_the_seed_rule_sizes_on_the_seeds_its_sd_came_from(tmp_path):
    # y's seed 2 failed: the SD comes from 2 differences, so its upper bound is wider (df 1, not 2)
    from sparsetrain.analysis.power import seeds_by_internal_pilot

    decl, runs = _seed_rule_study(tmp_path, [0.3, 0.5, 0.4], cap=6)
    runs.loc[(runs["scheme"] == "randk") & (runs["seed"] == 2), ["status", "test_accuracy"]] = ["failed", None]
    seeds, why = declared.due_seeds(decl, runs)
    sd = float(pd.Series([0.3, 0.5]).std(ddof=1))
    assert len(seeds) == seeds_by_internal_pilot(sd, 1.0, 3, 6, n_measured=2)
    assert len(seeds) > seeds_by_internal_pilot(sd, 1.0, 3, 6)  # sized as if from 3: too few
    assert "(2 where both completed)" in why


def test_format_2_tables_give_the_interval_with_test_set_error(tmp_path):
    from sparsetrain.analysis.findings import difference_over_images

    decl, runs = _seed_rule_study(tmp_path, [0.1, 0.15, 0.05], predictions=True)
    _, comparisons, *_ = declared.tables(decl, runs)
    cell = comparisons.data.iloc[0]["95% interval with test-set error"]
    side = runs.set_index("scheme")
    t = difference_over_images(runs[runs["scheme"] == "topk"], runs[runs["scheme"] == "randk"])
    assert side.shape[0] == 6 and t.n_seeds == 3 and t.n_images == 200
    assert cell == f"[{t.low:+.2f}, {t.high:+.2f}] (SE seeds {t.se_seeds:.2f}, images {t.se_images:.2f})"
