"""Config schemas (Hydra ConfigStore) and the semantic checks that run before any rank starts.

The dataclasses type every key and ``HELP`` says what each one does (``--help`` prints it). A
scheme's keys are its structured config's: ``SchemeConfig`` (the keys every scheme has) or, for a
scheme with options of its own, its subclass in ``SCHEME_SCHEMAS`` (``BlockKConfig``:
``block_size``; ``PowerSGDConfig``: ``rank``), which conf/scheme/<name>.yaml names in its defaults
list (``base_scheme``, ``base_<name>``).

``check_overrides`` reads the command line before Hydra does: an unknown key (with or without
``+``), a value of the wrong type, an unknown group option or a scheme's own key with another
scheme stops with one line (and a "did you mean"). ``validate`` then checks what types cannot
express (ranges, combinations, the launch environment). Both raise ``ConfigError`` with one line
naming the key, the value and what is allowed.

Over 400 lines on purpose: the schema, the help for each key and both checks describe the same
keys, and are read together when one changes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from sparsetrain.errors import ConfigError  # noqa: F401  (re-exported: its old home)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
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
    # dist.overlap's buckets, in the order backward fills them: the first small (it is ready
    # earliest and its AllReduce starts first), the others larger
    overlap_bucket_mb: float = 4.0
    overlap_first_bucket_mb: float = 1.0
    # Train through torch DistributedDataParallel: the exchange runs in a DDP communication hook
    # during backward, overlapped with it (sparsetrain.train.ddp_exchange): the scheme as
    # sparsetrain.ddp.sparse_hook (scope=global: global within a bucket), dense SGD as DDP's own
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


def register() -> None:
    """Register schemas and resolvers; idempotent (tests compose configs many times)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="scheme", name="base_scheme", node=SchemeConfig)
    for name, cls in SCHEME_SCHEMAS.items():
        store.store(group="scheme", name=f"base_{name}", node=cls)
    for name, fn in (("st_nodes", _nodes), ("st_tasks_per_node", _tasks_per_node), ("st_tuned", tuned_value)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def group_options(group: str, dirs: tuple[Path, ...] = ()) -> list[str]:
    """The options of ``group`` in conf/ and in the extra config folders ``dirs`` (``search_dirs``)."""
    found = set()
    for conf in (CONF_DIR, *dirs):
        root = conf / group
        found.update(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))
    return sorted(found)


