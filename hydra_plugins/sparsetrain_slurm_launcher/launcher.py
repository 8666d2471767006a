"""sparsetrain's SLURM launcher: hydra-submitit-launcher's SlurmLauncher with two changes.

1. **Per-job resources.** The stock launcher resolves ``hydra.launcher`` once, from the config
   without the sweep's values, so ``-m world_size=1,2,4`` would give every job the same number of
   tasks. Here every sweep point's launcher config is resolved from that point's own config
   (``nodes``/``tasks_per_node`` follow its ``world_size`` and ``dist.ranks_per_node``), and jobs
   are grouped by their resolved parameters: one SLURM job array per distinct group.
2. **Failed jobs do not end the sweep.** A job that raised, was cancelled (``scancel``), killed,
   timed out or lost its node is reported as failed -- its run folder's ``summary.json`` says
   ``failed`` with the SLURM state and where its logs are -- and the other jobs go on. The stock
   launcher raises on the first such job and, on a cluster without ``sacct`` (such as
   scripts/slurm_cluster.sh's), waits forever for a cancelled one; this one watches the queue
   with ``squeue`` and reads each job's rank-0 result file.

Everything else (``__call__`` on the compute node, ``checkpoint`` for preemption/requeue) is the
stock launcher's. Hydra finds this plugin, and jobs unpickle it, because the package installs
``hydra_plugins.sparsetrain_slurm_launcher`` beside ``sparsetrain`` (pyproject.toml).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)

# squeue states in which a job will still run (or is running).
_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED",
           "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
           "RESV_DEL_HOLD", "SPECIAL_EXIT", "PREEMPTED"}


class GroupedSlurmLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        assert len(job_overrides) > 0
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")

        # Resolve each sweep point's own launcher config and run folder; group equal configs.
        groups: dict[str, list[int]] = {}
        params_of: dict[str, dict[str, Any]] = {}
        run_dirs: list[Path] = []
        job_params: list[tuple[Any, ...]] = []
        refused: dict[int, str] = {}
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params, run_dir, error = self._resolve_job(list(overrides), idx, sweep_dir)
            run_dirs.append(run_dir)
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                               Singleton.get_state()))
            if error is not None:  # invalid: recorded as failed, never submitted
                refused[i] = error
                continue
            key = json.dumps(params, sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
            params_of[key] = params

        jobs: list[Any] = [None] * len(job_overrides)
        for key, members in groups.items():
            params = params_of[key]
            try:
                executor = self._executor(params)
                submitted = executor.map_array(self, *zip(*(job_params[i] for i in members), strict=True))
            except Exception as exc:  # e.g. sbatch refused the partition, account or resources
                from sparsetrain.results import mark_failed

                error = f"not submitted: {type(exc).__name__}: {_last_line(str(exc))}"
                log.error(f"\t{error}")
                for i in members:
                    refused[i] = error
                    mark_failed(run_dirs[i], error)
                continue
            for i, job in zip(members, submitted, strict=False):
                jobs[i] = job
            if len(groups) > 1:
                log.info(f"\tSLURM job array {submitted[0].job_id.split('_')[0]}: "
                         f"{params.get('nodes')} node(s) x {params.get('tasks_per_node')} task(s) "
                         f"for jobs {', '.join('#' + str(initial_job_idx + i) for i in members)}")

        _wait([j for j in jobs if j is not None])
        returns = [_failed(list(o), run_dir, refused[i]) if i in refused
                   else self._outcome(job, list(o), run_dir)
                   for i, (job, o, run_dir) in enumerate(zip(jobs, job_overrides, run_dirs, strict=True))]
        from sparsetrain.launch.cli import note_job_error

        for ret, run_dir in zip(returns, run_dirs, strict=True):  # for the sweep's report
            value = ret._return_value
            if isinstance(value, dict) and value.get("status") == "failed":
                note_job_error(run_dir, str(value.get("error")))
        return returns

    # ---- helpers -------------------------------------------------------------------------------
    def _resolve_job(self, overrides: list[str], idx: int,
                     sweep_dir: Path) -> tuple[dict[str, Any], Path, str | None]:
        """This sweep point's launcher parameters, run folder, and why it is invalid (or None)."""
        from hydra.core.hydra_config import HydraConfig

        from sparsetrain.config import ConfigError, validate

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
        params: dict[str, Any] = {}
        error = None
        try:  # the job's own checks, minus the launch environment (that is the job's to check)
            if "scheme" in cfg and "train" in cfg:  # a sparsetrain config (not some other app's)
                validate(cfg, env={k: v for k, v in os.environ.items()
                                   if k.startswith("WANDB") or k in ("HOME", "NETRC")})
            params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
            params.pop("_target_", None)
        except ConfigError as exc:
            error = str(exc)
        previous = HydraConfig.instance().cfg
        try:  # the run folder, as hydra's run_job computes it in the job
            HydraConfig.instance().set_config(cfg)
            run_dir = Path(str(OmegaConf.select(cfg, "hydra.sweep.dir"))) / str(
                OmegaConf.select(cfg, "hydra.sweep.subdir"))
        except Exception:
            run_dir = sweep_dir / str(idx)
        finally:
            if previous is not None:
                HydraConfig.instance().cfg = previous
        run_dir = run_dir.absolute()
        if error is not None:
            from sparsetrain.results import record_refusal

            config = OmegaConf.to_container(cfg, resolve=False)
            config.pop("hydra", None)
            record_refusal(run_dir, error, config=config)
            log.error(f"\t#{idx} not submitted: {error}")
        return params, run_dir, error

    def _executor(self, params: dict[str, Any]) -> Any:
        """An executor with ``params`` (the launcher config), as the stock launcher builds one."""
        import submitit

        init = {"folder": params["submitit_folder"], "slurm_max_num_timeout": params["max_num_timeout"]}
        executor = submitit.AutoExecutor(cluster="slurm", **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            k if k in base else f"slurm_{k}": v
            for k, v in params.items() if k not in ("submitit_folder", "max_num_timeout")
        })
        return executor

    def _outcome(self, job: Any, overrides: list[str], run_dir: Path) -> JobReturn:
        """Rank 0's JobReturn, or a completed one carrying ``{"status": "failed", ...}``.

        The basic sweeper re-raises a failed JobReturn and so ends the whole sweep; a failed job
        is recorded in its run folder instead and listed by sparsetrain.run's sweep report."""
        rank0 = job.task(0)
        logs = rank0.paths.stderr.parent
        error: str | None = None
        ret: JobReturn | None = None
        if rank0.paths.result_pickle.exists():
            try:
                ret = rank0.result()
            except Exception as exc:  # the job's python raised outside hydra's run_job
                error = f"SLURM job {job.job_id} raised: {_last_line(str(exc))}"
            if ret is not None and ret.status == JobStatus.FAILED:
                error = f"{type(ret._return_value).__name__}: {_last_line(str(ret._return_value))}"
                ret = None
        else:
            error = f"SLURM job {job.job_id} ended {_final_state(job)} before finishing"
        if ret is not None:
            return ret
        from sparsetrain.results import mark_failed

        mark_failed(run_dir, error, slurm_job_id=job.job_id, slurm_logs=str(logs))
        return _failed(overrides, run_dir, error)


