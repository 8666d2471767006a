"""Command line: ``python -m sparsetrain.run [overrides]`` and ``python -m sparsetrain.run -m [sweep]``
(``sparsetrain/run.py`` hands over to ``main`` here).

Hydra composes and type-checks the config; ``validate`` checks values and combinations; then
this process either *is* a rank (torchrun, SLURM task) or spawns ``world_size`` local ranks.
A job that fails is marked ``failed`` in its run folder; in a sweep the other jobs go on and the
sweep ends with its table and a report of the jobs that did not complete (refused ones too),
and a non-zero exit code. A run ends with its folder and a one-row table. A stop signal (Ctrl-C,
SIGTERM) ends the command with 128 + the signal and the exact command that resumes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from sparsetrain.config import (
    CLASS_NODES,
    CONF_DIR,
    check_overrides,
    help_text,
    register,
    search_dirs,
    validate,
)
from sparsetrain.errors import (
    CheckpointError,
    ConfigError,
    Preempted,
    RunFolderInUse,
    one_line_error,
    print_error,
)
from sparsetrain.launch.env import check_launch_environment, env_rank, launcher_of, under_torchrun
from sparsetrain.launch.report import end_of_run, end_of_sweep
from sparsetrain.results import (
    SUMMARY,
    RunWriter,
    claim_run_folder,
    holds_a_run,
    mark_failed,
    read_heartbeat,
    read_summary,
    record_refusal,
    relative_run_dir,
    replace_error,
)

register()
_failed_sweep_jobs: list[str] = []
# This sweep's own account of the jobs that it refused or that failed, by resolved run folder: a
# refused job's folder may hold an older run's summary (completed, or another error).
_job_errors: dict[str, str] = {}
_argv: list[str] = []  # the command line's arguments, for the command that resumes
_error = print_error
CHECKPOINT = "checkpoint.pt"  # sparsetrain.train.checkpoint.CHECKPOINT (that module imports torch)
HYDRA_DIR = ".hydra"  # a run's config files, as the analysis reads them (_settle_hydra_files)


def _run_job(cfg: DictConfig) -> dict[str, Any]:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        return _job(cfg, hc, run_dir)
    finally:  # a refused or failed attempt: its config files go only where no run was
        _settle_hydra_files(run_dir, hc.output_subdir, taken=False)


def _settle_hydra_files(run_dir: Path, output_subdir: str | None, taken: bool) -> None:
    """Hydra writes an attempt's config.yaml, hydra.yaml and overrides.yaml before the job runs,
    into ``hydra.output_subdir``: conf/config.yaml points it at ``.hydra.attempt/``, not at the
    ``.hydra/`` the analysis reads (the experiment, the overrides), so that a refused attempt
    (a completed run of another configuration, a run training there now) cannot rewrite what a
    run in the folder recorded. An attempt that trains there (``taken``), or one in a folder
    that holds no run (an earlier refusal at most), becomes the folder's ``.hydra/``; otherwise
    its files are dropped. Once settled, later calls do nothing."""
    if not output_subdir or Path(output_subdir).name == HYDRA_DIR:
        return
    staged = run_dir / output_subdir
    if not staged.is_dir():
        return
    if taken or not holds_a_run(run_dir):
        final = run_dir / HYDRA_DIR
        shutil.rmtree(final, ignore_errors=True)
        staged.rename(final)
    else:
        shutil.rmtree(staged, ignore_errors=True)


def _job(cfg: DictConfig, hc: Any, run_dir: Path) -> dict[str, Any]:
    from sparsetrain.launch.spawn import spawn_ranks

    multirun = hc.mode == RunMode.MULTIRUN
    kind = launcher_of(os.environ)
    is_rank0 = kind == "spawn" or env_rank() == 0
    if multirun and cfg.wandb.group is None:  # a sweep's jobs share one W&B group
        cfg.wandb.group = Path(hc.sweep.dir).as_posix().replace("/", "_")
    if is_rank0:
        print(f"run folder: {relative_run_dir(run_dir)}", flush=True)

    try:
        validate(cfg)
        check_launch_environment(cfg.world_size, os.environ)  # world_size vs torchrun / SLURM
        _check_search(cfg, hc)
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    except ConfigError as exc:  # this attempt's error, not what the folder held before
        if is_rank0:
            record_refusal(run_dir, str(exc), config=OmegaConf.to_container(cfg, resolve=False))
        return _fail(str(exc), run_dir, multirun, code=2, own_summary=False)
    try:  # a checkpoint here is resumed: it must be readable and from this same configuration
        from sparsetrain.train.checkpoint import check_resume

        check_resume(run_dir, cfg_dict)
    except (ConfigError, CheckpointError) as exc:  # the folder's files are left as they are
        return _fail(str(exc), run_dir, multirun, code=2, own_summary=False)
    # Rerunning into a folder (a sweep, a cancelled SLURM array): a finished job is not run again,
    # a finished run of another configuration is never overwritten, and a run training there now
    # is never joined (results.claim_run_folder). Local ranks: checked here, before they are
    # spawned; torchrun's and SLURM's ranks: by rank 0 in worker_main (only it knows the folder
    # before the process group exists), every rank following it.
    from sparsetrain.launch.worker import AlreadyCompleted, CompletedOtherConfiguration, worker_main

    def taken() -> None:  # rank 0 holds the folder: this attempt's config files become its own
        _settle_hydra_files(run_dir, hc.output_subdir, taken=True)

    if kind != "spawn":  # this process is one of the ranks (torchrun; SLURM requeues a preempted job)
        try:
            return worker_main(cfg_dict, str(run_dir), launcher=kind, check_completed=True, on_claim=taken)
        except AlreadyCompleted as done:
            return _already_completed(run_dir, done.summary, is_rank0)
        except (CompletedOtherConfiguration, RunFolderInUse) as exc:  # left as it is
            return _fail(str(exc), run_dir, multirun, code=2, own_summary=False)
        except Preempted as exc:
            if kind != "torchrun":
                raise
            if is_rank0:
                _error(f"{one_line_error(exc)} (run folder: {relative_run_dir(run_dir)})")
                print(f"to resume: {_env_prefix()}torchrun ... "
                      f"{_resume_command(run_dir, multirun, program='-m sparsetrain.run', env=False)}",
                      file=sys.stderr, flush=True)
            raise SystemExit(128 + (exc.signum or signal.SIGTERM)) from None
    from sparsetrain.train.checkpoint import completed_run

    try:
        release = claim_run_folder(run_dir)
    except RunFolderInUse as exc:
        return _fail(str(exc), run_dir, multirun, code=2, own_summary=False)
    try:
        # read while held: a run that completes and lets go between a read and a hold would be
        # trained again over its completed files
        try:
            done = completed_run(run_dir, cfg_dict)
        except ConfigError as exc:
            return _fail(str(exc), run_dir, multirun, code=2, own_summary=False)
        if done is not None:
            return _already_completed(run_dir, done, is_rank0)
        taken()
        if not multirun and not any(o.startswith("hydra.run.dir=") for o in hc.overrides.hydra):
            _note_interrupted_twins(run_dir, cfg_dict)

        # Recorded before any rank exists, so a launch that fails early still leaves a summary,
        # and a failure is never read back from an earlier run's summary in this folder.
        RunWriter(run_dir).start(config=cfg_dict, run_dir=relative_run_dir(run_dir), world_size=cfg.world_size)
        if cfg.world_size == 1:
            return _guarded(lambda: worker_main(cfg_dict, str(run_dir), launcher="single"), run_dir, multirun)
        log_dir = run_dir / "ranks"

        def launch():
            try:
                results = spawn_ranks(worker_main, (cfg_dict, str(run_dir), "spawn"), cfg.world_size,
                                      port=cfg.dist.master_port, log_dir=str(log_dir))
            finally:
                _remove_empty_folders(log_dir)  # torch makes one per rank; only failures write there
            return results[0]

        return _guarded(launch, run_dir, multirun)
    finally:
        release()


def _check_search(cfg: DictConfig, hc: Any) -> None:
    """A search (Hydra's Optuna sweeper) maximises what runs return: their validation accuracy,
    so it needs a validation split."""
    target = str(OmegaConf.select(hc, "sweeper._target_", default="") or "")
    if hc.mode == RunMode.MULTIRUN and "optuna" in target.lower() and not cfg.data.get("val_size"):
        raise ConfigError(f"data.val_size={cfg.data.get('val_size', 0)} is not allowed with the Optuna "
                          "sweeper: it picks by validation accuracy; hold some out, e.g. data.val_size=5000")


def _remove_empty_folders(root: Path) -> None:
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()


def _note_interrupted_twins(run_dir: Path, cfg_dict: dict) -> None:
    """A fresh run in a default folder (outputs/DATE/TIME/) says so when an interrupted run of the
    same configuration waits in another default folder: rerunning a command without its
    hydra.run.dir starts over, and the checkpoint of the first try would go unnoticed."""
    from sparsetrain.train.checkpoint import config_differences

    if (run_dir / SUMMARY).exists():
        return
    for ckpt in sorted(run_dir.parent.parent.glob(f"*/*/{CHECKPOINT}"), reverse=True):
        other = ckpt.parent
        summary = read_summary(other) or {}
        if other.resolve() == run_dir.resolve() or not isinstance(summary.get("config"), dict):
            continue
        if not config_differences(summary["config"], cfg_dict):
            print(f"note: {relative_run_dir(other)} holds an interrupted run of this configuration "
                  f"(stopped at step {summary.get('steps')}); this run starts over in "
                  f"{relative_run_dir(run_dir)}; to resume that one instead, stop this one and run: "
                  f"{_resume_command(other, multirun=False)}", flush=True)
            return


def _env_prefix() -> str:
    """``PYTHONPATH=... `` when it is set: a researcher's compressor module (scheme.compressor's
    ``_target_``) is found through it, and the command that resumes needs it as much."""
    path = os.environ.get("PYTHONPATH")
    return f"PYTHONPATH={shlex.quote(path)} " if path else ""


def _resume_command(folder: Path, multirun: bool, program: str | None = None, env: bool = True) -> str:
    """This command line with its folder set: rerunning it resumes what was interrupted there
    (``hydra.run.dir`` for a run, ``hydra.sweep.dir`` for a sweep; completed jobs are skipped).
    Its ``--config-dir`` comes with the arguments; ``PYTHONPATH`` before it (``env``)."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if multirun:
        folder = Path(HydraConfig.get().sweep.dir)
    args = [a for a in _argv if not a.startswith(f"{key}=")]
    if program is None:
        python = sys.executable
        try:
            python = str(Path(python).relative_to(Path.cwd()))
        except ValueError:
            pass
        program = f"{shlex.quote(python)} -m sparsetrain.run"
    command = " ".join([program, *map(shlex.quote, [*args, f"{key}={relative_run_dir(folder)}"])])
    return (_env_prefix() if env else "") + command


