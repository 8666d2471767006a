"""The learning-rate schedule: linear warm-up, then step decay at fractions of the run."""

from __future__ import annotations

from typing import Any


def lr_at(step: int, steps_per_epoch: int, cfg: Any, world_size: int) -> float:
    """Linear warm-up from the base lr to the (world-size scaled) peak, then step decay."""
    base = cfg.optim.lr
    peak = base * world_size if cfg.optim.scale_lr else base
    warmup = cfg.optim.warmup_epochs * steps_per_epoch
    if step < warmup:
        return base + (peak - base) * step / warmup
    total = cfg.train.epochs * steps_per_epoch
    passed = sum(step >= m * total for m in cfg.optim.milestones)
    return peak * cfg.optim.gamma**passed
