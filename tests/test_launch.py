"""torchrun, preemption-safe resume and dead ranks, end to end from the command line."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import ROOT, TINY, cli_env, read_json, read_jsonl, run_cli

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
_env = cli_env


def _wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        metrics = run / "metrics.jsonl"
        if metrics.exists() and sum(r["kind"] == "step" for r in read_jsonl(metrics)) >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {n} steps logged in {timeout} s")


def _rank_processes(root_pid: int) -> list[psutil.Process]:
    """The rank processes under a launcher: torchrun's children carry RANK in their
    environment; multiprocessing-spawned ones set it after start, so find them by command line."""
    ranks = []
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd, env = " ".join(child.cmdline()), child.environ()
        except psutil.Error:
            continue
        if "spawn_main" in cmd or ("LOCAL_RANK" in env and "sparsetrain.run" in cmd):
            ranks.append(child)
    return sorted(ranks, key=lambda p: p.pid)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_torchrun_makes_one_run_folder(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [*TORCHRUN, "-m", "sparsetrain.run", *TINY, "world_size=2", "train.max_steps=3",
         f"hydra.run.dir={run}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["launcher"] == "torchrun" and s["world_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no stray folders from rank 1


@pytest.mark.slow  # three torchrun launches
def test_a_rerun_under_torchrun_never_overwrites_a_completed_run(tmp_path):
    """Audit 5: only local ranks checked the folder for a completed run; under torchrun (and
    SLURM) a rerun trained it again from scratch, and one of another seed replaced it, exit 0."""
    run = tmp_path / "run"

    def launch(*extra):
        return subprocess.run([*TORCHRUN, "-m", "sparsetrain.run", *TINY, "world_size=2", "train.max_steps=3",
                               *extra, f"hydra.run.dir={run}"],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)

    first = launch()
    assert first.returncode == 0, first.stderr[-3000:]
    kept = {p.name: p.read_bytes() for p in (run / "summary.json", run / "metrics.jsonl")}
    again = launch()
    assert again.returncode == 0 and "already completed" in again.stdout, again.stdout[-2000:]
    other = launch("seed=1")
    assert other.returncode != 0 and "holds a completed run of a different configuration: seed=0 there, 1 now" \
        in other.stderr, other.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (run / "summary.json", run / "metrics.jsonl")} == kept


@pytest.mark.slow  # two torchrun launches
def test_torchrun_refuses_multirun_and_mismatched_world_size(tmp_path):
    proc = subprocess.run([*TORCHRUN, "-m", "sparsetrain.run", "-m", *TINY, "seed=0,1"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "-m/--multirun is not allowed under torchrun" in proc.stderr
    proc = subprocess.run([*TORCHRUN, "-m", "sparsetrain.run", *TINY, "world_size=3",
                           f"hydra.run.dir={tmp_path / 'r'}"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "world_size=3 contradicts the launcher: torchrun started WORLD_SIZE=2" in proc.stderr


RESUME = (*TINY, "world_size=2", "train.epochs=2", "train.log_every=1", "train.save_model=true",
          "data.train_size=384")  # 6 steps per epoch, 12 in all


# The DDP path (dist.ddp) too: several buckets (a small cap), so DDP rebuilds them, and positions
# drawn per bucket must come out the same after the restart; torch's PowerSGD hook with its state;
# sparsetrain's PowerSGD (memory and Q) through the trainer's exchange and through its DDP hook.
RESUMED_CONFIGS = {
    "dense": ("scheme=none",),
    "blockk": ("scheme=blockk",),
    "ddp-randk-global": ("scheme=randk", "scope=global", "dist.ddp=true", "dist.bucket_cap_mb=0.05"),
    "ddp-blockk-allreduce": ("scheme=blockk", "aggregation=allreduce", "dist.ddp=true",
                             "dist.bucket_cap_mb=0.05", "scheme.warmup_steps=3"),
    "ddp-torch-powersgd": ("scheme=torch_powersgd", "dist.ddp=true"),
    "powersgd": ("scheme=powersgd", "scheme.rank=2", "scheme.warmup_steps=2"),
    "ddp-powersgd": ("scheme=powersgd", "dist.ddp=true", "dist.bucket_cap_mb=0.05"),
}


# The fast tier resumes block-k through the trainer's exchange (the DDP path's resume into other
# buckets: test_powersgd.py, in-process); the full tier every configuration.
@pytest.mark.parametrize("config", [pytest.param(c, marks=[] if c == "blockk" else pytest.mark.slow)
                                    for c in RESUMED_CONFIGS])
def test_sigterm_then_resume_is_bit_exact(config, tmp_path):
    args = (*RESUME, *RESUMED_CONFIGS[config])
    straight = run_cli(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]

    run = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "sparsetrain.run", *args, f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run, 8, proc)  # in the second epoch, after the first epoch's checkpoint
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    s = read_json(run / "summary.json")
    assert s["status"] == "failed" and "SIGTERM" in s["error"], (s["error"], err[-2000:])
    assert (run / "checkpoint.pt").exists()
    assert s["steps"] < 12

    resumed = run_cli(*args, f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["steps"] == 12 and s["resumed_from_step"] > 0
    assert not (run / "checkpoint.pt").exists()

    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time_ms", "elapsed_s")} for r in rs]  # noqa: E731
    assert strip(read_jsonl(run / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


@pytest.mark.parametrize("launcher", ["spawn", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_killed_rank_fails_the_job_quickly_and_leaves_nothing(launcher, tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "world_size=2", "train.epochs=50", "train.log_every=1", "dist.timeout_s=30",
            f"hydra.run.dir={run}"]
    cmd = ([*TORCHRUN, "-m", "sparsetrain.run", *args] if launcher == "torchrun"
           else [sys.executable, "-m", "sparsetrain.run", *args])
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_steps(run, 2, proc)
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 2, ranks
        everyone = _descendants(proc.pid)
        t0 = time.time()
        ranks[-1].kill()
        _, err = proc.communicate(timeout=90)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    s = read_json(run / "summary.json")
    assert s["status"] == "failed" and s["error"], s
    time.sleep(1)
    alive = [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
