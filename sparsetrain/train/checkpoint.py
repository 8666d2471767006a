"""``checkpoint.pt``: written atomically, read with a clear error, resumed only by the same run.

- ``save``: the state goes to a temporary file in the run folder, is flushed to disk and only
  then replaces ``checkpoint.pt``; a failed write (a full disk above all) deletes the temporary
  file and leaves the previous checkpoint as it was. ``CheckpointError`` says what happened.
- ``load``: a file torch cannot read (truncated, overwritten, not a checkpoint) is named, with the
  two ways on: delete it, or ``train.checkpoint=false``.
- ``check_same_run``: the checkpoint records the config that wrote it; a rerun in the same folder
  resumes only when every key that defines the run is unchanged (``NOT_DEFINING`` lists the keys
  that may change: logging, progress, device, threads, W&B, communication plumbing, the step cap).

Imports no Hydra and nothing from the trainer, so the CLI can check a folder before any rank starts.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import torch

from sparsetrain.errors import CheckpointError, ConfigError
from sparsetrain.provenance import (
    SCHEME_NODES,
    code_version,
    compressor_code,
    describe,
    describe_own,
    same_code,
    same_own_code,
    scheme_targets,
)
from sparsetrain.results import recorded_scheme

CHECKPOINT = "checkpoint.pt"

# Keys that may differ between a checkpoint and the run that resumes it: they change how a run is
# watched, where it runs or when it stops, not what it computes. Prefixes end with a dot.
NOT_DEFINING = (
    "train.max_steps",  # a cap: resuming with a higher (or no) cap trains on
    "train.log_every",
    "train.eval_every",
    "train.curve_points",  # evaluation only: the training steps are the same
    "train.curve_size",
    "train.stop_at_accuracy",  # when to stop, like max_steps
    "train.progress",
    "train.device",
    "train.threads",
    "train.fast_path",  # the same messages and memory, by other kernels
    "train.timing_warmup",
    "train.checkpoint",
    "train.save_model",
    "train.allow_code_change",  # whether to resume on other code (checked by check_same_code)
    "data.root",
    "data.download",
    "wandb.",
    "dist.",
    # How the model is built: fixed by model.name. The scheme's classes (scheme.compressor /
    # memory / sync ._target_) and the compressor's options do define the run: see
    # config_differences.
    "model._target_",
    "model._partial_",
)


# Communication plumbing that does change the run: the DDP path (state format) and its buckets
# (positions are drawn per bucket).
DEFINING = ("dist.ddp", "dist.bucket_cap_mb")
# Keys added after studies had started: the value a checkpoint without them ran with.
ADDED_LATER = {"dist.ddp": False, "dist.bucket_cap_mb": 25.0, "scheme.rank": None,
               # QSGD before its buckets: one norm per tensor
               "scheme.bucket_size": None, "scheme.compressor.bucket_size": None,
               # before the validation split: every training image trained on
               "data.val_size": 0,
               # before the memory was a component: error feedback (scheme.error_feedback)
               "scheme.memory": None,
               # before local SGD / DiLoCo: every step's exchange
               "scheme.sync": None}
# A scheme's keys are those of its schema (sparsetrain/config/schema.py): scheme.block_size is block-k's,
# scheme.rank PowerSGD's. Runs written before they were (issue 23) recorded both for every scheme;
# a saved ``scheme.`` key that the current scheme does not have did nothing in that run (the
# scheme's name is compared on its own), so it is no difference.
SCHEME = "scheme."


def _not_defining(key: str) -> bool:
    if key in DEFINING:
        return False
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in NOT_DEFINING)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for key, value in d.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


_ABSENT = "<absent>"


def _scheme_as_now(config: dict) -> dict:
    """A recorded config with its scheme under today's name (``scheme=powersgd`` before issue 24
    was torch's hook: ``torch_powersgd``; ``results.recorded_scheme``)."""
    node = config.get("scheme") if isinstance(config, dict) else None
    if isinstance(node, dict) and recorded_scheme(node) != node.get("name"):
        return {**config, "scheme": {**node, "name": recorded_scheme(node)}}
    return config


COMPRESSOR = "scheme.compressor."
# The scheme's class nodes (provenance.SCHEME_NODES): the class each builds (its ``_target_``;
# None where the node is null) defines the run. Checkpoints written before the compressor node
# existed have no ``compressor`` key (their class is told by scheme.name); before memory and
# sync, the node was null.


