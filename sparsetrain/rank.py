"""Who this process is among the ranks: ``RankInfo``, decided once by ``launch.env`` (the only
reader of the launchers' environment) and passed as given to the process group, the trainer and
the run record. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # torchrun | slurm | spawn | single
    slurm_job_id: str | None = None  # the SLURM job this rank runs in, if any
    preempt_signal: str | None = None  # SLURM: the signal announcing preemption (e.g. USR2)
    # the emulated link this rank sends through (launch.netcluster: rate, rate_bits, delay_us)
    link: dict | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0
