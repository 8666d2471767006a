"""One rank's life: who it is (``launch.env``), its threads and device, the process group, then
the trainer, then teardown."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from sparsetrain.comm.group import destroy_process_group, init_process_group
from sparsetrain.errors import ConfigError, RunFolderInUse, one_line_error
from sparsetrain.launch.env import rank_info
from sparsetrain.results import claim_run_folder, mark_failed
from sparsetrain.train import Trainer


def pick_device(requested: str, local_rank: int) -> torch.device:
    """The rank's device for ``train.device`` (``auto``: its local GPU when there is one), made
    the current CUDA device. Picked once per rank, here; the process group and the trainer take it."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' is not allowed here: no CUDA device; use cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AlreadyCompleted(Exception):
    """The run folder holds this configuration's completed run (``summary``): not run again."""

    def __init__(self, summary: dict):
        super().__init__("already completed")
        self.summary = summary


class CompletedOtherConfiguration(ConfigError):
    """The run folder holds a completed run of another configuration: never overwritten."""


def _completed_verdict(run_dir: str, cfg_dict: dict) -> tuple[str, object] | None:
    """Rank 0's reading of its folder (``checkpoint.completed_run``): ``("done", summary)``,
    ``("refused", line)`` for a completed run of another configuration, or None: train."""
    from sparsetrain.train.checkpoint import completed_run

    try:
        done = completed_run(run_dir, cfg_dict)
    except ConfigError as exc:
        return "refused", str(exc)
    return ("done", done) if done is not None else None


def worker_main(cfg_dict: dict, run_dir: str, launcher: str | None = None, check_completed: bool = False,
                on_claim: Callable[[], None] | None = None) -> dict:
    """Entry point of one rank: set up the process group, train, tear down.

    ``check_completed`` (torchrun and SLURM, whose ranks start on their own): rank 0 reads the
    folder, which only it knows before the broadcast, and every rank follows it: a completed run
    of this configuration raises ``AlreadyCompleted``, one of another
    ``CompletedOtherConfiguration``, and a folder that another live run holds
    (``results.claim_run_folder``) ``RunFolderInUse``, on every rank, before anything is written.
    Otherwise rank 0 holds the folder until the run ends and calls ``on_claim`` once it does.
    (Local ranks are checked, and the folder held, before they are spawned.)"""
    cfg = OmegaConf.create(cfg_dict)
    info = rank_info()
    if launcher is not None:
        info = replace(info, launcher=launcher)
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // max(1, info.local_world_size))
    torch.set_num_threads(threads)
    device = pick_device(cfg.train.device, info.local_rank)
    init_process_group(info, device, cfg.dist.backend, cfg.dist.timeout_s)
    verdict, release = None, None
    if check_completed and info.is_main:  # held first, then read: see cli._job
        try:
            release = claim_run_folder(run_dir)
        except RunFolderInUse as exc:
            verdict = "in use", str(exc)
        else:
            verdict = _completed_verdict(run_dir, cfg_dict)
            if verdict is not None:  # nothing to train here: let it go
                release()
                release = None
    if info.world_size > 1:  # every rank uses rank 0's run folder (checkpoints live there)
        shared = [run_dir, verdict]
        try:
            dist.broadcast_object_list(shared, src=0)
        except Exception as exc:  # a rank gone before the trainer could record it
            if info.is_main and verdict is None:  # (a finished run's summary stays as it is)
                mark_failed(run_dir, one_line_error(exc), config=cfg_dict, world_size=info.world_size)
            if release is not None:
                release()
            destroy_process_group()
            raise
        run_dir, verdict = shared
    if verdict is not None:  # nothing in the folder is touched
        destroy_process_group()
        kind, what = verdict
        if kind == "done":
            raise AlreadyCompleted(what)
        if kind == "in use":
            raise RunFolderInUse(what)
        raise CompletedOtherConfiguration(what)
    try:
        if release is not None and on_claim is not None:
            on_claim()
        return _train(cfg, cfg_dict, info, run_dir, device)
    finally:
        if release is not None:
            release()


def _train(cfg, cfg_dict: dict, info, run_dir: str, device) -> dict:
    try:
        trainer = Trainer(cfg, info, run_dir, device)
    except Exception as exc:  # set-up failed before the trainer could record it
        if info.is_main:
            mark_failed(run_dir, one_line_error(exc), config=cfg_dict, world_size=info.world_size)
        destroy_process_group()
        raise
    try:
        return trainer.fit()
    finally:
        destroy_process_group()
