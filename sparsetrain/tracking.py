"""Weights & Biases logging from rank 0.

``wandb.mode=offline`` (the default) writes real run files under ``<run_dir>/wandb/`` that
``wandb sync`` uploads later; ``online`` needs the user's own key (``wandb login`` or
WANDB_API_KEY, never read or written by this code); ``disabled`` skips W&B entirely.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


class NullTracker:
    run_id = None

    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def finish(self, summary: dict[str, Any], failed: bool = False) -> None: ...


class WandbTracker:
    """One W&B run per training run: a resumed run (``run_id``: the id its checkpoint kept)
    goes on in the same W&B run, so that W&B holds one run with every step, as metrics.jsonl."""

    def __init__(self, wandb_cfg: dict[str, Any], config: dict[str, Any], run_dir: str, name: str,
                 run_id: str | None = None):
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            id=run_id,
            resume="allow" if run_id else None,
            project=wandb_cfg["project"],
            entity=wandb_cfg.get("entity"),
            group=wandb_cfg.get("group"),
            tags=list(wandb_cfg.get("tags") or []),
            name=name,
            config=config,
            dir=run_dir,
            mode=wandb_cfg["mode"],
            reinit="create_new",
        )
        self.run_id = self.run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_flatten(metrics), step=step)

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        # flat keys (``time_ms/step``), as the logged metrics; lists (``hosts``, ``code_commits``,
        # ``time_ms_ranks``) kept whole, so that ``analysis.wandb_runs`` rebuilds summary.json
        for key, value in _flatten(summary, keep_lists=True).items():
            if key.startswith("config/"):
                continue
            self.run.summary[key] = value
        self.run.finish(exit_code=1 if failed else 0)


def _flatten(d: dict[str, Any], prefix: str = "", keep_lists: bool = False) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``: scalars, and with ``keep_lists`` lists whole."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/", keep_lists))
        elif isinstance(value, (int, float, str, bool)) or value is None or (keep_lists and isinstance(value, list)):
            out[name] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``_flatten``'s inverse: ``{"a/b": 1}`` -> ``{"a": {"b": 1}}`` (a W&B run summary back to
    summary.json's shape).

    >>> unflatten({"time_ms/step": 2.0, "steps": 3, "target/accuracy": 0.9})
    {'time_ms': {'step': 2.0}, 'steps': 3, 'target': {'accuracy': 0.9}}
    """
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = str(key).split("/")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):  # a scalar and a group of one name: keep the scalar
                break
        else:
            node[leaf] = value
    return out


def has_wandb_credentials(env: Mapping[str, str] | None = None) -> bool:
    """Whether W&B would find a key without asking: ``WANDB_API_KEY`` (or an identity token file),
    or a non-empty password for the W&B host (``WANDB_BASE_URL``, default api.wandb.ai) in the
    netrc file (``$NETRC`` or ``~/.netrc``) that ``wandb login`` writes. Reads nothing else and
    never prints or stores the key. Without one, ``wandb.init`` would prompt on a terminal (a
    SLURM job would wait forever) or fail inside the rank, so online runs are refused up front."""
    import netrc
    from urllib.parse import urlsplit

    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY", "").strip():
        return True
    token = env.get("WANDB_IDENTITY_TOKEN_FILE")
    if token and os.path.isfile(token):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc or "api.wandb.ai"
    path = env.get("NETRC") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        creds = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and (creds[2] or "").strip())


def make_tracker(wandb_cfg: dict[str, Any], config: dict[str, Any], run_dir: str, name: str,
                 run_id: str | None = None):
    if wandb_cfg["mode"] == "disabled":
        return NullTracker()
    return WandbTracker(wandb_cfg, config, run_dir, name, run_id)
