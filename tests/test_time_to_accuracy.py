"""Time to accuracy (issue 12, item 4) and wire bytes in the analysis (item 2), on fake run
folders whose numbers are known (tests/test_analysis.py's ``write_run``): every predicted number
is recomputed here by hand from the ring formulas."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import analysis_cli
from test_analysis import fake_times, make_config, write_run

from sparsetrain import analysis as sa
from sparsetrain.analysis import cluster_check
from sparsetrain.analysis import time_to_accuracy as tta
from sparsetrain.costmodel import WIRE_OVERHEAD

ALPHA = 50e-6
DENSE_HALF = 500_000  # fp16: every entry of the fake runs' 1 MB gradient in 2 bytes
DATA = Path(__file__).parent / "data"


def beta(gbit):
    return WIRE_OVERHEAD * 8 / (gbit * 1e9)


def test_steps_to_target_interpolates_and_never_extrapolates():
    curve = [(10.0, 0.3), (20.0, 0.6), (30.0, 0.9)]
    assert tta.steps_to_target(curve, 0.45) == pytest.approx(15.0)
    assert tta.steps_to_target(curve, 0.9) == 30.0
    assert tta.steps_to_target(curve, 0.2) == 10.0  # reached at the first evaluation: its step
    assert math.isnan(tta.steps_to_target(curve, 0.95))  # not reached: no extrapolation
    assert math.isnan(tta.steps_to_target([], 0.1))


def test_accuracy_curve_skips_epochs_without_evaluation(tmp_path):
    records = [{"kind": "step", "step": 1, "test_accuracy": 0.99},
               {"kind": "epoch", "step": 10, "test_accuracy": 0.2, "test_loss": 2.0},
               {"kind": "epoch", "step": 20, "test_accuracy": 0.2, "test_loss": 2.0},  # eval_every=2: repeated
               {"kind": "epoch", "step": 30, "test_accuracy": 0.8, "test_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curve = tta.accuracy_curve(tmp_path)
    assert curve == [(10.0, 0.2), (30.0, 0.8)]
    assert tta.steps_to_target(curve, 0.5) == pytest.approx(20.0)  # between the real evaluations


def test_a_table_of_validation_and_test_curves_stops_in_one_line(tmp_path):
    """Each run's curve reads validation where it has it, else test; the title read one split for
    all: validation runs (about a point higher) won a "test accuracy" ranking beside test runs."""
    runs_dir = _sweep(tmp_path / "runs")
    run = tmp_path / "runs" / "topk1"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if record["kind"] == "epoch":
            record["val_accuracy"] = record["test_accuracy"] + 0.01
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError) as refused:
        tta.time_to_accuracy_table(sa.load_runs(runs_dir), 0.5, [1], [2])
    message = str(refused.value)
    assert "\n" not in message and "curves score different data: test (" in message and "validation (" in message
    run.rename(tmp_path / "topk1")  # one split again: its title says which
    assert tta.time_to_accuracy_table(sa.load_runs(runs_dir), 0.5, [1], [2]).title.startswith("Time to 50% test")


def _sweep(root: Path, **fixed) -> Path:
    for scheme in ("none", "topk"):
        for seed in (0, 1):
            write_run(root / f"{scheme}{seed}", make_config(scheme=scheme, seed=seed, **fixed))
    return root


def _curve_step(final, target, planned=3, per_epoch=10):
    """write_run's curve: accuracy final * e / planned after e epochs (10 steps each)."""
    points = [(e * per_epoch, final * e / planned) for e in range(1, planned + 1)]
    return tta.steps_to_target(points, target)


def test_time_to_accuracy_arithmetic(tmp_path):
    runs = sa.load_runs(_sweep(tmp_path / "r"))
    table = tta.time_to_accuracy_table(runs, 0.5, [1, 10], [8], tta.default_model(ALPHA), compute="own")
    data = table.data.set_index(["scheme", "bandwidth_gbit", "workers"])
    for scheme in ("dense", "topk"):
        config = "none" if scheme == "dense" else "topk"
        for gbit in (1, 10):
            steps, times, step_ms = [], [], []
            for seed in (0, 1):
                cfg = make_config(scheme=config, seed=seed)
                t = fake_times(cfg)
                if scheme == "dense":  # ring AllReduce of the whole buffer at 8 workers
                    exch = 14 * ALPHA + 2 * 7 / 8 * 1_000_000 * beta(gbit)
                    local = t["data"] + t["forward"] + t["backward"] + t["optimizer"]
                else:  # ring AllGather of 20,000 bytes (values + positions); decompress x 8/2
                    exch = 7 * ALPHA + 7 * 20_000 * beta(gbit)
                    local = t["data"] + t["forward"] + t["backward"] + t["optimizer"] + t["compress"] + t["decompress"] * 4
                ms = local + 1e3 * exch
                final = sa.load_runs(tmp_path / "r" / f"{config}{seed}")["test_accuracy"].iloc[0]
                s = _curve_step(final, 0.5)
                step_ms.append(ms)
                steps.append(s)
                times.append(s * ms / 1e3)
            row = data.loc[(scheme, float(gbit), 8)]
            assert row["predicted_step_ms_mean"] == pytest.approx(sum(step_ms) / 2, rel=1e-12)
            assert row["steps_to_target_mean"] == pytest.approx(sum(steps) / 2, rel=1e-12)
            assert row["time_to_target_s_mean"] == pytest.approx(sum(times) / 2, rel=1e-12)
            assert row["time_to_target_s_std"] == pytest.approx(abs(times[0] - times[1]) / math.sqrt(2), rel=1e-9)
            assert (row["reached"], row["n"]) == (2, 2)
    assert "alpha 50 us" in table.notes[-3] and "defaults" in table.notes[-3]


