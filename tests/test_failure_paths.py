"""Failure paths a user meets (issue 15), end to end from the command line, with real processes,
real signals, a real full disk (a tmpfs) and a real terminal (a pty).

1. a killed rank is named as the cause, not rank 0's "Connection reset by peer";
2. resume refuses a checkpoint written by a different configuration;
3. a damaged checkpoint is named; a full disk keeps the previous checkpoint and says so;
5. a run whose rank 0 died silently is "unfinished (no heartbeat since ...)";
6. the progress bar and the epoch lines never share a terminal line;
7. wandb.mode=online without a key stops before any rank starts.
(4, the step-exact SLURM requeue, is in tests/test_slurm.py.)
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import ROOT, TINY, cli_env, read_json, read_jsonl, read_terminal, run_cli, wait_until

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
_env = cli_env


def _start(*args: str, cwd: Path = ROOT, cmd: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*(cmd or [sys.executable, "-m"]), "sparsetrain.run", *args], cwd=cwd,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _steps(run: Path) -> int:
    return sum(r["kind"] == "step" for r in read_jsonl(run / "metrics.jsonl"))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


# ---- 1. a dead rank is named -----------------------------------------------------------------
@pytest.mark.slow  # test_launch.py kills a rank in the fast tier
def test_killed_rank_is_named_as_the_cause(tmp_path):
    run = tmp_path / "run"
    proc = _start(*TINY, "world_size=2", "train.epochs=50", "train.log_every=1",
                  f"hydra.run.dir={run}", cwd=tmp_path)
    try:
        wait_until(lambda: _steps(run) >= 2, proc, "two steps")
        ranks = sorted((p for p in psutil.Process(proc.pid).children(recursive=True)
                        if "spawn_main" in " ".join(p.cmdline())), key=lambda p: p.pid)
        assert len(ranks) == 2, ranks
        # rank 0 is the process that writes the heartbeat (ranks start in order otherwise)
        rank0_pid = (read_json(run / "heartbeat.json") if (run / "heartbeat.json").exists()
                     else {}).get("pid", ranks[0].pid)
        victims = [p for p in ranks if p.pid != rank0_pid]
        assert len(victims) == 1, ranks
        victims[0].kill()
        _, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode != 0
    s = read_json(run / "summary.json")
    assert s["status"] == "failed"
    assert re.fullmatch(r"rank 1 died \(SIGKILL\) after step \d+", s["error"]), s
    assert int(s["error"].rsplit(" ", 1)[1]) >= 2
    lines = _error_lines(err)
    assert len(lines) == 1 and s["error"] in lines[0], err[-3000:]
    assert "Connection" not in lines[0] and "pair.cc" not in lines[0]


def test_one_line_error_drops_the_cpp_source_position():
    from sparsetrain.results import one_line_error

    exc = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] "
                       "Read error [127.0.0.1]:28058: Connection reset by peer\nmore")
    assert one_line_error(exc) == "RuntimeError: Read error [127.0.0.1]:28058: Connection reset by peer"


# ---- 2. resume refuses a changed configuration -------------------------------------------------
RESUME = (*TINY, "world_size=1", "train.epochs=3", "train.log_every=1", "data.train_size=384")


def _interrupted_run(run: Path, *args: str) -> dict:
    """Start a run, SIGTERM it after its first epoch checkpoint: a folder to resume."""
    proc = _start(*args, f"hydra.run.dir={run}")
    try:
        wait_until(lambda: (run / "checkpoint.pt").exists() and _steps(run) >= 14, proc, "checkpoint")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        _stop(proc)
    s = read_json(run / "summary.json")
    assert s["status"] == "failed" and "SIGTERM at step" in s["error"], s
    return s


def test_resume_refuses_a_changed_configuration(tmp_path):
    run = tmp_path / "run"
    before = _interrupted_run(run, *RESUME, "scheme=blockk")
    files = {p: p.read_bytes() for p in (run / "checkpoint.pt", run / "metrics.jsonl", run / "summary.json")}

    refused = run_cli(*RESUME, "scheme=randk", "ratio=0.05", f"hydra.run.dir={run}", timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = _error_lines(refused.stderr)
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    line = lines[0]
    assert "scheme.name='blockk' there, 'randk' now" in line and "ratio=0.01 there, 0.05 now" in line
    assert "hydra.run.dir" in line and "train.log_every" not in line
    assert {p: p.read_bytes() for p in files} == files  # nothing written is lost or changed

    # Keys that do not define the run (logging, progress, W&B, the step cap) may change.
    resumed = run_cli(*RESUME, "scheme=blockk", "train.log_every=2", "train.eval_every=2",
                      f"hydra.run.dir={run}", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["resumed_from_step"] == before["steps"]


def test_config_differences_ignore_the_documented_keys():
    from sparsetrain.train.checkpoint import NOT_DEFINING, config_differences

    saved = {"scheme": {"name": "blockk"}, "train": {"max_steps": 10, "epochs": 3, "device": "cpu"},
             "wandb": {"mode": "offline"}, "dist": {"timeout_s": 120.0}, "seed": 0}
    now = {"scheme": {"name": "blockk"}, "train": {"max_steps": None, "epochs": 4, "device": "cuda"},
           "wandb": {"mode": "disabled"}, "dist": {"timeout_s": 30.0}, "seed": 0, "new_key": 1}
    assert config_differences(saved, now) == [("new_key", "<absent>", 1), ("train.epochs", 3, 4)]
    assert "train.max_steps" in NOT_DEFINING and "wandb." in NOT_DEFINING


def test_a_run_saved_before_the_schemes_had_keys_of_their_own_is_the_same_run():
    """Old runs recorded scheme.block_size and scheme.rank for every scheme; a scheme that has no
    such key now did nothing with it. Where the scheme has the key, it still defines the run."""
    from sparsetrain.train.checkpoint import config_differences

    old = {"scheme": {"name": "topk", "error_feedback": True, "block_size": 256, "rank": None}}
    assert config_differences(old, {"scheme": {"name": "topk", "error_feedback": True}}) == []
    old_blockk = {"scheme": {"name": "blockk", "block_size": 256, "rank": None}}
    assert config_differences(old_blockk, {"scheme": {"name": "blockk", "block_size": 256}}) == []
    assert config_differences(old_blockk, {"scheme": {"name": "blockk", "block_size": 64}}) == [
        ("scheme.block_size", 256, 64)]
    assert [k for k, *_ in config_differences(old, {"scheme": {"name": "randk", "error_feedback": True}})] == [
        "scheme.name"]


# ---- 3. a damaged checkpoint, a full disk ------------------------------------------------------
@pytest.mark.slow  # two runs
def test_damaged_checkpoint_is_named_with_the_ways_on(tmp_path):
    run = tmp_path / "run"
    _interrupted_run(run, *RESUME, "scheme=randk")
    ckpt = run / "checkpoint.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])  # truncated, as by a crash mid-copy

    proc = run_cli(*RESUME, "scheme=randk", f"hydra.run.dir={run}", timeout=300)
    assert proc.returncode == 2
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"the checkpoint {ckpt} cannot be read" in lines[0]
    assert "delete it" in lines[0] and "train.checkpoint=false" in lines[0]
    assert lines[0].count("(") == lines[0].count(")")  # no message cut mid-sentence
    assert ckpt.exists()

    fresh = run_cli(*RESUME, "scheme=randk", "train.checkpoint=false", "train.max_steps=3",
                    f"hydra.run.dir={run}", timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["resumed_from_step"] is None


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs mounted for this test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow  # a tmpfs mount and two runs
def test_full_disk_keeps_the_previous_checkpoint_and_says_no_space(small_disk):
    run = small_disk / "run"
    proc = _start(*RESUME, "scheme=randk", "data.train_size=960", f"hydra.run.dir={run}")
    try:  # 30 steps per epoch: stop the run right after its first checkpoint
        wait_until(lambda: (run / "checkpoint.pt").exists(), proc, "first checkpoint")
        os.killpg(proc.pid, signal.SIGSTOP)
        epochs = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "epoch"]
        assert epochs == [30], epochs  # still in epoch 2: its checkpoint is yet to be written
        size = (run / "checkpoint.pt").stat().st_size
        st = os.statvfs(small_disk)
        with open(small_disk / "filler", "wb") as f:  # leave half a checkpoint free
            f.write(b"\0" * (st.f_bavail * st.f_frsize - size // 2))
        os.killpg(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
    finally:
        _stop(proc)
    assert proc.returncode != 0
    s = read_json(run / "summary.json")
    assert s["status"] == "failed" and "no space left" in s["error"], s
    assert "previous checkpoint" in s["error"] and s["steps"] == 60
    lines = _error_lines(err)
    assert len(lines) == 1 and "no space left" in lines[0], err[-3000:]
    state = torch.load(run / "checkpoint.pt", weights_only=True)  # intact, epoch 1's
    assert state["step"] == 30 and state["epoch"] == 1
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == ["checkpoint.pt"]

    (small_disk / "filler").unlink()  # space again: the same command resumes from epoch 1
    resumed = run_cli(*RESUME, "scheme=randk", "data.train_size=960", f"hydra.run.dir={run}",
                      timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["resumed_from_step"] == 30 and s["steps"] == 90


def test_write_error_other_than_space_is_named(tmp_path):
    from sparsetrain.train.checkpoint import CheckpointError, save

    target = tmp_path / "missing-folder" / "checkpoint.pt"
    with pytest.raises(CheckpointError, match=f"cannot write the checkpoint {target}"):
        save({"step": 1}, target)


def test_a_cuda_runs_checkpoint_keeps_each_ranks_gpu_generator(tmp_path, monkeypatch):
    """On a GPU the checkpoint keeps the rank's CUDA generator (per rank: each rank has its own
    GPU) and a resume restores it; a checkpoint without it (CPU runs, older ones) still loads.
    No GPU here: the device is said to be cuda:0 and torch.cuda's two calls stand in for it."""
    from omegaconf import OmegaConf

    from sparsetrain.config import compose
    from sparsetrain.rank import RankInfo
    from sparsetrain.train import Trainer

    cfg = compose([*TINY, "scheme=topk", "world_size=1", "train.max_steps=2"])
    trainer = Trainer(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), RankInfo(0, 1, 0, 1, "single"),
                      tmp_path / "run", torch.device("cpu"))
    assert "cuda_rng" not in trainer.state_dict()  # a CPU run: nothing to keep
    gpu = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gpu.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device)))
    trainer.device = torch.device("cuda", 0)
    trainer.save_checkpoint()
    saved = torch.load(trainer.record.checkpoint_path, weights_only=True)
    assert torch.equal(saved["per_rank"][0]["cuda_rng"], gpu) and "cuda_rng" not in saved
    state = {**saved, **saved["per_rank"][0]}
    trainer.load_state_dict(state)
    assert len(restored) == 1 and torch.equal(restored[0][0], gpu) and restored[0][1] == torch.device("cuda", 0)
    del state["cuda_rng"]  # written on the CPU, or before CUDA's generator was kept
    trainer.load_state_dict(state)
    assert len(restored) == 1