def search_dirs(args: list[str]) -> tuple[Path, ...]:
    """The config folders Hydra searches besides conf/, in its order: ``--config-dir``/``-cd``,
    then ``hydra.searchpath=[...]`` of the command line, else conf/config.yaml's own (Hydra reads
    one or the other). ``file://``, ``pkg://`` and plain paths; folders that do not exist are left
    to Hydra to report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    entries: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            entries.append(args[i + 1])
        elif arg.startswith(("--config-dir=", "-cd=")):
            entries.append(arg.partition("=")[2])
    searchpath = None
    for arg in args:
        if arg.lstrip("+").startswith("hydra.searchpath="):
            try:
                (override,) = OverridesParser.create().parse_overrides([arg])
                searchpath = override.value()
            except HydraException:
                searchpath = None  # Hydra says what is wrong with it
    if searchpath is None:
        searchpath = OmegaConf.select(OmegaConf.load(CONF_DIR / "config.yaml"), "hydra.searchpath")
    if isinstance(searchpath, (list, tuple)) or OmegaConf.is_list(searchpath):
        entries += [str(e) for e in searchpath]
    dirs = [d for d in map(_search_dir, entries) if d is not None and d.is_dir()]
    return tuple(dict.fromkeys(d for d in dirs if d != CONF_DIR))


def _search_dir(entry: str) -> Path | None:
    """The folder a search path entry names (``pkg://mypkg.conf``: the package's folder)."""
    scheme, sep, rest = entry.partition("://")
    if not sep:
        return Path(entry).resolve()
    if scheme == "file":
        return Path(rest).resolve()
    if scheme == "pkg":
        import importlib.util

        try:
            spec = importlib.util.find_spec(rest.replace("/", "."))
        except (ImportError, ValueError):
            return None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return Path(locations[0]).resolve() if locations else None
    return None  # structured:// and others: no folder


# One line per group and key: what `--help` prints. tests/test_config.py checks that every key of
# the schema has one, so a new key cannot be left undescribed.
GROUP_HELP = {
    "scheme": "how gradients are compressed: none (dense SGD), topk, randk, blockk, powersgd, signsgd, qsgd; torch_powersgd, fp16, bf16 need dist.ddp=true",
    "scope": "layerwise (k per tensor) or global (one k over the flattened model)",
    "aggregation": "allgather (own positions, gathered) or allreduce (shared positions, summed; not topk)",
    "model": "resnet20 (0.27M parameters) or resnet18 (CIFAR variant, 11.2M, the paper's)",
    "data": "fashion_mnist (offline), cifar10 (downloads into data.root), synthetic (generated)",
    "experiment": "a preset with its own sweep grid (conf/experiment/), run with -m; writes under multirun/<preset>/",
    "point": "a named point of a study whose points differ in several keys (conf/point/), e.g. frontier_signsgd",
    "debug": "tiny: small, fast settings for smoke runs and tests (synthetic data, 512 images, no W&B)",
}
HELP = {
    "world_size": "data-parallel ranks, >= 1",
    "ratio": "fraction of gradient entries sent per step, 0 < ratio <= 1 (scheme=none ignores it)",
    "seed": "seeds the weights, the data order and the shared random positions",
    "scheme.name": "the scheme (set it with scheme=...)",
    "scheme.compressor": "how the compressor is built (set by scheme=...)",
    "scheme.error_feedback": "keep what was not sent and add it to the next gradient (false: the ablation)",
    "scheme.block_size": "scheme=blockk only, with scope=global: entries per contiguous block",
    "scheme.uncompressed": "tensors sent whole: 1d (biases, batch-norm), none, or N (tensors under N entries)",
    "scheme.warmup_steps": "exchange densely for the first N steps, then compress (memory starts empty)",
    "scheme.rank": "scheme=powersgd, torch_powersgd only: the matrix rank (null: the bytes closest to the sparse schemes' at ratio)",
    "scheme.levels": "scheme=qsgd only: quantization levels s per bucket, an integer in [1, 65535] (1 + ceil(log2(s+1)) bits an entry)",
    "scheme.bucket_size": "scheme=qsgd only: entries per bucket, each with its own float32 norm, an integer >= 1 (null: one norm per tensor, or per buffer with scope=global)",
    "scope.name": "the scope (set it with scope=...)",
    "aggregation.name": "the aggregation (set it with aggregation=...)",
    "model._target_": "the function that builds the model (set by model=...)",
    "model._partial_": "built once the data's shape is known (set by model=...)",
    "model.name": "the model (set it with model=...)",
    "data.name": "the data set (set it with data=...)",
    "data.root": "where data sets live (default: $SPARSETRAIN_DATA, else data/)",
    "data.download": "download a data set that is not there",
    "data.train_size": "train on the first N training examples (null: all); for short runs",
    "data.test_size": "evaluate on the first N test examples (null: all); evaluation dominates short runs",
    "data.val_size": "hold out N training images as the validation split (the same draw for every run); choices read it, the test set is only reported (0: none)",
    "data.augment": "random crops and flips of the training images",
    "train.epochs": "epochs to train; the lr warm-up and milestones are fractions of them",
    "train.max_steps": "stop after N steps (null: no cap); raising it resumes a capped run further",
    "train.batch_size": "examples per rank per step",
    "train.eval_every": "evaluate on the test set every N epochs, and at the end",
    "train.curve_points": "accuracy-curve points per epoch (needs data.val_size): the validation subset scored at N evenly spaced steps, for time to accuracy (1: none)",
    "train.curve_size": "validation images each curve point scores, the first N of the split (null: all)",
    "train.log_every": "log a step record every N steps; stop signals and divergence are checked then",
    "train.device": "auto, cpu or cuda (one GPU per rank)",
    "train.threads": "torch threads per rank (null: cores / local ranks)",
    "train.timing_warmup": "first steps left out of the per-phase time means",
    "train.checkpoint": "save checkpoint.pt every epoch and on a stop signal, and resume from it",
    "train.save_model": "write the final weights to model.pt",
    "train.progress": "progress bar on rank 0 when attached to a terminal",
    "train.bn_recalibrate": "recompute batch-norm statistics from N training batches before each evaluation (0: off)",
    "train.allow_code_change": "resume a checkpoint written by other code (another commit, other changes)",
    "optim.lr": "learning rate per rank (times world_size when optim.scale_lr)",
    "optim.scale_lr": "scale the lr linearly with world_size",
    "optim.momentum": "SGD momentum",
    "optim.nesterov": "Nesterov momentum",
    "optim.weight_decay": "weight decay (not on batch-norm parameters and biases)",
    "optim.warmup_epochs": "linear lr warm-up over this many epochs",
    "optim.milestones": "fractions of train.epochs, increasing, each in (0, 1): the lr is multiplied by optim.gamma there",
    "optim.gamma": "lr factor at each milestone",
    "wandb.mode": "offline (files in the run folder), online (needs a key), disabled",
    "wandb.project": "W&B project",
    "wandb.entity": "W&B entity (null: your default)",
    "wandb.group": "W&B group (null: the sweep folder, shared by a sweep's jobs)",
    "wandb.tags": "W&B tags",
    "dist.backend": "auto (nccl on cuda, gloo on cpu), gloo or nccl",
    "dist.timeout_s": "collective timeout in seconds: a dead rank cannot hang the job longer",
    "dist.ranks_per_node": "SLURM: ranks per node (null: all on one node)",
    "dist.master_port": "local ranks: rendezvous port (null: a free one)",
    "dist.overlap": "dense: start bucketed AllReduces during backward, as DDP does",
    "dist.overlap_bucket_mb": "dist.overlap: bucket size in MB (all buckets but the first)",
    "dist.overlap_first_bucket_mb": "dist.overlap: size in MB of the first bucket backward fills",
    "dist.ddp": "train through torch DDP, the exchange in a communication hook",
    "dist.bucket_cap_mb": "DDP's bucket size in MB",
}


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


# Keys whose value is free-form (the scheme's class and its options): any key below them is allowed.
FREE_FORM = ("scheme.compressor", "scheme.memory")


def _known(key: str, keys: dict[str, Any]) -> bool:
    head = key.split(".")
    if key in keys or key in GROUPS:
        return True
    if any(key.startswith(f"{k}.") for k in FREE_FORM):
        return True
    parent = ".".join(head[:-1])  # an item of a list: optim.milestones.0
    return head[-1].isdigit() and isinstance(keys.get(parent), list)


def did_you_mean(key: str, keys: list[str]) -> str | None:
    """The known key closest to ``key``: one with the same last part in another section
    (train.lr -> optim.lr), else the closest whole name, else the closest last part."""
    leaf = key.rpartition(".")[2]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        return close[0]
    by_leaf = {k.rpartition(".")[2]: k for k in keys}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None


def _typed_schema(scheme: type[SchemeConfig] = SchemeConfig):
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config(scheme=scheme(), scope=NamedConfig(),
                                       aggregation=NamedConfig(), model=ModelConfig(), data=DataConfig()))