def test_shared_compute_keeps_runs_whose_batch_size_is_not_recorded(tmp_path):
    """A run that recorded no batch size (NaN in its column) is its own group, not dropped: with
    pandas 3, whose ``astype(str)`` keeps NaN missing, the groupby left it out and its shared
    compute came out NaN."""
    runs = sa.load_runs(_sweep(tmp_path / "r"))
    runs["batch_size"] = [32.0, 32.0, None, None]
    shared = tta.shared_compute_ms(runs)
    assert shared.notna().all()
    local = [tta.compute_ms(row) for _, row in runs.iterrows()]
    assert list(shared.iloc[2:]) == pytest.approx([(local[2] + local[3]) / 2] * 2)


def test_shared_compute_is_the_median_of_the_same_work_and_break_even_names_the_winner(tmp_path):
    """Compute is the same work for every scheme: each prediction uses the median over the runs of
    the same model, data and batch; the break-even map then compares dense SGD with the best
    compressed configuration at each bandwidth, only where every seed reached the target."""
    from sparsetrain.analysis.break_even import break_even_table, plot_break_even

    runs = sa.load_runs(_sweep(tmp_path / "r"))
    local = sorted(tta.compute_ms(row) for _, row in runs.iterrows())  # 4 runs: seeds x schemes
    shared = tta.shared_compute_ms(runs)
    assert list(shared) == pytest.approx([(local[1] + local[2]) / 2] * 4)
    model = tta.default_model(ALPHA)
    table = tta.time_to_accuracy_table(runs, 0.5, [0.01, 100], [8], model)
    data = table.data.set_index(["scheme", "bandwidth_gbit"])
    for _, run in runs.iterrows():
        own, _ = tta.predict_step_ms(run.to_dict(), 8, 1e9 * 100, model, shared.iloc[0])
        assert own == pytest.approx(tta.predict_step_ms(run.to_dict(), 8, 1e11, model)[0]
                                    - tta.compute_ms(run) + shared.iloc[0])
    assert "median measured data + forward" in " ".join(table.notes)
    even = break_even_table(table)
    rows = even.data.set_index("bandwidth_gbit")
    # at 0.01 Gbit/s dense SGD's 1 MB AllReduce takes seconds: top-k wins; elsewhere the numbers say
    per_seed = table.frames["per_seed"].set_index(["scheme", "bandwidth_gbit", "seed"])["time_to_target_s"]
    for gbit in (0.01, 100):
        dense_s = data.loc[("dense", gbit), "time_to_target_s_mean"]
        topk_s = data.loc[("topk", gbit), "time_to_target_s_mean"]
        # on matched seeds: the geometric mean of each seed's dense / top-k time
        ratios = [per_seed[("dense", gbit, s)] / per_seed[("topk", gbit, s)] for s in (0, 1)]
        assert rows.loc[gbit, "speedup"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / 2), rel=1e-12)
        assert rows.loc[gbit, "matched_seeds"] == 2
        assert rows.loc[gbit, "speedup_low"] <= rows.loc[gbit, "speedup"] <= rows.loc[gbit, "speedup_high"]
        assert rows.loc[gbit, "fastest"] == ("top-k" if topk_s < dense_s else "dense SGD")
    assert rows.loc[0.01, "speedup"] > 1
    assert "x" in even.display["speed-up (matched seeds)"].iloc[0] and "(n=2)" in even.display["speed-up (matched seeds)"].iloc[0]
    # a configuration with a seed that never reached the target does not compete
    never = break_even_table(tta.time_to_accuracy_table(runs, 0.99, [1], [8], model))
    assert never.display["fastest"].iloc[0] == "none reached" and math.isnan(never.data["speedup"].iloc[0])
    plot_break_even(even)  # draws
    plot_break_even(never)


def _as_torch_hook(run: Path, scheme: str, sent: int, compress_ms: float) -> None:
    """Turn a fake dense run into one of torch's DDP hooks (``fp16``, ``bf16``, ``torch_powersgd``):
    its bytes, and the host time inside the hook that the trainer records as compress."""
    import yaml

    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    cfg["scheme"]["name"], cfg["dist"]["ddp"] = scheme, True
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = json.loads((run / "summary.json").read_text())
    summary.update(config=cfg, bytes_sent_per_step=sent)
    summary["time_ms"] = {**summary["time_ms"], "compress": compress_ms, "decompress": 0.0}
    (run / "summary.json").write_text(json.dumps(summary))