# ---- 5. heartbeat ------------------------------------------------------------------------------
@pytest.mark.slow
def test_rank0_killed_under_torchrun_is_unfinished_not_running(tmp_path):
    from sparsetrain.analysis import load_runs

    run = tmp_path / "run"
    proc = _start(*TINY, "world_size=2", "train.epochs=50", "train.log_every=1",
                  f"hydra.run.dir={run}", cwd=tmp_path, cmd=[*TORCHRUN, "-m"])
    try:
        wait_until(lambda: read_json(run / "heartbeat.json")["step"] >= 2, proc, "a heartbeat at step 2")
        beat = read_json(run / "heartbeat.json")
        os.kill(beat["pid"], signal.SIGKILL)  # rank 0: nobody is left to write its summary
        proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert read_json(run / "summary.json")["status"] == "running"
    beat = read_json(run / "heartbeat.json")
    assert beat["step"] >= 1 and beat["time"] and beat["last_step_at"]

    fresh = load_runs(run).iloc[0]  # just died: could still be alive for all anyone knows
    assert fresh["status"] == "running"
    later = load_runs(run, stale_after_s=0).iloc[0]
    assert later["status"] == "unfinished"
    assert later["error"] == f"no heartbeat since {beat['time']} (step {beat['step']})"


