"""Where ranks come from: one helper decides rank and world size for every launcher.

- ``torchrun`` (or any launcher exporting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, such as
  scripts/netns_cluster.sh): this process is one rank.
- a SLURM task (``srun`` or Hydra's submitit launcher): this process is one rank; rank, world and
  master address/port come from submitit's helpers.
- otherwise ``spawn``: this process starts ``world_size`` local ranks with PyTorch's elastic
  launcher (the API behind torchrun), which also watches them: when one dies the others are
  stopped and the launch fails.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # torchrun | slurm | spawn | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_of(env: Mapping[str, str]) -> str:
    """Which launcher made this process: torchrun, slurm, or none (we spawn ranks ourselves)."""
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_JOB_ID" in env:
        if int(env["SLURM_NTASKS"]) > 1 or env.get("SUBMITIT_EXECUTOR") == "slurm":
            return "slurm"
    return "spawn"


def check_launch_environment(world_size: int, env: Mapping[str, str]) -> None:
    from sparsetrain.config import ConfigError

    kind = launcher_of(env)
    started = {"torchrun": env.get("WORLD_SIZE"), "slurm": env.get("SLURM_NTASKS")}.get(kind)
    if started is not None and int(started) != world_size:
        var = "WORLD_SIZE" if kind == "torchrun" else "SLURM_NTASKS"
        raise ConfigError(
            f"world_size={world_size} contradicts the launcher: {kind} started {var}={started} "
            f"ranks; set world_size={started}"
        )


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """Rank and world of this process; exports MASTER_ADDR/PORT etc. for SLURM tasks."""
    env = os.environ if env is None else env
    kind = launcher_of(env)
    if kind == "slurm":
        import submitit

        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return RankInfo(dist_env.rank, dist_env.world_size, dist_env.local_rank,
                        dist_env.local_world_size, "slurm")
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            "torchrun" if kind == "torchrun" else "spawn",
        )
    return RankInfo(0, 1, 0, 1, "single")


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from sparsetrain.config import ConfigError

            raise ConfigError("train.device='cuda' is not allowed here: no CUDA device; use cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_backend(backend: str, device: torch.device, local_world_size: int,
                    gpus: int | None = None) -> str:
    """The process-group backend for ``dist.backend`` on ``device``: ``auto`` is NCCL on CUDA,
    gloo on CPU. Raises ConfigError (one line) where NCCL cannot work: CPU tensors, or more
    ranks on this machine than GPUs (NCCL refuses two ranks on one GPU)."""
    from sparsetrain.config import ConfigError

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable, args: tuple, world_size: int, *, port: int | None, log_dir: str,
                monitor_interval: float = 0.5):
    """Run ``fn(*args)`` in ``world_size`` local processes with torch's elastic launcher.

    Returns ``{rank: return value}``; raises ``ChildFailedError`` when any rank fails, after
    the agent has stopped the others (no process is left behind).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"sparsetrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port or free_port()}",
        rdzv_configs={"timeout": 60},
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    # The agent logs every child's traceback at ERROR; the rank logs and the run's summary
    # already hold the failure, so keep the console to our one-line report.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    return elastic_launch(config, entrypoint=_rank_main)(fn, *args)


# What a rank sees when a peer is gone (gloo, NCCL): a symptom, not a cause.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "Connection refused", "remote process exited", "NCCL communicator was aborted")
PEER_LOST_GRACE_S = 5.0


def peer_lost(exc: BaseException) -> bool:
    text = f"{exc}"
    return any(p in text for p in PEER_LOST)


def _rank_main(fn: Callable, *args):
    """A local rank. One that fails only because a peer vanished waits a moment before exiting,
    so the agent (polling every ``monitor_interval``) sees the peer's death first and reports
    *that* rank ("rank 1 died (SIGKILL)") rather than this one's "Connection reset by peer"; the
    agent then stops this rank."""
    try:
        return fn(*args)
    except Exception as exc:
        if peer_lost(exc):
            import time

            time.sleep(PEER_LOST_GRACE_S)
        raise
