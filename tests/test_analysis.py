"""sparsetrain.analysis on run folders written here by the results-file contract.

``write_run`` and ``write_sweep`` write exactly what the trainer's rank 0 writes (summary.json,
metrics.jsonl, .hydra/{config,overrides,hydra}.yaml, multirun.yaml), with accuracies and times that
follow a known formula so that every number in a table can be checked.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import analysis_cli

from sparsetrain import analysis as sa

# --- fake run folders, by the contract ----------------------------------------------------------

BASE_CONFIG = {
    "world_size": 2,
    "ratio": 0.01,
    "seed": 0,
    "scheme": {"name": "topk", "error_feedback": True, "block_size": 256},
    "scope": {"name": "layerwise"},
    "aggregation": {"name": "allgather"},
    "model": {"name": "resnet20"},
    "data": {"name": "fashion_mnist", "root": "data", "download": False, "train_size": 1000,
             "test_size": 500, "augment": False},
    "train": {"epochs": 3, "max_steps": None, "batch_size": 32, "eval_every": 1, "log_every": 5,
              "device": "cpu", "threads": 1, "timing_warmup": 2},
    "optim": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4,
              "warmup_epochs": 0, "milestones": [0.5, 0.8333], "gamma": 0.1, "scale_lr": True},
    "wandb": {"mode": "disabled", "project": "sparsetrain", "entity": None, "group": None, "tags": []},
    "dist": {"backend": "gloo", "timeout_s": 60, "ranks_per_node": None},
}
GROUPS = ("scheme", "scope", "aggregation", "model", "data")
BASE_ACCURACY = {"none": 0.91, "topk": 0.90, "blockk": 0.88, "randk": 0.86, "powersgd": 0.89, "localsgd": 0.905,
                 "diloco": 0.90, "torch_powersgd": 0.895, "fp16": 0.91}
DENSE_BYTES = 1_000_000


def make_config(**overrides) -> dict:
    """The base config with overrides in sweep form: ``scheme="randk"``, ``train.epochs=2``."""
    config = copy.deepcopy(BASE_CONFIG)
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if key in GROUPS:
            config[key]["name"] = value
            continue
        target = config
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target[parent]
        target[leaf] = value
    return config


def expected_accuracy(config: dict) -> float:
    """The final test accuracy a fake run reports: a formula of its axes."""
    scheme = config["scheme"]["name"]
    acc = BASE_ACCURACY[scheme] + 0.002 * config["seed"]
    if scheme != "none":
        acc -= 0.03 if config["scope"]["name"] == "global" else 0.0
        acc -= 0.01 * math.log10(0.1 / config["ratio"])
        if scheme == "blockk" and config["aggregation"]["name"] == "allreduce":
            acc -= 0.005 * config["world_size"]
    return acc - 0.004 * config["world_size"]


def fake_times(config: dict) -> dict:
    dense = config["scheme"]["name"] == "none"
    times = {"data": 1.0, "forward": 10.0, "backward": 20.0, "exchange": 30.0 if dense else 5.0,
             "optimizer": 2.0}
    if not dense:
        times["compress"] = {"topk": 8.0, "randk": 2.0, "blockk": 0.5, "powersgd": 4.0}.get(config["scheme"]["name"], 1.0)
        times["decompress"] = 1.0
    times = {k: v * (1 + 0.1 * config["seed"]) for k, v in times.items()}
    times["step"] = sum(times.values()) + 0.5
    return times


def write_run(run_dir: Path, config: dict, status: str = "completed", overrides=(),
              experiment: str | None = None, epochs: int | None = None) -> Path:
    """One run folder as rank 0 writes it; ``status`` 'failed' stops after one epoch."""
    run_dir = Path(run_dir)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    choices = {"scheme": config["scheme"]["name"], "scope": config["scope"]["name"],
               "aggregation": config["aggregation"]["name"], "model": config["model"]["name"],
               "data": config["data"]["name"], "experiment": experiment}
    (run_dir / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"runtime": {"choices": choices}, "job": {"name": "run"}}})
    )
    planned = epochs or config["train"]["epochs"]
    done_epochs = planned if status == "completed" else 1
    final = expected_accuracy(config)
    times = fake_times(config)
    dense = config["scheme"]["name"] == "none"
    sent = DENSE_BYTES if dense else int(DENSE_BYTES * config["ratio"] * (2 if config["scheme"]["name"] == "topk" else 1))
    steps_per_epoch = 10
    lines = []
    for epoch in range(1, done_epochs + 1):
        for step in range((epoch - 1) * steps_per_epoch, epoch * steps_per_epoch, config["train"]["log_every"]):
            lines.append({"kind": "step", "step": step, "epoch": step / steps_per_epoch, "lr": 0.1,
                          "train_loss": 2.0 / (1 + step), "time_ms": times, "bytes_sent": sent,
                          "density": 1.0 if dense else config["ratio"],
                          "compression_error": None if dense else 0.5, "memory_norm": None if dense else 1.0})
        lines.append({"kind": "epoch", "epoch": epoch, "step": epoch * steps_per_epoch,
                      "train_loss": 1.0 / epoch, "train_accuracy": final * epoch / planned,
                      "test_loss": 1.0 / epoch, "test_accuracy": final * epoch / planned, "lr": 0.1,
                      "elapsed_s": 1.5 * epoch})
    with open(run_dir / "metrics.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    if status == "running":
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write('{"kind": "step", "st')  # torn last line of a killed run
    summary = {
        "status": status,
        "error": "RuntimeError: NCCL timeout in allgather" if status == "failed" else None,
        "config": config, "run_dir": str(run_dir), "world_size": config["world_size"],
        "steps": done_epochs * steps_per_epoch, "epochs": float(done_epochs),
        "train_loss": 1.0 / done_epochs if status != "running" else None,
        "test_accuracy": final * done_epochs / planned if status == "completed" else None,
        "test_loss": 1.0 / done_epochs if status == "completed" else None,
        "time_ms": times, "bytes_sent_per_step": sent, "dense_bytes_per_step": DENSE_BYTES,
        "num_parameters": DENSE_BYTES // 4, "device": "cpu",
        "started_at": "2025-01-01T00:00:00", "finished_at": None if status == "running" else "2025-01-01T00:01:00",
        "duration_s": None if status == "running" else 60.0,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def write_sweep(sweep_dir: Path, params: dict[str, str], experiment: str, fixed: dict | None = None,
                failed=(), running=(), absent=()) -> Path:
    """A Hydra multirun folder: ``params`` is ``hydra.sweeper.params`` ({"scheme": "none,topk"}).

    ``failed``/``running``/``absent`` hold job numbers that fail, never finish, or leave no folder.
    """
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fixed = fixed or {}
    multirun = {"hydra": {"sweeper": {"params": params},
                          "overrides": {"task": [f"experiment={experiment}"]}, "mode": "MULTIRUN"}}
    (sweep_dir / "multirun.yaml").write_text(yaml.safe_dump(multirun))
    keys = list(params)
    for num, combo in enumerate(itertools.product(*(params[k].split(",") for k in keys))):
        if num in absent:
            continue
        values = {k: yaml.safe_load(v) for k, v in zip(keys, combo, strict=False)}
        config = make_config(**{**fixed, **values})
        status = "failed" if num in failed else "running" if num in running else "completed"
        overrides = [f"experiment={experiment}", *(f"{k}={v}" for k, v in zip(keys, combo, strict=False))]
        write_run(sweep_dir / str(num), config, status, overrides, experiment)
    return sweep_dir


def write_results(root: Path) -> Path:
    """A small results/ tree with one sweep per research question, each with a flaw or two."""
    root = Path(root)
    # job 7 = (topk, global, seed 1) fails; job 15 = (blockk, global, seed 1) left no folder.
    write_sweep(root / "rq1_scope", {"scheme": "none,topk,randk,blockk", "scope": "layerwise,global",
                                     "seed": "0,1"}, "rq1_scope", failed=(7,), absent=(15,))
    write_sweep(root / "rq2_scheme", {"scheme": "topk,randk,blockk", "ratio": "0.01,0.1", "seed": "0,1"},
                "rq2_scheme", running=(0,))
    write_sweep(root / "rq3_aggregation", {"scheme": "randk,blockk", "aggregation": "allreduce,allgather",
                                           "world_size": "2,4", "seed": "0,1"}, "rq3_aggregation")
    write_sweep(root / "rq4_workers", {"scheme": "none,topk,blockk", "world_size": "1,2,4", "seed": "0,1"},
                "rq4_workers")
    write_sweep(root / "rq5_speed", {"scheme": "none,topk,randk,blockk", "seed": "0,1"}, "rq5_speed",
                fixed={"aggregation": "allreduce"})
    write_sweep(root / "stability", {"scheme": "randk,blockk", "scheme.uncompressed": "none,1d"}, "stability")
    write_sweep(root / "ddp_hooks", {"scheme": "blockk,powersgd,none", "seed": "0,1"}, "ddp_hooks",
                fixed={"aggregation": "allreduce", "dist.ddp": True})
    write_sweep(root / "budget", {"scheme": "none,randk", "train.epochs": "2,4"}, "budget")
    write_sweep(root / "ablation", {"scheme": "randk,blockk", "scheme.warmup_steps": "0,100"}, "ablation")
    # the headline protocol: 4 epochs, the same seeds for every configuration
    headline = {"train.epochs": 4}
    write_sweep(root / "headline_dense", {"seed": "0,1,2"}, "headline_dense", fixed={**headline, "scheme": "none"})
    write_sweep(root / "headline", {"seed": "0,1,2", "scheme": "topk,randk,blockk", "scope": "layerwise,global"},
                "headline", fixed=headline)
    write_sweep(root / "headline_bytes", {"seed": "0,1,2"}, "headline_bytes",
                fixed={**headline, "scheme": "blockk", "ratio": 0.01992})
    write_sweep(root / "ddp_fair", {"seed": "0,1", "scheme": "blockk,powersgd"}, "ddp_fair",
                fixed={**headline, "dist.ddp": True, "ratio": 0.0238, "scheme.warmup_steps": 2})
    write_sweep(root / "frontier", {"seed": "0,1", "scheme": "topk,randk"}, "frontier",
                fixed={**headline, "ratio": 0.00504})
    return root


@pytest.fixture
def results(tmp_path) -> Path:
    return write_results(tmp_path / "results")


# --- loader -----------------------------------------------------------------------------------


def test_analysis_imports_no_torch():
    code = "import sys, sparsetrain.analysis, sparsetrain.analysis.__main__; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_runs_one_row_per_run_with_axes_and_status(results):
    runs = sa.load_runs(results / "rq1_scope")
    # 16 grid points: 15 folders (one failed) + 1 job that left no folder.
    assert len(runs) == 16
    assert runs["status"].value_counts().to_dict() == {"completed": 14, "failed": 1, "absent": 1}
    failed = runs[runs["status"] == "failed"].iloc[0]
    assert (failed["scheme"], failed["scope"], failed["seed"]) == ("topk", "global", 1)
    assert "NCCL timeout" in failed["error"]
    absent = runs[runs["status"] == "absent"].iloc[0]
    assert (absent["scheme"], absent["scope"], absent["seed"]) == ("blockk", "global", 1)
    assert pd.isna(absent["run_dir"])

    done = sa.load_runs(results / "rq1_scope", include_failed=False)
    assert len(done) == 14 and set(done["status"]) == {"completed"}
    row = done[(done["scheme"] == "randk") & (done["scope"] == "global") & (done["seed"] == 0)].iloc[0]
    config = make_config(scheme="randk", scope="global", seed=0)
    assert row["test_accuracy"] == pytest.approx(expected_accuracy(config))
    assert row["time_compress_ms"] == pytest.approx(2.0)
    assert row["time_step_ms"] == pytest.approx(fake_times(config)["step"])
    assert row["compression"] == pytest.approx(100.0)
    assert row["bytes_fraction"] == pytest.approx(0.01)
    assert (row["model"], row["data"], row["world_size"], row["experiment"]) == ("resnet20", "fashion_mnist", 2, "rq1_scope")
    assert row["error_feedback"] is True or row["error_feedback"] == True  # noqa: E712

    dense = done[done["scheme"] == "dense"]
    assert len(dense) == 4
    assert set(dense["scope"]) == {"-"} and set(dense["ratio"]) == {1.0}
    assert (dense["time_compress_ms"] == 0).all() and (dense["time_decompress_ms"] == 0).all()


def test_an_absent_job_has_the_values_the_command_line_fixed(tmp_path):
    # reproduce.sh's EXTRA="optim.lr=0.4" beside the swept grid: the job that left no folder was
    # promised that rate too (the tuning table showed it as nan).
    sweep = write_sweep(tmp_path / "tune_edge2", {"scheme": "topk,randk"}, "tune", absent=(1,))
    multirun = yaml.safe_load((sweep / "multirun.yaml").read_text())
    multirun["hydra"]["overrides"]["task"].append("optim.lr=0.4")
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(multirun))
    absent = sa.load_runs(sweep).set_index("status").loc["absent"]
    assert (absent["scheme"], absent["lr"]) == ("randk", 0.4)


def test_load_runs_accepts_single_run_and_many_sweeps(results, tmp_path):
    single = write_run(tmp_path / "single", make_config(scheme="blockk"))
    one = sa.load_runs(single)
    assert len(one) == 1 and one.iloc[0]["scheme"] == "blockk" and one.iloc[0]["status"] == "completed"
    assert one.iloc[0]["experiment"] is None
    both = sa.load_runs(results / "rq1_scope", results / "rq5_speed")
    assert set(both["experiment"]) == {"rq1_scope", "rq5_speed"}
    assert len(sa.load_runs(results)) == 16 + 12 + 16 + 18 + 8 + 4 + 6 + 4 + 4 + 3 + 18 + 3 + 4 + 4  # ... frontier: 4


def test_run_without_summary_is_flagged(tmp_path):
    run = write_run(tmp_path / "r", make_config())
    (run / "summary.json").unlink()
    runs = sa.load_runs(tmp_path)
    assert list(runs["status"]) == ["no summary"] and runs.iloc[0]["scheme"] == "topk"
    assert sa.load_runs(tmp_path, include_failed=False).empty


def test_old_and_new_run_folders_give_the_same_block_size_cells(tmp_path):
    """Runs written before block_size became block-k's own key carry scheme.block_size (256) for
    every scheme; newer runs of the other schemes carry none and read as before, so old and new
    runs of a configuration stay one group."""
    old = make_config()  # BASE_CONFIG: topk with block_size 256, as the old code wrote it
    new = make_config()
    del new["scheme"]["block_size"]
    blockk = make_config(scheme="blockk")
    blockk["scheme"]["block_size"] = 64
    for name, config in (("old", old), ("new", new), ("blockk", blockk)):
        write_run(tmp_path / name, config)
    runs = sa.load_runs(tmp_path).set_index("run_dir")
    cells = {Path(run).name: size for run, size in runs["block_size"].items()}
    assert cells == {"old": 256, "new": 256, "blockk": 64}


def test_load_runs_rejects_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        sa.load_runs(tmp_path / "nope")


def test_load_curves_epochs_and_steps(results):
    epochs = sa.load_curves(results / "rq1_scope")
    # Only completed runs: 14 runs x 3 epochs.
    assert len(epochs) == 14 * 3
    assert {"scheme", "scope", "seed", "epoch", "test_accuracy", "run_dir"} <= set(epochs.columns)
    last = epochs[(epochs["scheme"] == "topk") & (epochs["scope"] == "layerwise") & (epochs["seed"] == 0)]
    assert list(last["epoch"]) == [1, 2, 3]
    assert last["test_accuracy"].iloc[-1] == pytest.approx(expected_accuracy(make_config()))

    with_failed = sa.load_curves(results / "rq1_scope", include_failed=True)
    assert len(with_failed) == 14 * 3 + 1

    # From a runs frame already loaded (what load_study does): the same curves, failed run kept
    # only when asked.
    runs = sa.load_runs(results / "rq1_scope")
    pd.testing.assert_frame_equal(sa.curves_of(runs), epochs)
    pd.testing.assert_frame_equal(sa.curves_of(runs, include_failed=True), with_failed)

    with pytest.warns(UserWarning, match="not JSON"):
        steps = sa.load_curves(results / "rq2_scheme", kind="step", include_failed=True)
    assert {"time_forward_ms", "time_step_ms", "bytes_sent", "density"} <= set(steps.columns)
    assert (steps["time_forward_ms"] > 0).all()


# --- tables -----------------------------------------------------------------------------------


def _row(table: sa.Table, **labels) -> pd.Series:
    frame = table.display
    for key, value in labels.items():
        frame = frame[frame[key] == value]
    assert len(frame) == 1, (labels, table.display)
    return frame.iloc[0]


def test_rq1_table_mean_std_n_and_missing_named(results):
    runs = sa.load_runs(results / "rq1_scope")
    table = sa.rq1_scope_table(runs)
    # top-k layerwise: seeds 0 and 1 -> mean of the formula, std of two values.
    accs = [expected_accuracy(make_config(seed=s)) * 100 for s in (0, 1)]
    mean, std = sum(accs) / 2, pd.Series(accs).std()
    acc = "test accuracy (%)"
    assert _row(table, scheme="top-k", scope="layerwise")[acc] == f"{mean:.2f} ± {std:.2f} (n=2)"
    # top-k global seed 1 failed: one seed left, and the table says so.
    assert _row(table, scheme="top-k", scope="global")[acc] == \
        f"{expected_accuracy(make_config(scope='global')) * 100:.2f} (n=1)"
    # Dense SGD has no scope: one row of its own; bytes and stability stand beside every number.
    dense = _row(table, scheme="dense SGD")
    assert dense["scope"] == "-" and dense[acc].endswith("(n=2)")
    assert list(dict.fromkeys(table.display["scheme"])) == ["dense SGD", "top-k", "random-k", "block-random-k"]
    assert {"bytes/step/worker", "wire bytes/step/worker", "blew up, recovered",
            "gain over the last epoch (points)"} <= set(table.display.columns)

    md = table.to_markdown()
    assert "Missing (2 runs" in md
    assert "failed: scheme=topk, scope=global" in md and "seed=1" in md and "NCCL timeout" in md
    assert "absent: scheme=blockk, scope=global" in md
    # the absent job names its sweep and the overrides Hydra would have given it
    assert re.search(r"absent: .*\(\S*rq1_scope, job scheme=blockk scope=global seed=1\)", md), md

    with_failed = sa.rq1_scope_table(runs, include_failed=True)
    assert with_failed.missing.empty


def test_run_that_did_not_train_is_listed_never_ranked(results):
    """A completed run whose final train loss is above ln(10) (a uniform guess) is not a result."""
    run = results / "rq1_scope" / "10"  # randk, global, seed 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["config"]["scheme"]["name"], summary["config"]["seed"]) == ("randk", 0)
    summary.update(train_loss=3.11, num_classes=10)
    (run / "summary.json").write_text(json.dumps(summary))
    runs = sa.load_runs(results / "rq1_scope")
    flagged = runs[runs["status"] == "did not train"]
    assert list(flagged["run_dir"]) == [str(run.resolve())]
    assert "3.11 >= ln(10) = 2.30" in flagged["error"].iloc[0]
    table = sa.rq1_scope_table(runs)
    # random-k global keeps only seed 1 in the numbers; the run is listed under the table.
    accs = expected_accuracy(make_config(scheme="randk", scope="global", seed=1)) * 100
    assert _row(table, scheme="random-k", scope="global")["test accuracy (%)"] == f"{accs:.2f} (n=1)"
    md = table.to_markdown()
    assert "did not train: scheme=randk, scope=global" in md and "a uniform guess" in md
    # a non-finite final loss counts too
    summary.update(train_loss=None)
    (run / "summary.json").write_text(json.dumps(summary))
    assert sa.load_runs(run)["status"].tolist() == ["did not train"]


def test_plateau_and_budget_tables(tmp_path):
    """Gain over the last epoch per configuration, and accuracy per training budget (epochs)."""
    sweep = write_sweep(tmp_path / "budget", {"scheme": "none,randk", "train.epochs": "2,4", "seed": "0,1"},
                        "budget")
    runs = sa.load_runs(sweep)
    # the fake accuracy climbs linearly: final * epoch / planned, so the last epoch gains final / planned
    one = runs[(runs["scheme"] == "randk") & (runs["epochs_planned"] == 4) & (runs["seed"] == 1)].iloc[0]
    final = expected_accuracy(make_config(scheme="randk", seed=1))
    assert one["test_accuracy_gain_last_epoch"] == pytest.approx(final / 4)

    plateau = sa.plateau_table(runs)
    gains = [expected_accuracy(make_config(scheme="randk", seed=s)) * 100 / 2 for s in (0, 1)]
    row = _row(plateau, scheme="random-k", epochs="2")
    assert row["gain over the last epoch (points)"] == f"{sum(gains) / 2:.2f} ± {pd.Series(gains).std():.2f} (n=2)"
    assert "dense SGD's" in plateau.to_markdown()

    budget = sa.budget_table(runs)
    assert list(budget.display.columns[:3]) == ["scheme", "epochs", "test accuracy (%)"]
    accs = [expected_accuracy(make_config(seed=s, scheme="none")) * 100 for s in (0, 1)]
    assert _row(budget, scheme="dense SGD", epochs="4")["test accuracy (%)"] == \
        f"{sum(accs) / 2:.2f} ± {pd.Series(accs).std():.2f} (n=2)"

    # a run with one evaluation has no gain to show
    single = write_run(tmp_path / "single", make_config(**{"train.epochs": 1}))
    assert math.isnan(sa.load_runs(single)["test_accuracy_gain_last_epoch"].iloc[0])


def test_the_last_epochs_gain_skips_epochs_without_an_evaluation(tmp_path):
    """Audit 3: with train.eval_every=2 an epoch without an evaluation repeats the last one's
    accuracy in its record; the gain read the repeat (epoch 5) against epoch 6: a two-epoch gain
    shown as one. It is now the gain between the last two evaluations, per epoch between them."""
    run = write_run(tmp_path / "r", make_config(**{"train.epochs": 6, "train.eval_every": 2}))
    metrics = [{"kind": "epoch", "epoch": e, "step": 10 * e, "train_loss": 1.0 / e,
                "test_accuracy": acc, "test_loss": 1.0 - acc}
               for e, acc in ((1, 0.5), (2, 0.6), (3, 0.6), (4, 0.7), (5, 0.7), (6, 0.74))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    gain = sa.load_runs(run)["test_accuracy_gain_last_epoch"].iloc[0]
    assert gain == pytest.approx(0.02)  # (0.74 - 0.70) / 2 epochs; it read 0.04
    # audit 7: the curves (accuracy against epoch) read the repeats as measurements of epochs 3
    # and 5; now those epochs keep their training loss and have no test numbers
    curves = sa.load_curves(run)
    assert curves["train_loss"].notna().all() and len(curves) == 6
    assert list(curves.dropna(subset=["test_accuracy"])["epoch"]) == [1, 2, 4, 6]
    assert curves.loc[curves["epoch"] == 3, "test_loss"].isna().all()


def test_stability_table_counts_runs_that_did_not_train(tmp_path):
    sweep = write_sweep(tmp_path / "stability", {"scheme": "randk,blockk", "scheme.uncompressed": "none,1d",
                                                 "seed": "0,1"}, "stability")
    for run in sorted(p for p in sweep.iterdir() if p.is_dir()):
        summary = json.loads((run / "summary.json").read_text())
        cfg = summary["config"]
        broken = cfg["scheme"]["uncompressed"] == "none" and cfg["scheme"]["name"] == "randk"
        summary.update(train_loss=3.5 + cfg["seed"] if broken else 0.5, num_classes=10,
                       memory_norm_max=500.0 * (1 + cfg["seed"]) if broken else 5.0,
                       bytes_sent_total=summary["steps"] * summary["bytes_sent_per_step"])
        if broken and cfg["seed"] == 1:
            summary["train_loss"] = 0.9  # one seed of the broken setting trains anyway
        (run / "summary.json").write_text(json.dumps(summary))
    runs = sa.load_runs(sweep)
    assert sorted(runs["uncompressed"].unique()) == ["1d", "none"]
    table = sa.TABLES["stability"](runs)
    rows = {(r["scheme"], r["whole tensors"]): r for r in table.display.to_dict("records")}
    assert rows[("random-k", "none")]["trained"] == "1/2"
    assert rows[("random-k", "none")]["final train loss"] == f"2.200 ± {pd.Series([3.5, 0.9]).std():.3f} (n=2)"
    assert rows[("random-k", "none")]["max memory norm"] == "1e+03"
    assert rows[("random-k", "1d")]["trained"] == "2/2" and rows[("random-k", "1d")]["max memory norm"] == "5"
    assert table.missing.empty  # runs that did not train are counted, not left out
    every = sa.TABLES["stability"](runs, include_failed=True)  # --include-failed adds runs, never drops them
    assert {(r["scheme"], r["whole tensors"]): r["trained"] for r in every.display.to_dict("records")} == \
        {key: row["trained"] for key, row in rows.items()}
    # ... while the research-question tables leave them out and name them
    md = sa.rq2_scheme_table(runs).to_markdown()
    assert "did not train: scheme=randk" in md and "uncompressed=none" in md


def test_tables_do_not_mix_configurations(results):
    """Runs of different ratios never share a cell, whichever table is asked."""
    runs = sa.load_runs(results / "rq2_scheme")
    table = sa.rq1_scope_table(runs)
    assert "ratio" in table.display.columns  # the varying axis becomes a row key
    assert len(table.display) == 6  # 3 schemes x 2 ratios
    rq2 = sa.rq2_scheme_table(runs)
    want = [expected_accuracy(make_config(scheme="randk", ratio=0.1, seed=s)) * 100 for s in (0, 1)]
    assert _row(rq2, scheme="random-k", ratio="0.1")["test accuracy (%)"].startswith(f"{sum(want) / 2:.2f} ± ")
    # Job 0 (topk, ratio 0.01, seed 0) never finished: named, and out of the numbers. Its
    # summary still says running, but it started long ago and never beat: unfinished.
    assert _row(rq2, scheme="top-k", ratio="0.01")["test accuracy (%)"].endswith("(n=1)")
    assert "unfinished: scheme=topk" in rq2.to_markdown()
    assert "no heartbeat since 2025-01-01T00:00:00 (start)" in rq2.to_markdown()


def test_rq3_rq4_rq5_tables(results):
    rq3 = sa.rq3_aggregation_table(sa.load_runs(results / "rq3_aggregation"))
    assert list(rq3.display.columns[:4]) == ["scheme", "workers", "aggregation", "test accuracy (%)"]
    assert len(rq3.display) == 8
    row = _row(rq3, scheme="block-random-k", workers="4", aggregation="allreduce")
    cfg = make_config(scheme="blockk", aggregation="allreduce", world_size=4)
    assert row["test accuracy (%)"].startswith(f"{(expected_accuracy(cfg) + 0.001) * 100:.2f}")

    rq4 = sa.rq4_workers_table(sa.load_runs(results / "rq4_workers"))
    assert len(rq4.display) == 9
    assert {"time/step (ms)", "test accuracy (%)", "bytes/step/worker"} <= set(rq4.display.columns)

    rq5 = sa.rq5_speed_table(sa.load_runs(results / "rq5_speed"))
    data = rq5.data.set_index("scheme")
    dense_step = (fake_times(make_config(scheme="none"))["step"]
                  + fake_times(make_config(scheme="none", seed=1))["step"]) / 2
    for scheme in ("topk", "randk", "blockk"):
        step = (fake_times(make_config(scheme=scheme))["step"]
                + fake_times(make_config(scheme=scheme, seed=1))["step"]) / 2
        assert data.loc[scheme, "speedup"] == pytest.approx(dense_step / step)
    assert data.loc["dense", "speedup"] == pytest.approx(1.0)
    assert _row(rq5, scheme="block-random-k")["speed-up over dense"] == f"{data.loc['blockk', 'speedup']:.2f}x"


def test_write_table_md_csv_tex(results, tmp_path):
    table = sa.rq1_scope_table(sa.load_runs(results / "rq1_scope"))
    paths = sa.write_table(table, tmp_path / "out")
    assert set(paths) == {"md", "csv", "tex"}
    csv = pd.read_csv(paths["csv"])
    assert set(csv["status"]) == {"ok", "failed", "absent"}
    assert {"test_accuracy_mean", "test_accuracy_std", "test_accuracy_n"} <= set(csv.columns)
    ok = csv[(csv["status"] == "ok") & (csv["scheme"] == "topk") & (csv["scope"] == "layerwise")]
    assert ok["test_accuracy_n"].item() == 2
    tex = paths["tex"].read_text()
    assert "\\begin{tabular}" in tex and "\\bottomrule" in tex and "$\\pm$" in tex
    assert "Missing (2)" in tex and "scheme=topk, scope=global" in tex
    assert paths["md"].read_text() == table.to_markdown()


# --- figures, report, CLI ---------------------------------------------------------------------


def assert_png(path: Path, min_px: int = 300):
    import matplotlib.image as mpimg

    assert path.is_file(), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = mpimg.imread(path)
    assert image.shape[0] >= min_px and image.shape[1] >= min_px
    # Not a blank canvas: a drawn figure has many distinct colours.
    assert len({tuple(px) for px in image[:: 7, :: 7].reshape(-1, image.shape[-1]).round(2)}) > 5


def test_figures_png_and_pdf(results, tmp_path):
    out = tmp_path / "figs"
    runs = sa.load_runs(results / "rq1_scope")
    curves = sa.load_curves(results / "rq1_scope")
    made = [
        sa.save_figure(sa.plot_accuracy_vs_epoch(curves), out, "accuracy_vs_epoch"),
        sa.save_figure(sa.plot_time_per_phase(runs), out, "time_per_phase"),
        sa.save_figure(sa.plot_accuracy_vs_bytes(runs), out, "accuracy_vs_bytes"),
        sa.save_figure(sa.plot_workers(sa.load_runs(results / "rq4_workers")), out, "workers"),
    ]
    for paths in made:
        assert_png(paths["png"])
        assert paths["pdf"].read_bytes()[:5] == b"%PDF-"
        # No creation date: regenerated from the same results, a PDF is byte-identical.
        assert b"/CreationDate" not in paths["pdf"].read_bytes()


def test_each_scheme_has_one_colour_in_every_figure_and_new_ones_keep_clear_of_top_k():
    """Issue 39, item 3: a new scheme's colour was nearly top-k's blue (matplotlib's first)."""
    import colorsys

    from matplotlib.colors import to_rgb

    from sparsetrain.analysis.figures import SCHEME_COLORS, scheme_color
    from sparsetrain.analysis.table import SCHEME_NAMES

    def hue(color):
        return colorsys.rgb_to_hls(*to_rgb(color))[0] * 360

    def gap(a, b):
        return min(abs(a - b), 360 - abs(a - b))

    assert set(SCHEME_NAMES) <= set(SCHEME_COLORS)  # every known scheme has its own colour
    assert len(set(SCHEME_COLORS.values())) == len(SCHEME_COLORS)
    assert scheme_color("mysgd") == "#9e3be3"  # from the name alone: the same in every session
    coloured = [hue(c) for c in SCHEME_COLORS.values() if colorsys.rgb_to_hls(*to_rgb(c))[2] > 0.2]
    for name in ("mysgd", "dgc", "adacomp", "terngrad", "sketch", *(f"scheme{i}" for i in range(50))):
        color = scheme_color(name)
        assert color == scheme_color(name) and color not in SCHEME_COLORS.values()
        assert gap(hue(color), hue(SCHEME_COLORS["topk"])) >= 40, name
        assert min(gap(hue(color), h) for h in coloured) >= 20, name


@pytest.mark.slow  # a frontier figure of four sweeps; the fast tier draws figures in test_figures_png_and_pdf
def test_local_sgd_and_diloco_are_lines_of_the_frontiers_figures_not_panels(tmp_path):
    """Issue 38: local runs in the frontier made one panel per period and delta, past the panel
    limit, so `make figures` stopped. A synchronising scheme's period and delta (and its delta's
    ratio) name its line, in its scheme's colour; panels stay the per-step compressors' settings."""
    from sparsetrain.analysis.figures import (
        plot_accuracy_vs_bytes,
        plot_accuracy_vs_epoch,
        scheme_color,
    )
    from sparsetrain.analysis.report import load_study, write_studies

    root = tmp_path / "results"
    write_sweep(root / "headline_dense", {"seed": "0,1", "scheme": "none"}, "headline_dense", {"ratio": 1.0})
    write_sweep(root / "frontier", {"seed": "0,1", "scheme": "topk,randk", "ratio": "0.01,0.03"}, "frontier")
    plain = {"_target_": "sparsetrain.comm.periodic.PeriodicSync", "_partial_": True, "outer_lr": 1.0,
             "outer_momentum": 0.0}
    nesterov = {**plain, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    topk = {"_target_": "sparsetrain.compress.TopK", "_partial_": True}
    for name, scheme, sync, extra in [("a", "localsgd", {**plain, "period": 8}, {}),
                                      ("b", "localsgd", {**plain, "period": 16}, {}),
                                      ("c", "diloco", {**nesterov, "period": 8}, {}),
                                      ("d", "diloco", {**nesterov, "period": 4}, {"scheme.compressor": topk, "ratio": 0.1})]:
        write_sweep(root / "local" / name, {"seed": "0,1", "scheme": scheme}, "local",
                    {"scheme.sync": sync, "ratio": 1.0, **extra})

    runs, curves = load_study(root, "frontier")
    assert set(runs["scheme"]) == {"dense", "topk", "randk", "localsgd", "diloco"}
    fig = plot_accuracy_vs_epoch(curves)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert not any(word in title for title in titles for word in ("sync", "delta", "H=", "Periodic")), titles
    assert titles == ["ratio=0.01", "ratio=0.03", "ratio=1.0", "ratio=-"], titles  # dense's 1.0; "-": syncing
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    local = {label for label in lines if label.startswith(("local SGD", "DiLoCo"))}
    assert local == {"local SGD H=8 (n=2)", "local SGD H=16 (n=2)", "DiLoCo H=8 (n=2)",
                     "DiLoCo H=4, TopK delta (ratio=0.1) (n=2)"}, local
    assert lines["local SGD H=8 (n=2)"].get_color() == lines["local SGD H=16 (n=2)"].get_color() == scheme_color("localsgd")
    assert lines["local SGD H=8 (n=2)"].get_marker() != lines["local SGD H=16 (n=2)"].get_marker()
    assert lines["top-k (n=2)"].get_marker() == "o"  # one line of a scheme: as before
    notes = {text.get_text() for text in plot_accuracy_vs_bytes(runs).axes[0].texts}
    assert {"H=8", "H=16", "H=4, TopK delta (ratio=0.1)", "0.01", "0.03"} <= notes, notes

    out = tmp_path / "figures"
    write_studies(root, out)  # every table and figure of the frontier, its time to accuracy too
    assert (out / "frontier" / "accuracy_vs_epoch.png").stat().st_size > 0
    assert "local SGD" in (out / "frontier" / "runs.md").read_text()
    assert "DiLoCo" in (out / "frontier_time_to_accuracy" / "time_to_accuracy_85.md").read_text()


def test_dense_sgd_joins_the_panels_of_other_runs_not_combinations_of_its_own(tmp_path):
    """Dense ignores error feedback and warm-up steps, so it is copied to each value of both; a
    combination that only those copies make (on with 2 warm-up steps) is no panel."""
    from sparsetrain.analysis.figures import plot_accuracy_vs_epoch

    write_sweep(tmp_path / "d", {"seed": "0,1", "scheme": "none"}, "mine", {"ratio": 1.0})
    write_sweep(tmp_path / "a", {"seed": "0,1", "scheme": "topk"}, "mine",
                {"scheme.error_feedback": True, "scheme.warmup_steps": 0})
    write_sweep(tmp_path / "b", {"seed": "0,1", "scheme": "topk"}, "mine",
                {"scheme.error_feedback": False, "scheme.warmup_steps": 2})
    fig = plot_accuracy_vs_epoch(sa.curves_of(sa.load_runs(tmp_path)))
    panels = {ax.get_title(): sorted(line.get_label() for line in ax.get_lines()) for ax in fig.axes if ax.get_title()}
    assert panels == {"error feedback: off, warm-up steps=2": ["dense SGD (n=2)", "top-k (n=2)"],
                      "error feedback: on, warm-up steps=0": ["dense SGD (n=2)", "top-k (n=2)"]}, panels
    # a dense run that shows nowhere else keeps its panel: 4 workers, where only dense ran
    write_sweep(tmp_path / "w4", {"seed": "0,1", "scheme": "none"}, "mine", {"ratio": 1.0, "world_size": 4})
    fig = plot_accuracy_vs_epoch(sa.curves_of(sa.load_runs(tmp_path)))
    panels = {ax.get_title(): sorted(line.get_label() for line in ax.get_lines()) for ax in fig.axes if ax.get_title()}
    four = [title for title in panels if "workers=4" in title]
    assert len(four) == 1 and panels[four[0]] == ["dense SGD (n=2)"], panels
    assert len(panels) == 3, panels


def test_an_error_feedback_split_has_legend_entries_that_say_what_they_are(tmp_path):
    """Issue 39, item 3: the legend showed a bare "True" / "False" for error feedback."""
    from sparsetrain.analysis.figures import (
        plot_accuracy_vs_bytes,
        plot_accuracy_vs_epoch,
        scheme_color,
    )

    sweep = write_sweep(tmp_path / "ef", {"scheme": "topk,randk", "scheme.error_feedback": "true,false"}, "ef")
    runs = sa.load_runs(sweep)
    fig = plot_accuracy_vs_bytes(runs)
    legend = fig.axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == ["top-k", "random-k", "error feedback: off", "error feedback: on"], texts
    assert [h.get_color() for h in legend.legend_handles[:2]] == [scheme_color("topk"), scheme_color("randk")]
    titles = [ax.get_title() for ax in plot_accuracy_vs_epoch(sa.curves_of(runs)).axes]
    assert titles == ["error feedback: off", "error feedback: on"], titles


def test_ddp_hooks_table_names_torch_hooks_as_schemes(results):
    """Runs through DDP (dist.ddp) carry exchange="ddp hook"; torch's PowerSGD hook is a scheme of
    its own (not dense SGD), with no scope or aggregation of sparsetrain's."""
    from sparsetrain.analysis.study_tables import ddp_hooks_table

    runs = sa.load_runs(results / "ddp_hooks")
    assert set(runs["exchange"]) == {"ddp hook"}
    assert set(runs["scheme"]) == {"dense", "blockk", "torch_powersgd"}  # recorded as powersgd before issue 24
    psgd = runs[runs["scheme"] == "torch_powersgd"].iloc[0]
    assert (psgd["scope"], psgd["aggregation"], psgd["ratio"]) == ("-", "-", 0.01)
    assert set(sa.load_runs(results / "rq1_scope")["exchange"]) == {"trainer"}
    table = ddp_hooks_table(runs)
    assert list(table.display["scheme"]) == ["dense SGD", "block-random-k", "PowerSGD (torch hook)"]
    assert all("(n=2)" in cell for cell in table.display["test accuracy (%)"])


@pytest.mark.slow  # every study's tables and figures
def test_report_per_study(results, tmp_path):
    out = tmp_path / "report"
    written = sa.write_report(results, out=out)
    studies = {s: v for s, v in sa.STUDIES.items() if (results / s).is_dir()}  # the fixture's sweeps
    assert {p.parent.name for p in written} >= set(studies) and len(studies) == len(sa.STUDIES)
    for study, (tables, figures) in studies.items():
        for name in tables:
            for ext in ("md", "csv", "tex"):
                assert (out / study / f"{name}.{ext}").is_file(), (study, name, ext)
        for name in figures:
            assert_png(out / study / f"{name}.png")
            assert (out / study / f"{name}.pdf").is_file()
    assert (out / "status.md").is_file()
    assert "failed" in (out / "status.md").read_text()


def _cli(*args, cwd=None):
    return analysis_cli(*args, cwd=cwd)


def _command(*args):
    """The analysis through the real command: its exit codes and what reaches stderr."""
    return subprocess.run([sys.executable, "-m", "sparsetrain.analysis", *map(str, args)],
                          capture_output=True, text=True)


def test_cli_writes_and_prints(results, tmp_path):
    out = tmp_path / "figures"
    proc = _cli(results / "rq1_scope", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "RQ1: test accuracy" in proc.stdout and "Missing (2 runs" in proc.stdout
    # One study: written straight into --out.
    for ext in ("md", "csv", "tex"):
        assert (out / f"rq1_scope.{ext}").is_file()
    assert_png(out / "accuracy_vs_epoch.png")

    proc = _cli(*(results / s for s in ("rq4_workers", "rq5_speed")), "--out", tmp_path / "two")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "two" / "rq4_workers" / "rq4_workers.csv").is_file()
    assert (tmp_path / "two" / "rq5_speed" / "rq5_speed.tex").is_file()


def test_cli_one_runs_table_for_unknown_experiment_and_a_study_on_request(tmp_path):
    write_sweep(tmp_path / "adhoc", {"scheme": "none,blockk", "seed": "0,1"}, experiment="", fixed={})
    proc = _cli(tmp_path / "adhoc", "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "o").glob("*.md")) == ["runs.md", "status.md"]
    asked = _cli(tmp_path / "adhoc", "--study", "rq1_scope", "--out", tmp_path / "s")
    assert asked.returncode == 0 and (tmp_path / "s" / "rq1_scope.md").is_file(), asked.stderr


def test_cli_where_keeps_the_slice_and_dense(results, tmp_path):
    out = tmp_path / "o"
    proc = _cli(results / "rq1_scope", "--study", "rq1_scope", "--where", "scope=layerwise",
                "--where", "scheme=dense,topk", "--out", out)
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(out / "rq1_scope.csv")
    assert set(table["scheme"].dropna()) == {"dense", "topk"}
    assert set(table["scope"].dropna()) == {"layerwise", "-"}  # dense SGD has no scope: "-"
    bad = _cli(results / "rq1_scope", "--where", "colour=red", "--out", out)
    assert bad.returncode == 2 and "'colour' is not an axis" in bad.stderr


def test_missing_runs_are_named_relative_to_the_working_directory(results, monkeypatch):
    """Tables written from the repository root name run folders as results/..., not by the
    clone's absolute path, so regenerated tables read the same on every machine."""
    monkeypatch.chdir(results.parent)
    table = sa.status_table(sa.load_runs(results / "rq2_scheme"))
    text = "\n".join(table.missing_lines())
    assert f"({results.name}{os.sep}rq2_scheme{os.sep}" in text
    assert str(results.parent) not in text
    assert str(results.parent) not in table.to_csv_frame().to_csv()


@pytest.mark.slow  # every study's tables and figures, three times
def test_cli_studies_assembles_each_study_from_its_sources(results, tmp_path):
    """--studies: each study from the sweeps SOURCES names (RQ2's table holds RQ1's layer-wise 1%
    points beside its own), stale study folders go, and bad combinations are refused."""
    import shutil

    out = tmp_path / "figures"
    (out / "rq2_scheme").mkdir(parents=True)
    (out / "rq2_scheme" / "old.png").write_bytes(b"stale")
    shutil.rmtree(results / "rq5_speed")
    (results / "rq4_workers").rename(results / "rq4_global")  # a preset that adds to rq4_workers
    (out / "rq5_speed").mkdir()
    proc = _cli("--studies", results, "--out", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "rq2_scheme" / "old.png").exists() and not (out / "rq5_speed").exists()
    runs, _ = sa.load_study(results, "rq2_scheme")
    assert set(runs["experiment"]) == {"rq1_scope", "rq2_scheme"}
    assert set(runs["scope"]) == {"layerwise", "-"}
    assert "ratio=0.01" in (out / "rq2_scheme" / "rq2_scheme.md").read_text()
    assert (out / "budget" / "plateau.md").is_file() and (out / "rq1_scope" / "plateau.md").is_file()
    assert (out / "rq4_workers" / "rq4_workers.md").is_file()
    assert "unfinished: scheme=topk" in (out / "status.md").read_text()  # rq2_scheme job 0 is named

    assert _cli("--studies", results, results, "--out", out).returncode == 2
    assert _cli("--studies", results, "--where", "scope=global", "--out", out).returncode == 2
    assert _cli("--studies", tmp_path / "figures", "--out", tmp_path / "x").returncode == 1


@pytest.mark.parametrize("run", [_cli, pytest.param(_command, marks=pytest.mark.slow)], ids=["in-process", "command"])
def test_cli_exit_codes(run, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run(tmp_path / "empty", "--out", tmp_path / "o")
    assert proc.returncode == 1 and "no runs found" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run(tmp_path / "does-not-exist", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "does-not-exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("--out", tmp_path / "o")
    assert proc.returncode == 2


def test_cli_strict_fails_on_missing(results, tmp_path):
    proc = _cli(results / "rq1_scope", "--out", tmp_path / "o", "--strict")
    assert proc.returncode == 3 and "2 runs are not in the numbers (1 failed, 1 absent)" in proc.stderr
    proc = _cli(results / "rq3_aggregation", "--out", tmp_path / "o3", "--strict")
    assert proc.returncode == 0, proc.stderr


def test_include_failed_says_it_brings_in_runs_that_did_not_train(results, tmp_path):
    """Issue 39, item 4: the flag puts runs that did not complete and runs that did not train into
    the numbers; its help says both, and the closing warning does not say they were left out."""
    help_text = " ".join(_cli("--help").stdout.split())
    assert "those that did not complete (failed, interrupted, unfinished) and those that completed but did not train" in help_text
    proc = _cli(results / "rq1_scope", "--out", tmp_path / "o", "--include-failed")
    assert proc.returncode == 0, proc.stderr
    assert "2 runs that did not complete or did not train are in the numbers (1 failed, 1 absent; " in proc.stderr
    assert "not in the numbers" not in proc.stderr


# --- experiment presets -----------------------------------------------------------------------

CONF = Path(__file__).resolve().parents[1] / "conf" / "experiment"
STUDY_NAMES = ("baseline", "rq1_scope", "rq2_scheme", "rq3_aggregation", "rq4_workers", "rq5_speed")
OTHER_PRESETS = ("stability", "ablation", "rq2_low", "rq4_global", "budget", "rq4_steps", "headline", "headline_dense",
                 "headline_bytes", "ddp_fair", "ddp_hooks", "frontier", "tta_frontier")


def _grid(params) -> list[list[str]]:
    keys = list(params)
    return [[f"{k}={v}" for k, v in zip(keys, combo, strict=False)]
            for combo in itertools.product(*(str(params[k]).split(",") for k in keys))]


# the fast tier composes the studies' presets; the full tier every preset and the paper-scale ones
@pytest.mark.parametrize("name", [*STUDY_NAMES, *(pytest.param(n, marks=pytest.mark.slow)
                                                  for n in (*OTHER_PRESETS, *(f"paper/{n}" for n in STUDY_NAMES[1:])))])
def test_experiment_presets_compose_and_every_grid_point_validates(name):
    """Each preset composes with the schema, runs at its scale, and no grid point is refused."""
    assert (CONF / f"{name}.yaml").read_text().startswith("# @package _global_")
    config = pytest.importorskip("sparsetrain.config")
    from hydra import compose, initialize_config_dir

    config.register()
    with initialize_config_dir(str(config.CONF_DIR), version_base=None):
        base = compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)
        assert base.hydra.sweep.dir.startswith(f"multirun/{name}/")  # results/: reproduce.sh
        if name.startswith("paper/"):
            assert (base.model.name, base.data.name, base.world_size) == ("resnet18", "cifar10", 8)
            assert base.train.epochs == 300 and base.train.batch_size == 128
            assert base.optim.lr == 0.1 and base.optim.warmup_epochs == 5
            assert list(base.optim.milestones) == [0.5, 0.8333]
            assert base.hydra.sweeper.params.seed == "0,1,2"
        else:
            assert (base.model.name, base.data.name) == ("resnet20", "fashion_mnist")
        points = _grid(base.hydra.sweeper.params)
        assert 2 <= len(points) <= 60
        for point in points:
            cfg = compose("config", overrides=[f"experiment={name}", *point])
            config.validate(cfg, env={})


# --- the paper's findings -----------------------------------------------------------------------


@pytest.mark.parametrize(("diff", "p_adjusted", "expect", "p_equivalent", "outcome"), [
    (3.0, 0.01, ">", math.nan, "agrees"),
    (3.0, 0.20, ">", math.nan, "within noise"),
    (-3.0, 0.01, ">", math.nan, "reversed"),
    (0.5, 0.60, "=", 0.01, "agrees"),   # shown equivalent within the margin
    (0.5, 0.60, "=", 0.30, "not told apart"),   # no difference found is not "no difference"
    (0.5, 0.60, "=", math.nan, "not told apart"),
    (1.0, 0.001, "=", 0.9, "differs"),
    (0.2, 0.001, "=", 0.01, "agrees"),   # a gap detected, but inside the margin
])
def test_judge_by_the_adjusted_p_value(diff, p_adjusted, expect, p_equivalent, outcome):
    from sparsetrain.analysis.findings import judge
    from sparsetrain.analysis.stats import PAIRED, Difference

    d = Difference(diff, diff - 1, diff + 1, p_adjusted, PAIRED, 5, 5, 5)
    assert judge(d, p_adjusted, expect, p_equivalent) == outcome


def test_judge_never_judges_a_side_of_one_run_and_waits_for_an_empty_one():
    from sparsetrain.analysis.findings import judge
    from sparsetrain.analysis.stats import compare

    one = compare(pd.Series([80.0], index=[0]), pd.Series([70.0, 71.0, 72.0], index=[0, 1, 2]))
    assert one.test == "not judged" and math.isnan(one.p) and one.diff == pytest.approx(9.0)
    assert judge(one, math.nan, ">") == "not judged"
    empty = compare(pd.Series([80.0, 81.0], index=[0, 1]), pd.Series([], dtype=float))
    assert judge(empty, math.nan, ">") == "pending"


def _draw(rng, n: int, shift: float, seed_effect: float = 1.0, noise: float = 0.5):
    """Two sides over the same seeds: a shared per-seed effect (same weights, same data order),
    independent noise, and a true difference ``shift``."""
    seeds = np.arange(n)
    common = rng.normal(80.0, seed_effect, n)
    a = pd.Series(common + shift + rng.normal(0, noise, n), index=seeds)
    b = pd.Series(common + rng.normal(0, noise, n), index=seeds)
    return a, b


def test_a_true_difference_is_found_and_its_interval_holds_it():
    from sparsetrain.analysis.stats import compare

    rng = np.random.default_rng(0)
    a, b = _draw(rng, 5, shift=2.0)
    d = compare(a, b)
    assert d.test == "paired t" and d.n_pairs == 5
    assert d.p < 0.05 and d.low < 2.0 < d.high and d.low > 0
    assert d.diff == pytest.approx(a.mean() - b.mean())


@pytest.mark.slow  # a simulation of many studies; the tests themselves are checked against identities above
def test_without_a_difference_false_positives_stay_near_five_percent():
    from sparsetrain.analysis.stats import compare

    rng = np.random.default_rng(1)
    draws = 2000
    paired = sum(compare(*_draw(rng, 5, shift=0.0)).p < 0.05 for _ in range(draws)) / draws
    assert 0.035 < paired < 0.065
    welch = 0
    for _ in range(draws):  # independent sides on other seeds, unequal spreads: unpaired
        a = pd.Series(rng.normal(80.0, 1.0, 5), index=range(5))
        b = pd.Series(rng.normal(80.0, 3.0, 4), index=range(10, 14))
        welch += compare(a, b).p < 0.05
    assert 0.03 < welch / draws < 0.065


def test_paired_or_welch_is_chosen_from_the_seeds():
    from sparsetrain.analysis.stats import compare

    rng = np.random.default_rng(2)
    a, b = _draw(rng, 5, shift=1.0, seed_effect=3.0, noise=0.3)
    same = compare(a, b)
    other = compare(a, b.set_axis([5, 6, 7, 8, 9]))
    part = compare(a, b.iloc[:4])  # one seed short on one side: not the same seeds
    assert (same.test, other.test, part.test) == ("paired t", "Welch t", "Welch t")
    # a declared study (every side runs the same seeds): the seed one side lacks failed, and the
    # pairs are the four seeds both hold, never Welch over five and four (audit 6)
    declared = compare(a, b.iloc[:4], pair_common=True)
    assert (declared.test, declared.n_pairs, declared.unpaired) == ("paired t", 4, (a.index[4],))
    assert declared.diff == pytest.approx(float((a.iloc[:4] - b.iloc[:4]).mean()))
    assert compare(a, b.set_axis([5, 6, 7, 8, 9]), pair_common=True).test == "Welch t"  # none shared
    # the seed effect cancels in the pairs: the paired test sees the shift, Welch does not
    assert same.p < 0.05 < other.p
    assert same.high - same.low < other.high - other.low


def test_holm_adjusts_like_the_textbook():
    from sparsetrain.analysis.stats import holm

    got = holm([0.01, 0.04, 0.03, 0.005])
    assert got == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1, kept monotone
    # a comparison that could not be tested (failed or missing runs) still counts in the family:
    # the others are not judged against a smaller m because runs failed
    assert math.isnan(holm([math.nan, 0.01])[0]) and holm([math.nan, 0.01])[1] == 0.02
    assert holm([0.01, 0.04, 0.03, math.nan])[:3] == pytest.approx([0.04, 0.09, 0.09])


def test_findings_tables_judge_sides_of_completed_runs(results):
    """Each side is chosen by its axes on top of a base setting; runs not completed are counted
    beside the number, and the verdict follows from the outcomes."""
    from sparsetrain.analysis.findings import Comparison, Finding, verdict

    base = {"model": "resnet20", "train_size": 1000, "epochs_planned": 3}
    layerwise = {"scope": "layerwise", "ratio": 0.01, "world_size": 2}
    finding = Finding("scope", "layer-wise beats global", (
        # formula: global is 3 points lower, seeds differ by 0.2: outside the noise
        Comparison("top-k", {"scheme": "topk", **layerwise}, {"scheme": "topk", **layerwise, "scope": "global"}, ">"),
        # formula: block-k is 2 points under top-k; expected equal: differs
        Comparison("top-k vs block-k", {"scheme": "topk", **layerwise}, {"scheme": "blockk", **layerwise}, "="),
        Comparison("8 workers", {"scheme": "topk", **layerwise, "world_size": 8}, {"scheme": "topk", **layerwise}, ">"),
    ))
    runs = sa.load_runs(results / "rq1_scope")
    verdicts, comparisons = sa.findings_tables(runs, (finding,), base=base)
    rows = comparisons.display
    # top-k global seed 1 failed: one run is shown, never judged; block-k is 2 points under top-k
    # on every seed (paired, no spread): outside the noise, where the paper saw no difference
    assert list(rows["outcome"]) == ["not judged", "differs", "pending"]
    # the fake runs' accuracies differ by the same amount in every seed: no spread, said beside the test
    assert list(rows["test"]) == ["not judged", "paired t (n=2), no spread: p is 0 or 1 by convention", "not judged"]
    assert rows["B: test accuracy (%)"].iloc[0] == f"{expected_accuracy(make_config(scope='global')) * 100:.2f} (n=1) [1 failed]"
    assert rows["A − B (points)"].iloc[0] == "+3.10"  # A: seeds 0 and 1 (+0.1 on average), B: seed 0
    assert rows["A − B (points)"].iloc[1] == "+2.00" and rows["p (Holm)"].iloc[1] == "<0.001"
    assert verdicts.display["verdict"].iloc[0] == "pending (2 of 3 comparisons measured)"
    assert verdict(["agrees", "agrees"]) == "reproduced"
    assert verdict(["agrees", "not judged"]) == "not judged yet (1 of 2 comparisons judged)"
    assert verdict(["reversed", "differs"]) == "not reproduced: 1 reversed, 1 differs"
    assert verdict(["agrees", "within noise", "agrees"]) == "partly: 2 agrees, 1 within noise"
    # a run evaluated otherwise (batch-norm statistics recomputed) is another configuration
    other = write_run(results / "rq1_scope" / "99", make_config(seed=0, **{"train.bn_recalibrate": 20}))
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "test_accuracy": 0.5}))
    # no filter: two configurations on one side (two runs of seed 0, once averaged into one
    # "seed"), stop in one line naming the setting and a run of each
    with pytest.raises(ValueError, match="differ in bn_recalibrate: bn_recalibrate = 0 .*; 20 .*rq1_scope/99"):
        sa.findings_tables(sa.load_runs(results / "rq1_scope"), (finding,), base=base)
    _, again = sa.findings_tables(sa.load_runs(results / "rq1_scope"), (finding,), base={**base, "bn_recalibrate": 0})
    assert again.display["A: test accuracy (%)"].iloc[0] == rows["A: test accuracy (%)"].iloc[0]
    # dense SGD rows pass the sparse-only axes ("-") but never another scheme's name
    dense = Comparison("dense", {"scheme": "dense", "world_size": 2}, {"scheme": "dense", "world_size": 2}, "=")
    _, table = sa.findings_tables(runs, (Finding("d", "", (dense,)),), base=base)
    assert table.display["A: test accuracy (%)"].iloc[0].endswith("(n=2)")


def test_beyond_the_paper_judges_the_ddp_fair_study_from_its_presets_configs():
    """The DDP comparison's sides select exactly the runs experiment=ddp_fair and
    experiment=headline_dense write (composed from the presets, so a preset and its comparison
    cannot drift apart), and a finding with no claim reads what was measured."""
    config = pytest.importorskip("sparsetrain.config")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sparsetrain.analysis.findings import BEYOND_FINDINGS, verdict
    from sparsetrain.analysis.loader import row_from_summary

    accuracy = {"none": 0.92, "blockk": 0.89, "torch_powersgd": 0.895}
    rows = []
    config.register()
    with initialize_config_dir(str(config.CONF_DIR), version_base=None):
        for name in ("ddp_fair", "headline_dense"):
            base = compose("config", overrides=[f"experiment={name}"], return_hydra_config=True)
            for point in _grid(base.hydra.sweeper.params):
                cfg = OmegaConf.to_container(compose("config", overrides=[f"experiment={name}", *point]), resolve=True)
                acc = accuracy[cfg["scheme"]["name"]] + 0.001 * cfg["seed"] ** 2  # seeds differ, pairs do not
                rows.append({**row_from_summary({"status": "completed", "test_accuracy": acc, "train_loss": 0.2,
                                                    "config": cfg}, None), "experiment": name})
    ddp_fair = tuple(f for f in BEYOND_FINDINGS if f.key == "ddp_fair")
    verdicts, comparisons = sa.findings_tables(pd.DataFrame(rows), ddp_fair, name="beyond_")
    shown = comparisons.display
    assert list(shown["A: test accuracy (%)"].str.extract(r"\(n=(\d)\)")[0]) == ["3", "5", "5"]
    assert list(shown["B: test accuracy (%)"].str.extract(r"\(n=(\d)\)")[0]) == ["3", "3", "3"]
    assert list(shown["test"]) == ["paired t (n=3)", "Welch t", "Welch t"]
    assert list(shown["outcome"]) == ["B higher", "A higher", "A higher"]
    assert set(shown["paper"]) == {"no claim"}
    assert verdicts.display["verdict"].iloc[0] == "measured: 2 A higher, 1 B higher"
    assert verdicts.title.startswith("Beyond the paper")
    assert verdict(["within noise", "within noise"], claimed=False) == "measured: 2 within noise"


@pytest.mark.slow  # composes every frontier point; sides are picked in-process in test_analysis_grouping
def test_frontier_comparisons_select_the_frontier_presets_runs_paired_on_shared_seeds():
    """Every side of the frontier's comparisons finds the runs experiment=frontier writes (every
    point, composed from the presets) or the headline runs it reuses, paired: over seeds 0-4 where
    both sides ran them (the points at 1.5% and 3.6% ran seeds 3-4 too, as did the headline
    protocol's dense SGD and block-k 1%), over seeds 0-2 otherwise."""
    config = pytest.importorskip("sparsetrain.config")
    from omegaconf import OmegaConf

    from sparsetrain.analysis.findings import BEYOND_FINDINGS
    from sparsetrain.analysis.loader import row_from_summary

    def row(overrides, seed):
        cfg = OmegaConf.to_container(config.compose([*overrides, f"seed={seed}"]), resolve=True)
        acc = 0.85 + 0.01 * (hash(str(overrides)) % 5) + 0.001 * seed ** 2
        experiment = overrides[0].removeprefix("experiment=")
        return {**row_from_summary({"status": "completed", "test_accuracy": acc, "train_loss": 0.3, "config": cfg},
                                   None), "experiment": experiment}

    with open(config.CONF_DIR / "experiment" / "frontier.yaml") as f:
        sweep = yaml.safe_load(f)["hydra"]["sweeper"]["params"]
    five = {"frontier_topk_low", "frontier_randk_low", "frontier_topk_high", "frontier_randk_high",
            "frontier_blockk_high", "frontier_signsgd"}  # results/frontier_s34: seeds 3-4
    rows = [row(["experiment=frontier", f"point={p}"], seed)
            for p in sweep["point"].split(",") for seed in (range(5) if p in five else range(3))]
    rows += [row(["experiment=headline", "scheme=blockk"], seed) for seed in range(5)]
    rows += [row(["experiment=headline_dense"], seed) for seed in range(5)]
    frontier = tuple(f for f in BEYOND_FINDINGS if f.key.startswith("frontier"))
    assert [f.key for f in frontier] == ["frontier_low", "frontier_high", "frontier_dense"]
    _, comparisons = sa.findings_tables(pd.DataFrame(rows), frontier, name="beyond_")
    shown = comparisons.display
    assert len(shown) == 16
    three = ("PowerSGD", "QSGD", "fp16", "bf16")  # dense SGD against a point of seeds 0-2 only
    n = shown["comparison (A vs B)"].map(lambda label: "3" if any(s in label for s in three) else "5")
    assert (n == "3").sum() == 4
    for side in ("A: test accuracy (%)", "B: test accuracy (%)"):
        assert (shown[side].str.extract(r"\(n=(\d)\)")[0] == n).all(), shown[["comparison (A vs B)", side]]
    # (the fake accuracies differ by the same amount in every seed: the label says "no spread" too)
    assert (shown["test"].str.replace(", no spread: p is 0 or 1 by convention", "") == "paired t (n=" + n + ")").all()


def test_paper_findings_cover_every_research_question():
    keys = [f.key for f in sa.FINDINGS]
    assert keys == ["rq1_scope", "rq2_order", "rq2_random", "rq3_aggregation", "rq4_workers"]
    for finding in sa.FINDINGS:
        for comparison in finding.comparisons:
            assert comparison.expect in (">", "=") and comparison.a != comparison.b


def test_ones_own_sweep_gets_one_table_its_untrained_runs_plotted_and_a_true_warning(tmp_path):
    """Issue 26, item 6: a 3-point sweep of no study gets one table of its configurations (not
    every study's), the epochs its runs really ran, runs that completed but did not train named
    as such and drawn (dashed) in the plots, and --studies on such a tree writes the same."""
    sweep = write_sweep(tmp_path / "mine" / "sweep", {"scheme": "topk,randk,blockk"}, "mine")
    capped = json.loads((sweep / "0" / "summary.json").read_text())
    (sweep / "0" / "summary.json").write_text(json.dumps({**capped, "epochs": 2.5}))  # max_steps
    bad = json.loads((sweep / "2" / "summary.json").read_text())
    (sweep / "2" / "summary.json").write_text(json.dumps({**bad, "train_loss": 3.1, "num_classes": 10}))
    out = tmp_path / "out"
    proc = _cli(sweep, "--out", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{name}.{ext}" for name in ("runs", "status") for ext in ("md", "csv", "tex")]
        + [f"{name}.{ext}" for name in ("accuracy_vs_bytes", "accuracy_vs_epoch") for ext in ("png", "pdf")])
    md = (out / "runs.md").read_text()
    assert "epochs run" in md and "1 of 2 stopped by train.max_steps at 2.5 epochs" in md
    assert md.count("did not train: scheme=blockk") == 1
    assert "1 did not train" in proc.stderr and "did not complete" not in proc.stderr
    curves = sa.curves_of(sa.load_runs(sweep))
    assert set(curves[curves["status"] == "did not train"]["scheme"]) == {"blockk"}
    studies = _cli(tmp_path / "mine", "--studies", "--out", tmp_path / "studies", "--quiet")
    assert studies.returncode == 0, studies.stderr
    assert "none of the studies' folders" in studies.stderr
    assert (tmp_path / "studies" / "runs.md").read_text() == md


def test_which_axes_apply_comes_from_the_runs_summary():
    """A run's summary records, from its compressor, whether ratio and aggregation change what is
    sent and which collective carried it; runs written before it did read conf/schemes.yaml."""
    from sparsetrain.analysis.loader import NOT_APPLICABLE, collective_of, row_from_summary

    cfg = {"scheme": {"name": "mine", "compressor": {"_target_": "mine.Mine"}}, "scope": {"name": "layerwise"},
           "aggregation": {"name": "allgather"}, "ratio": 0.01}
    plain = row_from_summary({"status": "completed", "config": cfg}, None)
    assert (plain["aggregation"], plain["ratio"], collective_of(plain)) == ("allgather", 0.01, "allgather")
    said = row_from_summary({"status": "completed", "config": cfg, "collective": "allreduce",
                             "applies": {"ratio": False, "aggregation": False}}, None)
    assert (said["aggregation"], said["ratio"], collective_of(said)) == (NOT_APPLICABLE, 1.0, "allreduce")
    old_qsgd = row_from_summary({"status": "completed", "config": {**cfg, "scheme": {"name": "qsgd"}}}, None)
    assert old_qsgd["ratio"] == 1.0  # conf/schemes.yaml: every_entry


def test_the_note_tells_a_stop_at_the_target_from_one_at_max_steps():
    """Runs of experiment=tta_frontier stop at their target before the planned epochs; the note
    under a table says so instead of blaming train.max_steps (which it said of every early stop)."""
    from sparsetrain.analysis.group import _constant_note

    runs = pd.DataFrame({"model": "resnet20", "epochs_planned": 4, "epochs": [1.25, 2.5, 4.0, 0.5],
                         "target_reached": [1, 1, 0, None], "seed": [0, 1, 2, 3]})
    note = _constant_note(runs, [])[0]
    assert "2 of 4 stopped at the target (train.stop_at_accuracy) at 1.25-2.5 epochs" in note
    assert "1 of 4 stopped by train.max_steps at 0.5 epochs" in note
    assert "stopped" not in _constant_note(runs.assign(epochs=4.0), [])[0]
