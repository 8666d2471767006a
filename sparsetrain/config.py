"""Config schemas (Hydra ConfigStore) and the semantic checks that run before any rank starts.

The dataclasses type every key: a typo or a wrong type fails at composition with Hydra's own
message. ``validate`` then checks what types cannot express (ranges, combinations, the launch
environment) and raises ``ConfigError`` with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from sparsetrain.errors import ConfigError  # noqa: F401  (re-exported: its old home)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("scheme", "scope", "aggregation", "model", "data", "experiment", "debug")


@dataclass
class SchemeConfig:
    name: str = MISSING
    # How to build the compressor once the flat buffer's layout is known: a node with
    # ``_target_`` (the scheme's class in sparsetrain.compress), ``_partial_: true`` and the
    # scheme's own options; None for dense SGD (scheme=none). Set by conf/scheme/<name>.yaml.
    compressor: Any = None
    error_feedback: bool = True
    block_size: int = 256  # blockk: entries per contiguous block (scope=global); others ignore it
    # Tensors that travel whole, in the same collective: "1d" (biases, batch-norm weights and
    # biases, as the reference code does), "none" (compress every tensor), or an integer N
    # (tensors with fewer than N entries).
    uncompressed: str = "1d"
    warmup_steps: int = 0  # dense exchange for the first N steps, then compression (memory empty)
    # scheme=powersgd: the matrix rank (None: the rank whose bytes come closest to the layer-wise
    # sparse schemes' at `ratio`); other schemes ignore it
    rank: int | None = None


@dataclass
class NamedConfig:
    name: str = MISSING


@dataclass
class ModelConfig:
    # conf/model/<name>.yaml: ``sparsetrain.models.build_model`` as a partial; the trainer calls it
    # with the data set's input channels and classes.
    _target_: str = "sparsetrain.models.build_model"
    _partial_: bool = True
    name: str = MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    root: str = "${oc.env:SPARSETRAIN_DATA,data}"
    download: bool = True
    train_size: int | None = None  # first N training examples (None: all)
    test_size: int | None = None
    augment: bool = True


@dataclass
class TrainConfig:
    epochs: int = 3
    max_steps: int | None = None  # stop after this many steps (short runs, smoke tests)
    batch_size: int = 128  # per worker
    eval_every: int = 1  # epochs
    log_every: int = 10  # steps
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None  # torch threads per rank (None: cores / local ranks)
    timing_warmup: int = 2  # first steps left out of the phase-time means
    checkpoint: bool = True  # save checkpoint.pt each epoch and on SIGTERM; resume from it
    save_model: bool = False  # write the final weights to model.pt
    progress: bool = True  # tqdm bar on rank 0 when attached to a terminal
    # Before each evaluation, recompute batch-norm running statistics from this many training
    # batches (0: keep the running averages from training).
    bn_recalibrate: int = 0
    # Resume a checkpoint written by other code (another commit or other uncommitted changes);
    # refused by default so that a run's numbers come from one version of the code.
    allow_code_change: bool = False


@dataclass
class OptimConfig:
    lr: float = 0.1  # per worker; scaled linearly by world_size when scale_lr
    scale_lr: bool = True
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4  # not on batch-norm parameters and biases
    warmup_epochs: float = 1.0  # linear warm-up from lr/world_size... to the scaled lr
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.8333])  # fractions of epochs
    gamma: float = 0.1


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "sparsetrain"
    entity: str | None = None
    group: str | None = None  # default: the sweep folder's name, shared by a sweep's jobs
    tags: list[str] = field(default_factory=list)


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on cuda, gloo on cpu) | gloo | nccl
    timeout_s: float = 120.0  # collective timeout: a dead rank cannot hang the job longer
    ranks_per_node: int | None = None  # SLURM: ranks per node (None: all on one node)
    master_port: int | None = None  # local spawn: None picks a free port
    # Dense only: start bucketed AllReduces during backward, as DDP does. Part of the exchange
    # then hides inside the backward phase; false times it as a phase of its own (the paper's view).
    overlap: bool = True
    # Train through torch DistributedDataParallel: the exchange runs in a DDP communication hook
    # during backward, overlapped with it (sparsetrain.train.ddp_exchange): the scheme as
    # sparsetrain.ddp.sparse_hook (scope=global: global within a bucket), dense SGD as DDP's own
    # AllReduce, scheme=powersgd / fp16 as torch's hooks.
    ddp: bool = False
    bucket_cap_mb: float = 25.0  # DDP's bucket size (PowerSGD on gloo: one bucket, see ddp_exchange)


@dataclass
class Config:
    scheme: SchemeConfig = MISSING
    scope: NamedConfig = MISSING
    aggregation: NamedConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    world_size: int = 2
    ratio: float = 0.01
    seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    dist: DistConfig = field(default_factory=DistConfig)


def _nodes(world_size: int, ranks_per_node: int | None) -> int:
    return math.ceil(world_size / (ranks_per_node or world_size))


def _tasks_per_node(world_size: int, ranks_per_node: int | None) -> int:
    return min(world_size, ranks_per_node or world_size)


def register() -> None:
    """Register schemas and resolvers; idempotent (tests compose configs many times)."""
    ConfigStore.instance().store(name="base_config", node=Config)
    for name, fn in (("st_nodes", _nodes), ("st_tasks_per_node", _tasks_per_node)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def group_options(group: str) -> list[str]:
    root = CONF_DIR / group
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def check_group_overrides(overrides: list[str]) -> None:
    """One-line error for an unknown group option (``scheme=nope``) before Hydra's longer one.

    Sweep values (``scheme=topk,randk``) are checked one by one; anything fancier is left to Hydra.
    """
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS or any(c in value for c in "()[]{}$*"):
            continue
        allowed = group_options(key)
        for choice in value.split(","):
            if choice not in allowed and not (key in ("experiment", "debug") and choice == "null"):
                raise ConfigError(
                    f"{key}={choice!r} is not allowed; choose one of: {', '.join(allowed)}"
                )


def validate(cfg: Any, env: dict | None = None) -> None:
    """Semantic checks on a composed config: the one place that says which values and
    combinations run. Raises ConfigError with one line (key, value, what is allowed). Whether
    ``world_size`` agrees with the launcher's environment is the launcher's check
    (``launch.env.check_launch_environment``, called by the CLI before any rank starts)."""
    from sparsetrain.comm.rules import TORCH_HOOK_SCHEMES, check_combination
    from sparsetrain.compress import parse_uncompressed

    env = os.environ if env is None else env
    if cfg.world_size < 1:
        raise ConfigError(f"world_size={cfg.world_size} is not allowed; it must be an integer >= 1")
    try:
        if cfg.scheme.name in TORCH_HOOK_SCHEMES:  # no scope or aggregation of ours; ratio: matching
            check_combination("none", cfg.scope.name, cfg.aggregation.name, cfg.ratio)
        else:
            check_combination(cfg.scheme.name, cfg.scope.name, cfg.aggregation.name, cfg.ratio)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_compressor_node(cfg.scheme)
    choices = {
        "wandb.mode": (cfg.wandb.mode, ("offline", "online", "disabled")),
        "train.device": (cfg.train.device, ("auto", "cpu", "cuda")),
        "dist.backend": (cfg.dist.backend, ("auto", "gloo", "nccl")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(allowed)}")
    positive = {
        "train.batch_size": cfg.train.batch_size,
        "train.epochs": cfg.train.epochs,
        "train.log_every": cfg.train.log_every,
        "train.eval_every": cfg.train.eval_every,
        "optim.lr": cfg.optim.lr,
        "dist.timeout_s": cfg.dist.timeout_s,
        "scheme.block_size": cfg.scheme.block_size,
    }
    if cfg.train.max_steps is not None:
        positive["train.max_steps"] = cfg.train.max_steps
    if cfg.dist.ranks_per_node is not None:
        positive["dist.ranks_per_node"] = cfg.dist.ranks_per_node
    if cfg.scheme.get("rank") is not None:
        positive["scheme.rank"] = cfg.scheme.rank
    positive["dist.bucket_cap_mb"] = cfg.dist.bucket_cap_mb
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} is not allowed; it must be > 0")
    for key, value in {"scheme.warmup_steps": cfg.scheme.warmup_steps,
                       "train.bn_recalibrate": cfg.train.bn_recalibrate}.items():
        if value < 0:
            raise ConfigError(f"{key}={value} is not allowed; it must be >= 0")
    _check_ddp(cfg)
    try:
        parse_uncompressed(cfg.scheme.uncompressed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.wandb.mode == "online" and not _wandb_logged_in(env):
        raise ConfigError(
            "wandb.mode='online' needs a W&B key: run `wandb login` or set WANDB_API_KEY; "
            "allowed without one: offline, disabled"
        )


def _check_ddp(cfg: Any) -> None:
    """``dist.ddp`` needs a process group; torch's hooks (scheme=powersgd, fp16) need DDP."""
    from sparsetrain.comm.rules import TORCH_HOOK_SCHEMES

    if cfg.dist.ddp and cfg.world_size < 2:
        raise ConfigError(f"dist.ddp=true is not allowed with world_size={cfg.world_size}: DDP needs "
                          "a process group; use world_size >= 2 or dist.ddp=false")
    if cfg.scheme.name in TORCH_HOOK_SCHEMES and not cfg.dist.ddp:
        raise ConfigError(f"scheme={cfg.scheme.name} is not allowed with dist.ddp=false: it is torch's "
                          "DDP communication hook; add dist.ddp=true")


def _check_compressor_node(scheme: Any) -> None:
    """``scheme.compressor._target_`` must be the class registered as ``scheme.name``."""
    from sparsetrain.compress import get_compressor

    node = scheme.get("compressor") if hasattr(scheme, "get") else None
    if scheme.name == "none" or not node:
        return
    target = str(node.get("_target_", ""))
    cls = get_compressor(scheme.name)
    if target.rsplit(".", 1)[-1] != cls.__name__:
        raise ConfigError(
            f"scheme.compressor._target_={target!r} does not build scheme.name={scheme.name!r}; "
            f"use sparsetrain.compress.{cls.__name__}"
        )


def _wandb_logged_in(env: Any) -> bool:
    from sparsetrain.tracking import has_wandb_credentials

    return has_wandb_credentials(env)
