"""A rank's place in the process group: backend, init, teardown. ``launch.env`` decides the
``RankInfo`` (``sparsetrain.rank``) and ``launch.worker`` the device; both are taken as given."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from sparsetrain.errors import ConfigError
from sparsetrain.rank import RankInfo


def resolve_backend(backend: str, device: torch.device, local_world_size: int,
                    gpus: int | None = None) -> str:
    """The process-group backend for ``dist.backend`` on ``device``: ``auto`` is NCCL on CUDA,
    gloo on CPU. Raises ConfigError (one line) where NCCL cannot work: CPU tensors, or more
    ranks on this machine than GPUs (NCCL refuses two ranks on one GPU)."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        if device.type != "cuda":
            raise ConfigError(
                f"dist.backend='nccl' is not allowed with train.device on {device.type}: NCCL "
                "needs CUDA tensors; use dist.backend=gloo (or auto) or train.device=cuda"
            )
        gpus = torch.cuda.device_count() if gpus is None else gpus
        if local_world_size > gpus:
            raise ConfigError(
                f"dist.backend='nccl' is not allowed with {local_world_size} ranks on a machine "
                f"with {gpus} GPU(s): NCCL needs one GPU per rank; use fewer ranks per node or "
                "dist.backend=gloo"
            )
    return backend


def init_process_group(info: RankInfo, device: torch.device, backend: str, timeout_s: float) -> None:
    if info.world_size <= 1 or dist.is_initialized():
        return
    backend = resolve_backend(backend, device, info.local_world_size)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