def _guarded(fn, run_dir: Path, multirun: bool) -> dict[str, Any]:
    try:
        result = fn()
    except KeyboardInterrupt:  # world_size=1: Ctrl-C before the trainer's own handler was there
        mark_failed(run_dir, "interrupted (Ctrl-C)")
        return _stopped(run_dir, multirun, signal.SIGINT)
    except Preempted as exc:  # world_size=1: the trainer saved a checkpoint at the step
        return _stopped(run_dir, multirun, exc.signum or signal.SIGTERM)
    except Exception as exc:  # one line for the user; the rank logs hold the traceback
        sigval = getattr(exc, "sigval", None)  # torch elastic's SignalException: the launcher was signalled
        if sigval is not None:  # the ranks got the signal too and saved a checkpoint
            return _stopped(run_dir, multirun, sigval)
        msg, root_rank = _describe(exc, run_dir)
        if root_rank:  # another rank's failure: rank 0's own account is only its symptom
            replace_error(run_dir, msg)
            return _fail(msg, run_dir, multirun, code=1, own_summary=False)
        mark_failed(run_dir, msg)
        return _fail(msg, run_dir, multirun, code=1)
    from sparsetrain.train.signals import received

    sig = received()  # world_size=1 trains in this process: a signal after the run's last step
    return _stopped(run_dir, multirun, sig) if sig is not None else result


