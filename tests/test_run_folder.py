"""One run folder, one live run: a second process into a folder where a run is training now is
refused before it writes anything, and a refused attempt never rewrites the folder's .hydra/
(the config files the analysis reads a run's experiment and overrides from)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, cli_env, run_cli

from sparsetrain.errors import RunFolderInUse
from sparsetrain.launch.cli import _settle_hydra_files
from sparsetrain.results import HEARTBEAT, HEARTBEAT_STALE_S, _beats_elsewhere, claim_run_folder


def _live_folder(folder: Path) -> dict[str, bytes]:
    """A folder as a run training there leaves it (summary running, a fresh heartbeat of this
    process, its metrics and config files); returns every file's bytes."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("- seed=0\n- experiment=mine\n")
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (folder / "summary.json").write_text(json.dumps({"status": "running", "started_at": "2026-12-07T10:00:00+00:00"}))
    (folder / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n')
    (folder / HEARTBEAT).write_text(json.dumps({"time": "now", "unix": time.time(), "step": 7, "pid": os.getpid(),
                                                "host": os.uname().nodename}))
    return _files(folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_held_folder_refuses_a_second_claim_until_it_is_let_go(tmp_path):
    _live_folder(tmp_path)
    release = claim_run_folder(tmp_path)
    with pytest.raises(RunFolderInUse) as refused:
        claim_run_folder(tmp_path)  # another open description of the folder: another process's view
    line = str(refused.value)
    assert "in use by a run training there now" in line and f"pid {os.getpid()}" in line and "step 7" in line
    assert "\n" not in line
    release()
    release()  # once is enough; twice does nothing
    claim_run_folder(tmp_path)()


def test_without_flock_a_fresh_heartbeat_of_another_live_process_is_the_sign(tmp_path):
    """The fallback where the file system has no flock: only a live process's heartbeat counts,
    so a run killed without a word never blocks its own resume."""
    _live_folder(tmp_path)
    beat = json.loads((tmp_path / HEARTBEAT).read_text())

    def with_beat(**change):
        (tmp_path / HEARTBEAT).write_text(json.dumps({**beat, **change}))
        return _beats_elsewhere(tmp_path)

    parent = os.getppid()  # alive, not this process
    assert with_beat(pid=parent)
    assert not with_beat(pid=os.getpid())  # this process's own
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not with_beat(pid=dead.pid)  # killed: its heartbeat stays behind
    assert with_beat(host="another-node")  # another node's process: its heartbeat is all there is
    assert not with_beat(host="another-node", unix=time.time() - HEARTBEAT_STALE_S - 1)  # stale
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    assert not with_beat(pid=parent)


@pytest.mark.parametrize("holds", ["completed", "running", "refused", "none"])
def test_an_attempts_config_files_become_the_folders_only_where_no_run_is(tmp_path, holds):
    staged, final = tmp_path / ".hydra.attempt", tmp_path / ".hydra"
    staged.mkdir()
    (staged / "overrides.yaml").write_text("- seed=1\n")
    if holds != "none":
        final.mkdir()
        (final / "overrides.yaml").write_text("- seed=0\n")
        status = {"completed": "completed", "running": "running", "refused": "failed"}[holds]
        (tmp_path / "summary.json").write_text(json.dumps({"status": status}))
    _settle_hydra_files(tmp_path, ".hydra.attempt", taken=False)
    kept = "- seed=0\n" if holds in ("completed", "running") else "- seed=1\n"
    assert (final / "overrides.yaml").read_text() == kept and not staged.exists()
    _settle_hydra_files(tmp_path, ".hydra.attempt", taken=False)  # settled: nothing more happens
    assert (final / "overrides.yaml").read_text() == kept


def test_an_attempt_that_trains_takes_the_folders_config_files(tmp_path):
    staged, final = tmp_path / ".hydra.attempt", tmp_path / ".hydra"
    staged.mkdir(), final.mkdir()
    (staged / "overrides.yaml").write_text("- seed=0\n- train.epochs=2\n")
    (final / "overrides.yaml").write_text("- seed=0\n")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running"}))  # its own resume
    _settle_hydra_files(tmp_path, ".hydra.attempt", taken=True)
    assert (final / "overrides.yaml").read_text() == "- seed=0\n- train.epochs=2\n" and not staged.exists()


def test_the_command_line_refuses_a_folder_a_live_run_holds_and_touches_nothing(tmp_path):
    """The same command started twice (a sweep launched again in another terminal): the second
    stops in one line, before any rank, and the first run's files stay byte for byte."""
    before = _live_folder(tmp_path)
    release = claim_run_folder(tmp_path)  # this test plays the run training there
    try:
        proc = run_cli(*TINY, "world_size=2", f"hydra.run.dir={tmp_path}")
    finally:
        release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "in use by a run training there now" in errors[0], proc.stderr[-2000:]
    assert f"pid {os.getpid()}" in errors[0]
    assert _files(tmp_path) == before and not (tmp_path / ".hydra.attempt").exists()


@pytest.mark.slow  # torchrun's start
def test_under_torchrun_rank_0_refuses_a_held_folder_for_every_rank(tmp_path):
    before = _live_folder(tmp_path)
    release = claim_run_folder(tmp_path)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "-m", "sparsetrain.run", *TINY, "world_size=2", f"hydra.run.dir={tmp_path}"],
            cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    finally:
        release()
    assert proc.returncode != 0
    assert "in use by a run training there now" in proc.stderr, proc.stderr[-3000:]
    assert _files(tmp_path) == before and not (tmp_path / ".hydra.attempt").exists()


@pytest.mark.slow  # a run, then the same command again
def test_a_folder_is_read_for_a_completed_run_only_while_held(tmp_path):
    """The completed check comes after the hold: a run that completes and lets go between a
    check and a hold would otherwise be trained again over its completed files (seen once by
    hand: a second command started as the first ended trained the run anew). Here the run has
    completed but its folder is still held, as in that instant: the same command is refused (in
    use), where reading first it said "already completed" and would have gone on to train had
    the hold been let go between the two."""
    args = (*TINY, "world_size=1", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert run_cli(*args).returncode == 0
    before = _files(tmp_path / "run")
    release = claim_run_folder(tmp_path / "run")
    try:
        proc = run_cli(*args)
    finally:
        release()
    assert proc.returncode == 2 and "in use by a run training there now" in proc.stderr, proc.stdout[-2000:]
    assert _files(tmp_path / "run") == before
    again = run_cli(*args)  # let go: the completed run is skipped, as before
    assert again.returncode == 0 and "already completed" in again.stdout
