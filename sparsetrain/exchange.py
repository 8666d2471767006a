"""Exchange: turn every rank's gradient into the averaged update, one collective per step.

The trainer keeps all gradients in one flat buffer (parameters' ``.grad`` are views into it).
A reducer overwrites that buffer, in place, with the update every rank applies identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsetrain.timing import PhaseTimer


@dataclass
class ExchangeStats:
    """What one step sent. Byte counts are per worker, as put on the wire."""

    bytes_sent: int
    dense_bytes: int
    density: float = 1.0
    compression_error: float | None = None  # ||acc - sent|| / ||acc||
    memory_norm: float | None = None  # ||error-feedback memory|| after the step


class DenseReducer:
    """Plain data-parallel SGD: one AllReduce of the flat gradient, divided by world size."""

    def __init__(self, numel: int, element_size: int = 4, group=None):
        self.group = group
        self.dense_bytes_per_step = numel * element_size
        self.bytes_sent_per_step = self.dense_bytes_per_step

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer) -> ExchangeStats:
        with timer.phase("exchange"):
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(flat_grad, group=self.group)
                flat_grad.div_(dist.get_world_size(self.group))
        return ExchangeStats(self.bytes_sent_per_step, self.dense_bytes_per_step)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
