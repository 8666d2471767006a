"""Core library: compressors and error feedback, exact identities on small tensors."""

from __future__ import annotations

import pytest
import torch

from sparsetrain.compress import (
    BlockRandomK,
    Compressor,
    DistinctSampler,
    ErrorFeedback,
    Layout,
    NoCompression,
    RandomK,
    TopK,
    compression_stats,
    compressor_class,
    k_for,
    sampling,
    step_seed,
)

SCHEMES = ["none", "topk", "randk", "blockk"]
SCOPES = ["layerwise", "global"]
# a bias-sized, a tiny and a larger-than-TopK.SMALL tensor exercise every path
SIZES = [7, 1, 300, 12001, 64]
LAYOUT = Layout.from_sizes(SIZES)


# the tests' own table (training takes the class from conf/scheme/<name>.yaml)
CLASSES = {"none": NoCompression, "topk": TopK, "randk": RandomK, "blockk": BlockRandomK}


def make(name, ratio, scope, layout=LAYOUT, **kw):
    return CLASSES[name](ratio, layout, scope, **kw)


def int_grad(n, seed):
    """Integer-valued float64: every sum below is exact, so identities hold bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (n,), generator=g).to(torch.float64)


def dense_of(comp, payload, n):
    return comp.decompress(payload.values, payload.positions, dtype=torch.float64)


def test_a_new_scheme_is_one_class():
    class FirstK(Compressor):
        shared_positions = True

        def select(self, acc, seed):
            idx = torch.arange(self.k, device=acc.device)
            return idx, idx

    comp = FirstK(0.5, [10], "global")
    p = comp.compress(torch.arange(10.0))
    assert p.values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(TypeError, match="FirstK got unknown options"):
        FirstK(0.5, [10], "global", block_size=4)


def test_compressor_class_reads_the_class_back_from_a_factory():
    from functools import partial

    assert compressor_class(partial(BlockRandomK, block_size=8)) is BlockRandomK
    assert compressor_class(TopK) is TopK and compressor_class(TopK(0.5, [4], "global")) is TopK
    with pytest.raises(TypeError, match="not a Compressor class"):
        compressor_class("topk")


def test_k_per_scope():
    comp = make("randk", 0.01, "layerwise")
    assert comp.ks == [k_for(0.01, n) for n in SIZES] == [1, 1, 3, 120, 1]
    assert comp.k == 126
    assert make("randk", 0.01, "global").k == round(0.01 * sum(SIZES))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", SCHEMES)
def test_error_feedback_identity_exact(name, scope):
    """sum of what was sent + final memory == sum of the gradients, bit for bit (float64)."""
    comp = make(name, 0.05, scope)
    ef = ErrorFeedback(LAYOUT.total, dtype=torch.float64)
    total_in = torch.zeros(LAYOUT.total, dtype=torch.float64)
    total_sent = torch.zeros(LAYOUT.total, dtype=torch.float64)
    for step in range(6):
        g = int_grad(LAYOUT.total, step)
        total_in += g
        p = ef.step(g.clone(), comp, seed=step_seed(3, step))
        assert p.values.numel() == comp.k
        total_sent += dense_of(comp, p, LAYOUT.total)
    assert torch.equal(total_sent + ef.memory, total_in)
    if name != "none":
        assert ef.memory.abs().sum() > 0


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", SCHEMES)
def test_ratio_one_sends_everything_exactly(name, scope):
    comp = make(name, 1.0, scope)
    acc = torch.randn(LAYOUT.total, dtype=torch.float64)
    ef = ErrorFeedback(LAYOUT.total, dtype=torch.float64)
    p = ef.step(acc.clone(), comp, seed=5)
    assert torch.equal(dense_of(comp, p, LAYOUT.total), acc)
    assert torch.count_nonzero(ef.memory) == 0


def test_disabled_error_feedback_keeps_memory_zero():
    comp = make("topk", 0.05, "layerwise")
    ef = ErrorFeedback(LAYOUT.total, enabled=False, dtype=torch.float64)
    g = int_grad(LAYOUT.total, 0)
    acc = ef.accumulate(g)
    p = comp.compress(acc)
    rel = compression_stats(acc, p, comp)
    ef.forget(p, comp)
    assert torch.count_nonzero(ef.memory) == 0 and ef.norm() == 0.0
    kept = dense_of(comp, p, LAYOUT.total)
    assert rel == pytest.approx(float((g - kept).norm() / g.norm()), rel=1e-9)


def test_stats_match_definitions():
    comp = make("randk", 0.1, "global")
    ef = ErrorFeedback(LAYOUT.total, dtype=torch.float64)
    ef.memory.copy_(torch.randn(LAYOUT.total, dtype=torch.float64))
    acc = ef.memory + (g := torch.randn(LAYOUT.total, dtype=torch.float64))
    p = comp.compress(ef.accumulate(g), seed=1)
    rel = compression_stats(ef.memory, p, comp)
    ef.forget(p, comp)
    sent = dense_of(comp, p, LAYOUT.total)
    assert rel == pytest.approx(float((acc - sent).norm() / acc.norm()), rel=1e-9)
    assert ef.norm() == pytest.approx(float(ef.memory.norm()), rel=1e-12)


def test_stats_measure_the_decoded_message():
    """A compressor that scales what it sends (random-k rescaled by n / k, unbiased) is measured
    by what it sends: the error is ||acc - decoded||, not the share of acc left unsent."""

    class Rescaled(type(make("randk", 0.1, "global"))):
        def decompress_add(self, values, positions, out, *, indices=None):
            return super().decompress_add(values * (self.numel / self.k), positions, out, indices=indices)

    comp = Rescaled(0.1, LAYOUT, "global")
    acc = torch.randn(LAYOUT.total, dtype=torch.float64)
    p = comp.compress(acc, seed=3)
    decoded = comp.decompress(p.values, p.positions, indices=p.indices)
    assert not torch.equal(decoded[p.indices], acc[p.indices])  # scaled: not acc's own entries
    assert compression_stats(acc, p, comp) == pytest.approx(float((acc - decoded).norm() / acc.norm()), rel=1e-12)
    assert compression_stats(acc, p, comp) > 1.0  # sends 10x the entries' values: far from acc


def test_state_dict_roundtrip():
    ef = ErrorFeedback(10, dtype=torch.float64)
    ef.step(torch.arange(10.0, dtype=torch.float64), make("topk", 0.3, "global", Layout.single(10)))
    other = ErrorFeedback(10, dtype=torch.float64)
    other.load_state_dict(ef.state_dict())
    assert torch.equal(other.memory, ef.memory)
    with pytest.raises(ValueError, match="entries"):
        ErrorFeedback(11).load_state_dict(ef.state_dict())


# --- top-k -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 0.9])
def test_topk_matches_torch_topk_per_segment_and_global(ratio):
    layout = Layout.from_sizes([5, 40000, 9000, 100, 20001])
    # Seeded, so that the draw does not depend on which tests ran before (with the global RNG
    # the 0.3 case failed once in a full run, not reproduced in 500 seeded draws since).
    acc = torch.randn(layout.total, generator=torch.Generator().manual_seed(147))
    lw = make("topk", ratio, "layerwise", layout)
    idx = lw.compress(acc).indices
    pos = 0
    for off, n, k in zip(layout.offsets, layout.sizes, lw.ks, strict=True):
        ref = torch.topk(acc[off : off + n].abs(), k).indices + off
        assert set(idx[pos : pos + k].tolist()) == set(ref.tolist())
        pos += k
    gl = make("topk", ratio, "global", layout)
    ref = torch.topk(acc.abs(), gl.k).indices
    assert set(gl.compress(acc).indices.tolist()) == set(ref.tolist())
    assert lw.fallbacks == 0 and gl.fallbacks == 0  # the sampled threshold sufficed


def test_topk_fallback_is_exact_when_threshold_is_too_high(monkeypatch):
    layout = Layout.from_sizes([30000, 20000])
    comp = make("topk", 0.01, "layerwise", layout)
    monkeypatch.setattr(comp, "_thresholds", lambda sc: [float("inf")] * len(layout))
    acc = torch.randn(layout.total)
    idx = comp.compress(acc).indices
    ref0 = set(torch.topk(acc[:30000].abs(), 300).indices.tolist())
    ref1 = {i + 30000 for i in torch.topk(acc[30000:].abs(), 200).indices.tolist()}
    assert set(idx.tolist()) == ref0 | ref1 and comp.fallbacks == 2


def test_topk_has_no_shared_positions():
    assert not TopK.shared_positions and RandomK.shared_positions and BlockRandomK.shared_positions


# --- random-k ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.01, 0.4, 0.6, 1.0])
def test_randk_exactly_k_distinct_per_segment(ratio):
    comp = make("randk", ratio, "layerwise")
    acc = torch.zeros(LAYOUT.total)
    for seed in range(5):
        idx = comp.compress(acc, seed).indices
        pos = 0
        for off, n, k in zip(LAYOUT.offsets, LAYOUT.sizes, comp.ks, strict=True):
            seg = idx[pos : pos + k]
            assert seg.unique().numel() == k
            assert bool(((seg >= off) & (seg < off + n)).all())
            pos += k


def test_randk_deterministic_from_seed():
    comp = make("randk", 0.05, "global")
    acc = torch.zeros(LAYOUT.total)
    a, b, c = (comp.compress(acc, s).indices for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.unique().numel() == comp.k


def test_distinct_sampler_is_uniform():
    """Each of 20 positions should be picked ~k/n of the time, by segment."""
    sampler = DistinctSampler([20, 10], [5, 3])
    counts = torch.zeros(30)
    gen = torch.Generator().manual_seed(0)
    trials = 4000
    for _ in range(trials):
        counts.index_add_(0, sampler.sample(gen), torch.ones(8))
    assert torch.allclose(counts[:20] / trials, torch.full((20,), 0.25), atol=0.035)
    assert torch.allclose(counts[20:] / trials, torch.full((10,), 0.3), atol=0.035)


def test_distinct_sampler_top_up_path(monkeypatch):
    """With no margin for duplicates, segments fall short and are redrawn: still exact."""
    monkeypatch.setattr(sampling, "_draws_needed", lambda n, k: k)
    sampler = DistinctSampler([50, 8, 1000], [20, 4, 400])
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        idx = sampler.sample(gen)
        for (a, b), lo, hi in zip([(0, 20), (20, 24), (24, 424)], [0, 50, 58], [50, 58, 1058], strict=True):
            seg = idx[a:b]
            assert seg.unique().numel() == b - a and bool(((seg >= lo) & (seg < hi)).all())


# --- block-random-k ----------------------------------------------------------------------------


def test_blockk_layerwise_runs_wrap_around():
    comp = make("blockk", 0.3, "layerwise")
    acc = torch.zeros(LAYOUT.total)
    wrapped = False
    for seed in range(40):
        p = comp.compress(acc, seed)
        assert p.positions.numel() == len(LAYOUT)
        pos = 0
        for s, (off, n, k) in enumerate(zip(LAYOUT.offsets, LAYOUT.sizes, comp.ks, strict=True)):
            start = int(p.positions[s])
            assert 0 <= start < n
            expect = (start + torch.arange(k)) % n + off
            assert torch.equal(p.indices[pos : pos + k], expect)
            wrapped |= start + k > n
            pos += k
    assert wrapped


@pytest.mark.parametrize("n,ratio,block", [(10000, 0.05, 64), (1000, 0.3, 64), (130, 0.9, 16), (100, 0.5, 256)])
def test_blockk_global_exactly_k_in_whole_blocks(n, ratio, block):
    comp = make("blockk", ratio, "global", Layout.from_sizes([n // 2, n - n // 2]), block_size=block)
    acc = torch.zeros(n)
    seen_last = False
    for seed in range(30):
        p = comp.compress(acc, seed)
        assert p.positions.numel() == comp.num_positions == min(-(-n // block), -(-comp.k // block) + 1)
        assert bool((p.positions % block == 0).all()) and p.positions.unique().numel() == p.positions.numel()
        idx = p.indices
        assert idx.numel() == comp.k and idx.unique().numel() == comp.k
        assert bool((idx < n).all())
        # every sent entry lies in one of the drawn blocks
        assert set((idx // block * block).tolist()) <= set(p.positions.tolist())
        seen_last |= (n - 1) // block * block in p.positions.tolist()
        assert torch.equal(comp.indices(p.positions), idx)
    assert seen_last


def test_blockk_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        BlockRandomK(0.1, [100], "global", block_size=0)


def test_step_seed_shared_and_per_rank():
    assert step_seed(1, 5) == step_seed(1, 5)
    assert step_seed(1, 5) != step_seed(1, 6) != step_seed(2, 5)
    assert step_seed(1, 5, rank=0) != step_seed(1, 5, rank=1)
    assert 0 <= step_seed(2**70, 3, rank=9) < 2**63


def test_compressor_rejects_bad_ratio_and_scope():
    with pytest.raises(ValueError, match="ratio"):
        make("randk", 0.0, "global")
    with pytest.raises(ValueError, match="scope='bogus'"):
        make("randk", 0.1, "bogus")


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", ["randk", "blockk"])
def test_random_schemes_converge_faster_with_more_entries(name, scope):
    """Error-feedback SGD on 0.5 ||x - x*||^2 (float64): the identities above hold for any
    selection, this catches one that leaves entries behind (a fixed block, a biased sampler).
    A random scheme's memory holds about 1/ratio steps of gradient, so 10% must converge far
    faster than 2%. (Top-k need not: on this isotropic problem its few largest entries suffice.)"""
    target = torch.randn(LAYOUT.total, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    errors = []
    for ratio in (0.02, 0.1):
        comp = make(name, ratio, scope)
        memory = ErrorFeedback(LAYOUT.total, dtype=torch.float64)
        x = torch.zeros_like(target)
        for step in range(300):
            payload = memory.step(x - target, comp, seed=step_seed(0, step))
            x -= 0.02 * comp.decompress(payload.values, payload.positions, dtype=torch.float64)
        errors.append(float((x - target).norm() / target.norm()))
    assert errors[1] < 1e-2 and errors[1] < errors[0] / 100, errors
