"""The semantic checks on a composed config (``validate``): what types cannot express (ranges,
combinations, the launch environment); the tuned values experiment=protocol reads; ``compose``."""

from __future__ import annotations

import functools
import os
from typing import Any

from omegaconf import OmegaConf

from sparsetrain.config.overrides import check_compressor_option, compressor_class
from sparsetrain.config.schema import CONF_DIR, register
from sparsetrain.errors import ConfigError
from sparsetrain.scheme_catalog import DENSE, exchange_scheme


def validate(cfg: Any, env: dict | None = None) -> None:
    """Semantic checks on a composed config: the one place that says which values and
    combinations run. Raises ConfigError with one line (key, value, what is allowed). Whether
    ``world_size`` agrees with the launcher's environment is the launcher's check
    (``launch.env.check_launch_environment``, called by the CLI before any rank starts)."""
    from sparsetrain.comm.rules import TORCH_HOOK_SCHEMES, check_combination
    from sparsetrain.compress import PowerSGD, parse_uncompressed

    env = os.environ if env is None else env
    _resolve_tuned(cfg)
    if cfg.world_size < 1:
        raise ConfigError(f"world_size={cfg.world_size} is not allowed; it must be an integer >= 1")
    compressor = None
    try:
        if cfg.scheme.name in TORCH_HOOK_SCHEMES:  # no scope or aggregation of ours; ratio: matching
            check_combination(DENSE, cfg.scope.name, cfg.aggregation.name, cfg.ratio)
            if cfg.scheme.get("rank") is not None:  # torch's PowerSGD hook: the rank PowerSGD takes
                PowerSGD.check_options(rank=cfg.scheme.rank)
        else:
            compressor = scheme_compressor(cfg.scheme)
            # a scheme that synchronises every `period` steps without a compressor averages densely
            sync = scheme_sync(cfg.scheme)
            scheme = exchange_scheme(cfg.scheme.name, has_compressor=compressor is not None,
                                     synchronises=sync is not None)
            check_combination(scheme, cfg.scope.name, cfg.aggregation.name, cfg.ratio, compressor)
            scheme_memory(cfg.scheme)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_unread_memory(cfg, compressor, TORCH_HOOK_SCHEMES)
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
        "train.curve_points": cfg.train.get("curve_points", 1),
        "optim.lr": cfg.optim.lr,
        "dist.timeout_s": cfg.dist.timeout_s,
    }
    if cfg.train.max_steps is not None:
        positive["train.max_steps"] = cfg.train.max_steps
    if cfg.dist.ranks_per_node is not None:
        positive["dist.ranks_per_node"] = cfg.dist.ranks_per_node
    positive["dist.bucket_cap_mb"] = cfg.dist.bucket_cap_mb
    positive["dist.overlap_bucket_mb"] = cfg.dist.overlap_bucket_mb
    positive["dist.overlap_first_bucket_mb"] = cfg.dist.overlap_first_bucket_mb
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} is not allowed; it must be > 0")
    _check_milestones(list(cfg.optim.milestones))
    _check_momentum(cfg.optim)
    for key, value in {"scheme.warmup_steps": cfg.scheme.warmup_steps,
                       "train.bn_recalibrate": cfg.train.bn_recalibrate,
                       "data.val_size": cfg.data.get("val_size", 0)}.items():
        if value < 0:
            raise ConfigError(f"{key}={value} is not allowed; it must be >= 0")
    _check_ddp(cfg)
    if cfg.train.get("curve_points", 1) > 1 and not cfg.data.get("val_size"):
        raise ConfigError(f"train.curve_points={cfg.train.curve_points} is not allowed with data.val_size=0: "
                          "curve points score the validation split; hold some out, e.g. data.val_size=5000")
    target = cfg.train.get("stop_at_accuracy")
    if target is not None:
        if not 0 < target <= 1:
            raise ConfigError(f"train.stop_at_accuracy={target} is not allowed; it must be in (0, 1], "
                              "or null (the whole budget)")
        if cfg.train.get("curve_points", 1) < 2:
            raise ConfigError(f"train.stop_at_accuracy={target} is not allowed with train.curve_points="
                              f"{cfg.train.get('curve_points', 1)}: it is checked at the curve points; "
                              "set train.curve_points >= 2 (e.g. 8) and data.val_size")
    curve_size = cfg.train.get("curve_size")
    if curve_size is not None and curve_size < 1:
        raise ConfigError(f"train.curve_size={curve_size} is not allowed; it must be >= 1, or null (the whole split)")
    try:
        parse_uncompressed(cfg.scheme.uncompressed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.wandb.mode == "online" and not _wandb_logged_in(env):
        raise ConfigError(
            "wandb.mode='online' needs a W&B key: run `wandb login` or set WANDB_API_KEY; "
            "allowed without one: offline, disabled"
        )


def _resolve_tuned(cfg: Any) -> None:
    """Resolve ``optim`` and ``train`` first, so that a scheme without tuned values
    (``${st_tuned:...}``) or a global batch the ranks do not divide (``${st_per_rank:...}``) stops
    with the resolver's own line rather than OmegaConf's wrapped one."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg.optim, resolve=True)
        OmegaConf.to_container(cfg.train, resolve=True)
    except InterpolationResolutionError as exc:
        first = str(exc).splitlines()[0]
        head = f"{ConfigError.__name__} raised while resolving interpolation: "
        if first.startswith(head):  # OmegaConf wraps the resolver's error: keep its line
            raise ConfigError(first[len(head):]) from None
        raise


def _check_milestones(milestones: list[float]) -> None:
    """Fractions of ``train.epochs`` (lr_at compares them with the step's share of the run): a
    value of 1 or more, or an unordered list, would silently never decay or decay out of order."""
    inside = all(0 < m < 1 for m in milestones)
    if not inside or any(a >= b for a, b in zip(milestones, milestones[1:])):
        shown = "[" + ",".join(f"{m:g}" for m in milestones) + "]"
        raise ConfigError(f"optim.milestones={shown} is not allowed; give fractions of train.epochs, "
                          "each in (0, 1), increasing, e.g. optim.milestones=[0.5,0.8333]")


def _check_momentum(optim: Any) -> None:
    """torch's SGD refuses these only once a rank builds it, in its own words."""
    if not optim.momentum >= 0:
        raise ConfigError(f"optim.momentum={optim.momentum:g} is not allowed; it must be >= 0 (0: plain SGD)")
    if optim.nesterov and optim.momentum == 0:
        raise ConfigError(f"optim.momentum={optim.momentum:g} is not allowed with optim.nesterov=true: Nesterov "
                          "momentum needs optim.momentum > 0; add optim.nesterov=false for plain SGD")


def _check_unread_memory(cfg: Any, compressor: Any, torch_hooks) -> None:
    """A memory that no step would run is a mistake, not a setting to ignore: ``scheme.memory``
    where the scheme compresses nothing of ours (dense SGD, a local SGD without a compressor,
    torch's hooks), and error feedback asked of torch's fp16 / bf16 hooks, which keep none."""
    name = cfg.scheme.name
    memory = cfg.scheme.get("memory")
    if memory is not None and (compressor is None or name in torch_hooks):
        target = memory.get("_target_") if hasattr(memory, "get") else memory
        why = "torch's hook keeps its own state" if name in torch_hooks else "it has no compressor"
        raise ConfigError(f"scheme.memory={target} is not allowed with scheme={name}: {why}, so no "
                          "memory would run; drop scheme.memory or pick a scheme with a compressor")
    if name in torch_hooks and name != "torch_powersgd" and cfg.scheme.get("error_feedback"):
        raise ConfigError(f"scheme.error_feedback=true is not allowed with scheme={name}: torch's "
                          f"{name} hook casts every entry and keeps no memory; use scheme.error_feedback=false")


def _check_ddp(cfg: Any) -> None:
    """``dist.ddp`` needs a process group; torch's hooks (scheme=torch_powersgd, fp16) need DDP."""
    from sparsetrain.comm.rules import TORCH_HOOK_SCHEMES

    if cfg.dist.ddp and cfg.world_size < 2:
        raise ConfigError(f"dist.ddp=true is not allowed with world_size={cfg.world_size}: DDP needs "
                          "a process group; use world_size >= 2 or dist.ddp=false")
    if cfg.scheme.name in TORCH_HOOK_SCHEMES and not cfg.dist.ddp:
        raise ConfigError(f"scheme={cfg.scheme.name} is not allowed with dist.ddp=false: it is torch's "
                          "DDP communication hook; add dist.ddp=true")


def scheme_compressor(scheme: Any) -> Any:
    """What the scheme's ``compressor`` node builds: a ``functools.partial`` of its class with its
    options (``.func`` is the class), called with (ratio, layout, scope) once the flat buffer is
    known; None when the node is null (dense SGD, torch's hooks). ``ConfigError`` (one line) when
    the node cannot be built."""
    from hydra.utils import instantiate

    node = scheme.get("compressor") if hasattr(scheme, "get") else None
    if not node:
        return None
    target = str(node.get("_target_")) if node.get("_target_") else None
    if target is not None:  # one line for a module off PYTHONPATH or an argument the class lacks
        compressor_class(target)
        for option in (k for k in node if k not in ("_target_", "_partial_")):
            check_compressor_option(option, target, f"scheme.compressor.{option}={node.get(option)!r}")
    try:
        factory = instantiate(node)
    except Exception as exc:  # noqa: BLE001  (Hydra's InstantiationException and what it wraps)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"scheme.compressor of scheme={scheme.name} cannot be built: {reason}") from None
    _check_implemented(factory, target)
    _check_options(factory)
    return factory


def _check_options(factory: Any) -> None:
    """The scheme's options, checked by their one source: the compressor class's
    ``check_options``, with the options of its ``compressor`` node, before any rank starts."""
    from sparsetrain.compress import Compressor
    from sparsetrain.compress.base import unwrap_partial

    cls = unwrap_partial(factory)
    if isinstance(cls, type) and issubclass(cls, Compressor) and isinstance(factory, functools.partial):
        try:
            cls.check_options(**factory.keywords)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _check_implemented(factory: Any, target: str | None) -> None:
    """A compressor class that lacks a method it must implement (``Compressor.unimplemented``)
    stops here, before any rank starts, rather than at its first step."""
    from sparsetrain.compress import Compressor
    from sparsetrain.compress.base import unwrap_partial

    cls = unwrap_partial(factory)
    if isinstance(cls, type) and issubclass(cls, Compressor):
        problem = cls.unimplemented()
        if problem:
            raise ConfigError(f"scheme.compressor._target_={target or cls.__qualname__} is not allowed: {problem}")


def scheme_memory(scheme: Any) -> Any:
    """What the scheme's ``memory`` node builds: a ``functools.partial`` of a ``Memory`` class
    with its options, called with the compressed entries by the exchange; None (error feedback)
    when the node is null. ``ConfigError`` (one line) when it cannot be built or is no memory."""
    from sparsetrain.compress import memory_class

    return _class_node(scheme, "memory", memory_class, "sparsetrain.compress.Memory",
                       "sparsetrain.compress.ErrorFeedback")


def scheme_sync(scheme: Any) -> Any:
    """What the scheme's ``sync`` node builds: a ``functools.partial`` of ``PeriodicSync`` (or a
    subclass) with its options (period, outer learning rate and momentum); None (every step's
    exchange) when the node is null. ``ConfigError`` (one line) when it cannot be built."""
    from sparsetrain.comm.periodic import sync_class

    factory = _class_node(scheme, "sync", sync_class, "sparsetrain.comm.periodic.PeriodicSync",
                          "sparsetrain.comm.periodic.PeriodicSync")
    if factory is not None:
        try:
            sync_class(factory).check_options(**factory.keywords)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return factory


def _class_node(scheme: Any, key: str, class_of, base: str, example: str) -> Any:
    """A scheme's node naming a class with ``_partial_: true`` and its options, built (None when
    the node is null); ``class_of(factory)`` raises ``TypeError`` when it builds no ``base``."""
    from hydra.utils import instantiate

    node = scheme.get(key) if hasattr(scheme, "get") else None
    if not node:
        return None
    target = str(node.get("_target_")) if node.get("_target_") else None
    if target is None:
        raise ConfigError(f"scheme.{key} of scheme={scheme.name} has no _target_; it names a class, e.g. "
                          f"{example}, with _partial_: true")
    module = target.rpartition(".")[0]
    try:
        factory = instantiate(node)
        class_of(factory)
        for option in (k for k in node if k not in ("_target_", "_partial_")):  # one line, not a TypeError at start
            check_compressor_option(option, target, f"scheme.{key}.{option}={node.get(option)!r}", key)
    except ConfigError:
        raise
    except TypeError:
        raise ConfigError(f"scheme.{key}._target_={target} is not allowed: it is not a subclass of "
                          f"{base} built with _partial_: true") from None
    except Exception as exc:  # noqa: BLE001  (Hydra's InstantiationException and what it wraps)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"scheme.{key} of scheme={scheme.name} cannot be built ({target}; is {module} on "
                          f"PYTHONPATH?): {reason}") from None
    return factory


def compose(overrides: list[str] = ()) -> Any:
    """The config ``python -m sparsetrain.run`` composes from these overrides, unchecked: what a
    benchmark row or a test builds (``validate`` checks it as the command line does)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def _wandb_logged_in(env: Any) -> bool:
    from sparsetrain.tracking import has_wandb_credentials

    return has_wandb_credentials(env)