def _classes(flat: dict[str, Any], scheme: Any) -> dict[str, Any]:
    """``flat`` without its class nodes' ``scheme.<node>``, ``._target_`` and ``._partial_`` keys,
    and with ``scheme.<node>._target_`` set to the class the node builds (None: no node), left
    out for a compressor node that the recorded config lacks."""
    scheme = scheme if isinstance(scheme, dict) else {}
    out = {k: v for k, v in flat.items()
           if not any(k == f"{SCHEME}{n}" or k in (f"{SCHEME}{n}._target_", f"{SCHEME}{n}._partial_")
                      for n in SCHEME_NODES)}
    for node in SCHEME_NODES:
        if node == "compressor" and node not in scheme:
            continue
        value = scheme.get(node)
        out[f"{SCHEME}{node}._target_"] = value.get("_target_") if isinstance(value, dict) else value
    return out


def _compressor_option(key: str) -> bool:
    """``scheme.compressor.<option>``: an argument of the compressor's class (not how it is built)."""
    return key.startswith(COMPRESSOR) and key[len(COMPRESSOR):].split(".")[0] not in ("_target_", "_partial_")


def _class_default(target: Any, option: str) -> Any:
    """The default of ``option`` in the ``__init__`` of the class ``target`` names (or of a base
    it reaches through ``**kw``): what a run that left the option out ran with; ``_ABSENT`` when
    it cannot be read (the module off PYTHONPATH, no default)."""
    import importlib
    import inspect

    module, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        for klass in cls.__mro__:
            if "__init__" in vars(klass):
                param = inspect.signature(klass.__init__).parameters.get(option)
                if param is not None and param.default is not inspect.Parameter.empty:
                    return param.default
    except Exception:  # noqa: BLE001  (a value to show, never a reason to fail)
        pass
    return _ABSENT