def _stopped(run_dir: Path, multirun: bool, sig: int) -> dict[str, Any]:
    """A stop signal ended the job: say where it stopped and the command that goes on from there,
    and exit with 128 + the signal. A sweep stops too rather than starting its next job (which
    the next signal would stop in turn). A single run that completed before the signal took
    effect (it came after the last step) ends as a completed run."""
    name = signal.Signals(sig).name
    summary = read_summary(run_dir) or {}
    where = relative_run_dir(run_dir)
    if summary.get("status") == "completed":
        print(f"{name} came after the last step: {where} completed", file=sys.stderr, flush=True)
        if not multirun:
            return summary
        line = f"{name}: not starting further jobs (run folder: {where}, completed)"
    else:
        error = summary.get("error")  # the ranks' own account
        if error is None:
            error = f"Preempted: {name} to the launcher"
            mark_failed(run_dir, error)
        line = f"{error} (run folder: {where})" + (f"; {name}: not starting further jobs" if multirun else "")
    _error(line)
    what = ("resume the sweep" if multirun else "resume this run" if (run_dir / CHECKPOINT).exists()
            else "run it again")
    print(f"to {what}: {_resume_command(run_dir, multirun)}", file=sys.stderr, flush=True)
    raise SystemExit(128 + int(sig))


