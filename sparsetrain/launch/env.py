"""Which process is which rank: the only module that reads the launchers' environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, TORCHELASTIC_RUN_ID, SLURM_*, SUBMITIT_*).

- ``torchrun`` (or any launcher exporting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, such as
  launch/netcluster.py, which runs torchrun in each namespace): this process is one rank.
- a SLURM task (``srun`` or Hydra's submitit launcher): this process is one rank; rank, world and
  master address/port come from submitit's helpers.
- otherwise ``spawn``: this process starts ``world_size`` local ranks (``launch.spawn``).

Everything past this module gets a ``RankInfo`` instead of reading the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from sparsetrain.errors import ConfigError
from sparsetrain.rank import RankInfo


def launcher_of(env: Mapping[str, str]) -> str:
    """Which launcher made this process: torchrun, slurm, or none (we spawn ranks ourselves)."""
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_JOB_ID" in env:
        if int(env["SLURM_NTASKS"]) > 1 or env.get("SUBMITIT_EXECUTOR") == "slurm":
            return "slurm"
    return "spawn"


def env_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher set it (0 where none did)."""
    env = os.environ if env is None else env
    return int(env.get("RANK", env.get("SLURM_PROCID", 0)))


def under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Started by torchrun (its elastic agent), so every rank runs the whole command line."""
    env = os.environ if env is None else env
    return "RANK" in env and "TORCHELASTIC_RUN_ID" in env


def check_launch_environment(world_size: int, env: Mapping[str, str]) -> None:
    kind = launcher_of(env)
    started = {"torchrun": env.get("WORLD_SIZE"), "slurm": env.get("SLURM_NTASKS")}.get(kind)
    if started is not None and int(started) != world_size:
        var = "WORLD_SIZE" if kind == "torchrun" else "SLURM_NTASKS"
        raise ConfigError(
            f"world_size={world_size} contradicts the launcher: {kind} started {var}={started} "
            f"ranks; set world_size={started}"
        )


def emulated_link(env: Mapping[str, str] | None = None) -> dict | None:
    """The tc-shaped link of this rank's network namespace (``launch.netcluster`` sets
    ``ST_NETNS_*``): its rate as given and in bit/s, and its one-way delay; None elsewhere."""
    env = os.environ if env is None else env
    if "ST_NETNS_RATE_BITS" not in env:
        return None
    return {"rate": env.get("ST_NETNS_RATE"), "rate_bits": float(env["ST_NETNS_RATE_BITS"]),
            "delay_us": float(env.get("ST_NETNS_DELAY_US", 0) or 0)}


def host_ranks(env: Mapping[str, str]) -> int:
    """How many ranks share this machine's CPUs (``RankInfo.local_world_size``: each rank's
    default torch threads, the load it expects): torchrun's ``LOCAL_WORLD_SIZE``, except on
    netcluster, whose namespaces all run on this one machine though torchrun sees one process a
    node (``ST_NETNS_HOST_RANKS``). With 2 threads a rank, 4 such ranks on 2 cores ran their
    steps 5.5-6x slower than with 1 (2026-12-05, dense SGD, experiment=e2e, A/B of train.threads)."""
    if "ST_NETNS_HOST_RANKS" in env:
        return int(env["ST_NETNS_HOST_RANKS"])
    return int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """Rank and world of this process; exports MASTER_ADDR/PORT etc. for SLURM tasks."""
    env = os.environ if env is None else env
    kind = launcher_of(env)
    if kind == "slurm":
        import submitit

        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return RankInfo(dist_env.rank, dist_env.world_size, dist_env.local_rank,
                        dist_env.local_world_size, "slurm", env.get("SLURM_JOB_ID"),
                        env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            host_ranks(env),
            "torchrun" if kind == "torchrun" else "spawn",
            env.get("SLURM_JOB_ID"),
            link=emulated_link(env),
        )
    return RankInfo(0, 1, 0, 1, "single", env.get("SLURM_JOB_ID"))
