"""The config's schema: the dataclasses that type every key (Hydra's ConfigStore), ``register()``
and the schema's keys with their defaults.

A scheme's keys are its structured config's: ``SchemeConfig`` (the keys every scheme has) or, for a
scheme with options of its own, its subclass in ``SCHEME_SCHEMAS`` (``BlockKConfig``:
``block_size``; ``PowerSGDConfig``: ``rank``), which conf/scheme/<name>.yaml names in its defaults
list (``base_scheme``, ``base_<name>``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from sparsetrain.errors import ConfigError

# conf/ at the top of the checkout, reached through the link sparsetrain/_conf (which an installed
# package carries as the folder itself: pyproject.toml's package-data)
CONF_DIR = (Path(__file__).resolve().parent.parent / "_conf").resolve()
GROUPS = ("scheme", "scope", "aggregation", "model", "data", "experiment", "point", "debug")


@dataclass
class SchemeConfig:
    """The keys every scheme has (conf/scheme/<name>.yaml names this schema, ``base_scheme``, or
    one that extends it, first in its defaults list)."""

    name: str = MISSING
    # How to build the compressor once the flat buffer's layout is known: a node with
    # ``_target_`` (the scheme's class in sparsetrain.compress), ``_partial_: true`` and the
    # scheme's own options; None for dense SGD (scheme=none) and torch's hooks. The one route from
    # a scheme to its class. Set by conf/scheme/<name>.yaml.
    compressor: Any = None
    error_feedback: bool = True
    # What a worker keeps of what it did not send: a node with ``_target_`` (a subclass of
    # sparsetrain.compress.Memory), ``_partial_: true`` and its options; None: error feedback
    # (sparsetrain.compress.ErrorFeedback). scheme.error_feedback=false keeps nothing.
    memory: Any = None
    # Tensors that travel whole, in the same collective: "1d" (biases, batch-norm weights and
    # biases, as the reference code does), "none" (compress every tensor), or an integer N
    # (tensors with fewer than N entries).
    uncompressed: str = "1d"
    warmup_steps: int = 0  # dense exchange for the first N steps, then compression (memory empty)
    # How often the ranks synchronise: None, every step (the exchange averages gradients); or a
    # node naming sparsetrain.comm.periodic.PeriodicSync (``_partial_: true``, period, outer_lr,
    # outer_momentum): local SGD / DiLoCo, the model averaged every `period` steps through the
    # compressor node's exchange (dense without one).
    sync: Any = None


@dataclass
class BlockKConfig(SchemeConfig):
    """scheme=blockk (``base_blockk``)."""

    block_size: int = 256  # entries per contiguous block (scope=global); passed to BlockRandomK


@dataclass
class PowerSGDConfig(SchemeConfig):
    """scheme=powersgd (``base_powersgd``: sparsetrain's PowerSGD) and scheme=torch_powersgd
    (``base_torch_powersgd``: torch's PowerSGD DDP hook)."""

    # the matrix rank (None: the rank whose bytes come closest to the layer-wise sparse schemes'
    # at `ratio`)
    rank: int | None = None


@dataclass
class QSGDConfig(SchemeConfig):
    """scheme=qsgd (``base_qsgd``)."""

    # s: each entry is rounded at random to one of s + 1 levels of |x| / ||x|| per bucket (0..s),
    # 1 + ceil(log2(s + 1)) bits an entry; passed to QSGD
    levels: int = 127
    # entries per bucket, each with its own float32 norm: each tensor (the whole compressed buffer
    # with scope=global) cut into consecutive buckets, the last one shorter; None: one norm per
    # tensor (per buffer). 512: the paper's d. Passed to QSGD
    bucket_size: int | None = 512
    # the random rounding's uniforms: counter (SplitMix64 at counter i of the step's seed: the same
    # numbers on the CPU and on CUDA, and the cheaper draw) or pcg64 (numpy's PCG64 on the CPU,
    # torch's generator on CUDA; every QSGD run before this key existed). Passed to QSGD
    generator: str = "counter"


# The schemes with keys of their own, and their schema: conf/scheme/<name>.yaml names
# ``base_<name>`` in its defaults list (the others name ``base_scheme``). A scheme's option is
# ``scheme.<option>`` on the command line; with another scheme it is refused in one line.
SCHEME_SCHEMAS: dict[str, type[SchemeConfig]] = {"blockk": BlockKConfig, "powersgd": PowerSGDConfig,
                                                  "torch_powersgd": PowerSGDConfig, "qsgd": QSGDConfig}


def scheme_options() -> dict[str, tuple[str, ...]]:
    """Every key a scheme has beyond ``SchemeConfig``'s (``scheme.block_size``), with the schemes
    that have it."""
    common = {f.name for f in dataclasses.fields(SchemeConfig)}
    out: dict[str, tuple[str, ...]] = {}
    for name, cls in SCHEME_SCHEMAS.items():
        for f in dataclasses.fields(cls):
            if f.name not in common:
                out[f"scheme.{f.name}"] = (*out.get(f"scheme.{f.name}", ()), name)
    return out


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
    # Validation split: N training images held out (one fixed draw for every run, never trained
    # on) that every choice reads. 0 keeps every training image, as the studies before the tuned
    # protocol ran (experiment=protocol sets 5000).
    val_size: int = 0
    augment: bool = True


@dataclass
class TrainConfig:
    epochs: int = 3
    max_steps: int | None = None  # stop after this many steps (short runs, smoke tests)
    batch_size: int = 128  # per worker
    eval_every: int = 1  # epochs
    # Accuracy-curve points per epoch (1: none beyond the epoch-end evaluations): the first
    # train.curve_size validation images scored at N evenly spaced steps of every epoch, the last
    # at its end, for time to accuracy (metrics.jsonl "curve" records; their time is left out of
    # the run's training time and reported apart)
    curve_points: int = 1
    curve_size: int | None = 2000  # validation images each curve point scores (None: the whole split)
    # Stop at the first curve point whose validation accuracy reaches this (time to accuracy
    # measured end to end: summary.json's ``target``); None trains the whole budget
    stop_at_accuracy: float | None = None
    log_every: int = 10  # steps
    device: str = "auto"  # auto | cpu | cuda
    threads: int | None = None  # torch threads per rank (None: cores / local ranks)
    # Error feedback + compression in fused Triton kernels on CUDA (top-k, random-k, block-k;
    # sparsetrain.compress.fused): the same messages and memory as the torch path, fewer kernel
    # launches. Changes nothing elsewhere (CPU, other schemes, dist.ddp's hook).
    fast_path: bool = False
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
    # dist.overlap's buckets, in the order backward fills them: the first small (it is ready
    # earliest and its AllReduce starts first), the others larger
    overlap_bucket_mb: float = 4.0
    overlap_first_bucket_mb: float = 1.0
    # Train through torch DistributedDataParallel: the exchange runs in a DDP communication hook
    # during backward, overlapped with it (sparsetrain.train.ddp_exchange): the scheme as
    # sparsetrain.comm.ddp_hook.sparse_hook (scope=global: global within a bucket), dense SGD as DDP's own
    # AllReduce, scheme=powersgd as sparsetrain's PowerSGD hook, scheme=torch_powersgd / fp16 / bf16
    # as torch's hooks.
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



TUNED_DIR = CONF_DIR / "tuned"


def tuned_value(scheme: str, scope: str, key: str) -> Any:
    """``key`` (``lr``, ``warmup_epochs``) of the tuned choice for ``scheme`` at ``scope``, from
    ``conf/tuned/<scheme>_<scope>.yaml`` (written by ``python -m sparsetrain.analysis --tuning ...
    --write-tuned``): what experiment=protocol's ``${st_tuned:...}`` reads. ``ConfigError`` (one
    line) when the scheme was not tuned."""
    path = TUNED_DIR / f"{scheme}_{scope}.yaml"
    if not path.is_file():
        tuned = sorted(p.stem for p in TUNED_DIR.glob("*.yaml")) if TUNED_DIR.is_dir() else []
        raise ConfigError(
            f"scheme={scheme} scope={scope} has no tuned values (conf/tuned/{path.name}); tuned: "
            f"{', '.join(tuned) or 'none yet (run experiment=tune)'}; or give optim.lr and optim.warmup_epochs")
    value = OmegaConf.load(path).get(key)
    if value is None:
        raise ConfigError(f"conf/tuned/{path.name} has no {key!r}")
    return value


def per_rank(total: int, world_size: int) -> int:
    """``${st_per_rank:128,${world_size}}``: a global batch split over the ranks, for studies that
    keep it fixed as the ranks change; one line when it does not divide."""
    if world_size < 1 or total % world_size:
        raise ConfigError(f"a global batch of {total} does not split over world_size={world_size} ranks; "
                          f"allowed: a world_size that divides {total}")
    return total // world_size


def register() -> None:
    """Register schemas and resolvers; idempotent (tests compose configs many times)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="scheme", name="base_scheme", node=SchemeConfig)
    for name, cls in SCHEME_SCHEMAS.items():
        store.store(group="scheme", name=f"base_{name}", node=cls)
    for name, fn in (("st_nodes", _nodes), ("st_tasks_per_node", _tasks_per_node), ("st_tuned", tuned_value),
                     ("st_per_rank", per_rank)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)

def schema_keys(cls: type = None, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the schema with its default (``MISSING`` where a group sets it); the
    schemes' own keys (``scheme.block_size``: ``SCHEME_SCHEMAS``) included."""
    hints = typing.get_type_hints(cls or Config)
    out: dict[str, Any] = {}
    if cls is None:
        for scheme_cls in SCHEME_SCHEMAS.values():
            out.update(schema_keys(scheme_cls, "scheme."))
        cls = Config
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(schema_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[f"{prefix}{f.name}"] = default
    return out



def _typed_schema(scheme: type[SchemeConfig] = SchemeConfig):
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config(scheme=scheme(), scope=NamedConfig(),
                                       aggregation=NamedConfig(), model=ModelConfig(), data=DataConfig()))

