"""Issue 62: the analysis never merges runs that differ, never averages two runs of one seed, and
reads a sweep's overrides by value. Run folders written here by the results-file contract
(``test_analysis.write_run`` / ``write_sweep``), analysed in-process."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from test_analysis import _row, make_config, write_run, write_sweep

from sparsetrain import analysis as sa
from sparsetrain.analysis.__main__ import main as analysis_main
from sparsetrain.analysis.group import varying_axes, without_copies
from sparsetrain.analysis.loader import select
from sparsetrain.analysis.study_tables import runs_table
from sparsetrain.results import RunWriter

ACCURACY = "test accuracy (%)"


def _edit_summary(run: Path, **fields) -> None:
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, **fields}))


def test_runs_that_differ_in_any_recorded_key_are_rows_of_their_own(tmp_path):
    """optim.momentum 0.9 and 0 became one row: no axis read it. Bookkeeping keys (W&B group, how
    often it logged, the device) and a key a run predates at its default tell nothing apart."""
    for seed in (0, 1):
        for momentum in (0.9, 0.0):
            config = make_config(seed=seed, **{"optim.momentum": momentum, "wandb.group": f"g{seed}",
                                               "train.log_every": 5 + seed, "train.device": ["cpu", "auto"][seed]})
            if seed:  # written after train.curve_points existed, at its default: the same setting
                config["train"]["curve_points"] = 1
            config["scheme"]["compressor"] = {"_target_": "sparsetrain.compress.TopK", "_partial_": True}
            write_run(tmp_path / f"m{momentum}_s{seed}", config)
    # the compressor's class differs with the scheme: it splits nothing, so it adds no column
    randk = make_config(scheme="randk")
    randk["scheme"]["compressor"] = {"_target_": "sparsetrain.compress.RandomK", "_partial_": True}
    write_run(tmp_path / "randk", randk)
    table = runs_table(sa.load_runs(tmp_path))
    assert len(table.display) == 3, table.display
    assert list(table.display["optim.momentum"]) == ["0.0", "0.9", "0.9"]
    for momentum in ("0.0", "0.9"):
        assert "(n=2)" in _row(table, scheme="top-k", **{"optim.momentum": momentum})[ACCURACY]
    assert not {"wandb.group", "train.log_every", "train.device", "train.curve_points",
                "scheme.compressor._target_"} & set(table.display)
    # the same split in every grouping: the figures' and time to accuracy's
    assert "optim.momentum" in varying_axes(sa.load_runs(tmp_path))
    assert "optim.momentum" in sa.curves_of(sa.load_runs(tmp_path))
    # a slice by it, by value: the recorded 0.0 is the 0 one types
    assert set(select(sa.load_runs(tmp_path), {"optim.momentum": ["0"]})["optim.momentum"]) == {0.0}


def test_runs_of_one_seed_are_never_averaged_into_one(tmp_path, capsys):
    """Three DDP runs of seed 0 at 52.5 / 65.5 / 65.5% showed as "61.17 (n=1)", 0/1 blew up
    though one had: each is its own row now, and the table says which runs and what to change."""
    for i, accuracy in enumerate((0.525, 0.655, 0.655)):
        run = write_run(tmp_path / f"ddp{i}", make_config(**{"dist.ddp": True}))
        peak = {"after_step_20": {"train_loss": 5.0 if i == 0 else 1.0, "step": 30}}
        _edit_summary(run, test_accuracy=accuracy, train_loss_peak=peak)
    table = runs_table(sa.load_runs(tmp_path))
    cells = dict(zip(table.display["repeat"], table.display[ACCURACY], strict=True))
    assert cells == {"1": "52.50 (n=1)", "2": "65.50 (n=1)", "3": "65.50 (n=1)"}, table.display
    blew_up = dict(zip(table.display["repeat"], table.display["blew up, recovered"], strict=True))
    assert blew_up == {"1": "1/1", "2": "0/1", "3": "0/1"}
    note = [n for n in table.notes if "share seed=0" in n]
    assert len(note) == 1 and all(f"ddp{i}" in note[0] for i in range(3)) and "give each run its own seed" in note[0]
    assert analysis_main([str(tmp_path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "warning: 3 runs share seed=0 and every recorded setting" in capsys.readouterr().err
    # a configuration whose seeds all differ stays one row beside them, its seeds averaged
    for seed in (0, 1):
        write_run(tmp_path / "more" / f"randk{seed}", make_config(scheme="randk", seed=seed))
    table = runs_table(sa.load_runs(tmp_path))
    assert "(n=2)" in _row(table, scheme="random-k", repeat="-")[ACCURACY]
    # the time-per-phase figure and time to accuracy group the same way (no error, no mean)
    runs = sa.load_runs(tmp_path)
    sa.plot_time_per_phase(runs)
    tta = sa.time_to_accuracy_table(runs, 0.5, [1.0], [2])
    assert "repeat" in tta.data and any("share seed=0" in n for n in tta.notes)


def test_a_grid_that_ran_dense_sgd_at_two_scopes_counts_its_seed_once(tmp_path):
    """scheme=none,topk scope=layerwise,global runs dense SGD twice per seed under a key it
    ignores: one computation, counted once (from the first run), never a mean of the two. Copies
    that ended apart (another machine, another commit) are not one computation: repeats, shown
    apart, never one dropped for the other without a word."""
    sweep = write_sweep(tmp_path / "grid", {"scheme": "none,topk", "scope": "layerwise,global"}, "mine")
    _edit_summary(sweep / "0", test_accuracy=0.52)  # dense at layerwise
    _edit_summary(sweep / "1", test_accuracy=0.52)  # dense at global: the same seed, 0
    table = runs_table(sa.load_runs(sweep))
    assert _row(table, scheme="dense SGD")[ACCURACY] == "52.00 (n=1)", table.display
    assert "repeat" not in table.display
    assert any("differ only in settings dense SGD ignores" in note and "counted once" in note for note in table.notes)
    _edit_summary(sweep / "1", test_accuracy=0.60)
    runs = sa.load_runs(sweep)
    dense = runs[~runs["scheme"].isin(["topk"])]
    assert len(dense) == 2 and len(without_copies(dense)) == 2
    table = runs_table(runs)
    shown = table.display[table.display["scheme"] == "dense SGD"]
    assert sorted(shown[ACCURACY]) == ["52.00 (n=1)", "60.00 (n=1)"], table.display
    assert any("shown apart as repeats" in note for note in table.notes)


def test_summarize_refuses_two_runs_of_one_seed(tmp_path):
    for i in range(2):
        write_run(tmp_path / f"r{i}", make_config())
    runs = sa.load_runs(tmp_path)
    with pytest.raises(ValueError, match="share seed"):
        sa.summarize(runs, ["scheme"], ["test_accuracy"])


def _as_hydra_records(sweep: Path, recorded: dict[str, str]) -> None:
    """Rewrite each job's overrides.yaml as Hydra's sweeper records them: ``true`` -> ``True``,
    ``1e-3`` -> ``0.001`` (``BasicSweeper.split_arguments``)."""
    for overrides in sweep.glob("*/.hydra/overrides.yaml"):
        items = yaml.safe_load(overrides.read_text())
        fixed = []
        for item in items:
            key, _, value = item.partition("=")
            fixed.append(f"{key}={recorded.get(value, value)}")
        overrides.write_text(yaml.safe_dump(fixed))


def test_a_sweep_over_booleans_numbers_and_null_has_no_absent_job(tmp_path, capsys):
    """scheme.error_feedback=true,false: Hydra records the job's override as True, and every job
    read as absent (--strict exited 3). Values match by value, as Hydra parses them."""
    sweep = write_sweep(tmp_path / "sweep", {"scheme.error_feedback": "true,false", "optim.lr": "1e-3,0.1",
                                             "train.stop_at_accuracy": "null,0.9"}, "mine")
    _as_hydra_records(sweep, {"true": "True", "false": "False", "1e-3": "0.001"})
    runs = sa.load_runs(sweep)
    assert len(runs) == 8 and set(runs["status"]) == {"completed"}, runs[["status", "overrides"]]
    assert analysis_main([str(sweep), "--out", str(tmp_path / "out"), "--strict", "--quiet"]) == 0
    assert "not in the numbers" not in capsys.readouterr().err
    # a job that did leave no folder is still promised, with the values the sweep gave it
    (sweep / "7").rename(tmp_path / "gone")
    absent = sa.load_runs(sweep).set_index("status").loc[["absent"]]
    assert len(absent) == 1 and absent.iloc[0]["error_feedback"] in (False,) and absent.iloc[0]["lr"] == 0.1


def test_the_override_is_read_as_hydra_reads_it():
    from sparsetrain.analysis.loader import override_value

    assert override_value("a", "True") is True and override_value("a", "false") is False
    assert override_value("a", "null") is None and override_value("a", "1e-3") == 0.001
    assert override_value("a", "'0.1'") == "0.1" and override_value("+a", "[1,2]") == [1, 2]
    assert override_value("a", "topk") == "topk"


OWN = '''from sparsetrain.compress import TopK


class Mine(TopK):
    """version {version}"""
'''


def test_an_out_of_tree_compressors_source_is_recorded_and_two_versions_are_two_rows(tmp_path, monkeypatch):
    from sparsetrain.provenance import compressor_code

    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    (tmp_path / "code").mkdir()
    digests = []
    for version in (1, 2):
        (tmp_path / "code" / f"own_v{version}.py").write_text(OWN.format(version=version))
        code = compressor_code(f"own_v{version}.Mine")
        assert code["target"] == f"own_v{version}.Mine" and code["files"] == [str(tmp_path / "code" / f"own_v{version}.py")]
        digests.append(code["digest"])
    assert digests[0] != digests[1]
    assert compressor_code("sparsetrain.compress.TopK") is None and compressor_code(None) is None
    sys.modules.pop("own_v1", None), sys.modules.pop("own_v2", None)
    # two runs of one seed and config, on two versions of one's own class: two configurations
    for version, digest in enumerate(digests, 1):
        run = write_run(tmp_path / "runs" / f"v{version}", make_config())
        _edit_summary(run, compressor_code={"target": "own.Mine", "files": ["own.py"], "digest": digest})
    table = runs_table(sa.load_runs(tmp_path / "runs"))
    assert sorted(table.display["compressor_code"]) == sorted(digests) and "repeat" not in table.display


def test_a_helper_module_ones_class_imports_is_part_of_its_source(tmp_path, monkeypatch):
    """An edit in a module of one's own that the class imports (random-k's positions turned into
    top-k's in `helpers.order`) changes what runs: it is another version, not the same digest
    (a resume took it, and the analysis pooled the two, without a word). Installed packages and
    sparsetrain are not digested."""
    from sparsetrain.provenance import compressor_code

    code_dir = tmp_path / "code"
    code_dir.mkdir()
    monkeypatch.syspath_prepend(str(code_dir))
    (code_dir / "mine_order.py").write_text("import torch\n\ndef order(x, g):\n    return torch.randperm(x.numel(), generator=g)\n")
    (code_dir / "mine_hk.py").write_text("from mine_order import order\nfrom sparsetrain.compress import TopK\n\n\nclass Mine(TopK):\n    pass\n")
    first = compressor_code("mine_hk.Mine")
    assert first["files"] == [str(code_dir / "mine_hk.py"), str(code_dir / "mine_order.py")]
    (code_dir / "mine_order.py").write_text("import torch\n\ndef order(x, g):\n    return x.abs().argsort(descending=True)\n")
    assert compressor_code("mine_hk.Mine")["digest"] != first["digest"]
    sys.modules.pop("mine_hk", None), sys.modules.pop("mine_order", None)


def test_summary_json_says_its_schema_version(tmp_path):
    from sparsetrain.results import SCHEMA_VERSION

    writer = RunWriter(tmp_path / "new")
    writer.start(config=make_config())
    assert json.loads((tmp_path / "new" / "summary.json").read_text())["schema_version"] == SCHEMA_VERSION >= 1
    write_run(tmp_path / "old", make_config())  # written before the field: version 0
    runs = sa.load_runs(tmp_path).set_index("run_dir")
    assert runs.loc[str((tmp_path / "old").resolve()), "schema_version"] == 0
    assert runs.loc[str((tmp_path / "new").resolve()), "schema_version"] == SCHEMA_VERSION


def test_a_verdict_side_with_two_runs_of_one_seed_stops_in_one_line():
    # findings' sides went through a per-seed mean: three runs of seed 0 became one "seed"
    import pandas as pd

    from sparsetrain.analysis.findings import side_accuracy

    side = pd.DataFrame({"seed": [0, 0, 1], "status": "completed", "test_accuracy": [0.525, 0.655, 0.66],
                         "run_dir": ["sweep/a", "sweep/b", "sweep/c"]})
    with pytest.raises(ValueError) as refused:
        side_accuracy(side)
    message = str(refused.value)
    assert "\n" not in message and "seed 0 has 2 runs" in message and "sweep/a, sweep/b" in message
    assert side_accuracy(side.iloc[1:]).to_dict() == {0: 65.5, 1: 66.0}


def test_a_verdict_side_that_mixes_two_configurations_stops_in_one_line(tmp_path):
    """A side was picked by the axes its point names only: a top-k seed at another rate and
    momentum joined the other seeds, and the verdict moved without a word."""
    from sparsetrain.analysis.findings import _side, side_accuracy

    for seed in (0, 1):
        write_run(tmp_path / f"s{seed}", make_config(seed=seed))
    write_run(tmp_path / "s2", make_config(seed=2, **{"optim.lr": 0.025, "optim.momentum": 0.0}))
    runs = sa.load_runs(tmp_path)
    side = _side(runs, {"scheme": "topk"}, {})
    with pytest.raises(ValueError) as refused:
        side_accuracy(side)
    message = str(refused.value)
    assert "\n" not in message and "differ in lr: lr = 0.1 (" in message and "s2" in message
    assert "allowed: one configuration per side" in message
    assert list(side_accuracy(_side(runs, {"scheme": "topk", "lr": 0.1}, {})).index) == [0, 1]


def test_the_second_pass_reads_its_own_sweeps_only(tmp_path):
    """Its setting named no experiment: a run of the same setting in another folder joined its
    seeds (n 3 -> 4, paired -> Welch)."""
    from sparsetrain.analysis.findings import SECOND_PASS, _side

    config = make_config(seed=0)
    theirs = write_run(tmp_path / "rq1_scope" / "0", config, experiment="rq1_scope")
    write_run(tmp_path / "mine" / "0", make_config(seed=1), experiment="smoke")
    runs = sa.load_runs(tmp_path)
    picked = _side(runs, {"scheme": "topk"}, {k: v for k, v in SECOND_PASS.items() if k == "experiment"})
    assert list(picked["run_dir"]) == [str(theirs.resolve())]


def test_step_times_from_two_devices_are_not_averaged(tmp_path):
    """train.device is bookkeeping (it changes no number but the time): a GPU run's step time was
    averaged with a CPU run's into one cell, without a note."""
    for seed in (0, 1):
        write_run(tmp_path / f"s{seed}", make_config(seed=seed))
    table = runs_table(sa.load_runs(tmp_path))
    assert _row(table, scheme="top-k")["time/step (ms)"].endswith("(n=2)")
    _edit_summary(tmp_path / "s1", device="cuda:0")
    table = runs_table(sa.load_runs(tmp_path))
    row = _row(table, scheme="top-k")
    assert "(n=2)" in row[ACCURACY] and "(n=" not in row["time/step (ms)"], row
    assert any("Time left out for 1 configuration(s)" in n and "cpu; cuda" in n for n in table.notes), table.notes


