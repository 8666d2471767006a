"""The second pass's tuning read over its seeds (sparsetrain.analysis.tuning, format 2): a trial's
score is its seeds' mean validation accuracy, an incomplete trial is never chosen, a seed that did
not train loses the trial, ties go to the smaller rate, and the edge rule widens every point's
grid; then the tuned files and the verdict runs' configs. No training."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sparsetrain.analysis import tuning
from sparsetrain.analysis.declared import load
from sparsetrain.analysis.tuning import (
    COMPLETE,
    INCOMPLETE,
    LOST,
    RUNNING,
    DeclaredTuning,
    declared_tuning,
    read_tuning,
    seed_trials,
    tuning_runs,
)

ROOT = Path(__file__).resolve().parents[1]
VERDICTS2 = ROOT / "conf" / "declared" / "verdicts2.yaml"
LOCAL2 = ROOT / "conf" / "declared" / "local2.yaml"
SEEDS = (200, 201)


def _plan(grid: dict, path: Path = VERDICTS2, sweep: str = "verdict2", budget: int = 16) -> DeclaredTuning:
    return DeclaredTuning(path, sweep, budget, SEEDS, grid)


def _runs(trials: dict, warmup: dict | None = None, budget: int = 16) -> pd.DataFrame:
    """{(point, lr): {seed: val accuracy, or a status}} as load_runs rows (a status string: that
    run ended without training, or 'running')."""
    rows = []
    for (point, lr), by_seed in trials.items():
        for seed, value in by_seed.items():
            ran = isinstance(value, float)
            rows.append({"point": point, "scheme": "topk", "lr": lr, "warmup_epochs": (warmup or {}).get(point, 0.3),
                         "epochs_planned": budget, "seed": seed, "status": "completed" if ran else value,
                         "val_accuracy": value if ran else None, "code": "abc123",
                         "overrides": f"seed={seed} point=tuned_{point} optim.lr={lr} optim.warmup_epochs=0.3 "
                                      f"train.epochs={budget}",
                         "run_dir": f"/r/{point}-{lr}-{seed}"})
    return pd.DataFrame(rows)


def test_a_trials_score_is_the_mean_over_its_seeds_with_n_shown():
    found = seed_trials(_runs({("a", 0.1): {200: 0.90, 201: 0.92}, ("a", 0.2): {200: 0.80}}), SEEDS)
    full = found[found["lr"] == 0.1].iloc[0]
    assert full["n"] == 2 and full["state"] == "scored" and full["score"] == pytest.approx(0.91)
    part = found[found["lr"] == 0.2].iloc[0]
    assert part["n"] == 1 and part["state"] == INCOMPLETE and part["val_by_seed"][201] == "absent"


def test_an_incomplete_trial_is_never_chosen_and_the_point_waits():
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3)})
    runs = _runs({("a", 0.1): {200: 0.90, 201: 0.90}, ("a", 0.2): {200: 0.99, 201: "running"},
                  ("a", 0.4): {200: 0.80, 201: 0.80}})
    reading = read_tuning(plan, runs)
    assert reading.state == RUNNING and reading.choices["a"] is None
    assert reading.asks == {0: {"a": [0.2]}}
    text = tuning.tuning_text(reading)
    assert "incomplete: never chosen" in text and "NOT COMPLETE" in text and "CHOSEN" not in text
    assert "RESUME=1 bash scripts/verdict2.sh" in text


def test_a_trial_with_a_seed_that_did_not_train_loses():
    plan = _plan({"a": ((0.05, 0.1, 0.2, 0.4), 0.3)})
    runs = _runs({("a", 0.05): {200: 0.80, 201: 0.80}, ("a", 0.1): {200: 0.90, 201: 0.90},
                  ("a", 0.2): {200: 0.99, 201: "did not train"}, ("a", 0.4): {200: 0.80, 201: 0.80}})
    reading = read_tuning(plan, runs)
    lost = reading.trials[reading.trials["lr"] == 0.2].iloc[0]
    assert lost["state"] == LOST
    assert reading.state == COMPLETE and reading.choices["a"]["lr"] == 0.1  # not 0.2, whose one seed scored 0.99


def test_a_run_stopped_by_a_signal_has_not_ended_and_its_trial_waits(tmp_path):
    """A run SIGTERM stopped at a checkpoint (a session's end, SLURM's preemption) records status
    'failed': read as ended, its trial lost for good, and the tuning moved on without it."""
    import json

    from test_analysis import make_config, write_run

    from sparsetrain import analysis as sa

    run = write_run(tmp_path / "r", make_config(), status="failed")
    summary = json.loads((run / "summary.json").read_text())
    summary["error"] = "Preempted: SIGTERM at step 20: checkpoint saved; rerun into this folder to resume"
    (run / "summary.json").write_text(json.dumps(summary))
    assert list(sa.load_runs(tmp_path)["status"]) == ["stopped"]
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3)})
    runs = _runs({("a", 0.1): {200: 0.90, 201: 0.90}, ("a", 0.2): {200: 0.99, 201: "stopped"},
                  ("a", 0.4): {200: 0.80, 201: 0.80}})
    reading = read_tuning(plan, runs)
    assert reading.trials[reading.trials["lr"] == 0.2].iloc[0]["state"] == INCOMPLETE
    assert reading.state == RUNNING and reading.asks == {0: {"a": [0.2]}}


def test_ties_go_to_the_smaller_rate():
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3)})
    runs = _runs({("a", 0.1): {200: 0.80, 201: 0.80}, ("a", 0.2): {200: 0.90, 201: 0.92},
                  ("a", 0.4): {200: 0.92, 201: 0.90}})  # the same mean, summed in another order
    assert read_tuning(plan, runs).choices["a"]["lr"] == 0.2


def test_the_edge_rule_doubles_every_point_while_one_choice_is_at_the_top():
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3), "b": ((0.05, 0.1, 0.2), 0.3)})
    first = {("a", 0.1): {200: 0.80, 201: 0.80}, ("a", 0.2): {200: 0.85, 201: 0.85}, ("a", 0.4): {200: 0.90, 201: 0.90},
             ("b", 0.05): {200: 0.80, 201: 0.80}, ("b", 0.1): {200: 0.90, 201: 0.90}, ("b", 0.2): {200: 0.85, 201: 0.85}}
    reading = read_tuning(plan, _runs(first))
    assert reading.state == RUNNING and reading.rounds == [(["a"], [])]
    assert reading.asks == {1: {"a": [0.8], "b": [0.4]}}  # b too, though its choice is inside its grid
    lines = tuning.commands(reading)
    assert lines == [
        'PYTHONPATH=$PWD RESUME=1 SUFFIX=_a_edge1 EXTRA="point=tuned_a optim.warmup_epochs=0.3 train.epochs=16 '
        'optim.lr=0.8" bash scripts/reproduce.sh verdict2_tune',
        'PYTHONPATH=$PWD RESUME=1 SUFFIX=_b_edge1 EXTRA="point=tuned_b optim.warmup_epochs=0.3 train.epochs=16 '
        'optim.lr=0.4" bash scripts/reproduce.sh verdict2_tune']
    # the doubling ran: a's choice moves to 0.8, again the top: one more round for every point
    second = {**first, ("a", 0.8): {200: 0.95, 201: 0.95}, ("b", 0.4): {200: 0.70, 201: 0.70}}
    reading = read_tuning(plan, _runs(second))
    assert reading.rounds == [(["a"], []), (["a"], [])] and reading.asks == {2: {"a": [1.6], "b": [0.8]}}
    # ... which stops training: every choice inside its grid, the tuning is complete
    third = {**second, ("a", 1.6): {200: 0.95, 201: "did not train"}, ("b", 0.8): {200: 0.6, 201: 0.6}}
    reading = read_tuning(plan, _runs(third))
    assert reading.state == COMPLETE and reading.choices["a"]["lr"] == 0.8 and len(reading.rounds) == 2


def test_the_edge_rule_halves_every_point_while_one_choice_is_at_the_bottom():
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3), "b": ((0.05, 0.1, 0.2), 0.3)})
    runs = _runs({("a", 0.1): {200: 0.90, 201: 0.90}, ("a", 0.2): {200: 0.85, 201: 0.85}, ("a", 0.4): {200: 0.8, 201: 0.8},
                  ("b", 0.05): {200: 0.80, 201: 0.80}, ("b", 0.1): {200: 0.90, 201: 0.90}, ("b", 0.2): {200: 0.85, 201: 0.85}})
    reading = read_tuning(plan, runs)
    assert reading.rounds == [([], ["a"])] and reading.asks == {1: {"a": [0.05], "b": [0.025]}}


def test_runs_outside_the_grid_are_shown_and_not_read():
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3)})
    runs = _runs({("a", 0.1): {200: 0.80, 201: 0.80}, ("a", 0.2): {200: 0.90, 201: 0.90}, ("a", 0.4): {200: 0.8, 201: 0.8},
                  ("a", 0.3): {200: 0.99, 201: 0.99}})
    reading = read_tuning(plan, runs)
    assert reading.state == COMPLETE and reading.choices["a"]["lr"] == 0.2
    text = tuning.tuning_text(reading)
    assert "not asked for by the grid or the edge rule: not read" in text
    assert "CHOSEN" in text and "Tuning: COMPLETE" in text


def test_the_committed_dense_sweep_reads_as_two_seed_trials():
    """results/verdict2_tune_dense: each trial's n is 2 and its score the mean of its two runs'
    final validation accuracy, read here straight from their summary.json."""
    plan = declared_tuning(VERDICTS2)
    reading = read_tuning(plan, tuning_runs(plan, ROOT / "results"))
    dense = reading.trials[reading.trials["point"] == "dense"].sort_values("lr")
    assert list(dense["lr"]) == [0.025, 0.05, 0.1] and list(dense["n"]) == [2, 2, 2]
    for trial in dense.to_dict("records"):
        vals = []
        for seed in SEEDS:
            folder = ROOT / "results" / "verdict2_tune_dense" / f"none-layerwise-r0.01-lr{trial['lr']:g}-wu1.0-s{seed}"
            vals.append(json.loads((folder / "summary.json").read_text())["val_accuracy"])
        assert trial["score"] == pytest.approx(sum(vals) / 2, abs=1e-12), trial["lr"]


def _complete(plan: DeclaredTuning) -> tuning.TuningReading:
    runs = {}
    for point, (rates, _) in plan.grid.items():
        for i, lr in enumerate(rates):
            runs[(point, lr)] = {s: 0.9 if i == 1 else 0.8 for s in SEEDS}  # the middle rate chosen
    warmups = {p: w for p, (_, w) in plan.grid.items()}
    frame = _runs(runs, warmups, plan.budget)
    frame["overrides"] = [o.replace(f"point=tuned_{p}", f"point={_point_file(plan, p)}")
                          for o, p in zip(frame["overrides"], frame["point"])]
    reading = read_tuning(plan, frame)
    assert reading.state == COMPLETE
    return reading


def _point_file(plan: DeclaredTuning, point: str) -> str:
    if plan.sweep != "local2":
        return f"tuned_{point}"
    body = re.search(r"POINT_FILE=\((.*?)\)", (ROOT / "scripts" / "local2.sh").read_text(), re.S).group(1)
    return dict(re.findall(r"\[(\w+)\]=(\w+)", body))[point]


def test_the_writer_refuses_an_incomplete_tuning(tmp_path):
    plan = _plan({"a": ((0.1, 0.2, 0.4), 0.3)})
    reading = read_tuning(plan, _runs({("a", 0.1): {200: 0.8, 201: 0.8}, ("a", 0.2): {200: 0.9, 201: "running"},
                                       ("a", 0.4): {200: 0.8, 201: 0.8}}))
    with pytest.raises(ValueError, match="the tuning is running .* no tuned file written"):
        tuning.write_tuned2(reading, tmp_path / "tuned")
    assert not (tmp_path / "tuned").exists()
    (tmp_path / "results").mkdir()  # no run yet: every trial is due
    assert tuning.main(["--declared", str(VERDICTS2), "--results", str(tmp_path / "results"),
                        "--write-tuned", str(tmp_path / "tuned")]) == 2
    assert not (tmp_path / "tuned").exists()


def test_the_writer_records_the_choice_its_trials_commit_and_declaration(tmp_path):
    plan = declared_tuning(VERDICTS2)
    written = tuning.write_tuned2(_complete(plan), tmp_path)
    assert sorted(p.stem for p in written) == sorted(plan.grid)
    doc = yaml.safe_load((tmp_path / "topk_global.yaml").read_text())
    assert doc["lr"] == 0.1 and doc["warmup_epochs"] == 0.3 and doc["point_config"] == "tuned_topk_global"
    assert doc["declaration"] == "conf/declared/verdicts2.yaml" and doc["code"] == "abc123"
    assert [t["lr"] for t in doc["trials"]] == [0.05, 0.1, 0.2]
    assert doc["trials"][1]["val_accuracy"] == {200: 0.9, 201: 0.9} and doc["trials"][1]["mean"] == 0.9


def test_verdict_runs_refuse_before_every_point_is_tuned(tmp_path):
    assert tuning.main(["--declared", str(VERDICTS2), "--results", str(tmp_path),
                        "--verdict-runs", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize("path", [VERDICTS2, LOCAL2], ids=["verdicts2", "local2"])
def test_each_verdict_point_composes_to_the_declared_point_at_its_tuned_rate(tmp_path, path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sparsetrain import config

    plan, decl = declared_tuning(path), load(path)
    reading = _complete(plan)
    tuning.write_tuned2(reading, tmp_path)
    seeds, _ = tuning.verdict_seeds(path, tmp_path)  # no verdict run yet: the first seeds
    assert seeds == list(decl.seeds[:6])
    lines = tuning.verdict_overrides(plan, tmp_path, seeds)
    assert set(lines) == set(decl.points)
    config.register()
    with initialize_config_dir(str(config.CONF_DIR), version_base=None):
        for point, want in decl.points.items():
            tuned = yaml.safe_load((tmp_path / f"{point}.yaml").read_text())
            cfg = compose("config", overrides=[f"experiment={plan.sweep}", *lines[point].split()[:-1]])
            choice = reading.choices[point]
            assert (cfg.optim.lr, cfg.optim.warmup_epochs) == (choice["lr"], choice["warmup_epochs"]), point
            assert (tuned["lr"], tuned["warmup_epochs"]) == (choice["lr"], choice["warmup_epochs"]), point
            assert cfg.train.epochs == decl.budgets[0] and cfg.data.val_size > 0, point
            assert cfg.scheme.name == ("none" if want["scheme"] == "dense" else want["scheme"]), point
            if "ratio" in want:
                assert cfg.ratio == want["ratio"], point
            if "scope" in want:
                assert cfg.scope.name == want["scope"], point
            if "sync" in want:
                assert cfg.scheme.sync.period == int(re.search(r"period=(\d+)", want["sync"]).group(1)), point
            assert lines[point].split()[-1] == f"seed={','.join(map(str, seeds))}"
            # the tuning's own preset with the same overrides: the same run (scripts/verdict2_runs.sh
            # with TUNING_CHECKOUT runs it, on the tuning's commit)
            tune = compose("config", overrides=[f"experiment={plan.preset}", *lines[point].split()[:-1]])
            assert OmegaConf.to_container(tune, resolve=True) == OmegaConf.to_container(cfg, resolve=True), point


def test_a_verdict_run_without_its_tuned_rate_stops():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sparsetrain import config

    config.register()
    with initialize_config_dir(str(config.CONF_DIR), version_base=None):
        for experiment in ("verdict2", "local2"):
            cfg = compose("config", overrides=[f"experiment={experiment}", "point=tuned_dense"])
            with pytest.raises(Exception, match="tuned2_lr_on_the_command_line"):
                OmegaConf.to_container(cfg.optim, resolve=True)


def _verdict_run(results: Path, point: str, seed: int, test_accuracy: float) -> None:
    """A completed verdict run of ``point`` (a copy of a committed tuning run, its seed and test
    accuracy changed): what the seed rule reads."""
    source = ROOT / "results" / "verdict2_tune_dense" / "none-layerwise-r0.01-lr0.1-wu1.0-s200"
    folder = results / "verdict2" / point / f"s{seed}"
    folder.mkdir(parents=True)
    summary = json.loads((source / "summary.json").read_text())
    scheme = point.split("_")[0]  # the point's scheme, as the tables select it (layer-wise, 1%)
    summary["config"]["scheme"].update(name=scheme, error_feedback=True)
    summary["config"]["seed"], summary["test_accuracy"] = seed, test_accuracy
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text((source / "metrics.jsonl").read_text())
    (folder / ".hydra").mkdir()
    hydra = (source / ".hydra" / "hydra.yaml").read_text().replace("scheme: none", f"scheme: {scheme}")
    (folder / ".hydra" / "hydra.yaml").write_text(hydra)


def test_the_seed_rule_sizes_the_verdict_runs_on_its_pairs_first_seeds(tmp_path):
    from sparsetrain.analysis.power import seeds_by_internal_pilot

    gaps = [0.25, -0.75, 0.5, 1.0, -0.25, 0.0]  # random-k - block-k, points, seeds 0-5: SD 0.61
    for seed, gap in enumerate(gaps):
        _verdict_run(tmp_path, "blockk_layerwise", seed, 0.90)
        if seed < 5:
            _verdict_run(tmp_path, "randk_layerwise", seed, 0.90 + gap / 100)
    seeds, why = tuning.verdict_seeds(VERDICTS2, tmp_path)
    assert seeds == [0, 1, 2, 3, 4, 5] and "has not ended" in why  # seed 5 of the pair is due
    _verdict_run(tmp_path, "randk_layerwise", 5, 0.90 + gaps[5] / 100)
    seeds, why = tuning.verdict_seeds(VERDICTS2, tmp_path)
    n = seeds_by_internal_pilot(float(pd.Series(gaps).std(ddof=1)), 1.0, 6, 22, 0.8, 0.035, 0.8)
    assert n == 10 and seeds == list(range(n)), why  # 6 < n < 22: the rule, not a bound
    assert tuning.verdict_seeds(LOCAL2, tmp_path)[0] == [0, 1, 2, 3, 4, 5]  # no seed rule: its seeds


def test_the_command_exits_3_while_trials_are_due_and_0_once_complete(tmp_path, monkeypatch, capsys):
    (tmp_path / "results").mkdir()
    assert tuning.main(["--declared", str(VERDICTS2), "--results", str(tmp_path / "results")]) == 3
    assert "RESUME=1 bash scripts/verdict2.sh" in capsys.readouterr().out
    plan = declared_tuning(VERDICTS2)
    done = _complete(plan)  # every point's middle rate chosen
    frame = _runs({(p, lr): {200: 0.9 if i == 1 else 0.8, 201: 0.9 if i == 1 else 0.8}
                   for p, (rates, _) in plan.grid.items() for i, lr in enumerate(rates)},
                  {p: w for p, (_, w) in plan.grid.items()})
    monkeypatch.setattr(tuning, "tuning_runs", lambda plan, results: frame)
    assert tuning.main(["--declared", str(VERDICTS2), "--results", str(tmp_path / "results"),
                        "--write-tuned", str(tmp_path / "tuned")]) == 0
    assert sorted(p.stem for p in (tmp_path / "tuned").iterdir()) == sorted(done.choices)


def test_points_whose_schemes_record_other_config_keys_are_each_read():
    """local2 reads local SGD beside top-k: a config key one scheme records (the sync's period) is
    absent from the other's runs. pandas 3's ``astype(str)`` kept that absence missing, and the
    trial labels' join stopped on it (found on the committed topk_low sweep): every trial is read,
    each point's runs in their own trials."""
    runs = _runs({("low", 0.05): {200: 0.93, 201: 0.94}, ("top", 0.05): {200: 0.91, 201: 0.92}})
    runs["scheme.sync.period"] = [66.0, 66.0, None, None]
    found = seed_trials(runs, SEEDS)
    assert sorted(found["point"]) == ["low", "top"] and list(found["n"]) == [2, 2]
    assert list(found["state"]) == ["scored", "scored"]


def test_the_committed_local2_sweeps_read_as_two_seed_trials():
    """The local2 tuning sweeps committed whole (local SGD every 66 steps, top-k at 0.504%) read
    side by side, each trial with both seeds."""
    plan = declared_tuning(LOCAL2)
    reading = read_tuning(plan, tuning_runs(plan, ROOT / "results"))
    for point in ("localsgd_low", "topk_low"):
        mine = reading.trials[(reading.trials["point"] == point) & reading.trials["due"]]
        first = mine[mine["round"] == 0]
        assert len(first) == 4 and set(first["n"]) == {2}, point
        # localsgd_low's best lr (0.05) is the lowest tried, so by the edge rule every point gets
        # one halving; its runs are committed as they end, so only the rate is pinned here.
        assert set(mine[mine["round"] == 1]["lr"]) == {0.025}, point


# Stands in for the venv's python in scripts/verdict2_runs.sh: a sweep records where it ran, on which
# code and with what; everything else (the analysis, yaml) goes to the real interpreter.
FAKE_RUN = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = sparsetrain.run ]; then
  echo "$PWD|$PYTHONPATH|$*" >> "$SEEN"; exit 0