def test_torch_hooks_allreduce_and_the_16_bit_ones_are_dense_baselines(tmp_path):
    """fp16 / bf16 / torch's PowerSGD run through DDP with AllReduce: their predicted step is the
    AllReduce of their bytes, and the break-even map counts the 16-bit ones as dense baselines."""
    from sparsetrain.analysis.break_even import break_even_table
    from sparsetrain.analysis.loader import collective_of

    root = _sweep(tmp_path / "r")
    for seed in (0, 1):
        run = write_run(root / f"fp16{seed}", make_config(scheme="none", seed=seed))
        _as_torch_hook(run, "fp16", DENSE_HALF, compress_ms=1.5)
    runs = sa.load_runs(root)
    fp16 = runs[runs["scheme"] == "fp16"]
    assert len(fp16) == 2 and {collective_of(r) for _, r in fp16.iterrows()} == {"allreduce"}
    for name in ("bf16", "torch_powersgd"):
        assert collective_of({"scheme": name, "aggregation": "-"}) == "allreduce"
    model = tta.default_model(ALPHA)
    table = tta.time_to_accuracy_table(runs, 0.5, [0.1, 100], [8], model, compute="own")
    data = table.data.set_index(["scheme", "bandwidth_gbit", "workers"])
    for gbit in (0.1, 100):
        row = fp16.iloc[0].to_dict()
        local = sum(row[f"time_{p}_ms"] for p in ("data", "forward", "backward", "optimizer")) + 1.5
        ms, _ = tta.predict_step_ms(row, 8, gbit * 1e9, model)
        assert ms == pytest.approx(local + 1e3 * (14 * ALPHA + 2 * 7 / 8 * DENSE_HALF * beta(gbit)), rel=1e-12)
        assert not math.isnan(data.loc[("fp16", float(gbit), 8), "time_to_target_s_mean"])
    even = break_even_table(table).data.set_index("bandwidth_gbit")
    # fp16 sends half of dense SGD's bytes for the same steps: the best dense baseline wherever the
    # wire counts
    assert even.loc[0.1, "best_dense"].startswith("fp16 (torch hook)")


def test_warmup_steps_are_dense_steps(tmp_path):
    run = write_run(tmp_path / "w", make_config(scheme="randk", aggregation="allreduce", **{"scheme.warmup_steps": 5}))
    row = sa.load_runs(run).iloc[0].to_dict()
    model = tta.default_model(ALPHA)
    step_ms, warm_ms = tta.predict_step_ms(row, 4, 1e9, model)
    t = fake_times(make_config(scheme="randk"))
    local = t["data"] + t["forward"] + t["backward"] + t["optimizer"]
    assert warm_ms == pytest.approx(local + 1e3 * (6 * ALPHA + 1.5 * 1_000_000 * beta(1)))
    assert step_ms == pytest.approx(local + t["compress"] + t["decompress"] + 1e3 * (6 * ALPHA + 1.5 * 10_000 * beta(1)))
    table = tta.time_to_accuracy_table(sa.load_runs(run), 0.5, [1], [4], model)
    s = table.data["steps_to_target_mean"].iloc[0]
    assert s > 5
    assert table.data["time_to_target_s_mean"].iloc[0] == pytest.approx((5 * warm_ms + (s - 5) * step_ms) / 1e3)


def test_not_reached_and_untrained_runs(tmp_path):
    root = _sweep(tmp_path / "r")
    summary = json.loads((root / "topk1" / "summary.json").read_text())
    summary["train_loss"] = 3.0  # above ln 10: did not train
    (root / "topk1" / "summary.json").write_text(json.dumps(summary))
    table = tta.time_to_accuracy_table(sa.load_runs(root), 0.95, [1], [8], tta.default_model())
    assert set(table.display["reached"]) == {"0/2", "0/1"}
    assert set(table.display["time to target (s)"]) == {"not reached"}
    assert table.data["time_to_target_s_mean"].isna().all()
    lines = table.missing_lines()
    assert len(lines) == 1 and lines[0].startswith("did not train") and "seed=1" in lines[0]
    assert "Missing (1 runs" in table.to_markdown()


def test_the_title_names_the_data_the_completed_runs_curves_score(tmp_path):
    """A sweep still running (a job that left no accuracy) times validation targets all the same;
    the title follows the curves read (a summary's val_accuracy beside test-only curves said
    "validation" for a test ranking)."""
    root = _sweep(tmp_path / "r")
    for run in root.iterdir():
        summary = json.loads((run / "summary.json").read_text())
        summary["val_accuracy"] = None if run.name == "topk1" else 0.9
        if run.name == "topk1":
            summary["status"] = "running"
        (run / "summary.json").write_text(json.dumps(summary))
    table = tta.time_to_accuracy_table(sa.load_runs(root), 0.5, [1], [8], tta.default_model())
    assert table.title.startswith("Time to 50% test accuracy")  # the curves score the test set
    for run in root.iterdir():
        if run.name != "topk1":
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for record in records:
                if record["kind"] == "epoch":
                    record["val_accuracy"] = record["test_accuracy"]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = tta.time_to_accuracy_table(sa.load_runs(root), 0.5, [1], [8], tta.default_model())
    assert table.title.startswith("Time to 50% validation accuracy")


