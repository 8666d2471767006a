"""The decode check (``comm.probe``): before a reducer's first compressed step, a copy of its
compressor runs its rounds as if every rank sent the same message; a compressor of one's own
whose update is not what its error feedback forgets stops there in one line, on every rank. The
built-in compressors and the examples pass it, and it changes nothing of theirs."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, SCHEME_TARGETS, compressor_for, on_gloo_ranks

from sparsetrain.comm import build_reducer
from sparsetrain.comm.probe import check_decode
from sparsetrain.comm.sparse import SparseReducer
from sparsetrain.compress import Layout, RandomK, SignSGD, TopK, kernels
from sparsetrain.errors import ConfigError
from sparsetrain.timing import NULL_TIMER

LAYOUT = Layout.from_sizes([300, 1200, 64, 7])  # the last two travel whole
FLAGS = [False, False, True, True]
SHAPES = [(20, 15), (30, 40), (64,), (7,)]


class RandKWithReplacement(RandomK):
    """k positions drawn with replacement: some repeat."""

    def select(self, acc, seed):
        gen = torch.Generator().manual_seed(seed)
        idx = torch.cat([o + torch.randint(0, n, (k,), generator=gen)
                         for o, n, k in zip(self.layout.offsets, self.layout.sizes, self.ks, strict=True)])
        return idx, idx


class SumRandK(RandomK):
    """A receive of its own that forgets to divide the ranks' sum by their number."""

    def receive(self, r, step, got, out):
        self.decompress_add(got.floats[: self.num_values], step.payload.positions, out,
                            indices=step.payload.indices)


class DoubledScaleSign(SignSGD):
    """Sends twice the scale and decodes half of it in decode_add (but not in decode_many)."""

    def encode(self, acc, seed, values, wire):
        super().encode(acc, seed, values, wire)
        values.mul_(2.0)

    def decode_add(self, values, wire, out):
        super().decode_add(values * 0.5, wire, out)


def _refusal(red: SparseReducer) -> str:
    grad = torch.randn(red.numel, dtype=red.dtype)
    with pytest.raises(ConfigError) as err:
        red.start(grad.clone(), 0, async_op=False)
    assert torch.count_nonzero(red.memory.memory) == 0  # stopped before the step
    message = str(err.value)
    assert "\n" not in message and "docs/own_compressor.md ('The decode check')" in message
    return message


def test_repeated_indices_are_refused_naming_the_repeats():
    red = SparseReducer(RandKWithReplacement(0.3, [1000], "layerwise"), aggregation="allgather", world_size=1,
                        rank=0, seed=0, dtype=torch.float64)
    message = _refusal(red)
    assert message.startswith("RandKWithReplacement's update is ") and "repeats" in message
    assert "torch.randperm, not torch.randint" in message


class LockedRandK(RandKWithReplacement):
    """The same, holding what deepcopy refuses (a lock, as a logging helper would)."""

    def __init__(self, *args, **kw):
        import threading

        super().__init__(*args, **kw)
        self.lock = threading.Lock()


def test_a_compressor_deepcopy_refuses_is_checked_all_the_same():
    """The check copies the compressor to run it; one that deepcopy cannot copy was let through
    unchecked (a lock, an open file), and trained on repeated indices without a word."""
    red = SparseReducer(LockedRandK(0.3, [1000], "layerwise"), aggregation="allgather", world_size=1,
                        rank=0, seed=0, dtype=torch.float64)
    assert _refusal(red).startswith("LockedRandK's update is ")


@pytest.mark.parametrize("world", [2, 3])
def test_a_sum_not_divided_by_the_ranks_is_refused(world):
    """No collective runs: the check is local, before the step's first round."""
    red = SparseReducer(SumRandK(0.1, [1000, 30], "layerwise"), aggregation="allreduce", world_size=world,
                        rank=0, seed=0)
    message = _refusal(red)
    assert message.startswith(f"SumRandK's update is {world}x what its forget takes out of error feedback's memory")
    assert "receive must divide it by step.world" in message