def _search_path(dirs: tuple[Path, ...]):
    """Hydra's search path for conf/ and the extra folders, where Hydra puts ``--config-dir``."""
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    csp = create_config_search_path(str(CONF_DIR))
    for folder in dirs:
        csp.prepend(provider="command-line", path=f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    return csp


def _chosen_schemes(overrides: list, multirun: bool, dirs: tuple[Path, ...] = ()) -> list[str]:
    """The scheme(s) a command line runs: its ``scheme=`` (each value of a sweep); without one,
    what ``conf/config.yaml`` and the ``experiment=`` preset choose (a preset's own sweep with
    ``-m``), read from the defaults as Hydra composes them. [] when that cannot be read (Hydra
    then reports what is wrong)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.types import RunMode

    def values(override, options: list[str]) -> list[str]:
        if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
            return [str(v) for v in override.value().filter(options)]
        if override.is_sweep_override():
            return [str(v) for v in override.sweep_iterator()]
        return [str(override.value())]

    by_key = {o.key_or_group: o for o in overrides if o.package is None and not o.is_delete()}
    if "scheme" in by_key:
        return values(by_key["scheme"], group_options("scheme", dirs))
    presets = values(by_key["experiment"], group_options("experiment", dirs)) if "experiment" in by_key else [None]
    register()
    loader = ConfigLoaderImpl(config_search_path=_search_path(dirs))
    parser = OverridesParser.create()
    out: list[str] = []
    for preset in presets:
        try:
            cfg = loader.load_configuration(
                "config", [] if preset in (None, "None", "null") else [f"experiment={preset}"],
                run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN)
        except Exception:  # noqa: BLE001  (Hydra says what is wrong when it composes)
            return []
        swept = OmegaConf.select(cfg, "hydra.sweeper.params.scheme") if multirun else None
        if swept is not None:
            out += values(parser.parse_overrides([f"scheme={swept}"])[0], group_options("scheme", dirs))
        else:
            out.append(str(cfg.hydra.runtime.choices.scheme))
    return out


def launcher_options(dirs: tuple[Path, ...] = ()) -> list[str]:
    """The options of Hydra's ``hydra/launcher`` group: Hydra's own, the installed plugins', ours
    (and those in the extra config folders ``dirs``)."""
    from hydra._internal.config_repository import ConfigRepository
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the plugins register their launchers' configs
    repo = ConfigRepository(_search_path(dirs))
    return sorted(repo.get_group_options("hydra/launcher"))


def check_overrides(args: list[str]) -> None:
    """Check the command line's overrides before Hydra composes them, so that a mistake stops with
    one line: an unknown key (``sheme=topk``, ``+train.lr=0.1``: Hydra would add it, and nothing
    reads it) with the closest key, a value of the wrong type, an unknown option of a group
    (``scheme=nope``, ``hydra/launcher=nope``), a scheme's own key with another scheme
    (``scheme=topk scheme.block_size=64``: block_size belongs to scheme=blockk). Sweeps (``a,b``,
    ``range(...)``) are checked value by value; keys under ``hydra.`` and Hydra's other groups are
    left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    items = [a for a in args if "=" in a and not a.startswith("-")]
    if not items:
        return
    dirs = search_dirs(args)  # --config-dir, hydra.searchpath: their options count too
    multirun = "-m" in args or "--multirun" in args
    parser = OverridesParser.create()
    keys = schema_keys()
    owners = scheme_options()
    schemas: dict[type, Any] = {}
    parsed = []
    for item in items:
        try:
            (override,) = parser.parse_overrides([item])
        except HydraException as exc:
            raise ConfigError(f"{item} cannot be read: {str(exc).splitlines()[0]}") from None
        parsed.append((item, override))
    own = []  # (item, key) of the schemes' own keys: checked against the schemes the line runs
    options = []  # (item, key) of the compressor's options: checked against its class's arguments
    for item, override in parsed:
        key, text = override.key_or_group, item.partition("=")[2]
        if override.package is not None or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            if key == "hydra/launcher" and not override.is_sweep_override():
                allowed = launcher_options(dirs)
                if text not in allowed:
                    raise ConfigError(f"hydra/launcher={text!r} is not allowed; choose one of: {', '.join(allowed)}")
            continue
        if key.count(".") == 1 and key.startswith("scheme.") and not _known(key, keys):
            _compressor_hint(item, key, text, _chosen_compressors(parsed, multirun, dirs))
        if key.startswith("scheme.compressor.") and key.split(".")[2] not in ("_target_", "_partial_"):
            options.append((item, key))
        if not _known(key, keys):
            hint = did_you_mean(key, [*keys, *GROUPS])
            hint = f"did you mean {hint}={text}? " if hint else ""
            raise ConfigError(f"{item}: there is no key {key!r}; {hint}`python -m sparsetrain.run --help` lists every key")
        if override.is_add() and key in keys:
            raise ConfigError(f"{item}: {key} exists already; drop the '+' ({key}={text})")
        if key in owners:
            own.append((item, key))
        if override.is_delete() or override.value_type in (ValueType.INTERVAL_SWEEP, ValueType.GLOB_CHOICE_SWEEP):
            continue
        if override.is_sweep_override():
            values = list(override.sweep_iterator())
        else:
            values = [override.value()]
        if key in GROUPS:
            allowed = group_options(key, dirs)
            for choice in values:
                if str(choice) not in allowed and not (key in ("experiment", "point", "debug") and choice is None):
                    raise ConfigError(f"{key}={choice!r} is not allowed; choose one of: {', '.join(allowed)}")
            continue
        scheme_cls = SCHEME_SCHEMAS[owners[key][0]] if key in owners else SchemeConfig
        if scheme_cls not in schemas:
            schemas[scheme_cls] = _typed_schema(scheme_cls)
        for value in values:
            if isinstance(value, str) and "${" in value:  # an interpolation: resolved later
                continue
            default = OmegaConf.select(schemas[scheme_cls], key, default=None)
            try:
                OmegaConf.update(schemas[scheme_cls], key, value, merge=True)
            except OmegaConfBaseException as exc:
                reason = _wanted(key, str(exc).splitlines()[0], value, default)
                raise ConfigError(f"{key}={value!r} is not allowed: {reason}") from None
    if options:  # scheme.compressor.<option>: an argument of each chosen scheme's class
        for item, key in options:
            for scheme, target in _chosen_compressors(parsed, multirun, dirs):
                if target is None:
                    raise ConfigError(f"{item}: scheme={scheme} has no compressor (scheme.compressor is null)")
                check_compressor_option(key.split(".")[2], target, item)
    if own:  # a scheme's own key (scheme.block_size) goes with that scheme only
        chosen = _chosen_schemes([o for _, o in parsed], multirun, dirs)
        for item, key in own:
            for scheme in chosen:
                if scheme not in owners[key]:
                    leaf = key.rpartition(".")[2]
                    belongs = " or ".join(f"scheme={name}" for name in owners[key])
                    raise ConfigError(f"{item}: scheme={scheme} has no key {leaf!r}; {leaf} belongs to {belongs}")


def _chosen_compressors(parsed: list, multirun: bool, dirs: tuple[Path, ...]) -> list[tuple[str, str | None]]:
    """``(scheme, compressor._target_)`` for each scheme the command line runs: the target that
    ``scheme.compressor._target_=`` sets, else the one its yaml (conf/ or an extra folder) names."""
    target = next((str(o.value()) for _, o in parsed if o.key_or_group == "scheme.compressor._target_"
                   and not o.is_delete() and not o.is_sweep_override()), None)
    return [(scheme, target or scheme_target(scheme, dirs))
            for scheme in _chosen_schemes([o for _, o in parsed], multirun, dirs)]


def scheme_target(scheme: str, dirs: tuple[Path, ...] = ()) -> str | None:
    """The ``compressor._target_`` of conf/scheme/<scheme>.yaml (the first folder that has it, as
    Hydra searches them); None for a scheme without a compressor."""
    for conf in (CONF_DIR, *dirs):
        path = conf / "scheme" / f"{scheme}.yaml"
        if path.is_file():
            target = OmegaConf.select(OmegaConf.load(path), "compressor._target_", default=None)
            return None if target is None else str(target)
    return None


def compressor_class(target: str) -> type:
    """The class ``scheme.compressor._target_`` names; ``ConfigError`` (one line) when its module
    cannot be imported (the usual cause: a researcher's module not on PYTHONPATH)."""
    import importlib

    module, _, name = target.rpartition(".")
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (whatever the module raises on import)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot import {module or target} for scheme.compressor._target_={target}: "
                          f"{reason}; is its folder on PYTHONPATH?") from None
    if not isinstance(getattr(found, name, None), type):
        raise ConfigError(f"scheme.compressor._target_={target} is not allowed: {module} has no class {name!r}")
    return getattr(found, name)


