"""The step and DDP benchmarks end to end on a tiny netcluster (one torchrun node per namespace;
marker netns: root + ip netns + tc), through their ``python -m`` command lines."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_netns import requires_netns

REPO = Path(__file__).resolve().parents[1]


def _ours() -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in ns + os.listdir("/sys/class/net") if n.startswith("sb")]


@pytest.mark.slow  # netns
@pytest.mark.netns
@requires_netns
def test_bench_step_tiny_end_to_end(tmp_path):
    before = set(_ours())
    cmd = [sys.executable, "-m", "sparsetrain.benchmarks.step", "--rates", "2gbit,paper",
           "--nproc", "2", "--batch", "2", "--steps", "1", "--warmup", "0", "--rounds", "2", "--visits", "2",
           "--schemes", "compute,dense,blockk_ag,blockk_ar,ddp,powersgd,signsgd_ag,qsgd_ag", "--out", str(tmp_path),
           "--model", "resnet20"]  # the mechanics, not the figures: ResNet-20 takes a third of ResNet-18's time
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["schema"] == 2
    labels = [r["meta"]["label"] for r in doc["results"]]
    assert labels == ["2gbit", "paper"]
    for r in doc["results"]:
        s = r["schemes"]
        # "blockk" = both aggregations the studies train it with
        assert set(s) == {"compute", "dense", "blockk_ag", "blockk_ar", "ddp", "powersgd", "signsgd_ag", "qsgd_ag"}
        # two visits of one round each, merged: rates interleave in time
        assert r["meta"]["rounds"] == 2 and r["meta"]["visits"] == 2 and r["meta"]["preset"] == "cpu_scale"
        assert s["dense"]["phases_ms"]["exchange"] > 0
        assert "exchange" not in s["compute"]["phases_ms"] and s["compute"]["bytes_sent_per_step"] == 0
        assert all(v > 0 for v in s["blockk_ag"]["peak_rss_mb_per_rank"])
        for row in s.values():
            assert len(row["round_ms"]) == 2 and row["ci_low_ms"] <= row["step_ms"] <= row["ci_high_ms"]
        for agg in ("ag", "ar"):
            o = s[f"blockk_{agg}"]["options"]
            assert o["aggregation"] == {"ag": "allgather", "ar": "allreduce"}[agg]
            assert o["uncompressed"] == "1d" and o["error_feedback"] and o["model"] == "resnet20"
        # AllGather sends its own positions too: more bytes than the shared-seed AllReduce
        assert s["blockk_ag"]["bytes_sent_per_step"] > s["blockk_ar"]["bytes_sent_per_step"]
        # the other families, each under dense SGD's bytes and timed by phase
        for row in ("powersgd", "signsgd_ag", "qsgd_ag"):
            assert 0 < s[row]["bytes_sent_per_step"] < s["dense"]["bytes_sent_per_step"]
            assert s[row]["phases_ms"]["compress"] > 0 and s[row]["phases_ms"]["exchange"] > 0
        # the collective each row's reducer ran, as recorded (PowerSGD AllReduces whatever
        # `aggregation` says; compute-only exchanges nothing)
        assert {n: s[n]["collective"] for n in ("compute", "dense", "blockk_ag", "blockk_ar", "powersgd", "ddp")} == {
            "compute": None, "dense": "allreduce", "blockk_ag": "allgather", "blockk_ar": "allreduce",
            "powersgd": "allreduce", "ddp": "allreduce"}
    assert "compute_flat" in doc["noise_check"]
    rows = list(csv.DictReader(open(tmp_path / "step.csv")))
    assert {(r["row"], r["aggregation"], r["collective"]) for r in rows if r["row"] == "powersgd"} == {
        ("powersgd", "allgather", "allreduce")}
    assert len(rows) == 16 and (tmp_path / "step_vs_bandwidth.png").exists()
    assert "noise check" in (tmp_path / "step.txt").read_text()
    assert set(_ours()) <= before  # every namespace and link of the run is gone


@pytest.mark.slow  # netns
@pytest.mark.netns
@requires_netns
def test_bench_step_cleans_up_when_a_rank_fails(tmp_path):
    before = set(_ours())
    # an invalid ratio makes every rank fail inside its namespace (the config check in the worker)
    cmd = [sys.executable, "-m", "sparsetrain.benchmarks.step", "--rates", "1gbit", "--nproc", "2",
           "--batch", "2", "--steps", "1", "--warmup", "0", "--rounds", "1", "--schemes", "compute",
           "--override", "ratio=2", "--out", str(tmp_path), "--rate-timeout", "120"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode != 0
    # the workers' own error, not only torchrun's summary
    assert "netcluster exited" in p.stderr and "ConfigError: ratio" in p.stderr, p.stderr[-3000:]
    assert set(_ours()) <= before


def _overlap_worker(rank, world, port, q):
    import torch
    import torch.distributed as dist

    from sparsetrain.comm import DenseReducer, build_exchange
    from sparsetrain.models import build_model
    from sparsetrain.timing import PhaseTimer
    from sparsetrain.train.step import TrainStep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = build_model("resnet20", 3, 10)
        flat, params, red = build_exchange(model.parameters(), "none", world_size=world, rank=rank, seed=0)
        assert isinstance(red, DenseReducer)
        if overlap:
            red.attach(params, flat, bucket_mb=0.05, first_bucket_mb=0.01)
            assert len(red._buckets) > 3
        g = torch.Generator().manual_seed(rank)
        batches = ((torch.randn(4, 3, 32, 32, generator=g), torch.arange(4)) for _ in range(2))
        step = TrainStep(model, None, red, flat, PhaseTimer("cpu", 0), "cpu")  # no optimizer
        for i in range(2):
            step(batches, i)
        results.append(flat.clone())
    q.put((rank, bool(torch.equal(results[0], results[1]))))
    dist.destroy_process_group()


def test_dense_reducer_overlap_matches_plain_allreduce():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_overlap_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: True, 1: True}


@pytest.mark.slow  # netns
@pytest.mark.netns
@requires_netns
def test_bench_ddp_tiny_end_to_end(tmp_path):
    """python -m sparsetrain.benchmarks.ddp: 2 ranks, one rate, one round, every configuration runs."""
    before = set(_ours())
    cmd = [sys.executable, "-m", "sparsetrain.benchmarks.ddp", "--rates", "paper", "--paper-rate", "2gbit",
           "--nproc", "2", "--batch", "2", "--rounds", "1", "--steps", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (res,) = json.loads((tmp_path / "ddp.json").read_text())["results"]
    assert res["meta"]["label"] == "paper" and res["meta"]["powersgd_rank"] == 3
    configs = res["configs"]
    assert set(configs) == {"compute", "ddp", "ddp_noop", "ddp_fp16", "ddp_bf16", "ddp_powersgd", "ddp_st_powersgd",
                            "ddp_blockk", "ddp_randk", "ddp_topk", "reducer_blockk"}
    assert all(c["step_ms"] > 0 for c in configs.values())
    sent = {k: c["bytes_sent_per_step"] for k, c in configs.items()}
    assert sent["compute"] == sent["ddp_noop"] == 0 and sent["ddp_fp16"] * 2 == sent["ddp"] == sent["ddp_bf16"] * 2
    assert sent["ddp_blockk"] == sent["reducer_blockk"] < sent["ddp"] / 50  # 1% + the 1-D tensors
    assert 0.8 < sent["ddp_powersgd"] / sent["ddp_blockk"] < 1.2  # matched bytes
    assert re.search(r"^\| ddp_blockk +\|", (tmp_path / "ddp.txt").read_text(), re.M)
    # the buckets the overlap model reads: DDP's inside backward, one for torch's PowerSGD on gloo
    assert configs["compute"]["overlap_buckets"] is None and configs["reducer_blockk"]["overlap_buckets"] is None
    assert [b["lead_ms"] for b in configs["ddp_powersgd"]["overlap_buckets"]] == [0.0]
    assert math.isclose(sum(b["share"] for b in configs["ddp"]["overlap_buckets"]), 1.0)
    assert set(_ours()) <= before


def test_bench_ddp_goals_use_the_per_round_ratios():
    """A round times every configuration once, so the goals compare rounds pairwise: a slow round
    (the machine's drift) cancels out of the ratio."""
    from sparsetrain.benchmarks.ddp import goals

    def conf(rounds, sent=1000):
        return {"round_ms": rounds, "step_ms": sorted(rounds)[len(rounds) // 2], "bytes_sent_per_step": sent}

    compute = [600.0, 900.0, 600.0, 900.0, 600.0, 900.0]
    res = {"configs": {"compute": conf(compute), "reducer_blockk": conf([c * 1.2 for c in compute]),
                       "ddp_blockk": conf([c * 1.08 for c in compute]),
                       "ddp_powersgd": conf([c * 1.3 for c in compute], sent=980)}}
    g = goals(res)
    assert g["ddp_blockk/compute"] == pytest.approx([1.08] * 3)
    assert g["ddp_blockk/compute<=1.10"] and g["ddp_blockk<=reducer_blockk"] and g["ddp_blockk<ddp_powersgd"]
    assert g["ddp_blockk/reducer_blockk"][0] == pytest.approx(0.9)
    res["configs"]["ddp_blockk"] = conf([c * 1.15 for c in compute])
    assert not goals(res)["ddp_blockk/compute<=1.10"]
