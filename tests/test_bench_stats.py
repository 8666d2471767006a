"""The benchmarks' statistics, report and row building, without a cluster: the median's
order-statistic interval on known samples, the flag against compute-only, compute-only's
flatness across rates, the round-robin order, the summary of rounds, the shared table formatter,
the step report on both step.json schemas, and rows built from the studies' config."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from sparsetrain.benchmarks import harness, step
from sparsetrain.benchmarks.timing_stats import (
    Interval,
    compute_flags,
    coverage,
    flatness,
    median_interval,
    paired_ratio,
    round_order,
)
from sparsetrain.launch.report import grid

REPO = Path(__file__).resolve().parents[1]


def _brute_coverage(n: int, j: int) -> float:
    # P(x_(j) <= m <= x_(n+1-j)) = P(j <= #{x_i < m} <= n - j), #{x_i < m} ~ Bin(n, 1/2)
    return sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2**n


@pytest.mark.parametrize("n", range(1, 16))
def test_coverage_is_the_binomial_probability(n):
    for j in range(1, (n + 1) // 2 + 1):
        assert coverage(n, j) == pytest.approx(_brute_coverage(n, j))


@pytest.mark.parametrize(
    "values, median, low, high, level",
    [
        ([5, 1, 4, 2, 3], 3, 1, 5, 1 - 2 / 32),  # 5 rounds: [min, max] reaches only 93.75%
        ([6, 1, 5, 2, 4, 3], 3.5, 1, 6, 1 - 2 / 64),  # 6 rounds: [min, max] is >= 95%
        (list(range(9, 0, -1)), 5, 2, 8, 1 - 2 * (1 + 9) / 2**9),  # 9: [x(2), x(8)], 96.1%
        (list(range(1, 11)), 5.5, 2, 9, 1 - 2 * (1 + 10) / 2**10),  # 10: [x(2), x(9)], 97.9%
        ([7.0], 7.0, 7.0, 7.0, 0.0),
    ],
)
def test_median_interval_on_known_samples(values, median, low, high, level):
    iv = median_interval(values)
    assert (iv.median, iv.low, iv.high, iv.n) == (median, low, high, len(values))
    assert iv.level == pytest.approx(level)
    # the narrowest at >= 95%: one step narrower would fall below
    if len(values) >= 6:
        j = sorted(values).index(low) + 1
        assert iv.level >= 0.95 and coverage(len(values), j + 1) < 0.95


def test_median_interval_is_robust_to_one_wild_round():
    iv = median_interval([100, 101, 99, 102, 98, 100, 101, 99, 5000])
    assert iv.high <= 102 and iv.median == 100


def test_flag_rows_that_claim_to_beat_compute_only():
    rows = {
        "compute": Interval(100, 95, 110, 0.96, 9),
        "ties": Interval(97, 90, 105, 0.96, 9),  # below compute's median, interval overlaps
        "below": Interval(80, 70, 90, 0.96, 9),  # wholly below: impossible, suspect
        "slower": Interval(130, 120, 140, 0.96, 9),
        "above_overlapping": Interval(104, 96, 112, 0.96, 9),  # does not claim to beat it
    }
    assert compute_flags(rows) == {"ties": "ties compute-only", "below": "below compute-only"}
    assert compute_flags({"dense": rows["slower"]}) == {}  # no compute row: nothing to flag


def test_flatness_of_compute_only_across_rates():
    flat = flatness({"1gbit": Interval(100, 95, 110, 0.96, 9), "250mbit": Interval(104, 99, 112, 0.96, 9),
                     "4gbit": Interval(98, 90, 101, 0.96, 9)})
    assert flat.flat and (flat.low, flat.high) == (99, 101) and flat.outliers == ()
    # the first pass's load drift: 1403 ms at 1 Gbit/s, ~970-990 ms at the others
    drift = flatness({"1gbit": Interval(1403, 1350, 1450, 0.96, 9), "paper": Interval(966, 940, 990, 0.96, 9),
                      "250mbit": Interval(985, 950, 1010, 0.96, 9), "4gbit": Interval(996, 960, 1020, 0.96, 9)})
    assert not drift.flat and drift.outliers == ("1gbit",) and drift.low is None


def test_round_order_puts_every_row_first_once():
    names = ["a", "b", "c", "d"]
    orders = [round_order(names, r) for r in range(len(names))]
    assert all(sorted(o) == names for o in orders)
    assert sorted(o[0] for o in orders) == names
    assert round_order(names, 5) == ["b", "c", "d", "a"]


def test_paired_ratio_cancels_a_load_drift():
    base = [100, 200, 100, 200, 100, 200]  # the load doubles every other round
    row = [90, 180, 90, 180, 90, 180]
    r = paired_ratio(row, base)
    assert r.median == pytest.approx(0.9) and r.low == pytest.approx(0.9) and r.high == pytest.approx(0.9)
    with pytest.raises(ValueError):
        paired_ratio([1, 2], [1])


def test_summarize_takes_the_slowest_rank_per_step_and_the_median_per_round():
    # 2 ranks, 2 rows, 3 rounds of 3 steps
    r0 = {"compute": {"rounds": [[10, 12, 11], [20, 20, 20], [10, 10, 10]], "phases": [{"forward": 1.0}] * 3},
          "dense": {"rounds": [[30, 31, 29], [40, 40, 40], [30, 30, 30]], "phases": [{"exchange": 5.0}] * 3}}
    r1 = {"compute": {"rounds": [[11, 11, 13], [20, 25, 20], [10, 10, 10]], "phases": [{"forward": 3.0}] * 3},
          "dense": {"rounds": [[30, 30, 30], [40, 40, 40], [30, 33, 30]], "phases": [{"exchange": 7.0}] * 3}}
    s = harness.summarize([r0, r1], ["compute", "dense"], 3)
    assert s["compute"]["steps_ms"][0] == [11, 12, 13]  # max over ranks, step by step
    assert s["compute"]["round_ms"] == [12, 20, 10]
    assert s["compute"]["step_ms"] == 12 and (s["compute"]["ci_low_ms"], s["compute"]["ci_high_ms"]) == (10, 20)
    assert s["dense"]["round_ms"] == [30, 40, 30]
    assert s["compute"]["phases_ms"]["forward"] == 2.0  # median over ranks, then over rounds
    assert s["dense"]["x_compute"] == pytest.approx(2.5)  # per-round ratios 2.5, 2.0, 3.0
    assert s["dense"]["x_compute_ci"] == [pytest.approx(2.0), pytest.approx(3.0)]


def test_visits_merge_to_the_summary_of_all_their_rounds():
    """A rate measured in two visits (rounds 1-2, then round 3) summarizes as if its three rounds
    had run in one: medians, intervals, phases and the per-round ratios to compute-only."""
    from sparsetrain.benchmarks.step import merge_visits

    def ranks(rounds):  # one rank; 2 rows; per round: step times and a phase value
        return [{"compute": {"rounds": [s for s, _ in rounds], "phases": [{"forward": f} for _, f in rounds]},
                 "dense": {"rounds": [[2 * x for x in s] for s, _ in rounds],
                           "phases": [{"exchange": 3 * f} for _, f in rounds]}}]

    rounds = [([10, 11, 12], 1.0), ([20, 21, 22], 5.0), ([30, 31, 32], 2.0)]
    whole = harness.summarize(ranks(rounds), ["compute", "dense"], 3)
    parts = [{"meta": {"rounds": n, "wall_s": 1.0, "rate": "1gbit"},
              "schemes": harness.summarize(ranks(chunk), ["compute", "dense"], n)}
             for n, chunk in ((2, rounds[:2]), (1, rounds[2:]))]
    merged = merge_visits(parts)
    assert merged["meta"]["rounds"] == 3 and merged["meta"]["visits"] == 2 and merged["meta"]["wall_s"] == 2.0
    for row in ("compute", "dense"):
        for key in ("round_ms", "step_ms", "ci_low_ms", "ci_high_ms", "phases_ms", "x_compute", "x_compute_ci"):
            assert merged["schemes"][row][key] == whole[row][key], (row, key)
    assert merged["schemes"]["compute"]["round_ms"] == [11, 21, 31]


def test_grid_aligns_columns_and_refuses_ragged_rows():
    text = grid(["row", "ms"], [["compute", "1.0"], ["dense_ovl", "123.4"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1  # every line as wide
    assert lines[1].startswith("|---") and lines[1].endswith(":|")  # numbers right-aligned
    assert lines[3] == "| dense_ovl | 123.4 |"
    with pytest.raises(ValueError):
        grid(["a", "b"], [["only one"]])


def test_parse_rows_expands_a_scheme_to_every_aggregation_the_studies_train():
    assert step.parse_rows("compute,dense,blockk_ag,blockk_ar,ddp") == ["compute", "dense", "blockk_ag", "blockk_ar", "ddp"]
    assert step.parse_rows("topk_ag,randk_ar,topk_ag") == ["topk_ag", "randk_ar"]
    # a scheme's name is all of its rows, as --help says
    assert step.parse_rows("compute,blockk,randk_ar") == ["compute", "blockk_ag", "blockk_ar", "randk_ar"]
    with pytest.raises(SystemExit):
        step.parse_rows("nosuch")


def test_report_rewrites_a_saved_run_byte_for_byte(tmp_path):
    """`make figures` re-renders results/bench/step.json in place: same bytes."""
    src = REPO / "results" / "bench"
    shutil.copy(src / "step.json", tmp_path / "step.json")
    doc = json.loads((src / "step.json").read_text())
    text = step.render(doc, tmp_path)
    assert (tmp_path / "step.json").read_bytes() == (src / "step.json").read_bytes()
    assert (tmp_path / "step.csv").read_bytes() == (src / "step.csv").read_bytes()
    assert "noise check" in text
    with pytest.raises(SystemExit, match="schema 1 is not supported"):
        step.render({**doc, "schema": 1}, tmp_path)


def test_report_without_out_writes_next_to_the_saved_file(tmp_path, capsys):
    """`--report <dir>/step.json` redraws its outputs in <dir>: by default it wrote into
    results/bench, over the committed benchmark (a newcomer's walkthrough of one's own rows)."""
    src = REPO / "results" / "bench"
    committed = {name: (src / name).read_bytes() for name in ("step.json", "step.csv", "step.txt")}
    shutil.copy(src / "step.json", tmp_path / "step.json")
    assert step.main(["--report", str(tmp_path / "step.json")]) == 0
    assert (tmp_path / "step.csv").read_bytes() == committed["step.csv"] and "noise check" in capsys.readouterr().out
    assert {name: (src / name).read_bytes() for name in committed} == committed


def test_a_rows_collective_is_the_recorded_one_else_the_studies_rule():
    """The step table's and the cluster check's collective: what the worker recorded from the
    reducer; for files written before it did, the options by loader.collective_of's rule."""
    from sparsetrain.analysis.cluster_check import _timed_collective, bench_collective

    old = {"bytes_sent_per_step": 100}
    assert bench_collective("powersgd", {**old, "options": {"scheme": "powersgd", "aggregation": "allgather"}}) == "allreduce"
    assert bench_collective("dense", {**old, "options": {"scheme": "none", "aggregation": "allgather"}}) == "allreduce"
    assert bench_collective("topk_ag", {**old, "options": {"scheme": "topk", "aggregation": "allgather"}}) == "allgather"
    assert bench_collective("compute", {"bytes_sent_per_step": 0, "options": {"scheme": "none"}}) is None
    assert bench_collective("blockk", {}) == "allreduce"  # schema 1: by the row's name
    assert bench_collective("x", {**old, "collective": "allgather", "options": {"scheme": "powersgd"}}) == "allgather"
    # the cluster check times only exchanges that are a phase of their own
    ddp = {**old, "collective": "allreduce", "options": {"scheme": "none", "ddp": True}}
    assert bench_collective("ddp", ddp) == "allreduce" and _timed_collective("ddp", ddp) is None
    ovl = {**old, "options": {"scheme": "none", "overlap": True}}
    assert _timed_collective("dense_ovl", ovl) is None
    assert _timed_collective("powersgd", {**old, "options": {"scheme": "powersgd"}}) == "allreduce"