# What comm.build passes to every compressor (ratio, layout, scope, device): not options.
_BUILT_WITH = ("self", "ratio", "layout", "scope", "device")


def compressor_arguments(cls: type) -> list[str] | None:
    """The options ``cls`` takes (``scheme.compressor.<option>``): the keyword arguments of its
    ``__init__`` and, through ``**kw``, of its bases' up to ``Compressor`` (which refuses any
    other). None when a ``**kw`` goes where it cannot be read (any option may then be right)."""
    import inspect

    from sparsetrain.compress.base import Compressor

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    out: list[str] = []
    for klass in cls.__mro__:
        if klass is object:
            return None
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())
        out += [p.name for p in params if p.kind in named and p.name not in (*_BUILT_WITH, *out)]
        if klass is Compressor or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return out
    return None


def check_compressor_option(option: str, target: str, item: str) -> None:
    """``item`` (``scheme.compressor.<option>=...``) names an argument the class takes, else
    ``ConfigError`` naming the key, the class and the arguments it does take."""
    accepted = compressor_arguments(compressor_class(target))
    if accepted is not None and option not in accepted:
        raise ConfigError(f"{item}: {target} takes no argument {option!r}; it takes "
                          f"{', '.join(accepted) or 'no options'} (scheme.compressor.<option>=...)")