fi
exec "$REAL_PY" "$@"
"""


def _verdict_script(tmp_path: Path, dirty: bool = False, other_commit: bool = False):
    """scripts/verdict2_runs.sh conf/declared/local2.yaml with TUNING_CHECKOUT, from a copy of this
    checkout's scripts, declaration and tuned files; returns (the process, the sweeps it ran)."""
    import os
    import shutil
    import subprocess
    import sys

    here, tuned_at = tmp_path / "main", tmp_path / "wt"
    (here / "scripts").mkdir(parents=True)
    for name in ("verdict2_runs.sh", "reproduce.sh"):
        shutil.copy(ROOT / "scripts" / name, here / "scripts")
    (here / "conf" / "declared").mkdir(parents=True)
    decl = here / "conf" / "declared" / "local2.yaml"
    shutil.copy(LOCAL2, decl)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tuned_at)]
    (tuned_at / "conf").mkdir(parents=True)
    (tuned_at / "conf" / "a.yaml").write_text("a: 1\n")
    subprocess.run(["git", "init", "-q", str(tuned_at)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tuning"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    plan = declared_tuning(decl)
    for f in tuning.write_tuned2(_complete(plan), here / "conf" / "tuned2" / "local2"):
        f.write_text(f.read_text().replace("code: abc123", f"code: {commit[:12]}").replace(str(decl), "conf/declared/local2.yaml"))
    if other_commit:
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "later"], check=True)
    if dirty:
        (tuned_at / "conf" / "a.yaml").write_text("a: 2\n")
    fake, seen = tmp_path / "python", tmp_path / "seen"
    fake.write_text(FAKE_RUN)
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "REAL_PY": sys.executable, "SEEN": str(seen), "COMMIT": "0",
           "TUNING_CHECKOUT": str(tuned_at)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "scripts/verdict2_runs.sh", "conf/declared/local2.yaml"], cwd=here, env=env,
                          capture_output=True, text=True, timeout=120)
    return done, (seen.read_text().splitlines() if seen.exists() else []), plan, tuned_at