def _host(threads=None, cpu="AMD EPYC", backend="gloo") -> dict:
    return {"cpu": cpu, "cpus": 2, "system": "Linux", "torch": "2.x", "gpu": None,
            **({"threads": threads, "backend": backend} if threads is not None else {})}


@pytest.mark.parametrize("change", ["threads", "backend", "resumed elsewhere", "resumed with other threads"])
def test_step_times_on_other_threads_backends_or_a_moved_run_are_not_averaged(tmp_path, change):
    """Audit 3: train.threads is bookkeeping, yet one thread a rank against two changed a step
    5.5-6x: two seeds that differed only there were averaged into one time (n=2, no note); a run
    resumed on another machine was one host string ("A;B") and kept its mixed time."""
    hosts = {0: [_host(2)], 1: [_host(2)]}
    if change == "threads":
        hosts[1] = [_host(1)]
    elif change == "backend":
        hosts[1] = [_host(2, backend="nccl")]
    elif change == "resumed elsewhere":
        hosts[1] = [_host(2), _host(2, cpu="Intel Xeon")]
    else:
        hosts[1] = [_host(2), _host(1)]
    for seed in (0, 1):
        write_run(tmp_path / f"s{seed}", make_config(seed=seed))
        _edit_summary(tmp_path / f"s{seed}", hosts=[_host(2)])
    assert _row(runs_table(sa.load_runs(tmp_path)), scheme="top-k")["time/step (ms)"].endswith("(n=2)")
    _edit_summary(tmp_path / "s1", hosts=hosts[1])
    table = runs_table(sa.load_runs(tmp_path))
    row = _row(table, scheme="top-k")
    assert "(n=2)" in row[ACCURACY] and "(n=" not in row["time/step (ms)"], row
    assert any("Time left out for 1 configuration(s)" in n for n in table.notes), table.notes


