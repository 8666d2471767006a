"""Read run folders (the trainer's results files) into pandas frames.

A run folder is any folder holding ``summary.json`` or ``.hydra/config.yaml``; a sweep folder holds
numbered job folders and ``multirun.yaml``. Both are found recursively under the given paths. A job
that Hydra's sweep promised but that left no folder at all is reported as an ``absent`` row, so a
crashed sweep cannot shrink a grid without a trace.

The code here reads summary.json's current layout (``sparsetrain.results.SCHEMA_VERSION``) only:
a summary of an older layout goes through ``legacy``'s steps, one of a newer layout is refused.

No torch here: results are plain files.

Over 400 lines on purpose: one run's row (summary, config, metrics, heartbeat) and the rows a
sweep promised but never wrote are built by the same field readers; split, their private helpers
would cross files.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import warnings
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import yaml

from sparsetrain import scheme_catalog as schemes  # plain yaml, no torch
from sparsetrain.errors import Preempted  # stdlib only, no torch
from sparsetrain.provenance import UNKNOWN, describe  # stdlib only, no torch
from sparsetrain.results import (  # stdlib only, no torch
    BLEW_UP_RECOVERED,  # noqa: F401  (re-exported for the tables)
    DID_NOT_TRAIN,
    HEARTBEAT_STALE_S,
    PHASES,
    QUANTIZER_SCHEMES,
    STABILITY_FROM_STEP,
    TORCH_HOOK_SCHEMES,
    blow_up,
    peak_loss_of,
    stability_of,
    unfinished_reason,
    untrained_reason,
)

from . import legacy  # runs written before summary.json's current layout, read as it

# Phases that a dense run does not have: absent there means zero, not unknown.
SPARSE_ONLY_PHASES = ("compress", "decompress")

# The axes that tell runs apart, in the order tables list them. ``seed`` is the replicate axis.
AXES = (
    "scheme",
    "scope",
    "aggregation",
    "ratio",
    "world_size",
    "error_feedback",
    "block_size",
    "levels",
    "bucket_size",
    "generator",
    "rank",
    "compressor_options",
    "memory",
    "sync",
    "delta",
    "uncompressed",
    "warmup_steps",
    "exchange",
    "bn_recalibrate",
    "model",
    "data",
    "train_size",
    "epochs_planned",
    "batch_size",
    "lr",
    "warmup_epochs",
)
REPLICATE = "seed"
# A run a stop signal (SIGTERM, SLURM's preemption) ended at a checkpoint: summary.json says
# failed with a ``Preempted`` error, but it has not ended: rerun into its folder and it resumes.
STOPPED = "stopped"
# Axes that do not apply to dense SGD: its rows carry this marker instead of a value.
DENSE_IRRELEVANT = ("scope", "aggregation", "error_feedback", "block_size", "uncompressed", "warmup_steps")
# ... of which torch's PowerSGD hook reads two (use_error_feedback, start_powerSGD_iter); its fp16
# and bf16 hooks read none: runs that differ there are other configurations, never copies
TORCH_HOOK_KEEPS = {"error_feedback": ("torch_powersgd",), "warmup_steps": ("torch_powersgd",)}
NOT_APPLICABLE = "-"
DENSE = "dense"
# scheme.block_size is block-k's own key (issue 23): a run of another scheme, without the key,
# shows 256, the value every scheme's config carried before, so that its cells and groups are
# those of the same scheme's other runs.
BLOCK_SIZE_OF_OTHER_SCHEMES = 256
# scheme.bucket_size (QSGD's entries per norm) null: one norm per tensor
PER_TENSOR = "tensor"
# scheme.rank (PowerSGD's, sparsetrain's and torch's hook) null: the rank whose bytes come closest
# to the sparse schemes' at `ratio`
MATCHED_TO_RATIO = "matched"

STATUSES_DONE = ("completed",)


def is_dense(scheme) -> bool:
    """Dense SGD: the analysis's own row name for it, or a scheme conf/schemes.yaml calls dense."""
    return scheme == DENSE or bool(schemes.info(scheme).get("dense"))


def _read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        warnings.warn(f"cannot read {path}: {err}", stacklevel=3)
        return None


def _read_yaml(path: Path):
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        warnings.warn(f"cannot read {path}: {err}", stacklevel=3)
        return None


def _get(d: dict | None, *keys, default=None):
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def _name(value):
    """A config group may appear as ``{name: topk, ...}`` or as the bare string ``topk``."""
    if isinstance(value, dict):
        return value.get("name")
    return value


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / ".hydra" / "config.yaml").is_file()


def is_sweep_dir(path: Path) -> bool:
    return (path / "multirun.yaml").is_file()


def find_run_dirs(*paths: str | Path) -> list[Path]:
    """Every run folder under ``paths`` (a path may itself be a run folder), sorted, unique."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"no such results folder: {path}")
        candidates = [path, *(hit.parent for hit in path.rglob("summary.json"))]
        candidates += [hit.parent.parent for hit in path.rglob(".hydra/config.yaml")]
        for run in candidates:
            # W&B's own folders hold files of their own; they are never runs.
            if "wandb" in run.relative_to(path).parts or not is_run_dir(run):
                continue
            found.add(run.resolve())
    return sorted(found, key=_natural_key)


def _natural_key(path: Path):
    return [int(part) if part.isdigit() else part for part in path.parts]


def find_sweep_dirs(*paths: str | Path) -> list[Path]:
    found: set[Path] = set()
    for path in map(Path, paths):
        if is_sweep_dir(path):
            found.add(path.resolve())
        found.update(hit.parent.resolve() for hit in path.rglob("multirun.yaml"))
    return sorted(found, key=_natural_key)


def _block_size(cfg: dict, scheme: str | None):
    node = cfg.get("scheme")
    if isinstance(node, dict) and "block_size" not in node and "block_size" not in schemes.own_keys(scheme):
        return BLOCK_SIZE_OF_OTHER_SCHEMES
    return _get(cfg, "scheme", "block_size")


def _bucket_size(cfg: dict, scheme: str | None):
    if "bucket_size" not in schemes.own_keys(scheme):
        return NOT_APPLICABLE
    value = _get(cfg, "scheme", "bucket_size")
    return PER_TENSOR if value is None else value


def _generator(cfg: dict, scheme: str | None):
    """QSGD's ``scheme.generator``, or the one ``+scheme.compressor.generator`` named."""
    if "generator" not in schemes.own_keys(scheme):
        return NOT_APPLICABLE
    return _get(cfg, "scheme", "generator") or _get(cfg, "scheme", "compressor", "generator")


