"""W&B's run summary back to the run frame (``analysis.wandb_runs``): the row equals the run
folder's. Audit 5: the tracker flattened the summary (``time_ms/step``) and dropped its lists,
and the loader looked for the nested keys: every time NaN, local SGD read as synchronising every
step, code and host unrecorded."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparsetrain.analysis import load_runs
from sparsetrain.analysis.wandb_runs import load_wandb_runs
from sparsetrain.tracking import _flatten

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("test_accuracy", "val_accuracy", "time_step_ms", "time_compress_ms", "sync_period", "host", "code",
           "code_commits", "loss_peak", "compute_ms_ranks", "bytes_sent_per_step", "wire_bytes_per_step",
           "scheme", "ratio", "lr", "seed", "overlap_buckets", "status")


class _Api:
    """W&B's public API as ``load_wandb_runs`` reads it, holding what the tracker wrote."""

    def __init__(self, runs):
        self._runs = runs

    def runs(self, path, filters=None):
        return self._runs


def _as_wandb_run(run_dir: Path) -> SimpleNamespace:
    summary = json.loads((run_dir / "summary.json").read_text())
    written = {k: v for k, v in _flatten(summary, keep_lists=True).items() if not k.startswith("config/")}
    written.update(_runtime=12.5, _step=99)  # W&B's own keys
    return SimpleNamespace(summary=written, config=summary["config"], state="finished", group="local", url=None)


@pytest.mark.parametrize("run", ["local/3", "tta_frontier/11"])
def test_a_run_read_from_wandb_is_the_run_read_from_its_folder(run):
    folder = ROOT / "results" / run
    mine = load_runs(folder).iloc[0]
    theirs = load_wandb_runs("e/p", api=_Api([_as_wandb_run(folder)])).iloc[0]
    for column in COLUMNS:
        a, b = mine[column], theirs[column]
        if isinstance(a, float) and math.isnan(a):
            assert isinstance(b, float) and math.isnan(b), column
        else:
            assert a == b, (column, a, b)
    assert mine["time_step_ms"] > 0 and mine["host"] != "unrecorded"