def test_an_inherited_decode_many_of_other_codes_is_refused(monkeypatch):
    """With the compiled kernels, a quantizer whose decode_many decodes other codes than its
    decode_add (here: quantize's own guard against that turned off) is refused."""
    if not kernels.available():
        pytest.skip("decode_many runs with the compiled kernels only")
    from sparsetrain.compress import quantize

    monkeypatch.setattr(quantize, "_stale_decode_many", lambda cls: False)
    red = SparseReducer(DoubledScaleSign(1.0, [4096, 1000]), aggregation="allgather", world_size=2, rank=0, seed=0)
    assert red.compressor.fused_decode
    assert _refusal(red).startswith("DoubledScaleSign's update is 2x")


def test_without_error_feedback_the_update_is_held_to_one_message_decoded():
    red = SparseReducer(SumRandK(0.1, [1000], "layerwise"), aggregation="allreduce", world_size=2, rank=0,
                        seed=0, error_feedback=False)
    assert "2x what one message decodes to (decompress)" in _refusal(red)


def _examples():
    for name in ("thc", "dgc", "ef21"):
        path = str(ROOT / "examples" / name)
        if path not in sys.path:
            sys.path.insert(0, path)
    import dgc
    import ef21
    import thc

    from sparsetrain.compress import TopK

    return {"thc": (thc.IntegerSum, None), "dgc": (RandomK, dgc.MomentumCorrection), "ef21": (TopK, ef21.EF21)}


def _cases():
    for scheme in (s for s, target in SCHEME_TARGETS.items() if target):
        yield scheme, compressor_for(scheme, block_size=16), None
    for name, (compressor, memory) in _examples().items():
        yield name, compressor, memory


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_built_ins_and_the_examples_pass_and_nothing_of_theirs_changes(world, dtype):
    for scheme, compressor, memory in _cases():
        for aggregation in ("allreduce", "allgather"):
            for scope in ("layerwise", "global"):
                for ef in (True, False):
                    try:
                        red = build_reducer(scheme, scope, aggregation, 0.1, LAYOUT, world_size=world, rank=world - 1,
                                            seed=7, uncompressed=FLAGS, compressor=compressor, memory=memory,
                                            shapes=SHAPES, dtype=dtype, error_feedback=ef)
                    except ValueError:  # a combination the scheme refuses
                        continue
                    before = {k: v.clone() for k, v in red.compressor.state_dict().items() if v is not None}
                    rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
                    check_decode(red, 3)
                    assert torch.equal(rng[0], torch.get_rng_state()) and random.getstate() == rng[2]
                    assert np.array_equal(rng[1], np.random.get_state()[1])
                    after = red.compressor.state_dict()
                    assert all(torch.equal(v, after[k]) for k, v in before.items()), scheme