def _failed(overrides: list[str], run_dir: Path, error: str) -> JobReturn:
    return JobReturn(overrides=overrides, working_dir=str(run_dir), status=JobStatus.COMPLETED,
                     _return_value={"status": "failed", "error": error, "run_dir": str(run_dir)})


def _queue() -> dict[str, str] | None:
    """{job id: state} of the jobs squeue lists (pending array ranges under their base id)."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i|%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    states: dict[str, str] = {}
    for line in out.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        if "_[" in jid:  # a pending array range such as 38_[2-5%2]
            jid = jid.split("_[")[0] + "_*"
        states[jid] = state
    return states


def _active(job_id: str, queue: dict[str, str]) -> bool:
    state = queue.get(job_id) or queue.get(job_id.split("_")[0] + "_*")
    return state is not None and state.upper() in _ACTIVE


def _wait(jobs: list[Any]) -> None:
    """Until every job has all its result files or has left the queue."""
    pending = list(jobs)
    delay, last_queue_check = 1.0, 0.0
    while pending:
        pending = [j for j in pending
                   if not all(j.task(t).paths.result_pickle.exists() for t in range(j.num_tasks))]
        if not pending:
            return
        if time.monotonic() - last_queue_check >= delay:
            queue = _queue()
            last_queue_check = time.monotonic()
            if queue is not None:
                gone = [j for j in pending if not _active(j.job_id, queue)]
                if gone:  # left the queue: give the file system a moment to show result files
                    time.sleep(2)
                    pending = [j for j in pending if j not in gone]
            delay = min(delay * 1.5, 15.0)
        time.sleep(1.0)


def _final_state(job: Any) -> str:
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job.job_id, "-o", "%T"],
                             capture_output=True, text=True, timeout=60)
        state = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        state = ""
    if not state:
        try:
            state = job.watcher.get_state(job.job_id, mode="force")  # sacct, where it exists
        except Exception:
            state = ""
    return state if state and state.upper() != "UNKNOWN" else "(state unknown: left the queue)"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
