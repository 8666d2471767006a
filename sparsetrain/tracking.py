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
    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def finish(self, summary: dict[str, Any], failed: bool = False) -> None: ...


class WandbTracker:
    def __init__(self, wandb_cfg: dict[str, Any], config: dict[str, Any], run_dir: str, name: str):
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
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

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_flatten(metrics), step=step)

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        for key, value in _flatten(summary).items():
            if key.startswith("config/"):
                continue
            self.run.summary[key] = value
        self.run.finish(exit_code=1 if failed else 0)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
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


def make_tracker(wandb_cfg: dict[str, Any], config: dict[str, Any], run_dir: str, name: str):
    if wandb_cfg["mode"] == "disabled":
        return NullTracker()
    return WandbTracker(wandb_cfg, config, run_dir, name)