def test_the_check_runs_once_and_leaves_the_step_bit_identical():
    """A reducer whose check ran and one whose check is skipped apply the same update."""
    grads = [torch.randn(LAYOUT.total, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    outs = []
    for skip in (False, True):
        red = build_reducer("randk", "layerwise", "allgather", 0.1, LAYOUT, world_size=1, rank=0, seed=7,
                            uncompressed=FLAGS, compressor=compressor_for("randk"))
        red.decode_checked = skip
        steps = []
        for step, g in enumerate(grads):
            buf = g.clone()
            red.reduce(buf, step, NULL_TIMER)
            steps.append(buf)
        assert red.decode_checked
        outs.append(torch.stack(steps))
    assert torch.equal(*outs)


def _ddp_refused(rank, world):
    """One DDP step through the sparse hook with SumRandK: what each rank raises."""
    from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(50, 20), gradient_as_bucket_view=True)
    state = SparseHookState(model, "sumrandk", aggregation="allreduce", ratio=0.1, compressor=SumRandK)
    model.register_comm_hook(state, sparse_hook)
    try:
        model(torch.randn(4, 50)).sum().backward()
    except Exception as exc:  # noqa: BLE001  (what DDP hands back of the hook's error)
        return str(exc)
    return None


@pytest.mark.slow  # two spawned gloo ranks
def test_the_ddp_hook_runs_the_check_and_every_rank_stops(tmp_path):
    for message in on_gloo_ranks(_ddp_refused, tmp_path):
        assert message is not None and "SumRandK's update is 2x" in message


class RatioBlindTopK(TopK):
    """Says its message does not depend on ratio, yet sends k of n."""

    ratio_applies = False


def test_a_sparsifier_saying_ratio_does_not_apply_is_refused():
    """The analysis shows such a class at ratio 1.0: its runs at 0.1 and 0.5 were pooled into one
    row (the bytes a mean of the two) without a word."""
    with pytest.raises(ConfigError) as err:
        SparseReducer(RatioBlindTopK(0.1, [1000, 30], "layerwise"), aggregation="allgather", world_size=1, rank=0,
                      seed=0)
    assert str(err.value) == (
        "RatioBlindTopK.ratio_applies is False (its message does not depend on ratio: every entry is sent) but it "
        "sends k=103 of 1,030 entries at ratio=0.1, so the analysis would pool its runs at every ratio as one; "
        "allowed: ratio_applies = True, or k = numel (docs/own_compressor.md, 'Class attributes')")


class SharedTopK(TopK):
    """Top-k of the ranks' summed accumulators, summed by a dense AllReduce of its own: bytes no
    round accounts for (the run reported 1.5% of dense bytes while sending all of them again)."""

    def select(self, acc, seed):
        import torch.distributed as dist

        summed = acc.clone()
        dist.all_reduce(summed)
        return super().select(summed, seed)


def test_a_collective_outside_the_rounds_is_refused_after_the_first_compressed_step(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        red = SparseReducer(SharedTopK(0.1, [1000, 30], "layerwise"), aggregation="allgather", world_size=1, rank=0,
                            seed=0)
        with pytest.raises(ConfigError) as err:
            red.reduce(torch.randn(red.numel), 0, NULL_TIMER)
        assert str(err.value).startswith("SharedTopK called torch.distributed (all_reduce) in compressed step 0 "
                                         "outside the rounds it declares")
        assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"  # put back
        plain = SparseReducer(TopK(0.1, [1000, 30], "layerwise"), aggregation="allgather", world_size=1, rank=0, seed=0)
        for step in range(2):
            plain.reduce(torch.randn(plain.numel), step, NULL_TIMER)
    finally:
        dist.destroy_process_group()


class NarrowWireTopK(TopK):
    """Sends its positions as int16, which holds 32,767 at most."""

    @property
    def wire_dtype(self):
        return torch.int16


def test_a_wire_dtype_too_narrow_for_the_positions_is_refused():
    """Positions above 32,767 wrapped on the wire (40,000 became -25,536): every rank stopped with
    an IndexError in the first compressed step, or decoded another entry where the wrap stayed in
    range. Refused when the exchange is built; a tensor whose positions fit passes."""
    SparseReducer(NarrowWireTopK(0.1, [1000, 30], "layerwise"), aggregation="allgather", world_size=1, rank=0, seed=0)
    with pytest.raises(ConfigError) as err:
        SparseReducer(NarrowWireTopK(0.1, [40_000], "layerwise"), aggregation="allgather", world_size=1, rank=0, seed=0)
    assert str(err.value) == (
        "NarrowWireTopK.wire_dtype=torch.int16 cannot carry its positions (max_position=39,999, above 32,767): they "
        "would wrap on the wire and decode to other entries; allowed: an integer dtype that holds max_position "
        "(torch.int32 below 2**31, the default) (docs/own_compressor.md, 'Methods')")
