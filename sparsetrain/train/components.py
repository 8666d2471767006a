"""The exchange and the optimizer built from a composed config: one definition for the trainer
and every benchmark, so that what a benchmark times is what training runs."""

from __future__ import annotations

from typing import Any

import torch
from hydra.utils import instantiate

from sparsetrain.comm import build_exchange
from sparsetrain.models import param_groups_for_weight_decay


def exchange_from_config(cfg: Any, model: torch.nn.Module, *, world_size: int, rank: int,
                         device="cpu"):
    """The flat gradient buffer (each ``.grad`` a view into it) and its reducer for ``model``:
    scheme, scope, aggregation, ratio, ``scheme.uncompressed``, error feedback, block size,
    warm-up steps, seed, the scheme's compressor node and ``dist.overlap``.

    Returns ``(flat, params_in_buffer_order, reducer)``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    compressor = instantiate(cfg.scheme.compressor) if cfg.scheme.get("compressor") else None
    flat, params, reducer = build_exchange(
        params, cfg.scheme.name, cfg.scope.name, cfg.aggregation.name, cfg.ratio,
        uncompressed=cfg.scheme.uncompressed, device=device, world_size=world_size, rank=rank,
        seed=cfg.seed, error_feedback=cfg.scheme.error_feedback, block_size=cfg.scheme.block_size,
        warmup_steps=cfg.scheme.warmup_steps, compressor=compressor)
    if cfg.dist.overlap:
        reducer.attach(params, flat)
    return flat, params, reducer


def optimizer_from_config(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with the configured momentum and Nesterov; weight decay on all but batch-norm and
    biases. The learning rate is set per step by the schedule."""
    return torch.optim.SGD(param_groups_for_weight_decay(model, cfg.optim.weight_decay),
                           lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)
