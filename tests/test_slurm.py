"""SLURM sweeps through the CLI, against the real local cluster (scripts/slurm_cluster.sh start).

`python -m sparsetrain.run -m hydra/launcher=slurm ...` submits one SLURM job per sweep point
(hydra_plugins/sparsetrain_slurm_launcher); every job has world_size tasks, one per rank.
Skipped, with the reason, when `sinfo` does not answer.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, read_json, read_jsonl, slurm_state, wait_until
from test_slurm_cluster import _PROBLEM

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("empty_slurm_queue"),
              pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]

SLURM = ("-m", "hydra/launcher=slurm", *TINY, "data.train_size=256")


def _env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    for key in ("WANDB_API_KEY", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _sweep(*overrides: str, sweep: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsetrain.run", *SLURM, *overrides,
                           f"hydra.sweep.dir={sweep}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _start_sweep(*overrides: str, sweep: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sparsetrain.run", *SLURM, *overrides,
                             f"hydra.sweep.dir={sweep}"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _steps(run: Path) -> int:
    return sum(r["kind"] == "step" for r in read_jsonl(run / "metrics.jsonl"))


def _wait(cond, proc: subprocess.Popen, what: str, timeout: float) -> None:
    """`wait_until`, with the cluster's state in the failure message (a job may be held back)."""
    try:
        wait_until(cond, proc, what, timeout=timeout, poll=0.5)
    except pytest.fail.Exception as exc:
        pytest.fail(f"{exc}; {slurm_state()}")


def _squeue_state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def test_sweep_two_points_two_ranks(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _sweep("scheme=randk,blockk", "world_size=2", "train.max_steps=2", sweep=sweep)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # One folder per job; only rank 0 writes run files (rank 1 would clash or add its own).
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "1", "multirun.yaml"]
    job_ids = set()
    for run, scheme in ((sweep / "0", "randk"), (sweep / "1", "blockk")):
        s = read_json(run / "summary.json")
        assert s["status"] == "completed", s
        assert (s["launcher"], s["world_size"], s["steps"]) == ("slurm", 2, 2)
        assert s["config"]["scheme"]["name"] == scheme and s["run_dir"] == str(run)
        assert _steps(run) >= 1 and "checkpoint.pt" not in os.listdir(run)
        job_ids.add(s["slurm_job_id"])
    assert len(job_ids) == 2  # one SLURM job per sweep point
    # Both tasks of each job ran under SLURM and the job asked for 2 tasks on 1 node.
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=2" in script
    outs = sorted(sweep.glob(".submitit/*_*/*_log.out"))
    assert len(outs) == 4, outs  # 2 jobs x 2 tasks
    for out in outs:
        text = out.read_text()
        assert "Job completed successfully" in text
        rank = int(out.name.split("_")[-2])
        assert ("epoch " in text) == (rank == 0)  # only rank 0 reports


@pytest.mark.slow  # the fast tier's SLURM sweep: test_sweep_two_points_two_ranks
def test_invalid_point_fails_and_world_size_sweeps(tmp_path):
    """topk+allreduce is refused before submission; world_size=1,2 gets 1 and 2 tasks."""
    sweep = tmp_path / "sweep"
    proc = _sweep("scheme=topk,blockk", "aggregation=allreduce", "world_size=1,2",
                  "train.max_steps=2", sweep=sweep)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert "error: 2 sweep job(s) did not complete:" in proc.stderr
    # jobs: 0 topk ws1, 1 topk ws2, 2 blockk ws1, 3 blockk ws2
    for num in (0, 1):
        s = read_json(sweep / str(num) / "summary.json")
        assert s["status"] == "failed" and "aggregation='allreduce'" in s["error"], s
        assert f"{sweep / str(num)}: failed: aggregation='allreduce'" in proc.stderr
    for num, ws in ((2, 1), (3, 2)):
        s = read_json(sweep / str(num) / "summary.json")
        assert s["status"] == "completed", s
        assert (s["world_size"], s["launcher"]) == (ws, "slurm")
    scripts = sorted(p.read_text() for p in sweep.glob(".submitit/*/*_submission.sh"))
    assert sorted(line for s in scripts for line in s.splitlines() if "ntasks-per-node" in line) \
        == ["#SBATCH --ntasks-per-node=1", "#SBATCH --ntasks-per-node=2"]


@pytest.mark.slow
def test_cancelled_job_is_failed_and_reported_with_logs(tmp_path):
    sweep = tmp_path / "sweep"
    run = sweep / "0"
    proc = _start_sweep("scheme=randk", "world_size=2", "train.max_steps=100000",
                        "train.epochs=1000", "train.log_every=1", sweep=sweep)
    try:
        _wait(lambda: _steps(run) >= 1, proc, "training step", timeout=300)
        job_id = read_json(run / "summary.json")["slurm_job_id"]
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "failed", s
    assert "error: 1 sweep job(s) did not complete:" in err
    line = next(li for li in err.splitlines() if li.startswith(f"  {run}: failed:"))
    assert f"logs: {sweep / '.submitit' / job_id}" in line, line


@pytest.mark.slow
def test_preempted_job_requeues_and_resumes_at_the_step(tmp_path):
    """SIGUSR2 (what SLURM sends before a time limit / on preemption) to the job's tasks: the
    trainer saves a checkpoint at the step (not only at the epoch), then submitit calls the
    launcher's checkpoint() and requeues the job; the rerun resumes from that very step."""
    sweep = tmp_path / "sweep"
    run = sweep / "0"
    # 256 examples / 2 ranks / batch 32 = 4 steps per epoch, 12 in all; epoch checkpoints at 4, 8.
    proc = _start_sweep("scheme=randk", "world_size=2", "train.epochs=3", "train.log_every=1",
                        sweep=sweep)
    try:
        _wait(lambda: _steps(run) >= 5, proc, "a step past the first epoch checkpoint", timeout=300)
        job_id = read_json(run / "summary.json")["slurm_job_id"]
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        # SLURM holds a requeued job back for a while (BeginTime); let it start again now.
        _wait(lambda: _squeue_state(job_id) == "PENDING", proc, "requeue", timeout=120)
        stopped = read_json(run / "summary.json")
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=30)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert stopped["status"] == "failed", stopped
    match = re.fullmatch(r"Preempted: SIGUSR2 at step (\d+): checkpoint saved; rerun into this folder to resume",
                         stopped["error"] or "")
    assert match, stopped
    saved_at = int(match.group(1))
    assert saved_at >= 5 and saved_at == stopped["steps"]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["steps"] == 12, s
    assert s["resumed_from_step"] == saved_at, s  # the step, not the last epoch (4 or 8)
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(1, 13)), steps  # every step once: none redone, none lost
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "epoch"] == [4, 8, 12]
    log = next(sweep.glob(".submitit/*/*_0_log.out")).read_text()
    assert "Requeued job" in log
