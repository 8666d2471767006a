"""The full scheme x scope x aggregation grid from the command line, at world_size 2."""


import pytest
from conftest import TINY, read_json, run_cli


@pytest.mark.slow  # a sweep of every combination
def test_full_grid_runs_every_valid_combination_and_refuses_topk_allreduce(tmp_path):
    sweep = tmp_path / "grid"
    proc = run_cli(*TINY, "-m", "scheme=topk,randk,blockk", "scope=layerwise,global",
                   "aggregation=allreduce,allgather", "world_size=2", "ratio=0.01",
                   "train.max_steps=2", f"hydra.sweep.dir={sweep}", timeout=900)
    summaries = {p.parent.name: read_json(p) for p in sweep.glob("*/summary.json")}
    assert len(summaries) == 12, sorted(summaries)
    refused = []
    for s in summaries.values():
        cfg = s["config"]
        scheme, agg = cfg["scheme"]["name"], cfg["aggregation"]["name"]
        if scheme == "topk" and agg == "allreduce":
            assert s["status"] == "failed"
            assert "aggregation='allreduce' is not available for scheme='topk'" in s["error"]
            refused.append(s)
            continue
        assert s["status"] == "completed", s["error"]
        assert s["world_size"] == 2 and s["steps"] == 2
        # the 1-D tensors travel whole (scheme.uncompressed=1d); the rest at the ratio
        assert 0 < s["uncompressed_bytes_per_step"] < 0.01 * s["dense_bytes_per_step"]
        ratio = (s["bytes_sent_per_step"] - s["uncompressed_bytes_per_step"]) / s["dense_bytes_per_step"]
        if agg == "allreduce" or scheme == "blockk":  # values only (+ a few block offsets)
            assert 0.009 <= ratio <= 0.0115, (scheme, cfg["scope"]["name"], agg, ratio)
        else:  # values + int32 positions
            assert 0.019 <= ratio <= 0.0215, (scheme, cfg["scope"]["name"], agg, ratio)
        for phase in ("compress", "exchange", "decompress"):
            assert s["time_ms"][phase] > 0, phase
    assert len(refused) == 2
    assert proc.returncode != 0 and "2 sweep job(s) did not complete" in proc.stderr
