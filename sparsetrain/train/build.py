"""What a run is built from its config: the data, the model (Hydra's ``instantiate`` of
``model``), the exchange and the optimizer (``train.components``, as every benchmark builds them),
the sharded loader, the phase timer and the one train step (``train.step.TrainStep``).

The exchange learns on which steps to report its compression statistics from here, its caller:
``want_stats`` is the logging cadence (``results.logged_step``), so the reducer never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from sparsetrain.comm import Reducer
from sparsetrain.data import Dataset, ShardedLoader, load_dataset
from sparsetrain.errors import ConfigError
from sparsetrain.rank import RankInfo
from sparsetrain.results import logged_step
from sparsetrain.timing import PhaseTimer
from sparsetrain.train.components import exchange_from_config, optimizer_from_config
from sparsetrain.train.schedule import lr_at
from sparsetrain.train.step import TrainStep


@dataclass
class Parts:
    """A built run: ``model`` is the bare model (checkpointed, evaluated), ``run_step`` trains the
    network the exchange wraps (the model itself, or its DDP wrapper under ``dist.ddp``)."""

    data: Dataset
    model: torch.nn.Module
    reducer: Reducer
    optimizer: torch.optim.Optimizer
    loader: ShardedLoader
    timer: PhaseTimer
    run_step: TrainStep


def build(cfg: Any, info: RankInfo, device: torch.device) -> Parts:
    """Every rank builds the same parts from the same seed, then starts from rank 0's weights."""
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    data = load_dataset(cfg.data.name, cfg.data.root, download=cfg.data.download,
                        train_size=cfg.data.train_size, test_size=cfg.data.test_size,
                        seed=cfg.seed, val_size=cfg.data.get("val_size", 0))
    # conf/model/<name>.yaml: the model's class or builder, given the data's shape here
    model = instantiate(cfg.model)(in_channels=data.in_channels, num_classes=data.num_classes)
    model = model.to(device)
    # One flat gradient buffer, each .grad a view into it; tensors that bypass compression
    # (scheme.uncompressed) sit at its end. conf/scheme/<name>.yaml's ``compressor`` node is
    # the scheme's class with its options, built once the buffer's layout is known.
    # dist.ddp: the model in torch DDP, the exchange in a communication hook during backward
    # (train.ddp_exchange); the step then runs the DDP model and keeps per-parameter .grad.
    exchange = exchange_from_config(cfg, model, world_size=info.world_size, rank=info.rank, device=device)
    optimizer = optimizer_from_config(cfg, model)
    loader = ShardedLoader(data.train_x, data.train_y, cfg.train.batch_size, rank=info.rank,
                           world_size=info.world_size, seed=cfg.seed, augment=cfg.data.augment,
                           padding=data.augment_padding, flip=data.flip)
    if len(loader) == 0:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is not allowed: each of "
            f"{info.world_size} ranks holds {len(data.train_y) // info.world_size} examples; "
            "use a smaller batch"
        )
    timer = PhaseTimer(device, cfg.train.timing_warmup)
    schedule = partial(lr_at, steps_per_epoch=len(loader), cfg=cfg, world_size=info.world_size)
    # compression statistics on the steps the loop logs (0-based step i is logged after i + 1)
    run_step = TrainStep(exchange.net, optimizer, exchange.reducer, exchange.flat, timer, device,
                         lr=schedule, want_stats=lambda i: logged_step(i + 1, cfg.train.log_every))
    if info.world_size > 1:  # robust to seeding differences: start from rank 0's weights
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    return Parts(data, model, exchange.reducer, optimizer, loader, timer, run_step)