# compressor_options of a run that set none: its class's defaults. The column is there only when
# some run set one (load_runs), so results without such options keep their columns.
CLASS_DEFAULTS = "defaults"


def _compressor_options(cfg: dict) -> str | None:
    """The options a run's ``scheme.compressor`` node gives its class (``scheme.compressor.rescale``)
    as one stable text, ``rescale=False``; those a scheme key sets (``block_size: ${..block_size}``)
    are that key's axis already. None when it gives none."""
    node = _get(cfg, "scheme", "compressor")
    if not isinstance(node, dict):
        return None
    scheme = cfg.get("scheme") or {}
    shown = [f"{k}={v}" for k, v in sorted(node.items()) if k not in ("_target_", "_partial_")
             and not (k in scheme and scheme[k] == v)]
    return ", ".join(shown) or None


# how often a run whose scheme named no sync node synchronised: every step (its exchange's)
DEFAULT_SYNC = "every step"


def _delta(cfg: dict) -> str | None:
    """What sends a synchronising scheme's pseudo-gradient: its compressor's class (``TopK``, given
    as ``+scheme.compressor._target_``) or ``dense``; None for a scheme that exchanges every step
    (its compressor is its scheme)."""
    if not isinstance(_get(cfg, "scheme", "sync"), dict):
        return None
    node = _get(cfg, "scheme", "compressor")
    return str(node.get("_target_", "?")).rpartition(".")[2] if isinstance(node, dict) else "dense"

# memory of a run whose scheme named none: error feedback (or none, scheme.error_feedback=false,
# its own axis). The column is there only when some run named one (load_runs).
DEFAULT_MEMORY = "error feedback"


def _class_node(cfg: dict, key: str) -> str | None:
    """The class a run's ``scheme.<key>`` node names (``memory``, ``sync``), with its options, as
    one stable text (``MomentumCorrection(momentum=0.9)``); None when it names none (error
    feedback; every step's exchange)."""
    node = _get(cfg, "scheme", key)
    if not isinstance(node, dict):
        return None
    name = str(node.get("_target_", "?")).rpartition(".")[2]
    options = ", ".join(f"{k}={v}" for k, v in sorted(node.items()) if k not in ("_target_", "_partial_"))
    return f"{name}({options})"


def _powersgd_rank(cfg: dict, scheme: str | None):
    if "rank" not in schemes.own_keys(scheme):
        return NOT_APPLICABLE
    value = _get(cfg, "scheme", "rank")
    return MATCHED_TO_RATIO if value is None else value


def _axes_from_config(cfg: dict, applies: dict | None = None) -> dict:
    """The run's axes from its config. ``applies``: which of them change what is sent, as the
    run's summary recorded it from the compressor (``{"ratio": ..., "aggregation": ...}``); None
    where the summary does not say (a run refused or stopped before its exchange was built, as
    every run before summaries said), which reads conf/schemes.yaml's ``allreduce`` instead."""
    scheme = _name(cfg.get("scheme"))
    row = {
        "scheme": scheme,
        "scope": _name(cfg.get("scope")),
        "aggregation": _name(cfg.get("aggregation")),
        "ratio": cfg.get("ratio"),
        "world_size": cfg.get("world_size"),
        "seed": cfg.get("seed"),
        "error_feedback": _get(cfg, "scheme", "error_feedback"),
        "block_size": _block_size(cfg, scheme),
        "levels": _get(cfg, "scheme", "levels", default=NOT_APPLICABLE),  # scheme=qsgd's own key
        "bucket_size": _bucket_size(cfg, scheme),  # scheme=qsgd's own key
        "generator": _generator(cfg, scheme),  # scheme=qsgd's own key
        "rank": _powersgd_rank(cfg, scheme),  # PowerSGD's own key
        "compressor_options": _compressor_options(cfg),
        "memory": _class_node(cfg, "memory"),
        "sync": _class_node(cfg, "sync"),
        "delta": _delta(cfg),
        "uncompressed": str(_get(cfg, "scheme", "uncompressed")),
        "warmup_steps": _get(cfg, "scheme", "warmup_steps"),
        "model": _name(cfg.get("model")),
        "data": _name(cfg.get("data")),
        "epochs_planned": _get(cfg, "train", "epochs"),
        "batch_size": _get(cfg, "train", "batch_size"),
        "lr": _get(cfg, "optim", "lr"),
        "warmup_epochs": _get(cfg, "optim", "warmup_epochs"),  # the lr warm-up, in epochs
        "train_size": _get(cfg, "data", "train_size") or "all",  # null: the whole training set
        # evaluation with recomputed batch-norm statistics: another measurement, not averaged in
        "bn_recalibrate": _get(cfg, "train", "bn_recalibrate"),
    }
    # Where the exchange ran: the trainer's own reducer after backward, or a DDP hook (dist.ddp).
    row["exchange"] = "ddp hook" if _get(cfg, "dist", "ddp") else "trainer"
    if row["rank"] not in (NOT_APPLICABLE, MATCHED_TO_RATIO):
        row["ratio"] = NOT_APPLICABLE  # a rank of its own: `ratio` picks nothing
    if scheme in TORCH_HOOK_SCHEMES:  # torch's hooks: no scope, aggregation, ... of sparsetrain's
        for axis in DENSE_IRRELEVANT:
            if scheme not in TORCH_HOOK_KEEPS.get(axis, ()):
                row[axis] = NOT_APPLICABLE
        if scheme == "torch_powersgd":
            # torch runs plain AllReduce for max(2, warmup_steps) steps (train.ddp_exchange): 0 is
            # 2, and so is a run from before the key (its default, 0)
            row["warmup_steps"] = max(2, int(row["warmup_steps"] or 0))
        if schemes.info(scheme).get("every_entry"):
            row["ratio"] = 1.0  # every entry, in half the bytes
        return row  # torch_powersgd keeps its ratio unless its rank is set: the rank matched to it
    if applies is None:  # no compressor said: what conf/schemes.yaml says
        applies = {"aggregation": not schemes.info(scheme).get("allreduce"), "ratio": scheme not in QUANTIZER_SCHEMES}
    if not applies.get("aggregation", True):  # PowerSGD: two AllReduces whatever the key says
        row["aggregation"] = NOT_APPLICABLE
    if not applies.get("scope", True):  # local SGD / DiLoCo averaging densely
        row["scope"] = NOT_APPLICABLE
    if not applies.get("ratio", True):
        row["ratio"] = 1.0  # every entry, in a few bits
    if is_dense(scheme):
        # Dense SGD sends everything: its scope, aggregation and ratio knobs do nothing.
        row["scheme"] = DENSE
        row["ratio"] = 1.0
        for axis in DENSE_IRRELEVANT:
            row[axis] = NOT_APPLICABLE
    return row


