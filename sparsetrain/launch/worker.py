"""One rank's life: who it is (``launch.env``), its threads and device, the process group, then
the trainer, then teardown."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from sparsetrain.comm.group import destroy_process_group, init_process_group
from sparsetrain.errors import ConfigError, one_line_error
from sparsetrain.launch.env import rank_info
from sparsetrain.results import mark_failed
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


def worker_main(cfg_dict: dict, run_dir: str, launcher: str | None = None) -> dict:
    """Entry point of one rank: set up the process group, train, tear down."""
    cfg = OmegaConf.create(cfg_dict)
    info = rank_info()
    if launcher is not None:
        info = replace(info, launcher=launcher)
    threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // max(1, info.local_world_size))
    torch.set_num_threads(threads)
    device = pick_device(cfg.train.device, info.local_rank)
    init_process_group(info, device, cfg.dist.backend, cfg.dist.timeout_s)
    try:
        if info.world_size > 1:  # every rank uses rank 0's run folder (checkpoints live there)
            shared = [run_dir]
            dist.broadcast_object_list(shared, src=0)
            run_dir = shared[0]
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
