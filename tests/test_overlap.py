"""An exchange overlapped with backward (issue 37, item 4): the buckets' handoff times a run
records (``timing.BucketClock``), the exposed time the cost model charges for them
(``costmodel.exposed_ms``), and how time to accuracy and the DDP overlap table use them. Every
number is worked out by hand here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_analysis import make_config, write_run

from sparsetrain import analysis as sa
from sparsetrain.analysis import cluster_check
from sparsetrain.analysis import time_to_accuracy as tta
from sparsetrain.costmodel import Collective, CostModel, SchemeCost, exposed_ms
from sparsetrain.timing import BucketClock

ALPHA = 50e-6


def _clock(times, skip=0):
    ticks = iter(times)
    return BucketClock(skip=skip, now=lambda: next(ticks))


def test_bucket_clock_leads_skip_and_new_buckets():
    clock = _clock([0.0, 0.010, 0.030,   # skipped
                    1.0, 1.004, 1.010,   # leads 10, 6, 0 ms
                    2.0, 2.008, 2.010,   # leads 10, 2, 0 ms
                    3.0, 3.001], skip=1)  # two buckets now: the average starts again
    assert clock.means() is None
    for _ in range(3):
        for numel in (50, 30, 20):
            clock.mark(numel)
        clock.close()
    (a, b, c) = clock.means()
    assert clock.steps == 2
    assert a == pytest.approx((0.5, 10.0)) and b == pytest.approx((0.3, 4.0)) and c == pytest.approx((0.2, 0.0))
    clock.close()  # a step without handoffs changes nothing
    assert clock.steps == 2
    for numel in (80, 20):
        clock.mark(numel)
    clock.close()
    (a, b) = clock.means()
    assert clock.steps == 1 and a == pytest.approx((0.8, 1.0)) and b == pytest.approx((0.2, 0.0))


def test_exposed_time_follows_the_buckets_on_one_link():
    def cost(share):
        return 100.0 * share  # ms for a bucket holding `share` of the bytes

    assert exposed_ms([(1.0, 0.0)], cost) == 100.0  # one bucket at backward's end: nothing hidden
    assert exposed_ms([(1.0, 500.0)], cost) == 0.0  # ready long before the end: all hidden
    # the first bucket finishes 60 ms before the end; the second starts at the end
    assert exposed_ms([(0.5, 110.0), (0.5, 0.0)], cost) == pytest.approx(50.0)
    # the link is still busy with the first (from -10 to +80) when the second is ready at 0
    assert exposed_ms([(0.9, 10.0), (0.1, 0.0)], cost) == pytest.approx(90.0)
    # the cost model: each bucket a collective of its own (latency included) at the link's rate
    ring = Collective("allreduce", ALPHA, 0.0, None, floor_beta=0.0).at_rate(1e9)
    model = CostModel({"allreduce": ring})
    plain = SchemeCost("dense", "allreduce", 1e6)
    split = SchemeCost("dense", "allreduce", 1e6, buckets=((0.75, 2.0), (0.25, 0.0)))
    t_all, t_big, t_small = (1e3 * ring.time(n, 4) for n in (1e6, 7.5e5, 2.5e5))
    assert model.exchange_ms(plain, 4) == pytest.approx(t_all)
    assert model.exchange_ms(split, 4) == pytest.approx(max(t_big - 2.0, 0.0) + t_small)
    assert t_small < model.exchange_ms(split, 4) < t_all
    periodic = SchemeCost("localsgd", "allreduce", 1e6, period=4, buckets=((1.0, 50.0),))
    assert model.exchange_ms(periodic, 4) == pytest.approx(1e3 * ring.time(4e6, 4) / 4)  # not overlapped


def test_a_run_with_recorded_buckets_is_charged_what_backward_does_not_hide(tmp_path):
    run = write_run(tmp_path / "dense", make_config(scheme="none"))
    summary = json.loads((run / "summary.json").read_text())
    buckets = [{"share": 0.75, "lead_ms": 3.0}, {"share": 0.25, "lead_ms": 0.0}]
    (run / "summary.json").write_text(json.dumps({**summary, "overlap_buckets": buckets}))
    row = sa.load_runs(run).iloc[0].to_dict()
    assert row["overlap_buckets"] == ((0.75, 3.0), (0.25, 0.0))
    model = tta.default_model(ALPHA)
    own = tta.compute_ms(row)
    nbytes = row["bytes_sent_per_step"]
    step, _ = tta.predict_step_ms(row, 8, 1e9, model)
    hidden = step - own
    by_hand = max(model.time_ms("allreduce", 0.75 * nbytes, 8, 1e9) - 3.0, 0.0) + model.time_ms(
        "allreduce", 0.25 * nbytes, 8, 1e9)
    assert hidden == pytest.approx(by_hand, rel=1e-12)
    whole, _ = tta.predict_step_ms({**row, "overlap_buckets": None}, 8, 1e9, model)
    assert whole == pytest.approx(own + model.time_ms("allreduce", nbytes, 8, 1e9), rel=1e-12)
    assert step < whole
    # predicted on a compute twice the run's own: backward is twice as long, each lead too
    slow, _ = tta.predict_step_ms(row, 8, 1e9, model, compute=2 * own)
    by_hand = max(model.time_ms("allreduce", 0.75 * nbytes, 8, 1e9) - 6.0, 0.0) + model.time_ms(
        "allreduce", 0.25 * nbytes, 8, 1e9)
    assert slow - 2 * own == pytest.approx(by_hand, rel=1e-12)


def test_ddp_overlap_table_sets_the_modelled_exposure_beside_the_measured():
    buckets = [{"share": 0.5, "lead_ms": 40.0}, {"share": 0.5, "lead_ms": 0.0}]
    ddp = {"results": [{"meta": {"world_size": 4, "rate_bits": 1e9, "label": "1gbit"},
                        "configs": {"ddp": {"step_ms": 900.0, "phases_ms": {"exchange": 250.0},
                                            "bytes_sent_per_step": 1_000_000, "overlap_buckets": buckets},
                                    "reducer_blockk": {"step_ms": 700.0, "phases_ms": {"exchange": 20.0},
                                                       "bytes_sent_per_step": 10_000}}}]}
    model = tta.default_model(ALPHA)
    table = cluster_check.ddp_overlap(ddp, model).set_index("configuration")
    half = model.time_ms("allreduce", 500_000, 4, 1e9)
    assert table.loc["ddp", "modelled_exposed_ms"] == pytest.approx(max(half - 40.0, 0.0) + half, rel=1e-12)
    assert table.loc["ddp", "modelled_to_exposed"] == pytest.approx(table.loc["ddp", "modelled_exposed_ms"] / 250.0)
    assert math.isnan(table.loc["reducer_blockk", "modelled_exposed_ms"])  # after backward: no buckets


def _dense_run(root, name, seed, overlap=True, buckets=None, scheme="none"):
    config = make_config(scheme=scheme, seed=seed)
    config["dist"] = {**config.get("dist", {}), "overlap": overlap}
    run = write_run(root / name, config)
    if buckets is not None:
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "overlap_buckets": buckets}))
    return run


def test_a_run_from_before_the_record_borrows_the_buckets_of_its_kind(tmp_path):
    """A run without recorded buckets takes those of the runs of the same model, data, batch,
    path, scheme and overlap setting, each lead the same fraction of its own compute; a run of
    another scheme, or with dense overlap off, takes none."""
    donor = [{"share": 0.75, "lead_ms": 3.3}, {"share": 0.25, "lead_ms": 0.0}]  # compute 33 ms (seed 0)
    _dense_run(tmp_path, "donor", 0, buckets=donor)
    _dense_run(tmp_path, "old", 1)  # compute 33 x 1.1 = 36.3 ms
    _dense_run(tmp_path, "plain", 2, overlap=False)
    _dense_run(tmp_path, "topk", 1, scheme="topk")
    runs = sa.load_runs(tmp_path).set_index("run_dir", drop=False)
    got = tta.borrowed_buckets(runs)
    by_name = {Path(k).name: v for k, v in got.items()}
    assert by_name["donor"] == ((0.75, 3.3), (0.25, 0.0))
    (share, lead), last = by_name["old"]
    assert share == 0.75 and lead == pytest.approx(0.1 * 36.3, rel=1e-12) and last == (0.25, 0.0)
    assert by_name["plain"] == () and by_name["topk"] == ()
    # the prediction uses them: the borrowed run is charged less than the same run without
    table = tta.predict_runs(runs, 0.5, [1], [8], tta.default_model(ALPHA), compute="own")
    step = {Path(r["run_dir"]).name: r["predicted_step_ms"] for _, r in table.iterrows()}
    old = runs[runs["run_dir"].str.endswith("old")].iloc[0].to_dict()
    whole, _ = tta.predict_step_ms({**old, "overlap_buckets": None}, 8, 1e9, tta.default_model(ALPHA))
    assert step["old"] < whole
    notes = tta.time_to_accuracy_table(runs, 0.5, [1], [8], tta.default_model(ALPHA)).notes
    assert "Overlap with backward: 1 runs' own buckets, 1 borrowed from runs of their kind." in notes
