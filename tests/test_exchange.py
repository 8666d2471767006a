"""Exchange layer: reducers on real gloo process groups (2 ranks), checked against averages
computed by hand from each rank's gradient, memory and chosen positions."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import compressor_for

from sparsetrain.comm import (
    DenseReducer,
    SparseReducer,
    build_reducer,
    check_combination,
    flat_gradients,
)
from sparsetrain.compress import Layout, RandomK, TopK, step_seed, uncompressed_flags
from sparsetrain.timing import PhaseTimer

LAYOUT = Layout.from_sizes([7, 1, 300, 12001, 64])
RATIO = 0.05
SEED = 11
STEPS = 3
COMBOS = [
    (scheme, scope, agg)
    for scheme in ("topk", "randk", "blockk")
    for scope in ("layerwise", "global")
    for agg in ("allreduce", "allgather")
    if not (scheme == "topk" and agg == "allreduce")
]


# The same tensors with the last two (a 1-element and a 64-element "1-D" tensor) sent whole, and
# the first WARMUP steps dense: the layout the trainer builds with scheme.uncompressed.
TAIL_LAYOUT = Layout.from_sizes([7, 300, 12001, 1, 64])
TAIL_FLAGS = [False, False, False, True, True]
TAIL_NC = 7 + 300 + 12001
WARMUP = 1


def grad_of(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(LAYOUT.total, generator=g, dtype=torch.float64)


def build(scheme, scope, agg, rank, world, ratio=RATIO):
    return build_reducer(scheme, scope, agg, ratio, LAYOUT, world_size=world, rank=rank, seed=SEED,
                         compressor=compressor_for(scheme, block_size=32), dtype=torch.float64)


def hand_reference(scheme, scope, agg, world):
    """Per step: the average over ranks of acc_r masked to the entries rank r chose, computed
    with dense masks and explicit memory, not with the reducer."""
    comp = compressor_for(scheme, block_size=32)(RATIO, LAYOUT, scope)
    memory = [torch.zeros(LAYOUT.total, dtype=torch.float64) for _ in range(world)]
    outs, chosen = [], []
    for step in range(STEPS):
        avg = torch.zeros(LAYOUT.total, dtype=torch.float64)
        picks = []
        for r in range(world):
            acc = grad_of(r, step) + memory[r]
            seed = step_seed(SEED, step, None if agg == "allreduce" else r)
            _, idx = comp.select(acc, seed)
            mask = torch.zeros(LAYOUT.total, dtype=torch.bool)
            mask[idx] = True
            assert int(mask.sum()) == comp.k
            avg += torch.where(mask, acc, 0.0)
            memory[r] = torch.where(mask, 0.0, acc)
            picks.append(mask)
        outs.append(avg / world)
        chosen.append(picks)
    return outs, chosen, memory


def hand_reference_tail(scheme, scope, agg, world):
    """As ``hand_reference`` for TAIL_LAYOUT: the tail averaged whole, no memory for it, and the
    first WARMUP steps plain averages with the memory left empty."""
    comp = compressor_for(scheme, block_size=32)(RATIO, Layout(TAIL_LAYOUT.sizes[:3]), scope)
    memory = [torch.zeros(TAIL_NC, dtype=torch.float64) for _ in range(world)]
    outs = []
    for step in range(STEPS):
        avg = torch.zeros(TAIL_LAYOUT.total, dtype=torch.float64)
        for r in range(world):
            g = grad_of(r, step)
            if step < WARMUP:
                avg += g
                continue
            acc = g[:TAIL_NC] + memory[r]
            _, idx = comp.select(acc, step_seed(SEED, step, None if agg == "allreduce" else r))
            mask = torch.zeros(TAIL_NC, dtype=torch.bool)
            mask[idx] = True
            avg[:TAIL_NC] += torch.where(mask, acc, 0.0)
            avg[TAIL_NC:] += g[TAIL_NC:]
            memory[r] = torch.where(mask, 0.0, acc)
        outs.append(avg / world)
    return outs, memory


def build_tail(scheme, scope, agg, rank, world, ratio=RATIO):
    return build_reducer(scheme, scope, agg, ratio, TAIL_LAYOUT, world_size=world, rank=rank,
                         seed=SEED, compressor=compressor_for(scheme, block_size=32), dtype=torch.float64,
                         uncompressed=TAIL_FLAGS,
                         warmup_steps=WARMUP)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_steps(reducer, rank):
    """STEPS reductions of this rank's gradients: the outputs and the final memory (sparse)."""
    outs = []
    for step in range(STEPS):
        flat = grad_of(rank, step)
        reducer.reduce(flat, step, PhaseTimer("cpu", warmup_steps=0))
        outs.append(flat.clone())
    return outs, (reducer.memory.memory.clone() if isinstance(reducer, SparseReducer) else None)


