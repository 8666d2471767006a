"""Stop agreement: every rank learns, at the same step, of a stop signal that reached any of them
and of a non-finite loss on any of them, through one tiny collective, so that all stop together.

``request`` is the ``signals.StopSignals`` handler (it only records the signal); ``watch`` notes a
step's loss on the device, without waiting for the host; ``agreed`` is called by every rank at the
same points (logged steps, epoch ends)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from sparsetrain.errors import Diverged


class StopAgreement:
    def __init__(self, world_size: int, device: torch.device):
        self.world_size = world_size
        self.device = device
        self.requested = 0  # the stop signal's number, once one arrived
        # (step, loss) of this rank's first non-finite loss; step inf while there is none. Kept on
        # the device and read at the agreement points only, so no step waits for the host.
        self.nonfinite = torch.tensor([math.inf, 0.0], dtype=torch.float64, device=device)

    def request(self, signum, frame=None) -> None:
        self.requested = self.requested or int(signum)

    def watch(self, loss: torch.Tensor, step: int) -> None:
        """Note ``loss``, the batch loss of 1-based ``step``, if it is this rank's first non-finite one."""
        with torch.no_grad():
            value = loss.detach().double()
            first_bad = ~torch.isfinite(value) & torch.isinf(self.nonfinite[0])
            here = torch.stack([torch.full_like(value, step), value])
            self.nonfinite = torch.where(first_bad, here, self.nonfinite)

    def agreed(self) -> int:
        """Raises ``Diverged`` on every rank for the earliest non-finite loss on any rank; returns
        the stop signal's number (0: none)."""
        mine = torch.cat([torch.tensor([float(self.requested)], dtype=torch.float64,
                                       device=self.device), self.nonfinite])
        rows = [mine]
        if self.world_size > 1:
            rows = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()
        first = int(torch.argmin(table[:, 1]))  # lowest step; ties: the lowest rank
        if math.isfinite(table[first, 1].item()):
            step, loss = int(table[first, 1].item()), table[first, 2].item()
            where = f" on rank {first}" if self.world_size > 1 else ""
            raise Diverged(f"diverged at step {step} (loss={loss:g}{where})")
        return int(table[:, 0].max().item())