def test_an_old_run_without_recorded_threads_is_unknown_not_different(tmp_path):
    """A run from before threads were recorded (its config left train.threads to the default)
    is not told apart from one that recorded them: unknown, as an unrecorded host."""
    for seed in (0, 1):
        write_run(tmp_path / f"s{seed}", make_config(seed=seed, **{"train.threads": None}))
    _edit_summary(tmp_path / "s0", hosts=[_host()])
    _edit_summary(tmp_path / "s1", hosts=[_host(2)])
    runs = sa.load_runs(tmp_path)
    assert sorted(runs["threads"].fillna("-")) == ["-", "2"]
    assert _row(runs_table(runs), scheme="top-k")["time/step (ms)"].endswith("(n=2)")
    # ... but one whose config set them is known: 1 against 2 is not averaged
    write_run(tmp_path / "s0", make_config(seed=0, **{"train.threads": 1}))
    _edit_summary(tmp_path / "s0", hosts=[_host()])
    assert "(n=" not in _row(runs_table(sa.load_runs(tmp_path)), scheme="top-k")["time/step (ms)"]


def test_seeds_run_on_two_commits_are_said_to_mix_versions(tmp_path):
    """Audit 3: seeds 0-1 ran, a fix was committed, seed 2 ran: the table showed a plain n=3
    mean of two programs. Its note names the versions; a verdict side's cell says so too."""
    from sparsetrain.analysis.findings import _show, _side

    for seed in (0, 1, 2):
        write_run(tmp_path / f"s{seed}", make_config(seed=seed))
        commit = ("a" if seed < 2 else "b") * 40
        _edit_summary(tmp_path / f"s{seed}", code={"commit": commit, "dirty": False, "diff": None},
                      code_commits=[commit])
    runs = sa.load_runs(tmp_path)
    table = runs_table(runs)
    notes = [n for n in table.notes if "more than one code version" in n]
    assert notes and "aaaaaaaaaaaa, bbbbbbbbbbbb" in notes[0], table.notes
    side = _side(runs, {"scheme": "topk"}, {})
    assert _show(side["test_accuracy"] * 100, side).endswith("[2 code versions: aaaaaaaaaaaa, bbbbbbbbbbbb]")
    # on one commit: no note
    _edit_summary(tmp_path / "s2", code={"commit": "a" * 40, "dirty": False, "diff": None},
                  code_commits=["a" * 40])
    assert not [n for n in runs_table(sa.load_runs(tmp_path)).notes if "code version" in n]