def _worker(rank, world, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for scheme, scope, agg in COMBOS + [("none", "layerwise", "allreduce")]:
            results[(scheme, scope, agg)] = _run_steps(build(scheme, scope, agg, rank, world), rank)
            if scheme != "none":
                results[("tail", scheme, scope, agg)] = _run_steps(build_tail(scheme, scope, agg, rank, world), rank)
        # ratio = 1: every scheme and aggregation equals dense, bit for bit (W = 2)
        for scheme, scope, agg in COMBOS:
            red = build(scheme, scope, agg, rank, world, ratio=1.0)
            flat = grad_of(rank, 0)
            red.reduce(flat, 0, PhaseTimer("cpu", warmup_steps=0))
            results[("ratio1",) + (scheme, scope, agg)] = flat
        torch.save(results, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("gloo")
    mp.spawn(_worker, args=(2, _free_port(), str(path)), nprocs=2, join=True)
    return [torch.load(f"{path}/rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_two_ranks_match_hand_reference(gloo_results, scheme, scope, agg):
    ref, chosen, memory = hand_reference(scheme, scope, agg, 2)
    for rank in range(2):
        outs, mem = gloo_results[rank][(scheme, scope, agg)]
        for step in range(STEPS):
            torch.testing.assert_close(outs[step], ref[step], rtol=0, atol=1e-12)
        torch.testing.assert_close(mem, memory[rank], rtol=0, atol=1e-12)
    # ranks apply the identical update
    for step in range(STEPS):
        assert torch.equal(gloo_results[0][(scheme, scope, agg)][0][step], gloo_results[1][(scheme, scope, agg)][0][step])
    # shared seed: same positions on both ranks; own seed: different ones
    same = all(torch.equal(c[0], c[1]) for c in chosen)
    assert same == (agg == "allreduce")


def test_two_ranks_dense(gloo_results):
    outs, _ = gloo_results[0][("none", "layerwise", "allreduce")]
    for step in range(STEPS):
        torch.testing.assert_close(outs[step], (grad_of(0, step) + grad_of(1, step)) / 2, rtol=0, atol=0)


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_two_ranks_uncompressed_tail_and_warmup_match_hand_reference(gloo_results, scheme, scope, agg):
    ref, memory = hand_reference_tail(scheme, scope, agg, 2)
    for rank in range(2):
        outs, mem = gloo_results[rank][("tail", scheme, scope, agg)]
        for step in range(STEPS):
            torch.testing.assert_close(outs[step], ref[step], rtol=0, atol=1e-12)
        torch.testing.assert_close(mem, memory[rank], rtol=0, atol=1e-12)
    # the whole tensors arrive as the exact average, on both ranks
    for step in range(STEPS):
        tail = gloo_results[0][("tail", scheme, scope, agg)][0][step][TAIL_NC:]
        assert torch.equal(tail, (grad_of(0, step)[TAIL_NC:] + grad_of(1, step)[TAIL_NC:]) / 2)
        assert torch.equal(tail, gloo_results[1][("tail", scheme, scope, agg)][0][step][TAIL_NC:])


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_error_feedback_identity_with_uncompressed_tail(scheme, scope, agg):
    """float64, one process: update + new memory == gradient + old memory, bit for bit, on the
    compressed part; the tail is the gradient itself; warm-up steps leave the memory empty."""
    red = build_tail(scheme, scope, agg, 0, 1)
    old = torch.zeros(TAIL_NC, dtype=torch.float64)
    for step in range(STEPS + 2):
        grad = grad_of(0, step)
        flat = grad.clone()
        stats = red.reduce(flat, step, PhaseTimer("cpu", warmup_steps=0))
        new = red.memory.memory
        if step < WARMUP:
            assert torch.equal(flat, grad) and torch.count_nonzero(new) == 0
            assert stats.density == 1.0 and stats.bytes_sent == red.dense_bytes_per_step
            continue
        assert torch.equal(flat[:TAIL_NC] + new, grad[:TAIL_NC] + old)
        assert torch.equal(flat[TAIL_NC:], grad[TAIL_NC:])
        assert int(torch.count_nonzero(flat[:TAIL_NC])) <= red.compressor.k
        assert stats.bytes_sent == red.bytes_sent_per_step
        old = new.clone()


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_ratio_one_equals_dense_exactly(gloo_results, scheme, scope, agg):
    dense = (grad_of(0, 0) + grad_of(1, 0)) / 2
    for rank in range(2):
        assert torch.equal(gloo_results[rank][("ratio1", scheme, scope, agg)], dense)


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_single_process_matches_reference(scheme, scope, agg):
    ref, _, memory = hand_reference(scheme, scope, agg, 1)
    red = build(scheme, scope, agg, 0, 1)
    for step in range(STEPS):
        flat = grad_of(0, step)
        stats = red.reduce(flat, step, PhaseTimer("cpu", warmup_steps=0), want_stats=True)
        torch.testing.assert_close(flat, ref[step], rtol=0, atol=1e-12)
    torch.testing.assert_close(red.memory.memory, memory[0], rtol=0, atol=1e-12)
    assert stats.memory_norm == pytest.approx(float(memory[0].norm()))
    assert 0 < stats.compression_error < 1
    assert stats.density == red.compressor.k / LAYOUT.total


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_bytes_accounting(scheme, scope, agg):
    red = build_reducer(scheme, scope, agg, 0.01, LAYOUT, world_size=1, rank=0, seed=0,
                        compressor=compressor_for(scheme, block_size=32))
    comp = red.compressor
    assert red.dense_bytes_per_step == LAYOUT.total * 4
    if agg == "allreduce":
        assert red.bytes_sent_per_step == comp.k * 4
    elif scheme == "blockk":
        expect_pos = len(LAYOUT) if scope == "layerwise" else min(-(-LAYOUT.total // 32), -(-comp.k // 32) + 1)
        assert red.bytes_sent_per_step == comp.k * 4 + expect_pos * 4
    else:
        assert red.bytes_sent_per_step == comp.k * 8  # float32 values + int32 indices
    flat = torch.randn(LAYOUT.total)
    assert red.reduce(flat, 0, PhaseTimer("cpu")).bytes_sent == red.bytes_sent_per_step


@pytest.mark.parametrize("scheme,scope,agg", COMBOS)
def test_bytes_accounting_with_uncompressed_tail(scheme, scope, agg):
    """The whole tensors' values ride in the same message: 65 more float32 values per step."""
    comp = compressor_for(scheme, block_size=32)
    plain = build_reducer(scheme, scope, agg, 0.01, Layout(TAIL_LAYOUT.sizes[:3]), world_size=1,
                          rank=0, seed=0, compressor=comp)
    red = build_reducer(scheme, scope, agg, 0.01, TAIL_LAYOUT, world_size=1, rank=0, seed=0,
                        compressor=comp, uncompressed=TAIL_FLAGS)
    assert red.compressor.k == plain.compressor.k
    extra = red.bytes_sent_per_step - plain.bytes_sent_per_step
    assert red.uncompressed_bytes_per_step == 65 * 4
    # AllGather pads the message to a multiple of 4 bytes only: 65 values add 260 bytes exactly
    assert extra == 65 * 4
    assert red.density == pytest.approx((plain.compressor.k + 65) / TAIL_LAYOUT.total)
    assert red.dense_bytes_per_step == TAIL_LAYOUT.total * 4


def test_uncompressed_segments_must_be_last_and_all_whole_is_dense():
    with pytest.raises(ValueError, match="must come last"):
        build_reducer("randk", "layerwise", "allreduce", 0.1, TAIL_LAYOUT, world_size=1, rank=0,
                      seed=0, uncompressed=[True, False, False, False, False], compressor=RandomK)
    red = build_reducer("randk", "layerwise", "allreduce", 0.1, [3, 4], world_size=1, rank=0,
                        seed=0, uncompressed=[True, True], compressor=RandomK)
    assert isinstance(red, DenseReducer)


def test_flat_gradients_puts_whole_tensors_last_as_views():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    flags = uncompressed_flags([p.shape for p in params], "1d")
    flat, ordered, ordered_flags = flat_gradients(params, flags)
    assert [p.ndim for p in ordered] == [2, 2, 1, 1, 1, 1]
    assert ordered_flags == [False, False, True, True, True, True]
    assert ordered[0] is params[0] and ordered[1] is params[4]
    model(torch.randn(5, 4)).sum().backward()
    offset = 0
    for p in ordered:  # backward wrote into the flat buffer, in buffer order
        assert torch.equal(flat[offset : offset + p.numel()], p.grad.view(-1))
        assert p.grad.data_ptr() == flat[offset:].data_ptr()
        offset += p.numel()
    assert offset == flat.numel()


def test_dense_for_none_and_state_dict():
    red = build_reducer("none", "global", "allgather", 0.5, LAYOUT, world_size=1, rank=0, seed=0)
    assert isinstance(red, DenseReducer) and red.bytes_sent_per_step == LAYOUT.total * 4
    sp = build("randk", "layerwise", "allreduce", 0, 1)
    sp.reduce(grad_of(0, 0), 0, PhaseTimer("cpu"))
    other = build("randk", "layerwise", "allreduce", 0, 1)
    other.load_state_dict(sp.state_dict())
    assert torch.equal(other.memory.memory, sp.memory.memory)


def test_error_feedback_off_keeps_memory_zero():
    red = build_reducer("topk", "global", "allgather", 0.1, LAYOUT, world_size=1, rank=0, seed=0,
                        error_feedback=False, dtype=torch.float64, compressor=TopK)
    flat = grad_of(0, 0)
    stats = red.reduce(flat, 0, PhaseTimer("cpu"), want_stats=True)
    assert torch.count_nonzero(red.memory.memory) == 0 and stats.memory_norm == 0.0
    idx = torch.topk(grad_of(0, 0).abs(), red.compressor.k).indices
    expect = torch.zeros_like(flat)
    expect[idx] = grad_of(0, 0)[idx]
    assert torch.equal(flat, expect)


def test_topk_allreduce_refused_with_one_line():
    with pytest.raises(ValueError) as err:
        check_combination("topk", "layerwise", "allreduce", 0.01, compressor_for("topk"))
    msg = str(err.value)
    assert "\n" not in msg and "aggregation='allreduce'" in msg and "scheme='topk'" in msg and "allgather" in msg
    with pytest.raises(ValueError, match="aggregation='allreduce'"):
        build_reducer("topk", "global", "allreduce", 0.01, LAYOUT, world_size=1, rank=0, seed=0, compressor=TopK)
    with pytest.raises(ValueError, match="aggregation='allreduce'"):  # the reducer built by hand, too
        SparseReducer(TopK(0.01, LAYOUT, "global"), aggregation="allreduce", world_size=1, rank=0, seed=0)


@pytest.mark.parametrize(
    "args,match",
    [
        (("bogus", "global", "allgather", 0.1, None), "scheme='bogus' has no compressor"),
        (("randk", "flat", "allgather", 0.1, RandomK), "scope='flat'.*layerwise, global"),
        (("randk", "global", "broadcast", 0.1, RandomK), "aggregation='broadcast'.*allreduce, allgather"),
        (("randk", "global", "allgather", 0.0, RandomK), r"ratio=0.0.*\(0, 1\]"),
        (("randk", "global", "allgather", 1.5, RandomK), "ratio=1.5"),
    ],
)
def test_check_combination_names_key_value_and_allowed(args, match):
    with pytest.raises(ValueError, match=match):
        check_combination(*args)


def test_all_valid_combinations_pass_check():
    for scheme, scope, agg in COMBOS:
        check_combination(scheme, scope, agg, 0.01, compressor_for(scheme, block_size=32))
    check_combination("none", "global", "allreduce", 1.0)


def test_a_compressor_of_ones_own_that_sets_no_payload_stops_with_one_line():
    """A compressor with rounds of its own must say what this rank sent (``step.payload``): the
    memory's forget reads it. Forgetting it stops the step with one line naming the class."""
    from sparsetrain.compress import RandomK
    from sparsetrain.compress.base import Round
    from sparsetrain.timing import NULL_TIMER

    class Silent(RandomK):
        def rounds(self, aggregation):
            return (Round("sum", floats=self.k),)

        def send(self, r, step, mine):
            mine.floats.zero_()

        def receive(self, r, step, got, out):
            pass

    red = build_reducer("silent", "layerwise", "allreduce", 0.5, Layout.from_sizes([8]), world_size=1, rank=0,
                        seed=0, compressor=Silent)
    with pytest.raises(RuntimeError, match=r"^Silent set no step.payload in send or receive"):
        red.reduce(torch.randn(8), 0, NULL_TIMER)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_bytes_count_the_gradients_dtype(dtype):
    """Values travel in the gradient's dtype: float64 sends twice float32's bytes, bfloat16 half
    (a count fixed at 4 bytes a value survived every sparse-scheme test, all in float32)."""
    size = torch.tensor([], dtype=dtype).element_size()
    for agg in ("allreduce", "allgather"):
        red = build_reducer("randk", "layerwise", agg, 0.01, LAYOUT, world_size=1, rank=0, seed=0,
                            compressor=compressor_for("randk"), dtype=dtype)
        k = red.compressor.k
        assert red.dense_bytes_per_step == LAYOUT.total * size
        if agg == "allreduce":  # shared positions: values only
            assert red.bytes_sent_per_step == k * size
        else:  # values and int32 positions, the message padded to a multiple of 4 bytes
            assert red.bytes_sent_per_step == -(-(k * size + k * 4) // 4) * 4
        flat = torch.randn(LAYOUT.total).to(dtype)
        assert red.reduce(flat, 0, PhaseTimer("cpu")).bytes_sent == red.bytes_sent_per_step