# a row's recorded config keys on their way into columns, and a row known by its overrides alone
CONFIG_FIELDS, PARTIAL_CONFIG = "_config_fields", "_partial_config"
# the column of config_digest: which runs of one seed ran one configuration twice (group.py)
CONFIG_DIGEST = "config_digest"

# --- every other recorded config key ----------------------------------------------------------
# Runs are told apart by every key of their recorded config, not only by AXES: a key not read
# into an axis becomes a column named by its dotted path (``optim.momentum``), and the tables
# group by it where it differs between runs they would otherwise put together (group.py).
#
# Keys an axis above already reads (runs from before the key: legacy.KEYS_ADDED): they are that
# axis, not a column of their own. A prefix
# covers the keys under it; ``scheme.compressor._target_`` is not covered (a class swapped in
# under a scheme's name is another compressor).
COVERED_KEYS = (
    "scheme.name", "scope", "aggregation", "ratio", "world_size", "seed", "scheme.error_feedback",
    "scheme.block_size", "scheme.levels", "scheme.bucket_size", "scheme.generator", "scheme.rank",
    "scheme.compressor", "scheme.memory", "scheme.sync", "scheme.uncompressed", "scheme.warmup_steps",
    "model.name", "data.name", "data.train_size", "train.epochs", "train.batch_size", "optim.lr",
    "optim.warmup_epochs", "train.bn_recalibrate", "dist.ddp",
)
NOT_COVERED = ("scheme.compressor._target_",)
# Bookkeeping: where a run wrote, logged, reported or found its files, and how it was kept alive;
# never what it trained or measured. Two runs that differ only here are one configuration.
BOOKKEEPING_KEYS = (
    "wandb",                      # W&B mode, project, entity, group (a sweep's folder name), tags
    "data.root", "data.download",  # where the data set lives on this machine, fetched or not
    "train.progress",             # a tqdm bar on a terminal
    "train.log_every",            # which steps metrics.jsonl logs (the loss peak is recorded every step)
    "train.timing_warmup",        # how many first steps the phase means leave out
    "train.device", "train.threads", "dist.backend",  # where it ran (``host`` says which machine)
    "dist.timeout_s", "dist.master_port",  # how long a dead rank may hang; which port rank 0 listens on
    "train.checkpoint", "train.save_model", "train.allow_code_change",  # files kept; resume allowed
)
# Hydra's own plumbing in a node (``_partial_: true``), never a setting
PLUMBING_LEAVES = ("_partial_",)


def _flat_config(node, prefix: str = "") -> dict:
    """A config as ``{dotted.key: leaf}``; lists as their text, so that rows can be grouped."""
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out.update(_flat_config(value, f"{prefix}{key}."))
        return out
    if isinstance(node, (list, tuple, dict)):
        node = json.dumps(node, sort_keys=True, default=str)
    return {prefix[:-1]: node}


def _is_config_column(key: str) -> bool:
    # A top-level key is an axis (world_size, ratio, seed) or, in a promised job's overrides, a
    # group chosen by name (scheme=topk, experiment=...): never a column of its own, whose name
    # could be an axis's.
    if "." not in key:
        return False
    if key in NOT_COVERED:
        return True
    if key.rpartition(".")[2] in PLUMBING_LEAVES:
        return False
    return not any(key == k or key.startswith(k + ".") for k in (*COVERED_KEYS, *BOOKKEEPING_KEYS))


def config_fields(config: dict | None) -> dict:
    """The run's recorded config keys that no axis reads and that are not bookkeeping
    (``{"optim.momentum": 0.9, ...}``)."""
    return {k: v for k, v in _flat_config(config or {}).items() if _is_config_column(k)}