def test_verdict_runs_go_on_the_tunings_commit_as_its_preset(tmp_path):
    done, sweeps, plan, tuned_at = _verdict_script(tmp_path)
    assert done.returncode == 0, done.stderr
    ran = {}
    for line in sweeps:
        cwd, pythonpath, args = line.split("|")
        assert cwd == str(tuned_at) and pythonpath.split(":")[0] == str(tuned_at)
        point = re.search(r"hydra.sweep.dir=results/local2/(\w+)", args).group(1)
        ran.setdefault(point, args)
    assert set(ran) == set(plan.grid)
    for point, args in ran.items():
        assert "experiment=local2_tune " in args and f"point={_point_file(plan, point)} " in args
        assert "seed=0,1,2,3,4,5" in args and "optim.lr=" in args and "train.epochs=4" in args


@pytest.mark.parametrize("dirty,other_commit", [(False, True), (True, False)], ids=["other_commit", "dirty"])
def test_verdict_runs_refuse_a_checkout_off_the_tunings_commit(tmp_path, dirty, other_commit):
    done, sweeps, _, tuned_at = _verdict_script(tmp_path, dirty=dirty, other_commit=other_commit)
    assert done.returncode == 2 and sweeps == []
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"error: TUNING_CHECKOUT={tuned_at} is at ")
    assert "allowed: a clean checkout on the tuning's commit" in error[0]
    assert ("with uncommitted code" in error[0]) == dirty