def _describe(exc: Exception, run_dir: Path) -> tuple[str, int | None]:
    """One line for a failed launch and the rank it blames. Of the ranks torch's elastic agent saw
    fail, the first (by time, then rank) is the cause; a rank killed by a signal leaves no error
    file, so its line is ``rank 1 died (SIGKILL) after step N`` with N from rank 0's records."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(exc, ChildFailedError) or not exc.failures:
        return one_line_error(exc), None
    rank, failure = min(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    if failure.exitcode < 0 and failure.signal_name() != "<N/A>":  # killed, no word of its own
        return f"rank {rank} died ({failure.signal_name()}){_after_step(run_dir)}", rank
    detail = failure.message
    if isinstance(detail, dict):  # the error file written by the rank's @record wrapper
        detail = detail.get("message", "")
    detail = detail if isinstance(detail, str) else ""
    detail = detail.strip().splitlines()[-1] if detail.strip() else f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {detail}", rank


def _after_step(run_dir: Path) -> str:
    summary = read_summary(run_dir) or {}
    step = summary.get("steps") if summary.get("status") == "failed" else None
    if step is None:
        step = (read_heartbeat(run_dir) or {}).get("step")
    return f" after step {step}" if step is not None else ""


def _already_completed(run_dir: Path, summary: dict, is_rank0: bool) -> dict[str, Any]:
    if is_rank0:
        print(f"{run_dir}: already completed (test_accuracy {summary.get('test_accuracy')}); "
              "not run again (delete the folder to rerun)", flush=True)
    return summary


def _fail(msg: str, run_dir: Path, multirun: bool, code: int, own_summary: bool = True) -> dict[str, Any]:
    summary = read_summary(run_dir) if own_summary else None
    if summary and summary.get("error") and summary["error"] != msg:
        msg = summary["error"]  # the rank's own account is more precise
    if env_rank() == 0:
        _error(f"{msg} (run folder: {relative_run_dir(run_dir)})")
    if multirun:
        note_job_error(run_dir, msg)
        return {"status": "failed", "error": msg, "run_dir": str(run_dir)}
    sys.exit(code)


def note_job_error(run_dir: str | Path, error: str) -> None:
    """Remember why a sweep job failed or was refused, for the sweep's report (SweepReport)."""
    _job_errors[str(Path(run_dir).resolve())] = error


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> Any:
    result = _run_job(cfg)
    hc = HydraConfig.get()
    if hc.mode == RunMode.RUN and env_rank() == 0:  # a sweep's table comes at its end
        print(end_of_run(hc.runtime.output_dir), flush=True)
    return objective(result)


def objective(result: Any) -> float | None:
    """What a run returns to Hydra's sweeper (the value the Optuna sweeper maximises): its final
    validation accuracy, never the test set's. None for a run without a validation split or one
    that did not complete (the Optuna sweeper counts it a failed trial)."""
    if not isinstance(result, dict) or result.get("status") != "completed":
        return None
    return result.get("val_accuracy")


