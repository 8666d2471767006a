"""End-to-end runs from the command line: run folder files, errors, sweeps, W&B offline."""

import os
import re

import pytest
from conftest import SCHEMES, TINY, read_json, read_jsonl, refusal, run_cli

PHASES = ("data", "forward", "backward", "compress", "exchange", "decompress", "optimizer", "step")


BAD_INPUT = [
    ("world_size=0", "world_size=0 is not allowed"),
    ("ratio=2", "ratio=2.0 is not allowed"),
    ("scheme=nope", f"scheme='nope' is not allowed; choose one of: {', '.join(sorted(SCHEMES))}"),
]


@pytest.mark.parametrize("override, needle", BAD_INPUT)
def test_bad_input_is_refused_with_one_line(override, needle):
    assert needle in refusal(*TINY, override)


# Through the command line: a value refused by validation (ratio=2) in the fast tier, the others
# in the full tier (test_first_contact.py has the override check's).
@pytest.mark.parametrize("override, needle", [
    pytest.param(*case, marks=[] if case[0] == "ratio=2" else pytest.mark.slow) for case in BAD_INPUT])
def test_bad_input_is_one_line_and_nonzero(override, needle, tmp_path):
    proc = run_cli(*TINY, override, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    summary = tmp_path / "run" / "summary.json"
    if summary.exists():  # a refused run may leave a record, but never a finished-looking one
        assert read_json(summary)["status"] == "failed"


def test_two_rank_dense_run_writes_complete_run_folder(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*TINY, "scheme=none", "world_size=2", "train.max_steps=4",
                   "train.log_every=1", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["error"] is None
    assert s["world_size"] == 2 and s["steps"] == 4
    assert set(PHASES) <= set(s["time_ms"]) and s["time_ms"]["step"] > 0
    for key in ("forward", "backward", "exchange", "optimizer"):
        assert s["time_ms"][key] > 0, key
    # every rank's phases beside rank 0's own (time_ms), which they include
    ranks = s["time_ms_ranks"]
    assert set(ranks) == set(PHASES) and all(len(ranks[p]) == 2 for p in PHASES)
    assert all(ranks[p][0] == s["time_ms"][p] for p in PHASES) and ranks["forward"][1] > 0
    # the node's load while it trained, beside its CPUs and the run's 2 ranks here
    load = s["load"]
    assert load["readings"] >= 1 and 0 <= load["mean_1min"] <= load["max_1min"]
    assert load["cpus"] == os.cpu_count() and load["local_ranks"] == 2
    assert s["bytes_sent_per_step"] == s["dense_bytes_per_step"] == 4 * s["num_parameters"]
    assert 0.0 <= s["test_accuracy"] <= 1.0 and s["train_loss"] > 0
    assert s["config"]["scheme"]["name"] == "none" and s["config"]["world_size"] == 2
    records = read_jsonl(run / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert records[-1]["kind"] == "epoch" and records[-1]["test_accuracy"] == s["test_accuracy"]
    assert (run / ".hydra" / "config.yaml").exists()
    assert not (run / "wandb").exists()  # wandb.mode=disabled
    # nothing empty: no Hydra job log (sparsetrain prints), no per-rank folders of a run that
    # did not fail
    assert not list(run.glob("*.log")) and not (run / "ranks").exists(), sorted(p.name for p in run.iterdir())


@pytest.mark.slow  # a sweep of two runs
def test_multirun_failing_job_is_marked_and_others_complete(tmp_path):
    sweep = tmp_path / "sweep"
    # train_size=8 leaves 4 examples per rank: fewer than one batch, so that job fails at start.
    proc = run_cli(*TINY, "-m", "data.train_size=8,256", "train.max_steps=2",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode != 0
    failed, ok = read_json(sweep / "0" / "summary.json"), read_json(sweep / "1" / "summary.json")
    assert failed["status"] == "failed" and "train.batch_size=32" in failed["error"]
    assert ok["status"] == "completed" and ok["steps"] == 2
    assert "1 sweep job(s) did not complete" in proc.stderr and str(sweep / "0") in proc.stderr


@pytest.mark.slow
def test_wandb_offline_run_files_hold_metrics_and_no_key(tmp_path):
    from wandb_offline import config, history

    run = tmp_path / "run"
    secret = "0123456789abcdef0123456789abcdef01234567"
    proc = run_cli(*TINY, "wandb.mode=offline", "world_size=1", "train.max_steps=3",
                   "train.log_every=1", f"hydra.run.dir={run}",
                   env={"WANDB_API_KEY": secret, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run.rglob("*"))
    rows = history(files[0])
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    logged = [r["train_loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    assert losses[: len(logged)] == pytest.approx(logged)
    assert any("time_ms/forward" in r for r in rows)
    assert config(files[0])["scheme"]["name"] == "none"
    for path in run.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert re.search(r"offline", str(files[0]))


@pytest.mark.slow  # a run stopped and resumed
def test_a_resumed_run_goes_on_in_the_same_wandb_run(tmp_path):
    """Audit 5: every resume (a SLURM requeue) started a new W&B run: the finished one's history
    began at the resumed step, beside a "failed" twin of the same name."""
    from test_failure_paths import RESUME, _interrupted_run
    from wandb_offline import history

    run = tmp_path / "run"
    env = {"WANDB_MODE": "offline"}
    _interrupted_run(run, *RESUME, "wandb.mode=offline")
    resumed = run_cli(*RESUME, "wandb.mode=offline", f"hydra.run.dir={run}", env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # one a process; `wandb sync` uploads both into the one run
    assert len({f.name for f in files}) == 1, files  # run-<id>.wandb: the same id
    steps = sorted({r["_step"] for f in files for r in history(f) if "train_loss" in r})
    logged = sorted(r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step")
    assert set(logged) <= set(steps), (logged, steps)


@pytest.mark.slow  # three runs
def test_rerun_of_a_completed_run_skips_it_and_a_changed_one_is_refused(tmp_path):
    """Rerunning a sweep into its folder (a study interrupted between sessions) runs only what
    did not complete; a completed run of other settings is never overwritten."""
    run = tmp_path / "run"
    args = (*TINY, "world_size=1", "train.max_steps=2", f"hydra.run.dir={run}")
    assert run_cli(*args).returncode == 0
    before = (run / "summary.json").read_text()
    recorded = (run / ".hydra" / "overrides.yaml").read_text()
    again = run_cli(*args)
    assert again.returncode == 0 and "already completed" in again.stdout, again.stderr[-2000:]
    assert (run / "summary.json").read_text() == before
    changed = run_cli(*args, "seed=1")
    assert changed.returncode == 2
    errors = [line for line in changed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds a completed run of a different configuration: seed=0 there, 1 now" in errors[0]
    assert (run / "summary.json").read_text() == before
    # the refused attempt's overrides (seed=1) never replace the run's: the analysis reads them
    assert (run / ".hydra" / "overrides.yaml").read_text() == recorded and not (run / ".hydra.attempt").exists()