def _row(med, lo, hi, **kw):
    return {"step_ms": med, "ci_low_ms": lo, "ci_high_ms": hi, "ci_level": 0.96, "round_ms": [med] * 9,
            "phases_ms": {"exchange": kw.pop("exchange", 0.0)}, "bytes_sent_per_step": 0,
            "peak_rss_mb_per_rank": [1000.0], "x_compute": med / 100, "x_compute_ci": [0.9, 1.1], **kw}


def _result(label, rate_bits, compute, blockk):
    return {"meta": {"rate": label, "label": label, "rate_bits": rate_bits, "world_size": 4, "batch_per_rank": 8,
                     "threads_per_rank": 1, "rounds": 9, "steps": 3, "warmup": 2, "preset": "cpu_scale",
                     "ratio": 0.01},
            "schemes": {"compute": _row(*compute), "dense": _row(300, 290, 310, exchange=150.0),
                        "blockk_ag": _row(*blockk, options={"scheme": "blockk", "aggregation": "allgather"})}}


def test_report_of_a_new_file_flags_and_checks_flatness(tmp_path):
    results = [_result("1gbit", 1e9, (100, 95, 110), (98, 96, 104)),
               _result("250mbit", 2.5e8, (104, 99, 112), (120, 115, 125))]
    text = step.render({"schema": 2, "results": results}, tmp_path)
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["schema"] == 2
    assert doc["flags"] == {"1gbit": {"blockk_ag": "ties compute-only"}, "250mbit": {}}
    assert doc["noise_check"]["compute_flat"] and doc["noise_check"]["common_ms"] == [99, 110]
    assert "ties compute-only" in text and "compute-only is flat across bandwidths" in text
    assert (tmp_path / "step.txt").read_text().strip() == text.strip()
    assert len((tmp_path / "step.csv").read_text().splitlines()) == 1 + 2 * 3
    results[1] = _result("250mbit", 2.5e8, (140, 130, 150), (150, 140, 160))  # the load changed
    text = step.render({"schema": 2, "results": results}, tmp_path)
    assert "NOT flat" in text
    assert json.loads((tmp_path / "step.json").read_text())["noise_check"]["outliers"]