def test_stale_running_runs_are_unfinished_in_analysis_and_sweep_report(tmp_path, capsys):
    from omegaconf import OmegaConf

    from sparsetrain.analysis import load_runs, status_table
    from sparsetrain.results import now_iso, write_json_atomic

    sweep = tmp_path / "sweep"
    old = time.time() - 3600
    for num, unix in (("0", old), ("1", time.time())):
        write_json_atomic(sweep / num / "summary.json", {
            "status": "running", "started_at": "2024-01-01T00:00:00+00:00",
            "config": {"scheme": {"name": "randk"}, "seed": int(num)}})
        write_json_atomic(sweep / num / "heartbeat.json", {
            "time": "2024-01-01T00:05:00+00:00", "unix": unix, "step": 7, "last_step_at": now_iso()})
    write_json_atomic(sweep / "2" / "summary.json", {  # died before its first heartbeat
        "status": "running", "started_at": "2024-01-01T00:00:00+00:00", "config": {"seed": 2}})

    runs = load_runs(sweep).sort_values("run_dir").reset_index(drop=True)
    assert list(runs["status"]) == ["unfinished", "running", "unfinished"]
    assert runs["error"][0] == "no heartbeat since 2024-01-01T00:05:00+00:00 (step 7)"
    assert runs["error"][2] == "no heartbeat since 2024-01-01T00:00:00+00:00 (start)"
    assert "unfinished: " in "\n".join(status_table(runs).missing_lines())

    import sparsetrain.launch.cli as cli

    cli._failed_sweep_jobs.clear()
    cli.SweepReport().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    err = capsys.readouterr().err
    cli._failed_sweep_jobs.clear()
    assert f"{sweep / '0'}: unfinished (no heartbeat since 2024-01-01T00:05:00+00:00 (step 7))" in err
    assert f"{sweep / '2'}: unfinished (no heartbeat since 2024-01-01T00:00:00+00:00 (start))" in err


