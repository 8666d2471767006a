"""The exchange and the optimizer built from a composed config: one definition for the trainer
and every benchmark row (a list of config overrides), so that what a benchmark times is what
training runs, the DDP path (``dist.ddp=true``) included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate

from sparsetrain.comm import Reducer, build_exchange, check_reducer
from sparsetrain.models import param_groups_for_weight_decay
from sparsetrain.scheme_catalog import exchange_scheme
from sparsetrain.train.ddp_exchange import DDPExchange


@dataclass
class Exchange:
    """What the train step runs: ``net`` (the model, or the DDP model wrapping it), the flat
    gradient buffer (None under DDP: the parameters keep their own ``.grad``), the parameters in
    buffer order and the reducer (``DDPExchange`` under DDP: call its ``settle`` before step 0)."""

    net: torch.nn.Module
    flat: torch.Tensor | None
    params: list
    reducer: Reducer


def exchange_from_config(cfg: Any, model: torch.nn.Module, *, world_size: int, rank: int,
                         device="cpu") -> Exchange:
    """The exchange for ``model``: scheme, scope, aggregation, ratio, ``scheme.uncompressed``,
    error feedback, warm-up steps, seed, the scheme's compressor node (its class and options),
    ``dist.overlap``; with ``dist.ddp`` the model in DDP with the scheme's hook. A reducer that
    lacks a member of ``comm.Reducer`` is refused here (``ConfigError``), not mid-run."""
    exchange = _exchange(cfg, model, world_size=world_size, rank=rank, device=device)
    check_reducer(exchange.reducer, f"scheme={cfg.scheme.name}")
    return exchange


def _exchange(cfg: Any, model: torch.nn.Module, *, world_size: int, rank: int, device) -> Exchange:
    if cfg.dist.ddp and not cfg.scheme.get("sync"):
        red = DDPExchange(cfg, model, device=torch.device(device))
        return Exchange(red.net, None, list(model.parameters()), red)
    params = [p for p in model.parameters() if p.requires_grad]
    compressor = instantiate(cfg.scheme.compressor) if cfg.scheme.get("compressor") else None
    sync = instantiate(cfg.scheme.sync) if cfg.scheme.get("sync") else None
    # local SGD / DiLoCo: the scheme's exchange (dense without a compressor) averages the model's
    # pseudo-gradient every `period` steps, not the gradient every step (comm.periodic)
    scheme = exchange_scheme(cfg.scheme.name, has_compressor=compressor is not None, synchronises=sync is not None)
    flat, params, reducer = build_exchange(
        params, scheme, cfg.scope.name, cfg.aggregation.name, cfg.ratio,
        uncompressed=cfg.scheme.uncompressed, device=device, world_size=world_size, rank=rank,
        seed=cfg.seed, error_feedback=cfg.scheme.error_feedback,
        warmup_steps=cfg.scheme.warmup_steps if sync is None else 0,
        compressor=compressor, memory=instantiate(cfg.scheme.memory) if cfg.scheme.get("memory") else None,
        fast_path=bool(cfg.train.get("fast_path", False)))
    if sync is not None and cfg.dist.ddp:
        # DDP averages the gradients in backward until local SGD starts (torch's post-local-SGD
        # hook); the pseudo-gradient's exchange above keeps its own buffer, not the gradients'
        for p in params:
            p.grad = None
        ddp = DDPExchange(cfg, model, device=torch.device(device))
        reducer = sync(params, list(model.buffers()), reducer, warmup_steps=cfg.scheme.warmup_steps, gradients=ddp)
        return Exchange(ddp.net, None, list(model.parameters()), reducer)
    if sync is not None:
        reducer = sync(params, list(model.buffers()), reducer, warmup_steps=cfg.scheme.warmup_steps)
        return Exchange(model, flat, params, reducer)
    if cfg.dist.overlap:
        reducer.attach(params, flat, bucket_mb=cfg.dist.overlap_bucket_mb,
                       first_bucket_mb=cfg.dist.overlap_first_bucket_mb)
    return Exchange(model, flat, params, reducer)


def optimizer_from_config(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with the configured momentum and Nesterov; weight decay on all but batch-norm and
    biases. The learning rate is set per step by the schedule."""
    return torch.optim.SGD(param_groups_for_weight_decay(model, cfg.optim.weight_decay),
                           lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)
