"""The run frame from W&B's public API, for runs whose folders are not at hand (needs network).

The trainer logs the resolved config as the W&B run config and the fields of ``summary.json`` as
the run summary, flattened (``time_ms/step``; ``tracking.WandbTracker.finish``): put back into
summary.json's shape (``tracking.unflatten``), the same row builder applies. ``wandb`` is
imported only when called.
"""

from __future__ import annotations

import pandas as pd

from sparsetrain.tracking import unflatten

from .loader import _integer_columns, frame_of_rows, row_from_summary


def load_wandb_runs(path: str, filters: dict | None = None, api=None) -> pd.DataFrame:
    """Rows like ``load_runs`` for the runs of ``entity/project`` on W&B.

    ``filters`` is W&B's MongoDB-style filter (``{"group": "rq1_scope"}``). Raises RuntimeError
    with the reason when wandb is missing or the API cannot be reached.
    """
    if api is None:
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("loading from W&B needs the wandb package (pip install wandb)") from err
        try:
            api = wandb.Api(timeout=30)
        except Exception as err:  # no network, no API key: say so instead of a traceback wall
            raise RuntimeError(f"cannot reach the W&B API: {err}") from err
    try:
        remote = list(api.runs(path, filters=filters or {}))
    except Exception as err:
        raise RuntimeError(f"cannot list W&B runs of {path!r}: {err}") from err
    rows = []
    for run in remote:
        summary = unflatten({k: v for k, v in dict(run.summary).items() if not str(k).startswith("_")})
        config = dict(run.config)
        summary.setdefault("config", config)
        summary.setdefault("status", {"finished": "completed", "crashed": "failed", "failed": "failed"}.get(run.state, run.state))
        row = row_from_summary(summary, config)
        row.update(experiment=getattr(run, "group", None), sweep_dir=None, run_dir=getattr(run, "url", None), overrides="")
        rows.append(row)
    frame = frame_of_rows(rows)
    if frame.empty:
        return frame
    return _integer_columns(frame)