def test_torch_powersgd_runs_that_differ_in_error_feedback_or_warm_up_are_two_configurations(tmp_path):
    """Audit 4: every axis dense SGD ignores was '-' for torch's hooks, but its PowerSGD hook reads
    error feedback and the warm-up (start_powerSGD_iter = max(2, warmup_steps)): an ablation was
    averaged as seeds of one configuration, or one run of a seed dropped as a copy."""
    ddp = {"dist.ddp": True, "world_size": 2}
    write_run(tmp_path / "on", make_config(scheme="torch_powersgd", seed=0, **ddp))
    write_run(tmp_path / "off", make_config(scheme="torch_powersgd", seed=0, **ddp, **{"scheme.error_feedback": False}))
    write_run(tmp_path / "late", make_config(scheme="torch_powersgd", seed=0, **ddp, **{"scheme.warmup_steps": 50}))
    write_run(tmp_path / "fp16", make_config(scheme="fp16", seed=0, **ddp, **{"scheme.error_feedback": False}))
    runs = sa.load_runs(tmp_path)
    runs = runs.set_index(runs["run_dir"].map(lambda d: Path(d).name))
    assert (bool(runs.loc["on", "error_feedback"]), bool(runs.loc["off", "error_feedback"])) == (True, False)
    assert runs.loc["on", "warmup_steps"] == 2 and runs.loc["late", "warmup_steps"] == 50  # torch's floor of 2
    assert runs.loc["fp16", "error_feedback"] == "-" and runs.loc["fp16", "warmup_steps"] == "-"
    table = runs_table(sa.load_runs(tmp_path))
    hooks = table.display[table.display["scheme"] == "PowerSGD (torch hook)"]
    assert len(hooks) == 3 and all("(n=1)" in cell for cell in hooks[ACCURACY]), table.display
    assert not [n for n in table.notes if "ignores" in n], table.notes


