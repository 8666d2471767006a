"""Run folders written before summary.json's current layout, read as the current layout.

``summary.json`` says its layout in ``schema_version`` (``sparsetrain.results.SCHEMA_VERSION``); a
summary without it (or a run folder without a summary) is version 0. The loader (``loader.py``)
reads the current layout only; a row of an older version goes through these steps, in this
order, each a no-op for the current version:

1. ``upgrade_config``: the scheme a recorded config ran, by today's name (``scheme=powersgd``
   recorded with no compressor was torch's DDP hook: ``torch_powersgd``). The axes read the
   upgraded config; a row's config columns and digest keep the recorded one.
2. ``upgrade_summary``: what the summary did not say yet: the quantizers' kernels (numpy's).
   (Which knobs change what is sent, ``applies``, is not here: a current summary of a run refused
   or stopped before its exchange was built lacks it too, and the loader reads conf/schemes.yaml
   for both.)
3. ``upgrade_row``: axes whose config key came after the run take what the run did
   (``KEYS_ADDED``), and wire bytes the trainer did not log yet are computed from the payload
   with the ring model (``wire_bytes_source``: ``computed``).
4. ``upgrade_logged``: without the summary's per-step loss peak, the peak over the logged steps.
5. ``config_default``: a config key the run's config lacks takes its default (each key was added
   with a default that keeps earlier runs' behaviour), unless ``BEFORE_THE_KEY`` says otherwise.

A summary of a version above ``SCHEMA_VERSION`` is refused (``version_of``): its layout is unknown
to this code, and reading it as an older one would turn its new keys into silent defaults.
"""

from __future__ import annotations

import math

from sparsetrain.costmodel import wire_bytes  # no torch
from sparsetrain.results import (
    SCHEMA_VERSION,
    STABILITY_FROM_STEP,
    recorded_scheme,
)

# the row's column that says which layout its summary had
VERSION_COLUMN = "schema_version"


class NewerLayoutError(ValueError):
    """A summary.json written by newer code than this (its schema_version is above ours)."""


def version_of(summary: dict | None, where=None) -> int:
    """``summary``'s layout (0: written before summaries said); a newer one than this code reads
    is refused, naming ``where`` (the run folder, else the summary's own ``run_dir``)."""
    version = int((summary or {}).get("schema_version") or 0)
    if version > SCHEMA_VERSION:
        place = where or (summary or {}).get("run_dir") or "a run"
        raise NewerLayoutError(f"{place}: summary.json has schema_version {version}; this sparsetrain "
                               f"reads schema_version up to {SCHEMA_VERSION} (update sparsetrain to load it)")
    return version


def is_old(version: int) -> bool:
    return version < SCHEMA_VERSION


# --- step 1: the config ---------------------------------------------------------------------


def upgrade_config(config: dict, version: int) -> dict:
    """``config`` with its scheme by today's name (``results.recorded_scheme``: until issue 24,
    ``scheme=powersgd`` was torch's hook, ``torch_powersgd`` now)."""
    if not is_old(version):
        return config
    node = config.get("scheme")
    name = recorded_scheme(node)
    if isinstance(node, dict):
        return config if name == node.get("name") else {**config, "scheme": {**node, "name": name}}
    return config if name == node else {**config, "scheme": name}


# --- step 2: the summary --------------------------------------------------------------------

# the quantizers' CPU kernels of a run written before the compiled ones existed
OLD_KERNELS = "numpy"


def upgrade_summary(summary: dict, version: int) -> dict:
    """``summary`` with what it did not say yet: ``kernels``, numpy's."""
    if not is_old(version) or "kernels" in summary:
        return summary
    return {**summary, "kernels": OLD_KERNELS}


# --- step 3: the row ------------------------------------------------------------------------

# QSGD's generator of a run from before scheme.generator existed: numpy's PCG64 (torch's on CUDA),
# unless ``+scheme.compressor.generator`` said (the loader reads that)
OLD_GENERATOR = "pcg64"
# axis -> (config key, what runs from before the key did): every tensor compressed from the first
# step; evaluation with the running batch-norm statistics only
KEYS_ADDED = {
    "uncompressed": (("scheme", "uncompressed"), "none"),
    "warmup_steps": (("scheme", "warmup_steps"), 0),
    "bn_recalibrate": (("train", "bn_recalibrate"), 0),
}


def _lacks(node, *keys) -> bool:
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return True
        node = node[key]
    return False


def _num(value) -> float:
    try:
        return math.nan if value is None else float(value)
    except (TypeError, ValueError):
        return math.nan