def config_digest(config: dict | None) -> str | None:
    """One short hash of the whole recorded config but its seed and bookkeeping: two runs of one
    seed with the same digest ran one configuration twice; with different digests that read as
    the same axes, they differ only in keys their scheme ignores (dense SGD's scope)."""
    if not config:
        return None
    kept = {k: v for k, v in _flat_config(config).items()
            if k != "seed" and k.rpartition(".")[2] not in PLUMBING_LEAVES
            and not any(k == b or k.startswith(b + ".") for b in BOOKKEEPING_KEYS)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _same_value(value):
    """A value as one comparable text: 0 and 0.0 alike, True and 1 not."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("number", float(value))
    return ("value", json.dumps(value, sort_keys=True, default=str))


def _config_columns(frame: pd.DataFrame, fields: list[dict], partial: list[bool],
                    versions: list[int]) -> pd.DataFrame:
    """``frame`` with a column per config key that takes more than one value among its rows (a
    key the same in every run can tell none apart). A run without the key: ``legacy.config_default``
    (of the row's ``versions``). A row with a ``partial`` config (a job a sweep promised, known by
    its overrides alone) is None where its overrides say nothing, and that None makes no key vary."""
    keys = sorted(set().union(*fields)) if fields else []
    columns = {}
    for key in keys:
        values = [f.get(key) if part or key in f else legacy.config_default(key, version, _flat_config)
                  for f, part, version in zip(fields, partial, versions, strict=True)]
        seen = {_same_value(v) for v, f, part in zip(values, fields, partial, strict=True) if not part or key in f}
        if len(seen) > 1:
            columns[key] = values
    return frame.assign(**columns) if columns else frame


def _hydra_choices(run: Path) -> dict:
    hydra_cfg = _read_yaml(run / ".hydra" / "hydra.yaml") if (run / ".hydra" / "hydra.yaml").is_file() else None
    return _get(hydra_cfg, "hydra", "runtime", "choices", default={}) or {}


def _overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    return [str(o) for o in (_read_yaml(path) or [])]


def _num(value):
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _target_fields(target: dict | None) -> dict:
    """``train.stop_at_accuracy``'s record (summary's ``target``) as columns; NaN without one."""
    target = target or {}
    reached = target.get("reached")
    return {"target_accuracy": _num(target.get("accuracy")),
            "target_reached": math.nan if reached is None else float(bool(reached)),
            "target_step": _num(target.get("step")), "target_train_s": _num(target.get("train_s")),
            "target_curve_s": _num(target.get("curve_s")), "target_wall_s": _num(target.get("wall_s"))}


def row_from_summary(summary: dict | None, config: dict | None, where: str | Path | None = None) -> dict:
    """One loader row from a ``summary.json`` dict and a config dict (either may be missing). A
    summary of an older layout is read through ``legacy``'s steps; one of a newer layout is
    refused, naming ``where`` (the run folder)."""
    version = legacy.version_of(summary, where)
    status = summary.get("status") if summary else "no summary"
    summary = summary or {}
    recorded = summary.get("config") or config or {}
    config = legacy.upgrade_config(recorded, version)
    summary = legacy.upgrade_summary(summary, version)
    sync = summary.get("sync") or {}  # local SGD / DiLoCo: a synchronisation's sizes
    row = _axes_from_config(config, summary.get("applies"))
    row[CONFIG_FIELDS] = config_fields(recorded)  # into columns by load_runs (_config_columns)
    row[CONFIG_DIGEST] = config_digest(recorded)
    row.update(
        status=status or "unknown",
        error=summary.get("error"),
        test_accuracy=_num(summary.get("test_accuracy")),
        test_loss=_num(summary.get("test_loss")),
        val_accuracy=_num(summary.get("val_accuracy")),  # NaN: the run held no validation split
        train_loss=_num(summary.get("train_loss")),
        train_loss_final=_num(summary.get("train_loss_final")),
        steps=_num(summary.get("steps")),
        epochs=_num(summary.get("epochs")),
        bytes_sent_per_step=_num(summary.get("bytes_sent_per_step")),
        dense_bytes_per_step=_num(summary.get("dense_bytes_per_step")),
        num_parameters=_num(summary.get("num_parameters")),
        device=summary.get("device"),
        started_at=summary.get("started_at"),
        finished_at=summary.get("finished_at"),
        duration_s=_num(summary.get("duration_s")),
        memory_norm_max=_num(summary.get("memory_norm_max")),
        test_accuracy_running_bn=_num(summary.get("test_accuracy_running_bn")),
        bytes_sent_total=_num(summary.get("bytes_sent_total")),
        collective=summary.get("collective"),  # None: the summary does not say
        # NaN: synchronises every step; a schedule of its own: the measured mean
        sync_period=_num(sync.get("mean_period", sync.get("period"))),
        # an exchange inside backward: ((share, lead ms), ...) per bucket; None: after backward,
        # or not recorded
        overlap_buckets=tuple((float(b["share"]), float(b["lead_ms"])) for b in summary["overlap_buckets"])
        if summary.get("overlap_buckets") else None,
        # dense SGD's buckets started during backward
        dist_overlap=bool(_get(config, "dist", "overlap")),
        kernels=summary.get("kernels"),  # the quantizers' CPU kernels
        # each rank's compute per step (COMPUTE_PHASES' sum), where the summary gathered every
        # rank's phases (time_ms_ranks); None for one rank or where it did not
        compute_ms_ranks=_compute_of_ranks(summary.get("time_ms_ranks")),
        # the node's 1-minute load average over the run, its CPUs and the run's ranks there
        # (summary's load, from rank 0's heartbeat; NaN where it has none)
        load_mean=_num((summary.get("load") or {}).get("mean_1min")),
        load_cpus=_num((summary.get("load") or {}).get("cpus")),
        load_local_ranks=_num((summary.get("load") or {}).get("local_ranks")),
        # launch.netcluster's emulated link, and train.stop_at_accuracy's measured time to it
        link_rate_bits=_num((summary.get("link") or {}).get("rate_bits")),
        **_target_fields(summary.get("target")),
    )
    row["bytes_mean_per_step"] = row["bytes_sent_total"] / row["steps"] if row["steps"] else math.nan
    peak = (summary.get("train_loss_peak") or {}).get(f"after_step_{STABILITY_FROM_STEP}") or {}
    row.update(loss_peak=_num(peak_loss_of(summary)), loss_peak_step=_num(peak.get("step")),
               loss_peak_source="summary" if "train_loss_peak" in summary else None)
    row.update(_code_fields(summary))
    row["host"] = _host_of(summary)
    row.update(_timing_setup_of(summary, config))
    row[legacy.VERSION_COLUMN] = version  # summary.json's layout (legacy.version_of)
    # the source of the scheme's out-of-tree classes (summary's compressor_code.digest): two
    # versions of one's own class are two configurations, and so is a run resumed on another
    # version (compressor_code_versions, joined with ';'); None for sparsetrain's own classes
    versions = summary.get("compressor_code_versions") or []
    row["compressor_code"] = (";".join(versions) if len(versions) > 1
                              else (summary.get("compressor_code") or {}).get("digest"))
    reason = untrained_reason(summary)
    if reason:  # finished, but no better than a uniform guess: not a result to rank
        row.update(status=DID_NOT_TRAIN, error=reason)
    if summary.get("world_size") is not None:
        row["world_size"] = summary["world_size"]
    sent, dense = row["bytes_sent_per_step"], row["dense_bytes_per_step"]
    row.update(_wire_fields(summary, row))
    row["bytes_fraction"] = sent / dense if dense and not math.isnan(dense) else math.nan
    row["compression"] = dense / sent if sent and not math.isnan(sent) else math.nan
    times = summary.get("time_ms") or {}
    for phase in PHASES:
        value = _num(times.get(phase))
        if math.isnan(value) and row["scheme"] == DENSE and phase in SPARSE_ONLY_PHASES and times:
            value = 0.0
        row[f"time_{phase}_ms"] = value
    return legacy.upgrade_row(row, summary, config, collective_of(row), version)


#: the measured phases that stay when only the network changes (time to accuracy's compute): not
#: the exchange, nor compress / decompress, which are the scheme's own
COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")


def _compute_of_ranks(ranks: dict | None) -> tuple[float, ...] | None:
    """Each rank's ``COMPUTE_PHASES`` sum (ms per step) from summary's ``time_ms_ranks``."""
    if not ranks:
        return None
    columns = [ranks.get(phase) or [] for phase in COMPUTE_PHASES]
    if len({len(c) for c in columns}) != 1 or not columns[0]:
        return None
    return tuple(float(sum(values)) for values in zip(*columns))


def _code_fields(summary: dict) -> dict:
    """``code``: the version a run ran (``sparsetrain.provenance.describe``; ``unrecorded`` for
    a summary without it); ``code_commits``: every version a resumed run
    ran on, joined with ``;`` (more than one: it was resumed on other code)."""
    if "code" not in summary:
        return {"code": "unrecorded", "code_commits": "unrecorded"}
    versions = summary.get("code_commits") or [describe(summary["code"], full=True)]
    short = [v if v == UNKNOWN else v[:12] + (v[40:] if len(v) > 40 else "") for v in versions]
    return {"code": describe(summary["code"]), "code_commits": ";".join(short)}


def _host_of(summary: dict) -> str:
    """The machine a run ran on (rank 0's: processor x logical CPUs, + the GPU where one ran),
    ``;``-joined when a resumed run moved; ``unrecorded`` for a summary without it."""
    hosts = summary.get("hosts")
    if not hosts:
        return "unrecorded"
    labels = (f"{h.get('cpu')} x{h.get('cpus')}" + (f" + {h['gpu']}" if h.get("gpu") else "") for h in hosts)
    return ";".join(dict.fromkeys(labels))


def _timing_setup_of(summary: dict, config: dict | None) -> dict:
    """Besides the machine, what sets a step's time: torch's threads a rank (``threads``) and the
    collectives' backend (``backend``), as rank 0 recorded them in ``hosts`` (``;``-joined when a
    resumed run changed them); for a run from before they were recorded, ``train.threads`` and
    ``dist.backend`` where the config set them, else None: unknown, as an unrecorded host."""
    recorded = [h for h in summary.get("hosts") or [] if "threads" in h]
    if recorded:
        backends = [h.get("backend") for h in recorded]  # None: one rank, no collectives
        return {"threads": ";".join(dict.fromkeys(str(h["threads"]) for h in recorded)),
                "backend": ";".join(dict.fromkeys(str(b) for b in backends)) if any(backends) else None}
    threads, backend = _get(config, "train", "threads"), _get(config, "dist", "backend")
    return {"threads": None if threads is None else str(threads),
            "backend": None if backend in (None, "auto") else str(backend)}


def _peak(row: dict) -> tuple[float | None, int | None]:
    peak = None if math.isnan(row["loss_peak"]) else row["loss_peak"]
    step = None if math.isnan(row.get("loss_peak_step", math.nan)) else int(row["loss_peak_step"])
    return peak, step


def _spike_fields(row: dict, logged: list[tuple[int, float]]) -> dict:
    """``loss_spike`` / ``loss_spike_step``: the first blow-up among the recorded losses
    (``sparsetrain.results.blow_up``: the peak and the logged steps), NaN where none."""
    found = blow_up(*_peak(row), logged)
    return {"loss_spike": found[1] if found else math.nan,
            "loss_spike_step": math.nan if not found or found[0] is None else found[0]}


def _stability(row: dict, logged: list[tuple[int, float]] = ()) -> str | None:
    """A finished run's stability (``sparsetrain.results.stability_of``, over its peak and its
    logged steps' losses), else None."""
    if row["status"] not in ("completed", DID_NOT_TRAIN):
        return None
    if row["status"] == DID_NOT_TRAIN:
        return DID_NOT_TRAIN
    peak, step = _peak(row)
    loss = row["train_loss"] if math.isnan(row.get("train_loss_final", math.nan)) else row["train_loss_final"]
    accuracy = row["test_accuracy"] if math.isnan(row.get("val_accuracy", math.nan)) else row["val_accuracy"]
    return stability_of(loss, accuracy, peak, peak_step=step, logged=logged)