def _compressor_hint(item: str, key: str, text: str, chosen: list[tuple[str, str | None]]) -> None:
    """An unknown ``scheme.<leaf>`` with a scheme whose class takes ``leaf``: its options go under
    ``scheme.compressor.``; with one whose class does not, what the class takes (another scheme's
    key, ``scheme.rank``, is no hint). Returns when no chosen scheme has a class to ask."""
    leaf = key.partition(".")[2]
    for scheme, target in chosen:
        if target is None:
            continue
        try:
            accepted = compressor_arguments(compressor_class(target))
        except ConfigError:
            continue  # validate() reports it when it builds the compressor
        if accepted is None:
            continue
        if leaf in accepted:
            raise ConfigError(f"{item}: there is no key {key!r}; compressor options go under "
                              f"scheme.compressor.<option>: scheme.compressor.{leaf}={text}")
        own = [f.name for f in dataclasses.fields(SCHEME_SCHEMAS.get(scheme, SchemeConfig))]
        close = difflib.get_close_matches(leaf, own, n=1, cutoff=0.75)
        hint = f"did you mean scheme.{close[0]}={text}? " if close else ""
        raise ConfigError(f"{item}: there is no key {key!r}; {hint}scheme={scheme}'s compressor {target} takes "
                          f"{', '.join(accepted) or 'no options'} (scheme.compressor.<option>=...)")