def _local2_verdict_runs(results: Path, experiment: str) -> None:
    """Seeds 0-5 of local2's localsgd_low and topk_low in results/local2/<point>/, made from the
    committed tuning runs (seeds 200/201 relabelled; accuracies as they are: no result), each
    recording ``experiment`` as a verdict run on the tuning's commit does (``local2_tune``)."""
    import shutil

    tuned = {"localsgd_low": "local2_tune_localsgd_low/localsgd-layerwise-r0.01-lr0.05-wu0.3-s20{}",
             "topk_low": "local2_tune_topk_low/topk-layerwise-r0.00504-lr0.1-wu0.3-s20{}"}
    for point, pattern in tuned.items():
        for seed in range(6):
            source = ROOT / "results" / pattern.format(seed % 2)
            folder = results / "local2" / point / f"s{seed}"
            shutil.copytree(source, folder)
            summary = json.loads((folder / "summary.json").read_text())
            summary["config"]["seed"] = seed
            (folder / "summary.json").write_text(json.dumps(summary))
            hydra = folder / ".hydra" / "hydra.yaml"  # where the run records its preset
            hydra.write_text(re.sub(r"(?m)^(\s+experiment: )local2_tune$", rf"\g<1>{experiment}", hydra.read_text()))


@pytest.mark.parametrize("experiment,read", [("local2_tune", True), ("local2", True), ("frontier", False)])
def test_verdict_runs_made_as_the_tuning_preset_are_the_studys_own(tmp_path, experiment, read):
    """A verdict run on the tuning's commit records the tuning's preset (local2_tune): in the
    study's folder it is read as the study's (another preset's run is not), and the provenance
    line does not take it for a reference run."""
    from sparsetrain.analysis import declared

    _local2_verdict_runs(tmp_path, experiment)
    decl = declared.load(LOCAL2)
    assert decl.own_experiments == ["local2", "local2_tune"]
    runs = declared.runs_of(decl, tmp_path)
    assert sorted(set(runs["experiment"])) == [experiment] and len(runs) == 12
    verdicts, comparisons, *_ = declared.tables(decl, runs)
    row = comparisons.display[comparisons.display["comparison (A vs B)"] == "localsgd_low vs topk_low"].iloc[0]
    assert (row["outcome"] != "pending") == read
    assert ("before every run (12 runs on 1af263d5fe01)" in declared.provenance(decl, runs)) or not read