def collective_of(row: dict) -> str | None:
    """The collective that carries a run's exchange after warm-up: dense SGD AllReduces, a sparse
    scheme uses its aggregation (None when unknown). PowerSGD, sparsetrain's and torch's hook,
    AllReduces its P, then its Q (one AllReduce of their bytes here, one latency too few); torch's
    fp16 and bf16 hooks AllReduce the 16-bit gradient. A run's summary records it (``collective``,
    the exchange's own word); without it (a summary that does not say, or a configuration not
    run: cluster_check) it is read from the scheme and its aggregation."""
    if row.get("collective") in ("allreduce", "allgather"):
        return row["collective"]
    if is_dense(row.get("scheme")) or schemes.info(row.get("scheme")).get("allreduce"):
        return "allreduce"
    aggregation = row.get("aggregation")
    return aggregation if aggregation in ("allreduce", "allgather") else None


def _wire_fields(summary: dict, row: dict) -> dict:
    """``wire_bytes_per_step`` / ``wire_bytes_total`` (per rank, ring model: what crosses the
    link) as the summary logged them, and their mean per step; ``wire_bytes_source``: ``summary``,
    or ``unknown`` where it has none (the fields are then NaN). Runs written before the trainer
    logged them: ``legacy.upgrade_row`` computes them."""
    per_step = _num(summary.get("wire_bytes_per_step"))
    total = _num(summary.get("wire_bytes_total"))
    steps = row["steps"]
    mean = total / steps if steps and not math.isnan(total) else math.nan
    return {"wire_bytes_per_step": per_step, "wire_bytes_total": total, "wire_bytes_mean_per_step": mean,
            "wire_bytes_source": "unknown" if math.isnan(per_step) else "summary"}