# The range validate() checks, said already where a value is not a number at all (ratio=1%).
_NUMBER_RANGES = {"ratio": "in (0, 1]", "world_size": ">= 1"}


def _wanted(key: str, reason: str, value: Any, default: Any) -> str:
    """What a number key takes, with an example, for a value that is not one (``ratio=1%``:
    ``give a number in (0, 1], e.g. ratio=0.01``) instead of OmegaConf's conversion text; any
    other type error keeps OmegaConf's first line."""
    kind = reason.rpartition(" converted to ")[2]
    if kind not in ("Float", "Integer"):
        return reason
    what = ("a number" if kind == "Float" else "an integer") + (f" {_NUMBER_RANGES[key]}" if key in _NUMBER_RANGES else "")
    text = str(value).strip()
    example = default if isinstance(default, (int, float)) and not isinstance(default, bool) else None
    if kind == "Float" and text.endswith("%"):  # a percentage: the fraction it means
        try:
            example = float(text[:-1]) / 100
        except ValueError:
            pass
    return f"give {what}" + (f", e.g. {key}={example:g}" if example is not None else "")


def help_text(dirs: tuple[Path, ...] = ()) -> str:
    """What ``python -m sparsetrain.run --help`` prints: usage, the groups (with the options in the
    extra config folders ``dirs``), every key."""
    import textwrap

    from omegaconf import OmegaConf

    defaults = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    lines = [
        "python -m sparsetrain.run [key=value ...]        one run, in outputs/DATE/TIME/",
        "python -m sparsetrain.run -m [key=a,b ...]       a sweep, one run per combination, in multirun/DATE/TIME/N/",
        "",
        "Groups (group=option; conf/<group>/<option>.yaml):",
    ]
    for group in GROUPS:
        default = defaults.get(group) or "null"
        options = textwrap.wrap(f"{' | '.join(group_options(group, dirs))} (default {default})", 86)
        lines += [f"  {group:<12} {GROUP_HELP[group]}", *(f"  {'':<12} {line}" for line in options)]
    lines += ["", "Keys (key=value):"]
    keys = schema_keys()
    for key in sorted(keys, key=lambda k: "." in k):  # the top-level keys first
        if key in FREE_FORM or key.endswith((".name", "._target_", "._partial_")):
            continue  # set by their group
        default = keys[key]
        shown = ("null" if default is None else str(default).lower() if isinstance(default, bool)
                 else "see left" if "${" in str(default) else default)
        lines.append(f"  {key:<24} {HELP[key]} (default {shown})")
    lines += [
        "",
        "Folders: hydra.run.dir=... (a run), hydra.sweep.dir=... (a sweep); rerunning into a folder",
        "resumes what was interrupted and skips what completed. More: docs/running.md, conf/config.yaml;",
        "Hydra's own options: --hydra-help; the composed config: --cfg job.",
    ]
    return "\n".join(lines)


