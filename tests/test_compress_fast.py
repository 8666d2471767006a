"""The compressors' CPU fast paths equal their reference methods bit for bit (issue 25, item 2).

- random-k's sampler on the CPU finds repeated draws by sorting; the scatter method (what other
  devices run, ``DistinctSampler._distinct_torch``) must give the same positions in the same order;
- top-k on the CPU makes one pass over the buffer in cache-sized chunks, and takes the small
  segments in a few tables of similar lengths; the method it replaced (full |acc| scratch, one
  compare per segment, one table as wide as the widest small segment, written out below) must
  give the same indices in the same order, ties included;
- ``ErrorFeedback.step`` with the gradient in pieces (the DDP hook's bucket, read in place) equals
  the step with the gradient in one tensor: the same payload and memory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsetrain.compress import (
    BlockRandomK,
    DistinctSampler,
    ErrorFeedback,
    Layout,
    RandomK,
    TopK,
    k_for,
    sampling,
    step_seed,
)

# tiny, bias-sized, just under / at / over TopK.SMALL, a few chunks long, and not a chunk multiple
SIZES = [5, 1, 300, 8192, 8193, 40000, 100, 3 * TopK.CHUNK + 17, 9000]
LAYOUT = Layout.from_sizes(SIZES)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, so that equality also tells -0.0 from 0.0."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def grad(n, seed, dtype=torch.float32, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # a handful of values: many exact ties in |acc|
        return torch.randint(-3, 4, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=dtype)


# --- random-k: the sort finds the same first draws as the scatter -------------------------------------
def torch_path(sampler: DistinctSampler) -> DistinctSampler:
    sampler._np = None
    return sampler


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.45, 0.6, 1.0])
def test_sampler_cpu_path_equals_scatter_path(ratio):
    for sizes in (SIZES, [sum(SIZES)], [2, 3, 4, 5, 1]):
        ks = [k_for(ratio, n) for n in sizes]
        fast, ref = DistinctSampler(sizes, ks), torch_path(DistinctSampler(sizes, ks))
        assert fast._np is not None or not fast.draw_segs
        for seed in range(8):
            a = fast.sample(torch.Generator().manual_seed(seed))
            b = ref.sample(torch.Generator().manual_seed(seed))
            assert same(a, b), (sizes, ratio, seed)


def test_sampler_cpu_path_equals_scatter_path_when_segments_fall_short(monkeypatch):
    """No margin for repeats: most segments are short and redrawn (``_top_up``), the others keep
    their first k distinct draws; the generator is consumed the same way on both paths."""
    monkeypatch.setattr(sampling, "_draws_needed", lambda n, k: k)
    for sizes, ks in (([50, 8, 1000], [20, 4, 400]), (SIZES, [k_for(0.05, n) for n in SIZES])):
        fast, ref = DistinctSampler(sizes, ks), torch_path(DistinctSampler(sizes, ks))
        gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for _ in range(20):
            assert same(fast.sample(gen_a), ref.sample(gen_b))


@pytest.mark.parametrize("scope", ["layerwise", "global"])
def test_randk_and_blockk_positions_unchanged_by_the_cpu_sampler(scope):
    for comp in (RandomK(0.02, LAYOUT, scope), BlockRandomK(0.02, LAYOUT, scope, block_size=64)):
        sampler = getattr(comp, "sampler", None)
        if sampler is None:
            continue  # block-k layer-wise draws no distinct positions
        acc = grad(LAYOUT.total, 0)
        fast = [comp.compress(acc, seed) for seed in range(4)]
        torch_path(sampler)
        for seed, p in enumerate(fast):
            q = comp.compress(acc, seed)
            assert same(p.positions, q.positions) and same(p.values, q.values)


# --- top-k: one chunked pass equals the two-pass method ------------------------------------------------
def two_pass_select(comp: TopK, acc: torch.Tensor) -> torch.Tensor:
    """The CPU method before the one-pass rewrite: |acc| into a full scratch, per large segment a
    compare and a nonzero over the whole segment, exact topk on the candidates."""
    sc = acc.abs()
    thr = comp._thresholds(sc[comp.sample_idx]) if comp.large else [0.0] * len(comp.layout)
    offs, sizes = comp.layout.offsets, comp.layout.sizes
    idx = torch.empty(comp.k, dtype=torch.int64)
    small = comp._small_table(acc.device)
    if small:
        table, pad, kmax, keep, slots = small
        rows = sc[table].masked_fill_(pad, -1.0)
        sel = torch.topk(rows, kmax, dim=1, sorted=True).indices
        idx.index_copy_(0, slots, table.gather(1, sel)[keep])
    for s in comp.large:
        k, a, b = comp.ks[s], offs[s], offs[s] + sizes[s]
        dst = idx[comp.kstarts[s] : comp.kstarts[s] + k]
        c = torch.from_numpy(np.flatnonzero(sc[a:b].numpy() >= thr[s])) if thr[s] > 0.0 else None
        if c is not None and c.numel() == k:
            torch.add(c, a, out=dst)
        elif c is not None and c.numel() > k:
            torch.add(c[torch.topk(sc[a:b][c], k, sorted=False).indices], a, out=dst)
        else:
            torch.add(torch.topk(sc[a:b], k, sorted=False).indices, a, out=dst)
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scope", ["layerwise", "global"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3])
def test_topk_one_pass_equals_two_pass(ratio, scope, dtype):
    comp = TopK(ratio, LAYOUT, scope)
    for seed, ties in ((0, False), (1, True), (2, False)):
        acc = grad(LAYOUT.total, seed, dtype, ties)
        before, tied = acc.clone(), comp.small_ties
        _, idx = comp.select(acc)
        assert same(acc, before)  # select leaves acc alone
        assert same(idx, two_pass_select(comp, acc)), (ratio, scope, dtype, seed)
        if scope == "layerwise" and (ties or ratio <= 0.01):  # (at 30% float32 |values| can tie)
            assert comp.small_ties - tied == int(ties)  # the grouped tables, or on a tie the reference


@pytest.mark.parametrize("scope", ["layerwise", "global"])
def test_topk_one_pass_fallback_equals_two_pass(scope, monkeypatch):
    """Thresholds too high: every large segment falls back to an exact topk of the segment."""
    comp = TopK(0.01, LAYOUT, scope)
    monkeypatch.setattr(comp, "_thresholds", lambda samples: [float("inf")] * len(comp.layout))
    acc = grad(LAYOUT.total, 4)
    _, idx = comp.select(acc)
    assert same(idx, two_pass_select(comp, acc))
    assert comp.fallbacks == len(comp.large) > 0


def pieces_of(g: torch.Tensor, cuts) -> list[tuple[int, torch.Tensor]]:
    edges = [0, *cuts, g.numel()]
    return [(a, g[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]


# cuts inside chunks, at a segment boundary, one entry long pieces
CUTS = [(), (3, 6, 306), (LAYOUT.offsets[5] + 1000, LAYOUT.offsets[7] + TopK.CHUNK + 5, LAYOUT.total - 1)]


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("scope", ["layerwise", "global"])
@pytest.mark.parametrize("name", ["topk", "randk", "blockk"])
def test_error_feedback_step_in_pieces_equals_one_tensor(name, scope, enabled):
    """Three steps from a non-zero memory: added piece by piece, or the whole gradient at once."""
    cls = {"topk": TopK, "randk": RandomK, "blockk": BlockRandomK}[name]
    comp = cls(0.02, LAYOUT, scope)
    for cuts in CUTS:
        ref, got = ErrorFeedback(LAYOUT.total, enabled=enabled), ErrorFeedback(LAYOUT.total, enabled=enabled)
        for step in range(3):
            g = grad(LAYOUT.total, 10 + step, ties=step == 1)
            acc = ref.accumulate(g.clone())
            want = comp.compress(acc, step_seed(0, step))
            ref.forget(want, comp)
            out = torch.empty(comp.k)
            p = got.step(pieces_of(g.clone(), cuts), comp, step_seed(0, step), out=out)
            assert same(p.values, want.values) and same(p.positions, want.positions), (cuts, step)
            assert p.values.data_ptr() == out.data_ptr()
            assert same(got.memory, ref.memory), (cuts, step)


def test_error_feedback_step_refuses_pieces_that_do_not_cover_the_memory():
    g = grad(LAYOUT.total, 0)
    with pytest.raises(ValueError, match="entries"):
        ErrorFeedback(LAYOUT.total).step(pieces_of(g[:-1], (10,)), TopK(0.01, LAYOUT, "global"))


# --- block-k layer-wise: decompress by slices equals the index_add ----------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ratio", [0.001, 0.02, 0.5, 1.0])
def test_blockk_layerwise_decompress_by_slices_equals_index_add(ratio, dtype):
    """Runs that wrap around a tensor's end, tensors that send nothing or everything, values in
    another dtype than ``out``, and several messages added in turn (AllGather's unpack)."""
    comp = BlockRandomK(ratio, LAYOUT, "layerwise")
    fast, ref = grad(LAYOUT.total, 1, dtype), grad(LAYOUT.total, 1, dtype)
    wrapped = 0
    for seed in range(6):
        positions, idx = comp.select(grad(LAYOUT.total, seed), seed)
        values = grad(comp.k, 100 + seed, torch.float32)
        comp.decompress_add(values, positions, fast)
        ref.index_add_(0, idx, values.to(dtype))  # the generic path: Compressor.decompress_add
        wrapped += sum(s + k > n for s, n, k in zip(positions.tolist(), SIZES, comp.ks, strict=True))
        assert same(fast, ref), (ratio, seed)
    assert wrapped > 0 or ratio < 0.5  # the wrap-around branch ran (a run of half a tensor or more wraps often)
