"""Every rank holds the same model: checked, not assumed.

Data-parallel training keeps one model on every rank by applying the same update everywhere.
When an exchange breaks that (a compressor that says ``shared_positions=True`` but picks its
positions from the rank's own gradient, under ``aggregation=allreduce``; a memory or sync that
applies something other than what every rank decoded), nothing fails: each rank trains its own
model, the evaluation (sharded over the ranks) scores a mixture of them, and the tables carry
a wrong number without a word. ``check_replicas`` runs once after the first compressed step and
at every epoch's end (``Trainer._check_replicas``), on the model the ranks agree on
(``Reducer.synchronised``): two numbers per parameter tensor, compared over the ranks in one
small all-reduce, and ``ReplicasDiffer`` on every rank when they part by more than rounding. It reads the parameters only (no random number, no change): a run that passes it
computes what it computed before.

The two numbers, in float64: ``sum(p * p)`` and ``sum(p * h)``, ``h`` a fixed pattern of +-1
made from each entry's index (so that models of one norm but other entries differ too).
Identical models give identical bits, and on one kind of device every rank's model is the same to
the bit. Ranks on different devices may round an update differently (a fused multiply-add here,
none there): about 1e-7 of an entry a step, a random walk, some 1e-5 after 1e5 steps.
``TOLERANCE`` stands above that; ranks that applied different updates part by 1e-3 of the norm or
more within a few steps (an update is that large), so an epoch's end is far above it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsetrain.errors import ReplicasDiffer

#: relative difference (of the tensor's squared norm, or of ``sum(p * h)`` over its norm) above
#: which two ranks' tensors are not the same model
TOLERANCE = 1e-4


def _pattern(n: int, device) -> torch.Tensor:
    """+-1 for each of ``n`` indices: the top bit of Knuth's multiplicative hash (mod 2**32)."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return (((i * 2654435761) & 0xFFFFFFFF) >> 31).to(torch.float64).mul_(2).sub_(1)


def fingerprints(params) -> torch.Tensor:
    """``[sum(p * p), sum(p * h)]`` for each tensor in ``params``, float64, flat."""
    out = []
    for p in params:
        x = p.detach().reshape(-1).to(torch.float64)
        out += [x.dot(x), x.dot(_pattern(x.numel(), x.device))]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def check_replicas(named_params, world_size: int, where: str, hint: str = "") -> None:
    """``ReplicasDiffer`` on every rank when the ranks' ``named_params`` differ beyond rounding;
    ``where``: when (for the message); ``hint``: what to look at (one sentence). A no-op on one
    rank. Every rank must call it at the same point (one all-reduce)."""
    if world_size <= 1 or not dist.is_initialized():
        return
    named = list(named_params)
    names, params = zip(*named) if named else ((), ())
    mine = fingerprints(params)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[: len(mine)], -both[len(mine):]
    squares = high[0::2].clamp_min(torch.finfo(torch.float64).tiny)
    spread = torch.stack([(high[0::2] - low[0::2]) / squares,
                          (high[1::2] - low[1::2]) / squares.sqrt()], dim=1).amax(dim=1)
    worst = int(spread.argmax()) if len(spread) else 0
    if len(spread) and float(spread[worst]) > TOLERANCE:
        parted = int((spread > TOLERANCE).sum())
        raise ReplicasDiffer(
            f"the ranks' models differ at {where}: {parted} of {len(spread)} parameter tensors, {names[worst]} by "
            f"{float(spread[worst]):.2g} of its norm (more than rounding); every rank must apply the same update"
            + (f". {hint}" if hint else ""))