def upgrade_row(row: dict, summary: dict, config: dict, collective: str | None, version: int) -> dict:
    """``row`` (the loader's, of ``summary`` and its upgraded ``config``) with the axes whose key
    the config lacks at what the run did, QSGD's generator PCG64 where none was named, and the
    wire bytes computed where the summary has none (``collective``: ``loader.collective_of``)."""
    if not is_old(version):
        return row
    for axis, (keys, value) in KEYS_ADDED.items():
        # the loader's reading of the absent key (str(None) for a text axis), not an axis it
        # marked as not applying (dense SGD's ``-``)
        if _lacks(config, *keys) and row[axis] in (None, str(None)):
            row[axis] = value
    if not row["generator"]:  # "-" where the scheme has no generator
        row["generator"] = OLD_GENERATOR
    row.update(_wire_fields(summary, row, collective))
    return row


def _wire_fields(summary: dict, row: dict, collective: str | None) -> dict:
    """``wire_bytes_per_step`` / ``wire_bytes_total`` from the summary or, where the trainer did
    not log them yet, computed from the collective, world size and payload bytes with the ring
    model (``costmodel.wire_bytes``): warm-up steps as dense AllReduces, then the scheme's.
    ``wire_bytes_source``: ``summary``, ``computed``, or ``unknown`` (the fields are then NaN)."""
    per_step = _num(summary.get("wire_bytes_per_step"))
    total = _num(summary.get("wire_bytes_total"))
    source = "summary"
    world, steps = _num(row.get("world_size")), row["steps"]
    if math.isnan(per_step):
        source = "computed"
        sent = row["bytes_sent_per_step"]
        if collective is None or math.isnan(world) or math.isnan(sent):
            source, per_step = "unknown", math.nan
        else:
            per_step = float(round(wire_bytes(collective, sent, int(world))))
    if math.isnan(total) and not math.isnan(per_step) and not math.isnan(steps):
        warm = min(int(_num(summary.get("compression_start_step")) if summary.get("compression_start_step") else 0),
                   int(steps))
        dense = row["dense_bytes_per_step"]
        dense_wire = round(wire_bytes("allreduce", dense, int(world))) if warm and not math.isnan(dense) else 0
        total = warm * dense_wire + (int(steps) - warm) * per_step
        source = "computed" if source == "summary" else source
    mean = total / steps if steps and not math.isnan(total) else math.nan
    return {"wire_bytes_per_step": per_step, "wire_bytes_total": total, "wire_bytes_mean_per_step": mean,
            "wire_bytes_source": source}


# --- step 4: the loss peak ------------------------------------------------------------------


def upgrade_logged(row: dict, logged: list[tuple[int, float]], version: int) -> dict:
    """For a summary without the per-step loss peak (``loss_peak_source`` None): the largest
    train loss among the *logged* steps from ``STABILITY_FROM_STEP`` on (``loss_peak_source``:
    ``logged steps``; every ``train.log_every``-th step only, so a short spike between them can
    be missed). The fields to update ``row`` with; none for a current summary."""
    if not is_old(version) or row.get("loss_peak_source") is not None:
        return {}
    peak = (math.nan, math.nan)
    for step, loss in logged:
        if step >= STABILITY_FROM_STEP and not loss <= peak[0]:
            peak = (loss, float(step))
    return {"loss_peak": peak[0], "loss_peak_step": peak[1],
            "loss_peak_source": "logged steps" if not math.isnan(peak[0]) else None}


# --- step 5: config keys --------------------------------------------------------------------

# A key a run's config lacks was added after the run: the run did what the key's default does,
# unless listed here.
BEFORE_THE_KEY = {"dist.overlap": False}  # dense exchange after backward before dist.overlap existed
_SCHEMA_DEFAULTS: dict | None = None


def _schema_defaults() -> dict:
    """The schema's keys and defaults (``sparsetrain.config.schema``: Hydra and OmegaConf, no
    torch), read once, when a loaded frame lacks a key in some old run."""
    global _SCHEMA_DEFAULTS
    if _SCHEMA_DEFAULTS is None:
        from omegaconf import MISSING

        from sparsetrain.config.schema import schema_keys

        _SCHEMA_DEFAULTS = {k: v for k, v in schema_keys().items() if v != MISSING}
        _SCHEMA_DEFAULTS.update(BEFORE_THE_KEY)
    return _SCHEMA_DEFAULTS


def config_default(key: str, version: int, flat=None):
    """The value of config ``key`` (dotted) for a run whose config lacks it: for an old run the
    key's default (``BEFORE_THE_KEY``, else the schema's; None where the schema has none), a list
    or node as ``flat`` writes it (the loader's flattening); None for a current run, whose config
    holds every key."""
    if not is_old(version):
        return None
    default = _schema_defaults().get(key)
    return flat(default)[""] if isinstance(default, (list, tuple, dict)) and flat else default
