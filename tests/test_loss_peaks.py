"""Stability in the open (issue 22, item 3): every run records its largest batch loss from step
20 on and after the lr warm-up, with the step, and says whether it trained throughout, blew up and
recovered, or did not train."""

from __future__ import annotations

import math

import pytest
from conftest import TINY, read_json, read_jsonl, run_cli

from sparsetrain.results import (
    BLEW_UP_RECOVERED,
    DID_NOT_TRAIN,
    TRAINED_THROUGHOUT,
    stability_of,
)


def test_stability_of_reads_the_final_numbers_and_the_peak():
    assert stability_of(0.4, 0.85, 1.9) == TRAINED_THROUGHOUT
    assert stability_of(0.4, 0.85, 9.9) == BLEW_UP_RECOVERED
    assert stability_of(0.4, 0.85, None) == TRAINED_THROUGHOUT  # a run shorter than 20 steps
    assert stability_of(2.4, 0.85, 1.0) == DID_NOT_TRAIN  # final loss not below ln 10
    assert stability_of(0.4, 0.19, 1.0) == DID_NOT_TRAIN  # below 20 %, whatever its loss
    assert stability_of(float("nan"), 0.9, 1.0) == DID_NOT_TRAIN
    assert stability_of(None, 0.9, 1.0) == DID_NOT_TRAIN


@pytest.mark.slow  # a 2-epoch run; stability_of is checked in-process above
def test_a_run_records_its_largest_loss_and_its_step(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*TINY, "world_size=1", "train.epochs=2", "train.log_every=1",
                   "optim.warmup_epochs=0.5", f"hydra.run.dir={run}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    steps = {r["step"]: r["train_loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"}
    assert len(steps) == s["steps"] >= 30  # every step logged: the peak can be checked exactly
    warmup = math.ceil(0.5 * s["steps"] / 2)
    for key, first in (("after_step_20", 20), ("after_lr_warmup", warmup + 1)):
        peak = s["train_loss_peak"][key]
        later = {k: v for k, v in steps.items() if k >= first}
        assert peak["from_step"] == first and peak["step"] == max(later, key=later.get)
        assert math.isclose(peak["train_loss"], max(later.values()), rel_tol=1e-6)
    expected = stability_of(s["train_loss"], s["test_accuracy"],
                            s["train_loss_peak"]["after_step_20"]["train_loss"])
    assert s["stability"] == expected