def config_differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every run-defining key that differs. The
    compressor's options count when both runs built the same class (an option left out is the
    class's default). The class each of the scheme's nodes builds (``scheme.compressor._target_``,
    ``scheme.memory._target_``, ``scheme.sync._target_``) counts where the scheme's name is the
    same (another name is a difference of its own)."""
    saved, current = _scheme_as_now(saved), _scheme_as_now(current)
    a, b = _flatten(saved), _flatten(current)
    target = a.get(f"{COMPRESSOR}_target_")
    same_class = target is not None and target == b.get(f"{COMPRESSOR}_target_")
    a, b = _classes(a, saved.get("scheme")), _classes(b, current.get("scheme"))
    for node in SCHEME_NODES:  # another scheme's classes, or a class one side did not record: no difference
        key = f"{SCHEME}{node}._target_"
        if a.get(f"{SCHEME}name") != b.get(f"{SCHEME}name") or key not in a or key not in b:
            a.pop(key, None)
            b.pop(key, None)
    out = []
    for key in sorted(set(a) | set(b)):
        if _compressor_option(key):
            if not same_class:
                continue
        elif _not_defining(key) or (key.startswith(SCHEME) and key not in b):
            continue
        default = ADDED_LATER.get(key, _ABSENT)
        if default == _ABSENT and _compressor_option(key) and (key not in a or key not in b):
            default = _class_default(target, key[len(COMPRESSOR):])
        old, new = (c.get(key, default) for c in (a, b))
        if old != new:
            out.append((key, old, new))
    # an option the yaml takes from a scheme key (block_size: ${..block_size}) is said once
    return [(k, o, n) for k, o, n in out
            if not (_compressor_option(k) and (f"{SCHEME}{k[len(COMPRESSOR):]}", o, n) in out)]


def check_same_run(saved_config: dict | None, current: dict, path: str | Path) -> None:
    """Raise ConfigError naming the keys in which ``current`` differs from the checkpoint's run.
    Checkpoints written before configs were recorded (``saved_config`` None) are not checked."""
    if saved_config is None:
        return
    diffs = config_differences(saved_config, current)
    if not diffs:
        return

    shown = "; ".join(f"{k}={_show(old)} there, {_show(new)} now" for k, old, new in diffs[:6])
    more = f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else ""
    raise ConfigError(
        f"will not resume {path}: it was saved by a different configuration: {shown}{more}; "
        "rerun with the saved values to resume, or start fresh in a new folder "
        f"(hydra.run.dir=..., hydra.sweep.dir=...) or after deleting {path}"
    )


def check_same_code(saved_code: dict | None, current: dict | None, allow: bool,
                    path: str | Path) -> None:
    """Raise ConfigError when the checkpoint was written by other code than ``current`` (another
    commit, or other uncommitted changes), unless ``allow`` (``train.allow_code_change``).
    Checkpoints without a record, and code outside a git checkout, are not checked."""
    if allow or same_code(saved_code, current):
        return
    raise ConfigError(
        f"will not resume {path}: it was written by code {describe(saved_code)} and this is "
        f"{describe(current)}; check out {describe(saved_code)} to resume, or add "
        "train.allow_code_change=true to resume on this code (the summary lists both)"
    )


def check_same_own_code(saved: dict | None, current: dict | None, allow: bool, path: str | Path) -> None:
    """Raise ConfigError when the checkpoint was written by another version of the scheme's own
    classes (``compressor_code``: the digest of their files) than ``current``, unless ``allow``
    (``train.allow_code_change``, as for sparsetrain's own code)."""
    if allow or same_own_code(saved, current):
        return
    raise ConfigError(
        f"will not resume {path}: it was written by {describe_own(saved)} and this is "
        f"{describe_own(current)}; restore that version of {', '.join((current or saved or {}).get('files', []))} "
        "to resume, or add train.allow_code_change=true to resume on this code (the summary lists both)"
    )


OWN_CODE = "compressor_code"  # the checkpoint's record of the scheme's own classes' source


def _show(value: Any) -> str:
    return value if value == _ABSENT else repr(value)


def save(state: dict, path: str | Path) -> None:
    """Write ``state`` to ``path`` atomically; on failure the old file is untouched and no
    temporary file is left. A full disk raises CheckpointError saying 'no space left'."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:  # a Python file: a full disk surfaces as OSError(ENOSPC)
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if _no_space(exc):
            kept = f"the previous checkpoint {path} is kept" if path.exists() else "no checkpoint was kept"
            raise CheckpointError(
                f"no space left on device while writing the checkpoint {path}; {kept}; "
                "free some space and rerun the same command to resume"
            ) from exc
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write the checkpoint {path}: {exc.strerror or exc}") from exc
        raise


def _no_space(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def load(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """Read a checkpoint (``weights_only=True``); a file that cannot be read is named, with the
    ways on."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("not a sparsetrain checkpoint")
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = reason.split(". ")[0].rstrip(".")[:160]  # torch's miniz text runs on and on
        raise CheckpointError(
            f"the checkpoint {path} cannot be read ({type(exc).__name__}: {reason}); delete "
            "it to start this run over, or rerun with train.checkpoint=false to ignore it"
        ) from None
    return state


def check_resume(run_dir: str | Path, config: dict) -> None:
    """Before any rank starts: if ``run_dir`` holds a checkpoint this run would resume, make sure
    it can be read and was written by the same configuration (ConfigError / CheckpointError)."""
    path = Path(run_dir) / CHECKPOINT
    if not (config.get("train", {}).get("checkpoint", True) and path.exists()):
        return
    state = load(path, mmap=True)
    check_same_run(state.get("config"), config, path)
    allow = bool(config.get("train", {}).get("allow_code_change", False))
    check_same_code(state.get("code"), code_version(), allow, path)
    if OWN_CODE in state:  # checkpoints written before it was kept: not checked
        check_same_own_code(state[OWN_CODE], compressor_code(scheme_targets(config.get("scheme"))), allow, path)


def completed_run(run_dir: str | Path, config: dict) -> dict | None:
    """The summary of a run that already completed in ``run_dir`` with this configuration (so a
    rerun of the same command or sweep skips it and goes on with the rest), else None. A
    completed run of another configuration (train.max_steps included: the checkpoint is gone,
    the run cannot be extended) raises ConfigError rather than being overwritten."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if summary.get("status") != "completed" or not isinstance(summary.get("config"), dict):
        return None
    saved = summary["config"]
    diffs = config_differences(saved, config)
    cap = (saved.get("train", {}).get("max_steps"), config.get("train", {}).get("max_steps"))
    if cap[0] != cap[1]:
        diffs.append(("train.max_steps", *cap))
    if diffs:
        shown = "; ".join(f"{k}={_show(old)} there, {_show(new)} now" for k, old, new in diffs[:6])
        raise ConfigError(
            f"{run_dir} holds a completed run of a different configuration: {shown}; choose "
            "another folder (hydra.run.dir=..., hydra.sweep.dir=...) or delete that one to rerun"
        )
    return summary
