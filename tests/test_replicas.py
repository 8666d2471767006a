"""Every rank holds the same model, checked at each epoch's end (sparsetrain.train.replicas): a
researcher's compressor that says it draws shared positions but picks them from its own rank's
gradient, under AllReduce, used to train one model per rank while the sharded evaluation scored
a mixture of them, without a word. Now the run stops after its first compressed step (and the
check runs again at every epoch's end), in one line, and is recorded failed."""

from __future__ import annotations

import math
import re
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT, TINY, read_json, run_cli
from test_ddp_hook import _free_port

from sparsetrain.errors import ReplicasDiffer
from sparsetrain.train.replicas import TOLERANCE, check_replicas, fingerprints


def test_fingerprints_tell_a_reordered_tensor_from_the_same_one():
    torch.manual_seed(0)
    p = torch.randn(1000)
    same, shuffled = fingerprints([p.clone()]), fingerprints([p[torch.randperm(1000)]])
    assert torch.equal(fingerprints([p]), same)
    assert shuffled[0] == pytest.approx(float(same[0]), rel=1e-12)  # one norm...
    assert abs(float(shuffled[1] - same[1])) / math.sqrt(float(same[0])) > 100 * TOLERANCE  # ...other entries


CASES = ("equal", "rounding", "update")


def _worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for case in CASES:
            torch.manual_seed(0)
            params = [("conv.weight", torch.randn(8, 3, 3, 3)), ("conv.bias", torch.randn(8)),
                      ("fc.weight", torch.randn(10, 8))]
            if rank == 1 and case == "update":  # another update on one rank: a step of 1e-3 of each entry's size
                params[2][1].add_(1e-3 * torch.randn(10, 8, generator=torch.Generator().manual_seed(1)))
            if rank == 1 and case == "rounding":  # one ulp here and there: what another device's rounding does
                w = params[0][1].view(-1)
                w[::7] = torch.nextafter(w[::7], torch.full_like(w[::7], math.inf))
            try:
                check_replicas(params, world, "step 5 (epoch 1)", "hint.")
                results[case] = "same"
            except ReplicasDiffer as exc:
                results[case] = str(exc)
        torch.save(results, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_that_applied_another_update_stop_together(tmp_path):
    """Two gloo ranks: the same model passes, so does one ulp of rounding; another update on one
    rank raises on both (no rank left waiting), naming the tensor."""
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert results[0] == results[1]
    assert results[0]["equal"] == results[0]["rounding"] == "same"
    assert results[0]["update"].startswith("the ranks' models differ at step 5 (epoch 1): 1 of 3 parameter tensors, "
                                           "fc.weight by ")
    assert results[0]["update"].endswith("every rank must apply the same update. hint.")


SHARED_TOPK = '''
from sparsetrain.compress import TopK


class SharedTopK(TopK):
    """Top-k that claims every rank draws the same positions (it does not: each picks its own
    gradient's largest), so AllReduce is allowed and sums values at different positions."""
    shared_positions = True
'''

SCHEME = '''
defaults:
  - base_scheme
  - _self_
name: shared_topk
compressor:
  _target_: sharedtopk.SharedTopK
  _partial_: true
'''


def test_a_compressor_whose_ranks_part_stops_the_run_in_one_line(tmp_path):
    (tmp_path / "sharedtopk.py").write_text(textwrap.dedent(SHARED_TOPK))
    (tmp_path / "conf" / "scheme").mkdir(parents=True)
    (tmp_path / "conf" / "scheme" / "shared_topk.yaml").write_text(SCHEME)
    run = tmp_path / "run"
    proc = run_cli("--config-dir", str(tmp_path / "conf"), *TINY, "scheme=shared_topk", "aggregation=allreduce",
                   "world_size=2", "train.epochs=1", "data.train_size=256", f"hydra.run.dir={run}",
                   env={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ReplicasDiffer: the ranks' models differ at step 1 (epoch 0.25)" in errors[0], proc.stderr[-2000:]
    assert "scheme=shared_topk, aggregation=allreduce" in errors[0] and "shared_positions=True" in errors[0]
    summary = read_json(run / "summary.json")
    # every rank raises: whichever the launcher hears of first is recorded (rank 0's own, or "rank 1 failed: ...")
    assert summary["status"] == "failed"
    assert re.match(r"(rank \d failed: )?ReplicasDiffer: the ranks' models differ at step 1 ", summary["error"])
    assert summary.get("test_accuracy") is None  # nothing scored from the mixture
