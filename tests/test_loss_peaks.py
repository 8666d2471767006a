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
    blow_up,
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
    logged = [(r["step"], r["train_loss"]) for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    expected = stability_of(s["train_loss_final"], s["test_accuracy"],
                            s["train_loss_peak"]["after_step_20"]["train_loss"],
                            peak_step=s["train_loss_peak"]["after_step_20"]["step"], logged=logged)
    assert s["stability"] == expected


# logged steps (every 20th, and step 1) of runs in results/verdict_e4, to the 3 digits shown
TOPK_LAYERWISE_SEED3 = [(1, 2.437), (20, 2.586), (40, 1.31), (60, 1.12)]  # peak 2.586 at step 20
RANDK_GLOBAL_SEED1 = [(1, 2.512), (20, 2.3), (100, 1.35), (120, 1.211), (140, 4.525), (160, 1.6)]


def test_an_early_blip_is_not_a_blow_up_and_a_spike_is():
    # top-k layer-wise at step 20, a little above ln 10 while the network has not learned: a blip
    assert stability_of(0.2, 0.9, 2.586, peak_step=20, logged=TOPK_LAYERWISE_SEED3) == TRAINED_THROUGHOUT
    assert blow_up(3.03, 21, [(1, 2.4), (20, 1.768)]) is None  # 1.7 x the lowest before it
    # block-k global at ~10 at step 53: above 2 ln 10 = 4.61, whenever it comes
    assert stability_of(0.4, 0.85, 14.51, peak_step=53, logged=[(1, 2.5), (20, 2.4), (40, 1.45)]) == BLEW_UP_RECOVERED
    assert blow_up(5.32, 20, [(1, 2.7)]) == (20, 5.32, 2.7)
    # random-k global back at 4.5 from 1.2: above ln 10 and twice the lowest before it
    assert blow_up(4.525, 140, RANDK_GLOBAL_SEED1) == (140, 4.525, 1.211)
    # a spike that is not the run's largest loss: the peak is an early blip, a later logged step
    # rises from 0.6 to 2.5
    late = [(1, 2.4), (20, 3.8), (200, 0.6), (300, 2.5), (320, 0.7)]
    assert blow_up(3.8, 20, late) == (300, 2.5, 0.6)
    # below ln 10 is never a blow-up, however far it rose
    assert blow_up(2.2, 500, [(1, 2.4), (400, 0.3)]) is None
    # no logged steps (a summary alone): the level rule only
    assert stability_of(0.3, 0.9, 3.9) == TRAINED_THROUGHOUT and stability_of(0.3, 0.9, 4.7) == BLEW_UP_RECOVERED


def test_the_loader_reads_the_blow_up_from_the_peak_and_the_logged_steps(tmp_path):
    import json

    from test_analysis import make_config, write_run

    from sparsetrain.analysis.loader import load_runs

    rows = {}
    for name, peak, step, logged in (("blip", 2.586, 20, TOPK_LAYERWISE_SEED3),
                                     ("spike", 4.525, 140, RANDK_GLOBAL_SEED1)):
        run = write_run(tmp_path / name, make_config(scheme="randk", scope="global", ratio=0.01))
        summary = json.loads((run / "summary.json").read_text())
        summary["train_loss_peak"] = {"after_step_20": {"from_step": 20, "train_loss": peak, "step": step}}
        (run / "summary.json").write_text(json.dumps(summary))
        records = [{"kind": "step", "step": s, "train_loss": loss} for s, loss in logged]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        rows[name] = load_runs(run).iloc[0]
    assert rows["blip"]["stability"] == TRAINED_THROUGHOUT and math.isnan(rows["blip"]["loss_spike"])
    assert rows["spike"]["stability"] == BLEW_UP_RECOVERED
    assert (rows["spike"]["loss_spike"], rows["spike"]["loss_spike_step"]) == (4.525, 140)