def test_fitted_model_from_costmodel_json(tmp_path):
    fit = json.loads((DATA / "bench_check.json").read_text())["costmodel"]
    (tmp_path / "costmodel.json").write_text(json.dumps(fit))
    model = tta.fitted_model(tmp_path / "costmodel.json")
    assert "fitted" in model.source and "allreduce alpha 357.6 us" in model.source
    # the fit's CPU floor (3.92 ns/B, ~2 Gbit/s) caps the rate: 10 and 100 Gbit/s predict the same
    assert model.time_ms("allreduce", 1e6, 4, 10e9) == pytest.approx(model.time_ms("allreduce", 1e6, 4, 100e9))
    assert model.time_ms("allreduce", 1e6, 4, 10e9) == pytest.approx(1e3 * (6 * 357.5958e-6 + 1.5e6 * 3.9218e-9), rel=1e-4)


def test_cli_time_to_accuracy(tmp_path):
    root = _sweep(tmp_path / "r")
    out = tmp_path / "out"
    proc = analysis_cli(root, "--time-to-accuracy", "0.5", "--bandwidth", "1,10,100", "--workers", "8,64",
                        "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "Time to 50% test accuracy" in proc.stdout and "alpha 50 us" in proc.stdout
    for ext in ("md", "csv", "tex", "png", "pdf"):
        assert (out / f"time_to_accuracy.{ext}").stat().st_size > 0
    tta_part = proc.stdout.split("Break-even map")[0]
    assert len(tta_part.split("| top-k")) - 1 == 6  # 3 bandwidths x 2 worker counts
    assert "Break-even map" in proc.stdout and (out / "break_even.png").stat().st_size > 0
    bad = analysis_cli(root, "--time-to-accuracy", "85", "--out", out)
    assert bad.returncode == 2 and "fraction" in bad.stderr


def test_cli_time_to_accuracy_at_several_targets(tmp_path):
    """--time-to-accuracy 0.4,0.5 writes each target's tables and the map that calls a ranking
    only where it holds at both (the frontier's three-target map, for one's own sweep)."""
    root = _sweep(tmp_path / "r")
    out = tmp_path / "out"
    proc = analysis_cli(root, "--time-to-accuracy", "0.5,0.4", "--bandwidth", "1", "--workers", "8", "--out", out,
                        "--quiet")
    assert proc.returncode == 0, proc.stderr
    for name in ("time_to_accuracy_40", "time_to_accuracy_50", "break_even_40", "break_even_50", "break_even"):
        assert (out / f"{name}.md").stat().st_size > 0, name
    assert "40%/50%" in (out / "break_even.md").read_text()
    for bad in ("0.5,0.5", "0.5,85", "0.5,x"):
        proc = analysis_cli(root, "--time-to-accuracy", bad, "--out", out)
        assert proc.returncode == 2 and "--time-to-accuracy" in proc.stderr and bad in proc.stderr, proc.stderr


def test_bench_check_predicted_step_within_20_percent():
    """The one measured point: on the emulated cluster (4 ranks, tc-shaped links; the committed
    results/bench numbers, trimmed into tests/data), measured compute + predicted exchange vs
    the measured step, at every rate and for every scheme."""
    data = json.loads((DATA / "bench_check.json").read_text())
    check = cluster_check.bench_check(data["step"], data["costmodel"])
    assert len(check) == 16 and check["within"].all()
    paper = check[(check["rate"] == "paper") & (check["scheme"] == "blockk")].iloc[0]
    assert paper["predicted_step_ms"] == pytest.approx(884.1, abs=0.1)
    assert paper["measured_step_ms"] == pytest.approx(940.8, abs=0.1)
    assert paper["ratio"] == pytest.approx(0.940, abs=0.001)
    # the gap is the wait for the slowest rank (skew), which the model does not predict
    assert (check["ratio"] < 1).all()


def test_bench_check_on_the_interleaved_benchmark():
    """The same check on the rebuilt benchmark's output (schema 2: rows named by scheme and
    aggregation, with their config options; the committed results/bench/step.json, trimmed):
    each row's collective comes from its options; rows whose exchange is no phase of its own
    (compute-only, overlapped dense, DDP) are left out."""
    data = json.loads((DATA / "bench_check_v2.json").read_text())
    check = cluster_check.bench_check(data["step"], data["costmodel"])
    assert len(check) == 24 and check["within"].all()
    assert set(check["scheme"]) == {"dense", "topk_ag", "randk_ag", "randk_ar", "blockk_ag", "blockk_ar"}
    assert set(check.loc[check["scheme"].str.endswith("_ag"), "collective"]) == {"allgather"}
    paper = check[(check["rate"] == "paper") & (check["scheme"] == "blockk_ag")].iloc[0]
    assert paper["ratio"] == pytest.approx(0.931, abs=0.001)


# --- wire bytes in the loader and the figure ------------------------------------------------------


def test_loader_wire_bytes_from_summary_or_config(tmp_path):
    old = write_run(tmp_path / "old", make_config(scheme="topk", world_size=4))  # no wire fields
    row = sa.load_runs(old).iloc[0]
    assert row["wire_bytes_source"] == "computed"
    assert row["wire_bytes_per_step"] == 3 * 20_000  # ring AllGather: (W-1) x the message
    assert row["wire_bytes_total"] == 30 * 3 * 20_000
    dense = sa.load_runs(write_run(tmp_path / "dense", make_config(scheme="none", world_size=4))).iloc[0]
    assert dense["wire_bytes_per_step"] == 1.5 * 1_000_000  # ring AllReduce: 2(W-1)/W x the buffer
    new = write_run(tmp_path / "new", make_config(scheme="topk", world_size=4))
    summary = json.loads((new / "summary.json").read_text())
    summary.update(wire_bytes_per_step=123, wire_bytes_total=4567)
    (new / "summary.json").write_text(json.dumps(summary))
    row = sa.load_runs(new).iloc[0]
    assert (row["wire_bytes_per_step"], row["wire_bytes_total"], row["wire_bytes_source"]) == (123, 4567, "summary")
    fig = sa.plot_accuracy_vs_bytes(sa.load_runs(tmp_path))
    assert fig.axes[0].get_xlabel().startswith("wire bytes per step per worker")


def test_a_target_reached_at_the_first_evaluation_bounds_the_speed_up_from_one_side(tmp_path):
    """Steps to a target crossed at the first evaluation are only an upper bound: with both sides
    there the speed-up is step time alone and is not judged; a bounded compressed side still
    "pays" when its bound does (it is at least that fast), never "costs"."""
    from sparsetrain.analysis.break_even import (
        FIRST_EVALUATION,
        _verdict,
        break_even_table,
        plot_break_even,
        targets_table,
    )

    runs = sa.load_runs(_sweep(tmp_path / "r"))  # fake runs: accuracy rises linearly from epoch 1
    model = tta.default_model(ALPHA)
    first = min(c[0][1] for c in (tta.accuracy_curve(r) for r in runs["run_dir"]))
    table = tta.time_to_accuracy_table(runs, first * 0.99, [0.01, 100], [8], model)  # everyone, at once
    assert (table.frames["per_seed"]["at_first_evaluation"] == 1).all()
    assert table.display["steps to target"].str.endswith("(first evaluation)").all()
    even = break_even_table(table)
    assert set(even.data["compression"]) == {FIRST_EVALUATION}, even.data["compression"]
    cells = [text.get_text() for text in plot_break_even(even).axes[0].texts]
    assert cells and all(text.endswith("not judged") for text in cells), cells
    later = break_even_table(tta.time_to_accuracy_table(runs, 0.5, [0.01, 100], [8], model))
    assert FIRST_EVALUATION not in set(later.data["compression"])
    assert targets_table({0.5: even, 0.6: even}).display["ranking"].iloc[0] == FIRST_EVALUATION
    # one side bounded: its bound keeps the verdict it cannot overturn
    assert _verdict(1.2, 1.1, 1.3, compressed_bound=True) == "pays"
    assert _verdict(0.8, 0.7, 0.9, compressed_bound=True) == FIRST_EVALUATION
    assert _verdict(0.8, 0.7, 0.9, dense_bound=True) == "costs"
    assert _verdict(1.0, 0.9, 1.1, dense_bound=True) == FIRST_EVALUATION
    assert _verdict(1.2, 1.1, 1.3) == "pays"


def test_cluster_check_command(tmp_path, capsys):
    data = json.loads((DATA / "bench_check.json").read_text())
    (tmp_path / "step.json").write_text(json.dumps(data["step"]))
    (tmp_path / "costmodel.json").write_text(json.dumps(data["costmodel"]))
    assert cluster_check.main([str(tmp_path)]) == 0
    assert "16/16 within 20%" in capsys.readouterr().out
    assert cluster_check.main([str(tmp_path), "--tolerance", "0.05"]) == 1  # the skew gap is 1-9%


def test_speed_up_pairs_matched_seeds_and_a_ranking_holds_only_at_every_target():
    import pandas as pd

    from sparsetrain.analysis.break_even import matched_speedup, targets_table
    from sparsetrain.analysis.table import Table

    keys = ["scheme", "bandwidth_gbit", "workers"]
    rows = [{"scheme": "dense", "bandwidth_gbit": 1.0, "workers": 8, "seed": s, "time_to_target_s": t, "reached": 1.0}
            for s, t in zip(range(3), (10.0, 12.0, 11.0))]
    rows += [{"scheme": "signsgd", "bandwidth_gbit": 1.0, "workers": 8, "seed": s, "time_to_target_s": t, "reached": 1.0}
             for s, t in zip(range(5), (9.0, 11.0, 10.5, 1.0, 1.0))]  # seeds 3-4: lucky, unmatched
    per_seed = pd.DataFrame(rows)
    dense, sign = per_seed.iloc[0], per_seed.iloc[3]
    speedup, low, high, seeds = matched_speedup(per_seed, keys, dense, sign)
    assert seeds == [0, 1, 2]  # seeds 3-4 of signSGD have no dense partner and do not count
    assert speedup == pytest.approx(math.exp(sum(math.log(a / b) for a, b in ((10, 9), (12, 11), (11, 10.5))) / 3))
    assert low < speedup < high
    # three targets: the same fastest and verdict at each is a ranking; otherwise the target decides
    def even(fastest, does):
        data = pd.DataFrame([{"bandwidth_gbit": 1.0, "workers": 8, "fastest": fastest, "compression": does,
                              "speedup": 1.1, "best_compressed": "signSGD"}])
        return Table("break_even", "Break-even map: time to 85% validation accuracy", data, data)
    same = targets_table({0.84: even("signSGD", "pays"), 0.85: even("signSGD", "pays"), 0.86: even("signSGD", "pays")})
    assert bool(same.data["holds"].iloc[0]) and same.display["ranking"].iloc[0].startswith("holds: signSGD")
    split = targets_table({0.84: even("PowerSGD", "pays"), 0.85: even("fp16", "costs"), 0.86: even("fp16", "costs")})
    assert not split.data["holds"].iloc[0] and split.display["ranking"].iloc[0] == "decided by the target"
    assert "84%/85%/86%" in split.title


def test_local_sgd_pays_the_latency_once_a_period(tmp_path):
    """A run that synchronises every 8 steps (summary's ``sync``): one AllReduce of a
    synchronisation's bytes, its time spread over the period; a per-step scheme with the same mean
    bytes pays the latency every step."""
    run = write_run(tmp_path / "local", make_config(scheme="none"))
    summary = json.loads((run / "summary.json").read_text())
    summary.update(bytes_sent_per_step=1_000_000 / 8, collective="allreduce",
                   sync={"period": 8, "syncs": 1, "bytes_per_sync": 1_000_000, "time_ms_per_sync": 1.0})
    (run / "summary.json").write_text(json.dumps(summary))
    row = sa.load_runs(run).iloc[0].to_dict()
    assert row["sync_period"] == 8
    model = tta.default_model(ALPHA)
    t = fake_times(make_config(scheme="none"))
    local = sum(t[p] for p in ("data", "forward", "backward", "optimizer"))
    step_ms, _ = tta.predict_step_ms(row, 4, 1e9, model)
    assert step_ms == pytest.approx(local + 1e3 * (6 * ALPHA + 1.5 * 1_000_000 * beta(1)) / 8, rel=1e-12)
    every_step, _ = tta.predict_step_ms({**row, "sync_period": math.nan}, 4, 1e9, model)
    assert every_step - step_ms == pytest.approx(1e3 * 6 * ALPHA * 7 / 8, rel=1e-9)


def test_the_break_even_summary_names_a_synchronising_scheme_by_its_period_and_delta():
    """The summary and the map's cells name a local point short: its scheme, period and compressed
    delta, not its sync node's whole text (the full name stays in each target's own table)."""
    from sparsetrain.analysis.break_even import _short

    sync = "sync=PeriodicSync(nesterov=True, outer_lr=0.7, outer_momentum=0.9, period=14)"
    assert _short(f"DiLoCo, ratio=0.1, error feedback: on, {sync}, delta=TopK, exchange=trainer") == \
        "DiLoCo, ratio=0.1, H=14, TopK delta"
    assert _short("local SGD, ratio=1.0, sync=PeriodicSync(outer_lr=1.0, outer_momentum=0.0, period=66), "
                  "delta=dense") == "local SGD, H=66"
    assert _short("top-k, ratio=0.01, sync=every step, delta=-") == "top-k, ratio=0.01"
    assert _short(None) == "none reached"


def _stopped_at_target(run: Path, rate_bits: float, step: int, train_s: float, reached: bool = True) -> None:
    """Make a fake run one that ran on an emulated link and stopped at a target."""
    summary = json.loads((run / "summary.json").read_text())
    summary.update(link={"rate": "x", "rate_bits": rate_bits, "delay_us": 0.0},
                   target={"accuracy": 0.8, "reached": reached, "step": step, "epoch": step / 10,
                           "val_accuracy": 0.81, "train_s": train_s, "curve_s": 1.0, "wall_s": train_s + 5.0}
                   if reached else {"accuracy": 0.8, "reached": False})
    (run / "summary.json").write_text(json.dumps(summary))


def test_e2e_check_sets_measured_time_to_target_against_the_prediction(tmp_path):
    """A run stopped at its target on a 1 Gbit/s link (world size 4, random-k AllReduce, 3
    warm-up steps): predicted = 3 dense steps + 37 random-k steps at the ring formulas' exchange
    and the run's own phases; the ratio to the measured training time; runs that did not reach
    the target are listed, not compared. From the command line too, with the figure."""
    config = make_config(scheme="randk", aggregation="allreduce", world_size=4, **{"scheme.warmup_steps": 3})
    run = write_run(tmp_path / "sweep" / "hit", config)
    _stopped_at_target(run, 1e9, 40, 9.0)
    missed = write_run(tmp_path / "sweep" / "missed", {**config, "seed": 1})
    _stopped_at_target(missed, 1e9, 0, 0.0, reached=False)
    plain = write_run(tmp_path / "sweep" / "plain", {**config, "seed": 2})  # no link, no target: not a point
    assert plain.exists()
    model = tta.default_model(ALPHA)
    check = cluster_check.e2e_check(sa.load_runs(tmp_path / "sweep"), model).set_index("seed")
    assert sorted(check.index) == [0, 1]
    t = fake_times(config)
    local = t["data"] + t["forward"] + t["backward"] + t["optimizer"]
    step = local + t["compress"] + t["decompress"] + 1e3 * (6 * ALPHA + 1.5 * 10_000 * beta(1))
    warm = local + 1e3 * (6 * ALPHA + 1.5 * 1_000_000 * beta(1))
    hit = check.loc[0]
    assert hit["predicted_s"] == pytest.approx((3 * warm + 37 * step) / 1e3, rel=1e-12)
    assert hit["predicted_to_measured"] == pytest.approx(hit["predicted_s"] / 9.0) and hit["measured_wall_s"] == 14.0
    assert hit["within"] == (abs(hit["predicted_to_measured"] - 1) <= 0.15) and hit["ratio"] == 0.01
    # the residual's usual place, side by side: the model's exchange per step and the run's
    assert hit["modelled_exchange_ms"] == pytest.approx(1e3 * (6 * ALPHA + 1.5 * 10_000 * beta(1)), rel=1e-9)
    assert hit["measured_exchange_ms"] == t["exchange"]
    assert check.loc[1, "reached"] == 0 and math.isnan(check.loc[1, "predicted_to_measured"])
    fig = tmp_path / "fig" / "e2e"
    proc = analysis_cli("--runs", tmp_path / "sweep", "--figure", fig, module="sparsetrain.analysis.cluster_check")
    assert proc.returncode in (0, 1), proc.stderr
    assert "end to end" in proc.stdout and "within 15%" in proc.stdout
    assert (fig.parent / "e2e.png").stat().st_size > 0
    assert (fig.parent / "e2e.txt").read_text().strip() == proc.stdout.strip().rsplit("\n", 1)[0]  # the table, as printed


def test_a_run_that_recorded_every_rank_is_predicted_from_its_slowest(tmp_path):
    """summary.json's time_ms_ranks (every rank's phases): a synchronous step waits for the
    slowest rank, so its compute is what the prediction and the end-to-end check use, and the
    check shows how far apart the ranks were."""
    config = make_config(scheme="randk", aggregation="allreduce", world_size=4)
    run = write_run(tmp_path / "sweep" / "hit", config)
    _stopped_at_target(run, 1e9, 40, 9.0)
    t = fake_times(config)
    summary = json.loads((run / "summary.json").read_text())
    slow = {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0}  # + 10 ms on rank 2
    summary["time_ms_ranks"] = {p: [t[p], t[p], t[p] + slow.get(p, 0.0), t[p]] for p in t}
    summary["load"] = {"mean_1min": 4.5, "max_1min": 5.0, "readings": 9, "cpus": 2, "local_ranks": 4}
    (run / "summary.json").write_text(json.dumps(summary))
    row = sa.load_runs(tmp_path / "sweep").iloc[0]
    own = t["data"] + t["forward"] + t["backward"] + t["optimizer"]
    assert row["compute_ms_ranks"] == pytest.approx((own, own, own + 10.0, own))
    assert tta.compute_ms(row) == pytest.approx(own + 10.0)
    check = cluster_check.e2e_check(sa.load_runs(tmp_path / "sweep"), tta.default_model(ALPHA)).iloc[0]
    exchange = 1e3 * (6 * ALPHA + 1.5 * 10_000 * beta(1))
    assert check["predicted_step_ms"] == pytest.approx(own + 10.0 + t["compress"] + t["decompress"] + exchange)
    assert check["rank_compute_spread_ms"] == pytest.approx(10.0)
    assert check["modelled_exchange_ms"] == pytest.approx(exchange)
    assert check["load_mean"] == 4.5
    notes = " ".join(tta.time_to_accuracy_table(sa.load_runs(tmp_path / "sweep"), 0.8, [1], [8]).notes)
    assert "Compute: the slowest rank's for the 1 of 1 runs" in notes
    assert "1-minute load average 4.50-4.50 over each run, +0.50 to +0.50 beyond the run's own ranks (2 CPUs)" in notes
    # a run without every rank's record (written before): rank 0's, and no spread
    del summary["time_ms_ranks"]
    (run / "summary.json").write_text(json.dumps(summary))
    row = sa.load_runs(tmp_path / "sweep").iloc[0]
    assert row["compute_ms_ranks"] is None and tta.compute_ms(row) == pytest.approx(own)


def test_ddp_overlap_table_reads_the_ddp_benchmark():
    """cluster_check's DDP overlap table on a two-configuration ddp.json written here: the
    model's exchange for each configuration's bytes (ring formulas by hand), the measured exposed
    exchange (its `exchange` phase), what was hidden, and DDP's headroom (noop hook - compute)."""
    def config(step, exchange, sent):
        return {"step_ms": step, "phases_ms": {"exchange": exchange}, "bytes_sent_per_step": sent}

    ddp = {"results": [{"meta": {"world_size": 4, "rate_bits": 1e9, "label": "1gbit"},
                        "configs": {"compute": config(600.0, 0.0, 0), "ddp_noop": config(610.0, 0.0, 0),
                                    "ddp": config(900.0, 250.0, 1_000_000),
                                    "ddp_topk": config(650.0, 20.0, 10_000)}}]}
    table = cluster_check.ddp_overlap(ddp, tta.default_model(ALPHA)).set_index("configuration")
    assert set(table.index) == {"ddp", "ddp_topk"}  # compute and the noop hook are references
    dense = 1e3 * (6 * ALPHA + 1.5 * 1_000_000 * beta(1))
    topk = 1e3 * (3 * ALPHA + 3 * 10_000 * beta(1))
    assert table.loc["ddp", "predicted_exchange_ms"] == pytest.approx(dense, rel=1e-12)
    assert table.loc["ddp", "hidden_ms"] == pytest.approx(dense - 250.0)
    assert table.loc["ddp", "hidden_share"] == pytest.approx((dense - 250.0) / dense)
    assert table.loc["ddp_topk", "predicted_exchange_ms"] == pytest.approx(topk, rel=1e-12)
    assert (table["headroom_ms"] == 10.0).all()


def test_a_fused_decode_is_extrapolated_by_its_share(tmp_path):
    """A signSGD run whose compiled kernels decoded every message in one sweep: at more workers
    its decode grows by the per-message part only (``costmodel.growing_share``); the same row
    with numpy's kernels grows linearly through 0."""
    from sparsetrain.costmodel import growing_share

    run = write_run(tmp_path / "s", make_config(scheme="topk", aggregation="allgather"))
    row = {**sa.load_runs(run).iloc[0].to_dict(), "scheme": "signsgd"}
    assert row["kernels"] == "numpy"  # a summary without the key: from before the compiled kernels
    model = tta.default_model(ALPHA)
    numpy_ms, _ = tta.predict_step_ms(row, 16, 1e9, model)
    fused_ms, _ = tta.predict_step_ms({**row, "kernels": "numba 0.68.1"}, 16, 1e9, model)
    world, decompress = int(row["world_size"]), row["time_decompress_ms"]
    share = growing_share("signsgd", world, "numba 0.68.1")
    assert 0 < share < 1
    assert numpy_ms - fused_ms == pytest.approx(decompress * (1 - share) / world * (16 - world))


def test_runs_measured_at_several_worker_counts_say_which(tmp_path):
    """tta_workers measures steps to a target at 2, 4 and 8 ranks: each row names the runs' own
    worker count beside the worker count its prediction is for (the two once shared a label,
    and the runs' count was lost)."""
    for world in (2, 4):
        write_run(tmp_path / f"dense{world}", make_config(scheme="none", seed=0, world_size=world))
    table = tta.time_to_accuracy_table(sa.load_runs(tmp_path), 0.5, [1], [8], tta.default_model(ALPHA))
    shown = table.display
    assert list(shown["measured at workers"]) == ["2", "4"] and list(shown["workers"]) == [8, 8]


def test_machines_note_names_the_machines_the_runs_were_timed_on():
    import pandas as pd

    from sparsetrain.analysis.time_to_accuracy import machines_note

    one = pd.DataFrame({"host": ["AMD EPYC x2"] * 3})
    assert machines_note(one) == "Timed on one machine: AMD EPYC x2 (3 runs)."
    mixed = pd.DataFrame({"host": ["AMD EPYC x2", "Intel Xeon x2", "AMD EPYC x2", "unrecorded"]})
    note = machines_note(mixed)
    assert note.startswith("Timed on 2 machine(s), 1 runs from before it was recorded: AMD EPYC x2 (2 runs); "
                           "Intel Xeon x2 (1 runs).") and "compare within one machine" in note
    assert machines_note(pd.DataFrame({"host": ["unrecorded"]})) is None
    assert machines_note(pd.DataFrame({"scheme": ["topk"]})) is None
