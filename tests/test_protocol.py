"""The tuned protocol's parts: the validation split, "did not train" from the end of training, the
tuned values a preset reads, the tuning study's reading, and the search's objective."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import TINY, read_json, read_jsonl, refusal, run_cli

from sparsetrain.analysis import tuning
from sparsetrain.analysis.loader import load_runs
from sparsetrain.config import ConfigError, compose, validate
from sparsetrain.config import schema as config_schema
from sparsetrain.data import load_dataset, split_validation
from sparsetrain.launch.cli import objective
from sparsetrain.results import DID_NOT_TRAIN, untrained_reason


def test_validation_split_is_one_fixed_draw_apart_from_training():
    x = torch.arange(100).view(100, 1, 1, 1).float()
    y = torch.arange(100)
    train_x, train_y, val_x, val_y = split_validation(x, y, 20)
    again = split_validation(x, y, 20)
    assert torch.equal(val_y, again[3]) and torch.equal(train_y, again[1])  # the same draw every time
    assert len(val_y) == 20 and len(train_y) == 80
    assert not set(val_y.tolist()) & set(train_y.tolist())  # never trained on
    assert sorted(val_y.tolist() + train_y.tolist()) == list(range(100))
    assert val_y.tolist() == sorted(val_y.tolist())  # each split in its original order
    assert val_y.tolist() != list(range(20))  # drawn, not the first N
    with pytest.raises(ConfigError, match=r"data.val_size=100 is not allowed"):
        split_validation(x, y, 100)


def test_a_validation_split_does_not_depend_on_the_seed_and_none_changes_nothing():
    a = load_dataset("synthetic", "unused", train_size=256, test_size=64, seed=0, val_size=32)
    b = load_dataset("synthetic", "unused", train_size=256, test_size=64, seed=0)
    c = load_dataset("synthetic", "unused", train_size=256, test_size=64, seed=1, val_size=32)
    assert a.has_validation and not b.has_validation
    assert len(a.val_y) == 32 and len(a.train_y) == 224 and len(b.train_y) == 256
    # the same held-out positions whatever the run's seed
    held = split_validation(np.arange(256), np.arange(256), 32)[3]
    assert torch.equal(torch.as_tensor(held), torch.as_tensor(split_validation(np.arange(256), np.arange(256), 32)[3]))
    assert len(c.val_y) == 32
    # val_size=0 is the data set as before the split existed: the committed studies' setting
    d = load_dataset("synthetic", "unused", train_size=256, test_size=64, seed=0, val_size=0)
    assert torch.equal(d.train_x, b.train_x) and torch.equal(d.test_x, b.test_x)


@pytest.mark.slow  # a 2-epoch run; the split itself is checked in-process above
def test_a_run_records_validation_and_test_and_judges_training_on_validation(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*TINY, "world_size=2", "data.val_size=64", "train.epochs=2", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["val_size"] == 64 and 0 <= s["val_accuracy"] <= 1 and 0 <= s["test_accuracy"] <= 1
    assert s["val_loss"] > 0 and s["train_loss_final"] > 0
    assert s["train_loss_final_steps"] == math.ceil(0.1 * s["steps"] / s["epochs"])
    epochs = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "epoch"]
    assert len(epochs) == 2 and all("val_accuracy" in r and "test_accuracy" in r for r in epochs)
    assert "val_acc" in proc.stdout
    row = load_runs(run).iloc[0]
    assert row["val_accuracy"] == pytest.approx(s["val_accuracy"])


def test_did_not_train_reads_the_end_of_training_not_the_epochs_mean():
    # A 1-epoch run that blew up early and recovered: its epoch mean is above ln 10, its last
    # steps are well below, and its validation accuracy says it trained (issue 39's run).
    summary = {"status": "completed", "train_loss": 2.42, "train_loss_final": 1.3,
               "val_accuracy": 0.55, "test_accuracy": 0.578, "num_classes": 10}
    assert untrained_reason(summary) is None
    assert "final train loss 2.42" in untrained_reason({**summary, "train_loss_final": None})
    # validation, not test, decides where the run holds a split
    low = untrained_reason({**summary, "val_accuracy": 0.15, "test_accuracy": 0.5})
    assert low == "final validation accuracy 15.0% < 20%"
    assert untrained_reason({**summary, "val_accuracy": 0.5, "test_accuracy": 0.15}) is None
    assert "final test accuracy" in untrained_reason({**summary, "val_accuracy": None, "test_accuracy": 0.1})


def test_the_protocol_reads_each_schemes_tuned_values_and_the_command_line_wins(tmp_path, monkeypatch):
    (tmp_path / "topk_global.yaml").write_text("lr: 0.0125\nwarmup_epochs: 1.0\nval_accuracy: 0.9\n")
    monkeypatch.setattr(config_schema, "TUNED_DIR", tmp_path)
    cfg = compose(["experiment=protocol", "scheme=topk", "scope=global"])
    validate(cfg)
    assert (cfg.optim.lr, cfg.optim.warmup_epochs, cfg.data.val_size) == (0.0125, 1.0, 5000)
    assert compose(["experiment=protocol", "scheme=topk", "scope=global", "optim.lr=0.3"]).optim.lr == 0.3
    untuned = compose(["experiment=protocol", "scheme=randk", "scope=global"])
    with pytest.raises(ConfigError) as err:
        validate(untuned)
    assert str(err.value) == ("scheme=randk scope=global has no tuned values (conf/tuned/randk_global.yaml); "
                              "tuned: topk_global; or give optim.lr and optim.warmup_epochs")


def _trials() -> pd.DataFrame:
    rows = []
    for scheme, scope, lr, warmup, val, status in [
        ("topk", "global", 0.025, 0.3, 0.90, "completed"), ("topk", "global", 0.05, 0.3, 0.91, "completed"),
        ("topk", "global", 0.1, 0.3, 0.91, "completed"),  # a tie: the smaller lr wins
        ("randk", "layerwise", 0.025, 0.3, 0.80, "completed"), ("randk", "layerwise", 0.05, 0.3, 0.95, DID_NOT_TRAIN),
        ("randk", "layerwise", 0.1, 0.3, math.nan, "failed"),
        ("dense", "-", 0.05, 0.3, 0.92, "completed"), ("dense", "-", 0.1, 1.0, 0.93, "completed"),
        ("blockk", "global", 0.05, 0.3, 0.2, DID_NOT_TRAIN),
    ]:
        rows.append({"scheme": scheme, "scope": scope, "lr": lr, "warmup_epochs": warmup, "status": status,
                     "stability": None, "val_accuracy": val, "test_accuracy": 0.5, "seed": 100,
                     "epochs_planned": 4, "code": "abc123", "run_dir": "x"})
    return tuning.trials(pd.DataFrame(rows))


def test_the_choice_is_the_best_trained_trial_on_validation(tmp_path):
    rows = _trials()
    choices = tuning.choose(rows).set_index(["scheme", "scope"])
    assert choices.loc[("topk", "global"), "lr"] == 0.05  # 0.91 twice: the smaller lr
    # a trial that did not train is never chosen, however high its validation accuracy
    assert choices.loc[("randk", "layerwise"), "lr"] == 0.025
    assert choices.loc[("randk", "layerwise"), "trained"] == 1
    assert choices.loc[("randk", "layerwise"), "at_edge"]  # the lowest lr tried
    assert not choices.loc[("topk", "global"), "at_edge"]
    assert (choices.loc[("dense", "-"), "lr"], choices.loc[("dense", "-"), "warmup_epochs"]) == (0.1, 1.0)
    assert ("blockk", "global") not in choices.index
    assert tuning.unchosen(rows, choices.reset_index()) == ["blockk (global)"]
    # a grid not yet run to its end gives no tuned file
    unfinished = pd.concat([rows, rows[rows["scheme"] == "topk"].iloc[[0]].assign(lr=0.2, status="absent", val_accuracy=math.nan)])
    partial = tuning.choose(tuning.trials(unfinished))
    with pytest.raises(ValueError, match=r"not complete \(topk \(global\): 3 of 4 trials ran\)"):
        tuning.write_tuned(partial, tmp_path / "never")
    assert "partial, not a choice yet" in tuning.markdown(tuning.trials(unfinished), partial)

    written = tuning.write(pd.DataFrame(rows), tmp_path / "fig", tmp_path / "tuned")
    names = sorted(p.name for p in written if p.parent.name == "tuned")
    assert names == ["none_global.yaml", "none_layerwise.yaml", "randk_layerwise.yaml", "topk_global.yaml"]
    tuned = yaml.safe_load((tmp_path / "tuned" / "topk_global.yaml").read_text())
    assert (tuned["lr"], tuned["warmup_epochs"], tuned["trials"], tuned["code"]) == (0.05, 0.3, 3, "abc123")
    text = (tmp_path / "fig" / "trials.md").read_text()
    assert "blockk (global)" in text and "ran, none trained: no choice" in text and "**chosen**" in text
    # a scheme none of whose trials has run yet says so (not "none trained")
    waiting = pd.concat([rows, rows[rows["scheme"] == "topk"].assign(scheme="qsgd", status="absent", val_accuracy=math.nan)])
    assert "qsgd (global) | | | | | | 0 / " in tuning.markdown(tuning.trials(waiting), tuning.choose(tuning.trials(waiting)))
    assert (tmp_path / "fig" / "val_vs_lr.png").stat().st_size > 0


def test_a_second_seed_or_another_budget_is_not_a_trial_of_its_own():
    """The first pass grouped trials by scheme and scope only: a second seed at one rate, or a run at
    another budget, competed as a grid point of its own and could be chosen."""
    rows = _trials()
    topk = rows[(rows["scheme"] == "topk") & (rows["lr"] == 0.05)]
    with pytest.raises(ValueError, match=r"2 runs of topk \(global\) share one trial \(lr=0.05, warmup_epochs=0.3\)"):
        tuning.trials(pd.concat([rows, topk.assign(seed=101, val_accuracy=0.99, run_dir="y")]))
    with pytest.raises(ValueError, match=r"trials of topk \(global\) differ in epochs_planned \(epochs_planned: 4, 8\)"):
        tuning.trials(pd.concat([rows, topk.assign(lr=0.2, epochs_planned=8, run_dir="y")]))


def test_a_search_returns_validation_accuracy_never_test_accuracy():
    assert objective({"status": "completed", "val_accuracy": 0.8, "test_accuracy": 0.9}) == 0.8
    assert objective({"status": "completed", "test_accuracy": 0.9}) is None  # no split: nothing to pick by
    assert objective({"status": "failed", "val_accuracy": 0.8}) is None


@pytest.mark.slow  # two sweeps
def test_the_tuning_grid_names_each_trial_by_its_point_and_resumes(tmp_path):
    sweep = tmp_path / "tune"
    args = ("-m", "experiment=tune", *TINY, "world_size=1", "train.epochs=1", "data.val_size=64",
            "scheme=topk", "scope=layerwise", "optim.lr=choice(0.05,0.1)", "optim.warmup_epochs=0.3",
            f"hydra.sweep.dir={sweep}")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert names == ["topk-layerwise-lr0.05-warmup0.3", "topk-layerwise-lr0.1-warmup0.3"]
    assert "(2 runs:" in proc.stdout and "topk-layerwise-lr0.1-warmup0.3" in proc.stdout
    again = run_cli(*args)  # rerun into the folder: both trials are found completed
    assert again.returncode == 0 and again.stdout.count("already completed") == 2
    out = tmp_path / "fig"
    from sparsetrain.analysis.__main__ import main as analyse

    runs = load_runs(sweep)
    assert sorted(runs["lr"]) == [0.05, 0.1] and set(runs["warmup_epochs"]) == {0.3}
    trained = runs["status"].eq("completed").any()
    code = analyse([str(sweep), "--tuning", "--out", str(out), "--quiet"])
    assert code == (0 if trained else 1)


@pytest.mark.slow  # a search of several runs
def test_the_optuna_search_maximises_validation_accuracy(tmp_path):
    sweep = tmp_path / "tpe"
    proc = run_cli("-m", "experiment=tune_tpe", *TINY, "world_size=1", "train.max_steps=4",
                   "data.val_size=64", "hydra.sweeper.n_trials=2", "scheme=randk", "scope=global",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    runs = load_runs(sweep)
    assert len(runs) == 2 and set(runs["scheme"]) == {"randk"} and set(runs["scope"]) == {"global"}
    assert best["best_value"] == pytest.approx(runs["val_accuracy"].max())
    assert best["best_params"]["optim.lr"] in {0.0125, 0.025, 0.05, 0.1}


@pytest.mark.slow  # an Optuna study; the tuning grid reads validation in the fast tier
def test_the_optuna_search_needs_a_validation_split(tmp_path):
    proc = run_cli("-m", "experiment=tune_tpe", *TINY, "world_size=1", "train.max_steps=2",
                   "data.val_size=0", "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={tmp_path / 's'}")
    assert "data.val_size=0 is not allowed with the Optuna sweeper" in proc.stderr


def test_time_to_accuracy_reads_validation_where_a_run_held_a_split(tmp_path):
    import json

    from sparsetrain.analysis.time_to_accuracy import accuracy_curve

    with_split, without = tmp_path / "a", tmp_path / "b"
    for run, val in ((with_split, True), (without, False)):
        run.mkdir()
        records = [{"kind": "epoch", "step": 10 * e, "test_accuracy": 0.5 + 0.1 * e, "test_loss": 1.0 / e,
                    **({"val_accuracy": 0.4 + 0.1 * e, "val_loss": 1.1 / e} if val else {})} for e in (1, 2)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert accuracy_curve(with_split) == [(10.0, 0.5), (20.0, pytest.approx(0.6))]
    assert accuracy_curve(without) == [(10.0, 0.6), (20.0, pytest.approx(0.7))]


@pytest.mark.slow  # two runs
def test_curve_points_score_the_validation_subset_several_times_an_epoch(tmp_path):
    from sparsetrain.analysis.time_to_accuracy import accuracy_curve

    run = tmp_path / "run"
    proc = run_cli(*TINY, "world_size=2", "data.val_size=64", "train.epochs=2", "train.curve_points=3",
                   "train.curve_size=32", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    per_epoch = s["steps"] // 2
    curve = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "curve"]
    expected = sorted({round(j * per_epoch / 3) for j in (1, 2, 3)})
    assert [r["step"] for r in curve] == expected + [per_epoch + e for e in expected]
    assert all(r["size"] == 32 and r["eval_ms"] > 0 for r in curve)
    assert s["curve_s"] > 0 and 0 < s["curve_share"] < 1
    assert accuracy_curve(run) == [(float(r["step"]), r["accuracy"]) for r in curve]
    # scoring the curve changes nothing in training
    plain = tmp_path / "plain"
    assert run_cli(*TINY, "world_size=2", "data.val_size=64", "train.epochs=2", f"hydra.run.dir={plain}").returncode == 0
    p = read_json(plain / "summary.json")
    assert (p["train_loss"], p["train_loss_final"], p["val_accuracy"]) == (s["train_loss"], s["train_loss_final"], s["val_accuracy"])
    assert "train.curve_points=3 is not allowed with data.val_size=0" in refusal(*TINY, "train.curve_points=3")


@pytest.mark.slow  # three runs
def test_stop_at_accuracy_stops_at_the_first_curve_point_that_reaches_it(tmp_path):
    """``train.stop_at_accuracy``: the run stops at the first curve point whose validation
    accuracy reaches the target, having trained exactly as a run without it did up to there;
    summary.json's ``target`` says when and after how long. A target never reached trains the
    whole budget and says so. Bad values stop with one line."""
    common = (*TINY, "world_size=2", "data.val_size=64", "train.epochs=2", "train.curve_points=4",
              "train.curve_size=64", "train.log_every=1")
    plain = tmp_path / "plain"
    proc = run_cli(*common, f"hydra.run.dir={plain}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = [r for r in read_jsonl(plain / "metrics.jsonl") if r["kind"] == "curve"]
    target = curve[1]["accuracy"]  # reached at the second point at the latest
    first = next(r for r in curve if r["accuracy"] >= target)
    run = tmp_path / "stopped"
    proc = run_cli(*common, f"train.stop_at_accuracy={target}", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["steps"] == first["step"]
    t = s["target"]
    assert t["reached"] and (t["accuracy"], t["step"], t["val_accuracy"]) == (target, first["step"], first["accuracy"])
    assert 0 < t["train_s"] <= s["duration_s"] and t["curve_s"] > 0 and t["wall_s"] > t["train_s"] + t["curve_s"]
    losses = lambda d: [r["train_loss"] for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "step"]  # noqa: E731
    assert losses(run) == losses(plain)[: first["step"]]
    # the target is final: the last evaluation scores the stopped model
    assert s["val_accuracy"] is not None
    best = max(r["accuracy"] for r in curve)
    if best < 1.0:
        never = tmp_path / "never"
        proc = run_cli(*common, f"train.stop_at_accuracy={min(1.0, best + 1e-6)}", f"hydra.run.dir={never}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        n = read_json(never / "summary.json")
        assert n["target"]["reached"] is False and n["steps"] == read_json(plain / "summary.json")["steps"]
    for override, message in (("train.stop_at_accuracy=1.5", "train.stop_at_accuracy=1.5 is not allowed; it must be in (0, 1]"),
                              ("train.curve_points=1", "train.stop_at_accuracy=0.5 is not allowed with train.curve_points=1")):
        assert message in refusal(*TINY, "data.val_size=64", "train.curve_points=4", "train.stop_at_accuracy=0.5", override)