def test_rows_are_built_from_the_studies_config():
    from sparsetrain.compress import BlockRandomK
    from sparsetrain.errors import ConfigError
    from sparsetrain.train.components import exchange_from_config

    cfg = harness.study_config(["experiment=cpu_scale", "model=resnet20", *step.ROWS["blockk_ag"]], 1)
    model = harness.model_from_config(cfg)
    ex = exchange_from_config(cfg, model, world_size=1, rank=0)
    params, red = ex.params, ex.reducer
    ones = sum(p.numel() for p in params if p.dim() <= 1)
    assert isinstance(red.compressor, BlockRandomK) and red.aggregation == "allgather"
    assert red.uncompressed_numel == ones > 0  # scheme.uncompressed=1d: the 1-D tensors whole
    assert red.memory.enabled and cfg.ratio == 0.01
    assert harness.row_options(cfg)["uncompressed"] == "1d"
    ar = harness.study_config(["experiment=cpu_scale", *step.ROWS["randk_ar"]], 1)
    assert (ar.scheme.name, ar.aggregation.name) == ("randk", "allreduce")
    with pytest.raises(ConfigError):  # refused as the CLI refuses it
        harness.study_config(["experiment=cpu_scale", "scheme=topk", "aggregation=allreduce"], 1)


def test_worker_errors_names_the_ranks_own_exception():
    out = ("[r0] [rank0]: sparsetrain.errors.ConfigError: ratio=2.0 is not allowed\n"
           "[r1] torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "[r1] [rank1]: sparsetrain.errors.ConfigError: ratio=2.0 is not allowed\n[r1] exitcode  : 1\n")
    assert harness.worker_errors(out) == ": sparsetrain.errors.ConfigError: ratio=2.0 is not allowed"
    assert harness.worker_errors("[r0] all fine\n") == ""