def _run_row(run: Path, stale_after_s: float = HEARTBEAT_STALE_S) -> dict:
    summary = _read_json(run / "summary.json") if (run / "summary.json").is_file() else None
    config = None
    if not (summary and summary.get("config")) and (run / ".hydra" / "config.yaml").is_file():
        config = _read_yaml(run / ".hydra" / "config.yaml")
    row = row_from_summary(summary, config, where=run)
    metrics = _from_metrics(run / "metrics.jsonl")
    logged = metrics.pop("logged_losses")
    row.update(metrics)
    row.update(legacy.upgrade_logged(row, logged, row[legacy.VERSION_COLUMN]))
    row.update(_spike_fields(row, logged))
    row["stability"] = _stability(row, logged)
    silent = unfinished_reason(run, summary, stale_after_s)
    if silent:  # says running, but rank 0 stopped beating long ago: it died without a word
        row.update(status="unfinished", error=silent)
    elif row["status"] == "failed" and str(row.get("error") or "").startswith(f"{Preempted.__name__}:"):
        row["status"] = STOPPED  # a signal stopped it at a checkpoint: it has not ended, it resumes
    choices = _hydra_choices(run)
    sweep = run.parent if is_sweep_dir(run.parent) else None
    row.update(
        experiment=choices.get("experiment") or (sweep.name if sweep else None),
        sweep_dir=str(sweep) if sweep else None,
        run_dir=str(run),
        overrides=" ".join(_overrides(run)),
    )
    return row


def distinct_evaluations(records, split: str) -> list[dict]:
    """The epoch records of ``records`` (``metrics.jsonl``'s, in order) that hold a new
    ``<split>_accuracy`` (``split``: ``val`` or ``test``). An epoch without an evaluation
    (``train.eval_every`` > 1) repeats the last one's accuracy and loss: left out, so that a
    reader never takes it for another measurement."""
    return [r for r, new in _evaluated(records, split) if new]


def _evaluated(records, split: str):
    """Each epoch record of ``records`` that holds ``<split>_accuracy``, with whether it is a new
    evaluation (False: it repeats the last one's accuracy and loss, ``train.eval_every`` > 1)."""
    last = None
    for record in records:
        if record.get("kind") != "epoch" or record.get(f"{split}_accuracy") is None:
            continue
        key = (record[f"{split}_accuracy"], record.get(f"{split}_loss"))
        yield record, key != last
        last = key


def _from_metrics(path: Path) -> dict:
    """What ``metrics.jsonl`` adds to a run's row, in one read.

    ``test_accuracy_gain_last_epoch``: test accuracy at the last evaluation minus the one before,
    per epoch between them (``train.eval_every``; NaN with fewer than two). How fast a run was
    still climbing when it stopped; under a step schedule it includes what the last lr decays
    bought, so read it against dense SGD's.
    ``logged_losses``: every logged step's ``(step, train loss)``, for the blow-up rule.
    """
    records, logged = [], []
    if path.is_file():
        for r in _read_metrics(path, warn=False):
            records.append(r)
            if r.get("kind") == "step":
                loss, step = _num(r.get("train_loss")), _num(r.get("step"))
                if not (math.isnan(loss) or math.isnan(step)):
                    logged.append((int(step), loss))
    evaluations = distinct_evaluations(records, "test")
    gain = math.nan
    if len(evaluations) >= 2:
        (before, last) = evaluations[-2:]
        epochs = _num(last.get("epoch")) - _num(before.get("epoch"))
        epochs = epochs if epochs > 0 else 1.0  # records from before epochs were written: per evaluation
        gain = (_num(last["test_accuracy"]) - _num(before["test_accuracy"])) / epochs
    return {"test_accuracy_gain_last_epoch": gain, "logged_losses": logged}


# --- the grid a sweep promised --------------------------------------------------------------


def _split_sweep_value(value: str) -> list[str] | None:
    """``"a,b,c"`` and ``"choice(a,b,c)"`` -> ``["a", "b", "c"]``; None for sweep syntax this
    reader does not expand (``range(...)``, ``interval(...)``, tags)."""
    value = str(value).strip()
    if value.startswith("choice(") and value.endswith(")"):
        value = value[len("choice("):-1]
    if "(" in value or value.startswith("[") or value.startswith("{"):
        return None
    parts, depth, current = [], 0, ""
    for char in value:
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return parts


def _strip_override_key(key: str) -> str:
    return key.lstrip("+~")


@functools.lru_cache(maxsize=4096)
def override_value(key: str, text) -> object:
    """The value Hydra gives ``key=text`` on its command line: ``true``, ``True``: True; ``1e-3``:
    0.001; ``null``: None; ``'0.1'``: the string; ``[1,2]``: a list. YAML's reading where Hydra's
    parser refuses the text (a sweep's job never holds such a value, but a preset might)."""
    from hydra.core.override_parser.types import QuotedString
    from hydra.errors import HydraException

    def plain(value):
        if isinstance(value, QuotedString):
            return value.text
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    text = str(text)
    try:
        return plain(_override_parser().parse_override(f"{_strip_override_key(key)}={text}").value())
    except HydraException:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text