# ---- 6. progress bar and log lines on a terminal -------------------------------------------------
@pytest.mark.slow
def test_epoch_lines_never_land_in_the_progress_bar(tmp_path):
    args = [*TINY, "train.progress=true", "world_size=1",
            "train.epochs=3", "data.train_size=256", f"hydra.run.dir={tmp_path / 'run'}"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "sparsetrain.run", *args], cwd=ROOT,
                            env=_env(TERM="xterm"), stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True)
    os.close(slave)
    try:
        out = read_terminal(master, proc, 300)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "step/s" in text or "s/step" in text, text[-3000:]  # a bar was drawn
    starts = [m.start() for m in re.finditer(r"epoch \d", text)]
    assert len(starts) == 3, text[-3000:]
    for i in starts:  # every epoch line starts a terminal line: after \r or \n, never after "]"
        assert i == 0 or text[i - 1] in "\r\n", repr(text[max(0, i - 80): i + 40])


# ---- 7. W&B online without a key ---------------------------------------------------------------
def test_wandb_online_without_a_key_stops_before_any_rank(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    # What a half-finished `wandb login` can leave: the host, no key.
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password \n")
    (home / ".netrc").chmod(0o600)
    run = tmp_path / "run"
    proc = run_cli(*TINY, "wandb.mode=online", "world_size=2", "train.max_steps=2",
                   f"hydra.run.dir={run}", env={"HOME": str(home)}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "wandb.mode='online' needs a W&B key" in lines[0] and "offline" in lines[0]
    assert not (run / "ranks").exists() and not (run / "metrics.jsonl").exists()  # no rank started
    assert read_json(run / "summary.json")["status"] == "failed"


def test_wandb_credentials_are_looked_up_like_wandb_does(tmp_path):
    from sparsetrain.tracking import has_wandb_credentials

    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    netrc.chmod(0o600)
    assert has_wandb_credentials({"NETRC": str(netrc)})
    assert not has_wandb_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"})
    assert has_wandb_credentials({"WANDB_API_KEY": "x", "HOME": str(tmp_path)})
    assert not has_wandb_credentials({"WANDB_API_KEY": " ", "HOME": str(tmp_path)})


@pytest.mark.slow
def test_sigterm_to_a_sweep_stops_it_after_the_running_job_saves(tmp_path):
    """SIGTERM to `python -m sparsetrain.run -m ...`: the running job saves its checkpoint and the
    sweep stops there, instead of starting its next job (which the next SIGTERM would preempt in
    turn); rerunning the command resumes."""
    sweep = tmp_path / "sweep"
    proc = _start("-m", *TINY, "world_size=2", "train.epochs=50", "train.log_every=1", "seed=0,1",
                  f"hydra.sweep.dir={sweep}")
    try:
        wait_until(lambda: sum(r["kind"] == "step" for r in read_jsonl(sweep / "0" / "metrics.jsonl")) >= 2,
                   proc, "job 0 logged 2 steps")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    s = read_json(sweep / "0" / "summary.json")
    assert s["status"] == "failed" and "SIGTERM" in s["error"], s["error"]
    assert (sweep / "0" / "checkpoint.pt").exists()
    assert not (sweep / "1").exists(), "the sweep started its next job after SIGTERM"
    assert "not starting further jobs" in err
