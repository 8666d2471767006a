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


def _union_topk():
    """A compressor of two rounds of two collectives (gTop-k style): every rank's top-k
    positions gathered, then the values at their union summed."""
    from sparsetrain.compress import Payload, TopK
    from sparsetrain.compress.base import Round

    class UnionTopK(TopK):
        shared_positions = False

        def rounds(self, aggregation):
            return (Round("gather", ints=self.k, int_dtype=torch.int32), Round("sum", floats=4 * self.k))

        def send(self, r, step, mine):
            if r == 0:
                mine.ints.copy_(self.compress(step.acc).indices)
                return
            union = step.scratch["union"]
            mine.floats.zero_()
            mine.floats[: union.numel()] = step.acc[union]
            step.payload = Payload(step.acc[union].clone(), union, union)

        def receive(self, r, step, got, out):
            if r == 0:
                step.scratch["union"] = torch.cat([m.ints.long() for m in got]).unique()
                return
            union = step.scratch["union"]
            out.index_add_(0, union, got.floats[: union.numel()] / step.world)

    return UnionTopK


def test_wire_bytes_of_rounds_of_two_collectives_take_each_ones_ring_factor():
    """Positions gathered (4,000 bytes), then values summed (16,000), at 4 ranks: the ring moves
    3 x 4,000 + 1.5 x 16,000 = 36,000 bytes per rank, not 3 x 20,000 (one collective's factor
    for all the rounds, as the record counted them before)."""
    from sparsetrain.comm.sparse import SparseReducer
    from sparsetrain.train.tally import Tally

    cls = _union_topk()
    red = SparseReducer(cls(0.01, [100_000], "layerwise"), aggregation="allgather", world_size=4, rank=0, seed=0)
    assert red.bytes_by_collective == {"allgather": 4000, "allreduce": 16000}
    assert red.bytes_sent_per_step == 20000 and red.collective == "allgather"
    tally = Tally(4, torch.device("cpu"), 0)
    assert tally.wire_bytes(red.collective, red.bytes_sent_per_step, red.bytes_by_collective) == 36000
    # a step's statistics carry the split, as summary.json and metrics.jsonl read them
    one = SparseReducer(cls(0.01, [1000], "layerwise"), aggregation="allgather", world_size=1, rank=0, seed=0)
    stats = one.reduce(torch.randn(1000), 0, PhaseTimer("cpu", warmup_steps=0))
    assert stats.bytes_by_collective == {"allgather": 40, "allreduce": 160} == one.bytes_by_collective


@pytest.mark.parametrize("world", [2, 3, 4, 12])
def test_the_built_ins_wire_bytes_are_those_of_their_one_collective(world):
    """Every built-in scheme's rounds use one collective: its wire bytes with the split are the
    bytes of one collective's ring factor, as recorded before the split existed."""
    from conftest import SCHEME_TARGETS

    from sparsetrain.train.tally import Tally

    tally = Tally(world, torch.device("cpu"), 0)
    shapes = [(20, 15), (12001,), (64,), (7,)]
    for scheme in (s for s, target in SCHEME_TARGETS.items() if target):
        for aggregation in ("allreduce", "allgather"):
            try:
                red = _reducer(scheme, aggregation, world, shapes=shapes)
            except ValueError:  # an aggregation the scheme refuses
                continue
            assert len(red.bytes_by_collective) == 1, (scheme, aggregation)
            assert tally.wire_bytes(red.collective, red.bytes_sent_per_step, red.bytes_by_collective) == \
                tally.wire_bytes(red.collective, red.bytes_sent_per_step), (scheme, aggregation)


def _ddp_mixed_rounds(rank, world):
    """One DDP step through the sparse hook with the two-collective compressor (a layer of 20 x 50
    and its bias, which travels whole): the hook's bytes, split by collective."""
    from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(50, 20), gradient_as_bucket_view=True)
    state = SparseHookState(model, "uniontopk", aggregation="allgather", ratio=0.1, compressor=_union_topk())
    model.register_comm_hook(state, sparse_hook)
    model(torch.randn(4, 50)).sum().backward()
    return state.bytes_by_collective, state.sizes()["bytes_by_collective"], state.bytes_sent_per_step


@pytest.mark.slow  # two spawned gloo ranks
def test_the_ddp_hook_splits_its_bytes_by_collective(tmp_path):
    from conftest import on_gloo_ranks

    for split, planned, sent in on_gloo_ranks(_ddp_mixed_rounds, tmp_path):
        # k = 100 int32 positions gathered; 400 floats and the 20 whole bias entries summed
        assert split == planned == {"allgather": 400, "allreduce": 4 * 420}
        assert sent == 400 + 4 * 420


def test_a_local_sgd_synchronisation_counts_its_buffers_at_allreduces_factor():
    """Local SGD / DiLoCo over a gathering exchange: the batch-norm buffers travel in an AllReduce
    of their own, but were counted at the inner exchange's AllGather factor (4 ranks: 3x, not
    1.5x). Each part now at its own collective's factor, per synchronisation and per step."""
    from sparsetrain.comm.periodic import PeriodicSync
    from sparsetrain.compress import QSGD
    from sparsetrain.train.tally import Tally

    net = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.BatchNorm1d(20), torch.nn.Linear(20, 3))
    params = list(net.parameters())
    numel = sum(p.numel() for p in params)
    inner = build_reducer("qsgd", "layerwise", "allgather", 0.5, Layout.from_sizes([numel]), world_size=4,
                          rank=0, seed=0, compressor=QSGD)
    local = PeriodicSync(params, list(net.buffers()), inner, period=2)
    buffers = 2 * 20 * 4  # running mean and variance, float32 (num_batches_tracked is no float)
    assert local.bytes_by_collective_per_sync == {"allgather": inner.bytes_sent_per_step, "allreduce": buffers}
    tally = Tally(4, torch.device("cpu"), 0)
    want = wire_bytes("allgather", inner.bytes_sent_per_step, 4) + wire_bytes("allreduce", buffers, 4)
    assert tally.wire_bytes(local.collective, local.bytes_per_sync, local.bytes_by_collective_per_sync) == round(want)
    assert tally.wire_bytes(local.collective, local.bytes_sent_per_step, local.bytes_by_collective) == round(want / 2)