# Stands in for the venv's python in scripts/study.sh: `--commands` answers from a script of
# "<exit code>|<line>" (one answer a call), `--write-tuned DIR` writes one file; the rest is python.
FAKE_TUNING = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = sparsetrain.analysis.tuning ]; then
  case " $* " in
    *" --commands "*)
      n=$(cat "$STATE" 2>/dev/null || echo 0); echo $((n + 1)) > "$STATE"
      answer=$(sed -n "$((n + 1))p" "$ANSWERS"); out=${answer#*|}
      [ -z "$out" ] || echo "$out"
      exit "${answer%%|*}";;
    *" --write-tuned "*)
      for a; do last=$a; done; mkdir -p "$last"; echo "lr: 0.1" > "$last/dense.yaml"; exit 0;;
  esac
fi
exec "$REAL_PY" "$@"
"""


def _study_script(tmp_path: Path, answers: list[str], verdicts: str = "", tuned: str | None = None):
    """scripts/study.sh conf/declared/local2.yaml from a copy of this checkout's script (a git
    repository), the tuning's answers scripted; ``tuned``: conf/tuned2/local2/dense.yaml committed
    before it starts. Returns (the process, what ran, the checkout)."""
    import os
    import shutil
    import subprocess
    import sys

    here, tuned_at = tmp_path / "main", tmp_path / "wt"
    (here / "scripts").mkdir(parents=True)
    tuned_at.mkdir()
    shutil.copy(ROOT / "scripts" / "study.sh", here / "scripts")
    (here / "scripts" / "verdict2_runs.sh").write_text('echo "verdicts $1 on $TUNING_CHECKOUT" >> "$LOG"\n')
    (here / "conf" / "declared").mkdir(parents=True)
    shutil.copy(LOCAL2, here / "conf" / "declared" / "local2.yaml")
    if tuned is not None:
        (here / "conf" / "tuned2" / "local2").mkdir(parents=True)
        (here / "conf" / "tuned2" / "local2" / "dense.yaml").write_text(tuned)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(here)]
    subprocess.run(["git", "init", "-q", str(here)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    fake, log, script = tmp_path / "python", tmp_path / "log", tmp_path / "answers"
    fake.write_text(FAKE_TUNING)
    fake.chmod(0o755)
    script.write_text("\n".join(answers) + "\n")
    env = {**os.environ, "PY": str(fake), "REAL_PY": sys.executable, "LOG": str(log), "ANSWERS": str(script),
           "STATE": str(tmp_path / "state"), "TUNING_CHECKOUT": str(tuned_at), "VERDICTS": verdicts,
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    done = subprocess.run(["bash", "scripts/study.sh", "conf/declared/local2.yaml"], cwd=here, env=env,
                          capture_output=True, text=True, timeout=60)
    return done, (log.read_text().splitlines() if log.exists() else []), here


def test_the_study_driver_runs_the_tuning_to_its_end_then_the_verdicts(tmp_path):
    """Each round the tuning asks for runs in the tuning's checkout (with DEST here), the choices
    are committed here, and with VERDICTS=tuning-commit the verdict runs follow on that checkout."""
    done, ran, here = _study_script(tmp_path, ['3|echo "grid in $PWD to $DEST" >> "$LOG"',
                                               '3|echo "edge round 1 in $PWD" >> "$LOG"', "0|"],
                                    verdicts="tuning-commit")
    assert done.returncode == 0, done.stderr
    wt = tmp_path / "wt"
    assert ran == [f"grid in {wt} to {here}", f"edge round 1 in {wt}", f"verdicts conf/declared/local2.yaml on {wt}"]
    import subprocess

    log = subprocess.run(["git", "-C", str(here), "log", "--format=%s", "-1", "--stat"], capture_output=True, text=True)
    assert "conf/tuned2/local2: the choices of conf/declared/local2.yaml's tuning" in log.stdout
    assert "conf/tuned2/local2/dense.yaml" in log.stdout


def test_the_study_driver_stops_after_the_choices_without_verdicts_on_the_tuning_commit(tmp_path):
    done, ran, here = _study_script(tmp_path, ["0|"])
    assert done.returncode == 0 and ran == [] and (here / "conf" / "tuned2" / "local2" / "dense.yaml").exists()
    assert done.stdout.strip().endswith("next, the verdict runs: bash scripts/verdict2_runs.sh conf/declared/local2.yaml "
                                        "(docs/protocol.md)")


def test_the_study_driver_goes_on_with_committed_choices_and_refuses_other_ones(tmp_path):
    """A conf/tuned2 folder already there (a study resumed after its choices were committed) is
    checked against what the tuning gives: the same, the verdicts follow; other choices (left from
    another declaration or round) stop the driver in one line before any verdict run."""
    done, ran, _ = _study_script(tmp_path / "same", ["0|"], verdicts="tuning-commit", tuned="lr: 0.1\n")
    assert done.returncode == 0, done.stderr
    assert ran == [f"verdicts conf/declared/local2.yaml on {tmp_path / 'same' / 'wt'}"]
    done, ran, here = _study_script(tmp_path / "other", ["0|"], verdicts="tuning-commit", tuned="lr: 0.4\n")
    assert done.returncode == 2 and ran == []
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "error: conf/tuned2/local2 holds other choices than conf/declared/local2.yaml's tuning gives (Files "), done.stderr
    assert "allowed: the tuning's own" in done.stderr and "/tmp" not in done.stderr.replace(str(tmp_path), "")
    assert (here / "conf" / "tuned2" / "local2" / "dense.yaml").read_text() == "lr: 0.4\n"  # left as it was


@pytest.mark.parametrize("answers,error", [
    (['3|echo once >> "$LOG"', '3|echo once >> "$LOG"'], "the tuning asks again for what just ran"),
    (["2|"], None)], ids=["no_progress", "no_choice"])
def test_the_study_driver_stops_where_the_tuning_cannot_go_on(tmp_path, answers, error):
    done, ran, here = _study_script(tmp_path, answers, verdicts="tuning-commit")
    assert done.returncode == 2 and not (here / "conf" / "tuned2").exists()
    assert ran == (["once"] if error else [])
    if error:
        assert done.stderr.count("\n") == 1 and error in done.stderr


def test_commands_prints_only_what_runs_the_due_trials(tmp_path, capsys):
    (tmp_path / "results").mkdir()  # no run yet: the declared grid is due
    assert tuning.main(["--declared", str(LOCAL2), "--results", str(tmp_path / "results"), "--commands"]) == 3
    assert capsys.readouterr().out == "RESUME=1 bash scripts/local2.sh   # the declared grid (PY and DEST as in its header)\n"


def test_a_points_folder_holding_another_points_runs_stops_in_one_line(tmp_path):
    """A point's trials were whatever its folder held: top-k at 1.567% copied into top-k at 0.504%'s
    folder were ranked as its trials, and would have been written as its choice."""
    import shutil

    plan = declared_tuning(LOCAL2)
    committed = ROOT / "results" / "local2_tune_topk_high"
    shutil.copytree(committed, tmp_path / "local2_tune_topk_low")
    with pytest.raises(ValueError) as refused:
        tuning_runs(plan, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "ratio=0.01567 in the folder of tuning point 'topk_low'" in message
    assert "allowed: ratio=0.00504" in message
    shutil.copytree(committed, tmp_path / "local2_tune_topk_high")  # in its own folder: read
    shutil.rmtree(tmp_path / "local2_tune_topk_low")
    assert set(tuning_runs(plan, tmp_path)["point"]) == {"topk_high"}


def test_a_rate_of_many_digits_reaches_the_verdict_runs_whole(tmp_path):
    """Audit 5 (latent): the verdict runs' overrides wrote the tuned rate with ``:g`` (six
    significant digits): 0.0123456789 would have trained at 0.0123457."""
    plan = declared_tuning(LOCAL2)
    tuning.write_tuned2(_complete(plan), tmp_path)
    point = sorted(plan.grid)[0]
    path = tmp_path / f"{point}.yaml"
    path.write_text(path.read_text().replace("\nlr: ", "\nlr: 0.0123456789\n_was: ", 1))
    line = tuning.verdict_overrides(plan, tmp_path, [0])[point]
    assert "optim.lr=0.0123456789 " in line, line