class SweepReport(Callback):
    """After a sweep: its folder and table (``table: false`` leaves the table out), then the jobs
    that did not complete, with their logs: those whose run folder does not say ``completed``
    and those this sweep refused (their folder may hold an older run's summary)."""

    def __init__(self, table: bool = True):
        self.table = table

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        errors = dict(_job_errors)
        for summary_path in sorted(sweep_dir.glob("*/" + SUMMARY), key=lambda p: p.parent.name):
            summary = read_summary(summary_path.parent) or {}
            error = errors.get(str(summary_path.parent.resolve()))
            if summary.get("status") != "completed" or error is not None:
                where = summary_path.parent
                logs = _slurm_logs(sweep_dir, where, summary)
                hint = f"; logs: {logs}" if logs else ""
                status = summary.get("status")
                if error is not None:
                    state = f"failed: {error}"
                elif status == "running":  # the sweep is over: this job died without a word
                    state = f"unfinished ({_no_heartbeat(summary_path.parent, summary)})"
                else:
                    state = f"{status}: {summary.get('error')}"
                _failed_sweep_jobs.append(f"{where}: {state}{hint}")
        if self.table:
            print(end_of_sweep(sweep_dir, errors), flush=True)
        if _failed_sweep_jobs:
            _error(f"{len(_failed_sweep_jobs)} sweep job(s) did not complete:")
            for line in _failed_sweep_jobs:
                print(f"  {line}", file=sys.stderr)


def _no_heartbeat(run_dir: Path, summary: dict) -> str:
    beat = read_heartbeat(run_dir) or {}
    if beat.get("time"):
        return f"no heartbeat since {beat['time']} (step {beat.get('step')})"
    return f"no heartbeat since {summary.get('started_at')} (start)"


def _slurm_logs(sweep_dir: Path, run_dir: Path, summary: dict) -> str | None:
    """A SLURM job's log folder: ``.submitit/<job id>/`` where the job id is submitit's
    (``<array job>_<index>``, saved by Hydra as ``hydra.job.id``), not ``SLURM_JOB_ID``."""
    if summary.get("slurm_logs"):
        return str(summary["slurm_logs"])
    job_id = None
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    if hydra_yaml.exists():
        job_id = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.job.id")
    folders = [p for p in sweep_dir.glob(f".submitit/{job_id}") if p.is_dir()] if job_id else []
    return f"{folders[0]}/ (*_<rank>_log.err/.out)" if folders else None


def _class_option(arg: str) -> str:
    """``scheme.compressor.<option>=v`` (memory, sync; with a ``+`` or without) as
    ``++scheme.compressor.<option>=v``: an option of the class (check_overrides made sure of it)
    that the scheme's yaml leaves at the class's default is not in the node, and Hydra would
    refuse to add it without a ``+``, or to add one the yaml sets with one."""
    key = arg.partition("=")[0].lstrip("+")
    parts = key.split(".")
    if ("=" in arg and len(parts) >= 3 and parts[0] == "scheme" and parts[1] in CLASS_NODES
            and parts[2] not in ("_target_", "_partial_") and not arg.startswith("~")):
        return f"++{arg.lstrip('+')}"
    return arg


def main() -> None:
    global _argv
    args = sys.argv[1:]
    # Let `-m` stand anywhere among the overrides (argparse wants flags before positionals).
    flags = [a for a in args if a in ("-m", "--multirun")]
    sys.argv[1:] = args = flags + [a for a in args if a not in flags]
    if "--help" in args or "-h" in args:  # Hydra's own help: --hydra-help
        print(help_text(search_dirs(args)))
        return
    _argv = list(args)
    try:
        check_overrides(args)
    except ConfigError as exc:
        _error(str(exc))
        sys.exit(2)
    sys.argv[1:] = args = [_class_option(a) for a in args]
    run_dirs = [a.lstrip("+") for a in args if a.lstrip("+").startswith("hydra.run.dir=")]
    if ("-m" in args or "--multirun" in args) and run_dirs:  # Hydra would sweep into a new dated folder
        folder = run_dirs[0].partition("=")[2]
        _error(f"hydra.run.dir={folder} is ignored by a sweep (-m); use hydra.sweep.dir={folder}")
        sys.exit(2)
    if ("-m" in args or "--multirun" in args) and under_torchrun():
        _error("-m/--multirun is not allowed under torchrun (every rank would run the whole sweep); "
               "run the sweep without torchrun, or one torchrun per sweep point")
        sys.exit(2)
    if under_torchrun() and env_rank() != 0:
        # Under torchrun every rank runs this command; rank 0's folder is the run folder (its
        # path is broadcast to the others), so the other ranks must not make folders of their own.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null",
                     "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    hydra_main()
    if _failed_sweep_jobs:
        sys.exit(1)


if __name__ == "__main__":
    # Run through the importable module so the sweep callback and main() share state.
    from sparsetrain.launch.cli import main as _main

    _main()