@functools.cache
def _override_parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def expected_grid(sweep: Path) -> tuple[list[str], list[tuple[str, ...]]] | None:
    """The swept keys and every value combination a Hydra multirun in ``sweep`` should run.

    Command-line overrides take precedence over ``hydra.sweeper.params``. Returns None when the
    sweep uses syntax this reader does not expand (``range(...)``, ``choice(...)``, ...).
    """
    multirun = _read_yaml(sweep / "multirun.yaml")
    params = {**(_get(multirun, "hydra", "sweeper", "params", default={}) or {}),
              **_task_overrides(multirun)}
    keys, values = [], []
    for key, value in params.items():
        parts = _split_sweep_value(value)
        if parts is None:
            return None
        if len(parts) > 1:
            keys.append(key)
            values.append(parts)
    return keys, list(itertools.product(*values))


def _task_overrides(multirun: dict) -> dict[str, str]:
    """The sweep's command-line overrides (``hydra.overrides.task``), key -> value as given."""
    out = {}
    for override in _get(multirun, "hydra", "overrides", "task", default=[]) or []:
        key, sep, value = str(override).partition("=")
        if sep:
            out[_strip_override_key(key)] = value
    return out


def _absent_rows(sweep: Path, runs: list[Path]) -> list[dict]:
    grid = expected_grid(sweep)
    if grid is None:
        return []
    keys, combos = grid
    if not keys:
        return []
    seen = set()
    for run in runs:
        if run.parent != sweep:
            continue
        given = {}
        for override in _overrides(run):
            key, _, value = override.partition("=")
            given[_strip_override_key(key)] = value
        # by value, as Hydra reads both: the sweep's `true,false` and the job's recorded `True`
        seen.add(tuple(_same_value(override_value(key, given[key])) if key in given else None for key in keys))
    multirun = _read_yaml(sweep / "multirun.yaml")
    experiment = _get(multirun, "hydra", "runtime", "choices", "experiment") or sweep.name
    # A value the command line fixed for every job (optim.lr=0.2 beside a swept grid) is the
    # promised job's value too.
    fixed = [(key, value) for key, value in _task_overrides(multirun).items()
             if key not in keys and len(_split_sweep_value(value) or ()) == 1]
    rows = []
    for combo in combos:
        if tuple(_same_value(override_value(k, v)) for k, v in zip(keys, combo, strict=True)) in seen:
            continue
        config: dict = {}
        for key, value in [*fixed, *zip(keys, combo, strict=False)]:
            target = config
            *parents, leaf = key.split(".")
            for parent in parents:  # a group given by name (scheme=randk) and one of its keys
                node = target.get(parent)
                if not isinstance(node, dict):
                    node = target[parent] = {} if node is None else {"name": node}
                target = node
            if isinstance(target.get(leaf), dict):
                target[leaf]["name"] = override_value(key, value)
            else:
                target[leaf] = override_value(key, value)
        row = row_from_summary(None, config)
        row[PARTIAL_CONFIG] = True  # its overrides alone: the rest of its config is unknown
        for axis in ("uncompressed", "warmup_steps"):  # unknown unless the sweep set it
            if f"scheme.{axis}" not in keys:
                row[axis] = None
        row.update(
            status="absent",
            error="the sweep promised this job but it left no run folder",
            experiment=experiment,
            sweep_dir=str(sweep),
            run_dir=None,
            overrides=" ".join(f"{k}={v}" for k, v in zip(keys, combo, strict=False)),
        )
        rows.append(row)
    return rows


# --- public loaders ---------------------------------------------------------------------------

COLUMNS_FIRST = ("experiment", *AXES[:5], REPLICATE, "status")


def load_runs(*paths: str | Path, include_failed: bool = True,
              stale_after_s: float = HEARTBEAT_STALE_S) -> pd.DataFrame:
    """One row per run found recursively under ``paths`` (sweep folders or run folders).

    Columns: the axes (scheme, scope, aggregation, ratio, world_size, seed, error_feedback,
    block_size, model, data, ...), ``status`` (completed, failed, running, no summary, absent),
    ``error``, ``run_dir``, the metrics of ``summary.json`` and ``time_<phase>_ms``. Dense SGD shows
    as scheme ``dense`` with ratio 1 and ``-`` for the axes it ignores.

    A completed run whose final train loss is no better than a uniform guess (``ln classes``)
    gets the status ``did not train`` (``sparsetrain.results.untrained_reason``): tables list it
    under the numbers and never rank it.

    A run whose ``summary.json`` says ``running`` but whose ``heartbeat.json`` (rank 0 rewrites it
    at least every 15 s while training) is older than ``stale_after_s`` seconds is ``unfinished``, with
    ``error`` = ``no heartbeat since <time> (step N)``.

    ``include_failed=False`` keeps completed runs only. Tables take the full frame so that they can
    name what is missing; pass ``include_failed=False`` for ad-hoc analysis of finished runs.
    """
    if not paths:
        raise ValueError("load_runs needs at least one results folder")
    runs = find_run_dirs(*paths)
    rows = [_run_row(run, stale_after_s) for run in runs]
    for sweep in find_sweep_dirs(*paths):
        rows.extend(_absent_rows(sweep, runs))
    frame = frame_of_rows(rows)
    if frame.empty:
        return frame
    for column, default in (("compressor_options", CLASS_DEFAULTS), ("memory", DEFAULT_MEMORY),
                            ("sync", DEFAULT_SYNC), ("delta", NOT_APPLICABLE)):
        if column in frame:  # only where some run set one: other results keep their columns
            values = frame[column]
            frame = frame.drop(columns=column) if values.isna().all() else frame.assign(**{column: values.fillna(default)})
    frame = _integer_columns(frame)
    if not include_failed:
        frame = frame[frame["status"].isin(STATUSES_DONE)].reset_index(drop=True)
    return frame