def validate(cfg: Any, env: dict | None = None) -> None:
    """Semantic checks on a composed config: the one place that says which values and
    combinations run. Raises ConfigError with one line (key, value, what is allowed). Whether
    ``world_size`` agrees with the launcher's environment is the launcher's check
    (``launch.env.check_launch_environment``, called by the CLI before any rank starts)."""
    from sparsetrain.comm.rules import TORCH_HOOK_SCHEMES, check_combination
    from sparsetrain.compress import parse_uncompressed

    env = os.environ if env is None else env
    _resolve_tuned(cfg)
    if cfg.world_size < 1:
        raise ConfigError(f"world_size={cfg.world_size} is not allowed; it must be an integer >= 1")
    try:
        if cfg.scheme.name in TORCH_HOOK_SCHEMES:  # no scope or aggregation of ours; ratio: matching
            check_combination("none", cfg.scope.name, cfg.aggregation.name, cfg.ratio)
        else:
            check_combination(cfg.scheme.name, cfg.scope.name, cfg.aggregation.name, cfg.ratio,
                              scheme_compressor(cfg.scheme))
            scheme_memory(cfg.scheme)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
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
    if cfg.scheme.get("block_size") is not None:
        positive["scheme.block_size"] = cfg.scheme.block_size
    if cfg.train.max_steps is not None:
        positive["train.max_steps"] = cfg.train.max_steps
    if cfg.dist.ranks_per_node is not None:
        positive["dist.ranks_per_node"] = cfg.dist.ranks_per_node
    if cfg.scheme.get("rank") is not None:
        positive["scheme.rank"] = cfg.scheme.rank
    positive["dist.bucket_cap_mb"] = cfg.dist.bucket_cap_mb
    positive["dist.overlap_bucket_mb"] = cfg.dist.overlap_bucket_mb
    positive["dist.overlap_first_bucket_mb"] = cfg.dist.overlap_first_bucket_mb
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} is not allowed; it must be > 0")
    _check_milestones(list(cfg.optim.milestones))
    levels = cfg.scheme.get("levels")
    if levels is not None and not 1 <= levels <= 65535:  # QSGD's levels (an int: the schema says so)
        raise ConfigError(f"scheme.levels={levels} is not allowed; it must be an integer in [1, 65535]")
    bucket_size = cfg.scheme.get("bucket_size")
    if bucket_size is not None and not bucket_size >= 1:  # QSGD's buckets (an int or null: the schema)
        raise ConfigError(f"scheme.bucket_size={bucket_size} is not allowed; it must be an integer >= 1, "
                          "or null (one norm per tensor)")
    for key, value in {"scheme.warmup_steps": cfg.scheme.warmup_steps,
                       "train.bn_recalibrate": cfg.train.bn_recalibrate,
                       "data.val_size": cfg.data.get("val_size", 0)}.items():
        if value < 0:
            raise ConfigError(f"{key}={value} is not allowed; it must be >= 0")
    _check_ddp(cfg)
    if cfg.train.get("curve_points", 1) > 1 and not cfg.data.get("val_size"):
        raise ConfigError(f"train.curve_points={cfg.train.curve_points} is not allowed with data.val_size=0: "
                          "curve points score the validation split; hold some out, e.g. data.val_size=5000")
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
    """Resolve ``optim`` first, so that a scheme without tuned values (``${st_tuned:...}``) stops
    with its own line rather than OmegaConf's wrapped one."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg.optim, resolve=True)
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
        return instantiate(node)
    except Exception as exc:  # noqa: BLE001  (Hydra's InstantiationException and what it wraps)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"scheme.compressor of scheme={scheme.name} cannot be built: {reason}") from None


def scheme_memory(scheme: Any) -> Any:
    """What the scheme's ``memory`` node builds: a ``functools.partial`` of a ``Memory`` class
    with its options, called with the compressed entries by the exchange; None (error feedback)
    when the node is null. ``ConfigError`` (one line) when it cannot be built or is no memory."""
    from hydra.utils import instantiate

    from sparsetrain.compress import memory_class

    node = scheme.get("memory") if hasattr(scheme, "get") else None
    if not node:
        return None
    target = str(node.get("_target_")) if node.get("_target_") else None
    if target is None:
        raise ConfigError(f"scheme.memory of scheme={scheme.name} has no _target_; it names a class, e.g. "
                          "sparsetrain.compress.ErrorFeedback, with _partial_: true")
    module = target.rpartition(".")[0]
    try:
        factory = instantiate(node)
        memory_class(factory)
    except TypeError:
        raise ConfigError(f"scheme.memory._target_={target} is not allowed: it is not a subclass of "
                          "sparsetrain.compress.Memory built with _partial_: true") from None
    except Exception as exc:  # noqa: BLE001  (Hydra's InstantiationException and what it wraps)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"scheme.memory of scheme={scheme.name} cannot be built ({target}; is {module} on "
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
