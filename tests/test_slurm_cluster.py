"""Tests against the real local SLURM cluster (scripts/slurm_cluster.sh start).

Skipped, with the reason, when `sinfo` does not answer. `.ci/run` starts the cluster first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the full tier: test_slurm.py::test_sweep_two_points_two_ranks is the fast tier's SLURM sweep
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("empty_slurm_queue")]


def _cluster_problem() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("srun") is None:
        return "SLURM client tools not installed (apt-get install slurm-wlm munge)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%a %T"], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out; start the cluster: sudo scripts/slurm_cluster.sh start"
    if out.returncode != 0:
        return (
            "no SLURM cluster answers (sinfo: "
            f"{out.stderr.strip()[:120]}); start it: sudo scripts/slurm_cluster.sh start"
        )
    states = out.stdout.split()
    if "up" not in states or not any(
        s.startswith(("idle", "mixed", "alloc", "compl")) for s in states
    ):
        return f"SLURM partition/node not usable: {out.stdout.strip()!r}"
    return None


_PROBLEM = _cluster_problem()
requires_cluster = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


@requires_cluster
def test_srun_two_tasks_report_both_ranks():
    out = subprocess.run(
        [
            "srun",
            "-N1",
            "-n2",
            "--time=2",
            "bash",
            "-c",
            'echo "rank=$SLURM_PROCID of=$SLURM_NTASKS"',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split("\n")[:2]) == ["rank=0 of=2", "rank=1 of=2"], out.stdout


@requires_cluster
def test_submitit_job_two_tasks_returns_both_ranks(tmp_path):
    import submitit

    # A closure, so cloudpickle ships it by value: the job's python does not import tests/.
    def whoami(tag):
        env = submitit.JobEnvironment()
        dist_env = submitit.helpers.TorchDistributedEnvironment()
        return {
            "tag": tag,
            "rank": env.global_rank,
            "world": env.num_tasks,
            "local_rank": env.local_rank,
            "procid": os.environ.get("SLURM_PROCID"),
            "master": f"{dist_env.master_addr}:{dist_env.master_port}",
        }

    ex = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm")
    assert ex.cluster == "slurm"
    ex.update_parameters(
        nodes=1, tasks_per_node=2, cpus_per_task=1, timeout_min=5, slurm_partition="debug"
    )
    job = ex.submit(whoami, "x")
    deadline = time.monotonic() + 180
    while not job.done() and time.monotonic() < deadline:
        time.sleep(1)
    if not job.done():
        job.cancel()
        pytest.fail(f"submitit job {job.job_id} not done after 180 s; logs in {tmp_path}")
    results = job.results()
    assert [r["rank"] for r in results] == [0, 1], results
    assert all(r["world"] == 2 and r["tag"] == "x" for r in results)
    assert [r["procid"] for r in results] == ["0", "1"]
    # Every rank derives the same master address/port from the job id.
    assert len({r["master"] for r in results}) == 1


_APP = textwrap.dedent(
    """
    import math, os, sys, json
    import hydra
    from omegaconf import OmegaConf

    # Same semantics as the resolvers in sparsetrain/config/schema.py.
    def _rpn(w, r):
        return int(w) if r is None else int(r)
    OmegaConf.register_new_resolver("st_nodes", lambda w, r: math.ceil(int(w) / _rpn(w, r)), replace=True)
    OmegaConf.register_new_resolver("st_tasks_per_node", lambda w, r: min(int(w), _rpn(w, r)), replace=True)

    @hydra.main(version_base=None, config_path="conf", config_name="config")
    def main(cfg):
        import submitit, torch, torch.distributed as dist, datetime
        env = submitit.JobEnvironment()
        d = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([float(env.global_rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        rec = dict(point=cfg.label, rank=env.global_rank, world=env.num_tasks, sum=t.item(),
                   exe=sys.executable)
        with open(os.path.join(cfg.out, f"{cfg.label}_{env.global_rank}.json"), "w") as f:
            json.dump(rec, f)
        return rec

    if __name__ == "__main__":
        main()
    """
)


@requires_cluster
def test_hydra_sweep_with_repo_slurm_launcher(tmp_path):
    """conf/hydra/launcher/slurm.yaml: 2 sweep points x 2 ranks, each a SLURM job with 2 tasks."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "app.py").write_text(_APP)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(
        textwrap.dedent(
            f"""
            world_size: 1
            dist:
              ranks_per_node: null
            label: a
            out: {out}
            hydra:
              searchpath:
                - file://{REPO / "conf"}
            """
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "app.py",
            "-m",
            "hydra/launcher=slurm",
            "label=a,b",
            "world_size=2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        # slurm.yaml's launcher lives in the repository's hydra_plugins/ (installed with the package;
        # this stand-alone app in another folder also finds it on PYTHONPATH).
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = sorted(
        (json.loads(p.read_text()) for p in out.glob("*.json")),
        key=lambda r: (r["point"], r["rank"]),
    )
    assert [(r["point"], r["rank"], r["world"]) for r in recs] == [
        ("a", 0, 2),
        ("a", 1, 2),
        ("b", 0, 2),
        ("b", 1, 2),
    ], recs
    assert all(r["sum"] == 3.0 for r in recs)  # gloo all_reduce of 1 + 2 across the job's tasks
    assert all(r["exe"] == sys.executable for r in recs)  # jobs reuse the launching python
    subs = list((tmp_path / "sweep" / ".submitit").glob("*/*_submission.sh"))
    assert subs and "#SBATCH --ntasks-per-node=2" in subs[0].read_text()
    assert "#SBATCH --partition=debug" in subs[0].read_text()