def frame_of_rows(rows: list[dict]) -> pd.DataFrame:
    """``row_from_summary`` rows as one frame: the axes first, then a column per config key that
    differs between them (``_config_columns``)."""
    fields = [row.pop(CONFIG_FIELDS, None) or {} for row in rows]
    partial = [bool(row.pop(PARTIAL_CONFIG, False)) for row in rows]
    versions = [row.get(legacy.VERSION_COLUMN, 0) for row in rows]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame = frame[[*COLUMNS_FIRST, *[c for c in frame.columns if c not in COLUMNS_FIRST]]]
    frame = _config_columns(frame, fields, partial, versions)
    if "compressor_code" in frame and frame["compressor_code"].isna().all():  # only where some run recorded one
        frame = frame.drop(columns="compressor_code")
    return frame


INTEGER_COLUMNS = ("world_size", "seed", "block_size", "warmup_steps", "bn_recalibrate", "batch_size",
                   "epochs_planned", "train_size", "steps")


def _integer_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Counts stay integers (``workers=4``, not ``4.0``) even where an absent run leaves a gap."""
    for column in INTEGER_COLUMNS:
        if column not in frame:
            continue
        values = pd.to_numeric(frame[column], errors="coerce")
        whole = values.dropna()
        if (whole == whole.round()).all() and frame[column].map(lambda v: v is None or _is_real(v)).all():
            frame[column] = values.astype("Int64")
    return frame


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def completed(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"].isin(STATUSES_DONE)] if not runs.empty else runs


def not_completed(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[~runs["status"].isin(STATUSES_DONE)] if not runs.empty else runs


def select(frame: pd.DataFrame, where: dict[str, list[str]] | None) -> pd.DataFrame:
    """Rows whose axes take one of the given values (``{"scope": ["layerwise"]}``); dense SGD
    rows pass the axes it ignores (``-``), and ``dense`` is a scheme name like any other. A
    config key that differs between the runs is one too (``{"optim.momentum": ["0"]}``); numbers
    match by value (``0`` is a recorded ``0.0``)."""
    if not where or frame.empty:
        return frame
    keep = pd.Series(True, index=frame.index)
    for axis, values in where.items():
        if axis not in frame:
            keys = [c for c in frame.columns if "." in str(c)]
            raise ValueError(f"--where {axis}=...: {axis!r} is not an axis, nor a config key that differs "
                             f"between these runs; allowed: {', '.join([*AXES, *keys])}")
        text = frame[axis].astype(str)
        wanted = {_same_value(override_value(axis, v)) for v in values}
        by_value = frame[axis].map(lambda v, wanted=wanted: _same_value(v) in wanted)
        keep &= text.isin([str(v) for v in values]) | by_value | (text == NOT_APPLICABLE)
    return frame[keep]


def _read_metrics(path: Path, warn: bool = True) -> Iterable[dict]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                # A run killed mid-write leaves a torn last line; anything else is worth a warning.
                if warn:
                    warnings.warn(f"{path}:{number}: skipped a line that is not JSON", stacklevel=2)


def load_curves(*paths: str | Path, kind: str = "epoch", include_failed: bool = False) -> pd.DataFrame:
    """Records of ``metrics.jsonl`` of every run under ``paths``, with the run's axes joined.

    ``kind="epoch"``: one row per epoch (train_loss, test_accuracy, ...); an epoch that was not
    evaluated (``train.eval_every`` > 1) has no test or validation numbers (its record repeats
    the last evaluation's: blanked, never a second measurement).
    ``kind="step"``: one row per logged step; ``time_ms`` is spread into ``time_<phase>_ms``.
    """
    return curves_of(load_runs(*paths), kind, include_failed)


def curves_of(runs: pd.DataFrame, kind: str = "epoch", include_failed: bool = False) -> pd.DataFrame:
    """``load_curves`` for the runs of a ``load_runs`` frame already in hand (no second walk of
    the tree); ``include_failed=False`` drops the runs that did not complete (a run that completed
    but did not train keeps its curve, with its ``status``: plots draw it apart, never hide it)."""
    if kind not in ("epoch", "step"):
        raise ValueError(f"kind must be 'epoch' or 'step', not {kind!r}")
    if not include_failed and not runs.empty:
        runs = runs[runs["status"].isin((*STATUSES_DONE, DID_NOT_TRAIN))]
    frames = []
    # the axes and every other setting that tells runs apart (group.varying_axes reads them)
    settings = [c for c in runs.columns if "." in str(c) or c in ("compressor_code", "link_rate_bits", CONFIG_DIGEST)]
    keep = [*COLUMNS_FIRST, *[a for a in AXES if a not in COLUMNS_FIRST and a in runs], *settings, "run_dir"]
    for run in runs.to_dict("records"):  # not itertuples: a config key's column has dots in its name
        if not isinstance(run["run_dir"], str) or not (Path(run["run_dir"]) / "metrics.jsonl").is_file():
            continue
        raw = list(_read_metrics(Path(run["run_dir"]) / "metrics.jsonl"))
        for split in ("test", "val") if kind == "epoch" else ():  # an epoch not evaluated: blanked
            for record, new in _evaluated(raw, split):
                if not new:  # (its key was taken before this change)
                    record.update({f"{split}_accuracy": None, f"{split}_loss": None})
        records = []
        for record in raw:
            if record.get("kind") != kind:
                continue
            record = dict(record)
            for phase, ms in (record.pop("time_ms", None) or {}).items():
                record[f"time_{phase}_ms"] = ms
            if "lr" in record:  # the schedule's lr at that point, not the run's lr axis
                record["lr_now"] = record.pop("lr")
            records.append(record)
        if not records:
            continue
        frame = pd.DataFrame(records).drop(columns=["kind"])
        info = {column: run[column] for column in keep}
        for column, value in info.items():
            frame[column] = value  # the run's axes win over any same-named record field
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=[*keep, "epoch", "step"])
    out = pd.concat(frames, ignore_index=True)
    return out[[*keep, *[c for c in out.columns if c not in keep]]]