def test_the_time_figures_draw_no_mean_of_two_machines(tmp_path):
    """Audit 4: the tables left such times out (one_machine_times), the time-per-phase and
    workers figures still drew them."""
    for seed in (0, 1):
        write_run(tmp_path / f"s{seed}", make_config(seed=seed))
        _edit_summary(tmp_path / f"s{seed}", hosts=[_host(2, cpu=("AMD EPYC", "Intel Xeon")[seed])])
    runs = sa.load_runs(tmp_path)
    fig = sa.plot_time_per_phase(runs)
    assert any("no timings of one machine" in t.get_text() for ax in fig.axes for t in ax.texts)
    fig = sa.plot_workers(runs)
    times = [y for line in fig.axes[1].get_lines() for y in line.get_ydata()]
    assert times and all(math.isnan(y) for y in times), times


def test_a_pivot_with_a_column_takes_no_per_row_extra_metric(tmp_path):
    """Audit 4 (latent): a row's extra metric was its first column's (AllReduce's bytes shown for
    AllGather); no table asks for both, and now none can."""
    from sparsetrain.analysis.group import pivot_table

    runs = sa.load_runs(write_run(tmp_path / "r", make_config()))
    with pytest.raises(ValueError, match="would show the first column's"):
        pivot_table("t", "t", runs, ["scheme"], "aggregation", "test_accuracy", extra_metrics=["bytes_sent_per_step"])
    assert len(pivot_table("t", "t", runs, ["scheme"], "aggregation", "test_accuracy").display) == 1
