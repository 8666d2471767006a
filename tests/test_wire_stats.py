"""Wire bytes per rank (issue 12, item 2) and compression statistics on logged steps only
(item 3): the reducers' sizes through ``costmodel.wire_bytes``, and a real one-rank run that
counts the statistics passes."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, compressor_for
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sparsetrain.comm import build_reducer
from sparsetrain.compress import Layout
from sparsetrain.config import CONF_DIR, register
from sparsetrain.costmodel import wire_bytes
from sparsetrain.rank import RankInfo
from sparsetrain.results import logged_step
from sparsetrain.timing import PhaseTimer

LAYOUT = Layout.from_sizes([300, 12001, 64, 7])  # the last two travel whole
FLAGS = [False, False, True, True]
WHOLE = 64 + 7


def _reducer(scheme, aggregation, world, **kw):
    return build_reducer(scheme, "layerwise", aggregation, 0.05, LAYOUT, world_size=world, rank=0,
                         seed=0, uncompressed=FLAGS if scheme != "none" else None,
                         compressor=compressor_for(scheme), **kw)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_wire_bytes_exact_per_aggregation_and_dense(world):
    k = round(0.05 * 300) + round(0.05 * 12001)  # layer-wise k_i
    dense = _reducer("none", "allreduce", world)
    assert dense.collective == "allreduce"
    assert wire_bytes(dense.collective, dense.bytes_sent_per_step, world) == {
        1: 0, 2: 4 * LAYOUT.total, 4: 1.5 * 4 * LAYOUT.total}[world]
    shared = _reducer("blockk", "allreduce", world)  # k values + the whole tensors, summed
    assert shared.bytes_sent_per_step == 4 * (k + WHOLE)
    assert wire_bytes(shared.collective, shared.bytes_sent_per_step, world) == {
        1: 0, 2: 4 * (k + WHOLE), 4: 6 * (k + WHOLE)}[world]
    own = _reducer("randk", "allgather", world)  # values + whole + int32 positions, gathered
    message = 4 * (k + WHOLE) + 4 * k
    assert own.bytes_sent_per_step == message
    assert wire_bytes(own.collective, own.bytes_sent_per_step, world) == {
        1: 0, 2: message, 4: 3 * message}[world]


def _counting(monkeypatch):
    calls = []
    real = torch.dot
    monkeypatch.setattr(torch, "dot", lambda a, b: calls.append(1) or real(a, b))
    return calls


@pytest.mark.parametrize("error_feedback", [True, False])
def test_no_statistics_pass_on_unlogged_steps(monkeypatch, error_feedback):
    """The caller (the trainer: the steps it logs) asks for statistics; no pass otherwise."""
    red = _reducer("topk", "allgather", 1, error_feedback=error_feedback)
    calls = _counting(monkeypatch)
    timer = PhaseTimer("cpu", warmup_steps=0)
    logged = []
    for step in range(8):
        before = len(calls)
        with timer.step():
            stats = red.reduce(torch.randn(LAYOUT.total), step, timer, want_stats=logged_step(step + 1, 3))
        done = step + 1
        if logged_step(done, 3):  # after steps 1, 3, 6: the trainer's log steps
            logged.append(done)
            assert stats.compression_error is not None and stats.memory_norm is not None
            assert len(calls) > before
        else:
            assert stats.compression_error is None and stats.memory_norm is None
            assert len(calls) == before, f"a statistics pass on unlogged step {done}"
    assert logged == [1, 3, 6]


def test_trainer_computes_statistics_on_logged_steps_only(tmp_path):
    """A real one-rank run (warm-up 2 dense steps, then block-k): the error-feedback statistics
    run exactly on the steps the trainer logs, and every logged step record carries them."""
    from sparsetrain.results import METRICS, SUMMARY
    from sparsetrain.train import Trainer

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *TINY, "scheme=blockk", "world_size=1", "train.max_steps=8", "train.log_every=3",
            "scheme.warmup_steps=2", "train.checkpoint=false", "train.eval_every=1"])
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    trainer = Trainer(cfg, RankInfo(0, 1, 0, 1, "single"), tmp_path / "run", torch.device("cpu"))
    red = trainer.reducer
    passes, seen = [], []
    real_stats, real_reduce = red.memory.norm, red.reduce  # the memory's norm: on logged steps only

    def stats(*args, **kwargs):
        passes.append(trainer.step + 1)  # the step being run, 1-based like the log
        return real_stats(*args, **kwargs)

    def reduce(flat, step, timer, want_stats=False):
        out = real_reduce(flat, step, timer, want_stats=want_stats)
        seen.append((step + 1, out))
        return out

    red.memory.norm, red.reduce = stats, reduce
    trainer.fit()
    assert passes == [3, 6]  # logged compressing steps (1 and 2 are warm-up: dense, no pass)
    for done, out in seen:
        if done > 2 and not logged_step(done, 3):
            assert out.compression_error is None and out.memory_norm is None
    import json

    records = [json.loads(line) for line in (tmp_path / "run" / METRICS).read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 3, 6]
    assert all(r["compression_error"] is not None and r["memory_norm"] is not None for r in steps)
    assert all(r["wire_bytes"] == 0 for r in steps)  # one rank: nothing crosses a link
    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert summary["memory_norm_max"] == max(r["memory_norm"] for r in steps) > 0
    assert summary["wire_bytes_per_step"] == 0 and summary["wire_bytes_total"] == 0
