"""The fast path (``train.fast_path``, ``sparsetrain.compress.fused``): its Triton kernels against
the torch path, bit for bit.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set here before anything imports Triton's kernels); with one they run compiled on CUDA (the
``cuda`` cases, which ``make gpu-check`` runs). Sizes are small: the interpreter runs each
program in numpy. Without Triton every case skips with the reason.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # read when the kernels' module is imported: set before any test imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the fast path's kernels need it")

from sparsetrain.comm import SparseReducer  # noqa: E402
from sparsetrain.compress import (  # noqa: E402
    QSGD,
    BlockRandomK,
    ErrorFeedback,
    RandomK,
    SignSGD,
    TopK,
    fused,
    step_seed,
)
from sparsetrain.timing import NULL_TIMER  # noqa: E402

CPU = pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
    not fused.interpreting(), reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"))
CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device here (torch.cuda.is_available() is False)")])
DEVICES = [CPU, CUDA]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]
# the quantizers' matrices in the fast tier in float32; float64 too in the full tier (and on a GPU:
# `make gpu-check` selects `-m cuda`, whatever else is marked)
QDTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64", marks=pytest.mark.slow)]
SCOPES = ("layerwise", "global")
# large segments (sampled thresholds, several blocks each), small ones (every entry a candidate),
# one of a single entry
SIZES = [600, 16, 3000, 40, 1500, 1]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Segments above 256 entries sampled, blocks of 256, block-k global expanded by its kernel
    up to 64 drawn blocks: every path of the kernels on a few thousand entries (the
    interpreter's pace)."""
    monkeypatch.setattr(TopK, "SMALL", 256)
    monkeypatch.setattr(fused, "BLOCK", 256)
    monkeypatch.setattr(fused, "TAKE_BLOCK", 64)
    monkeypatch.setattr(fused, "MAX_BLOCKS", 64)


def segments(comp):
    """(first slot, k, offset, size) of each segment of ``comp``."""
    return list(zip(comp.kstarts, comp.ks, comp.layout.offsets, comp.layout.sizes, strict=True))


def torch_path(comp, mem, grad, seed=0):
    """What the exchange does without the fast path: ErrorFeedback.step (accumulate, compress,
    forget), on copies; returns (payload, memory after)."""
    ef = ErrorFeedback(mem.numel(), device=mem.device, dtype=mem.dtype)
    ef.memory.copy_(mem)
    payload = ef.step(grad, comp, seed=seed)
    return payload, ef.memory


def data(n, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=dtype).to(device), torch.randn(n, generator=g, dtype=dtype).to(device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_topk_sends_torch_topks_set_and_leaves_the_same_memory(device, scope, dtype):
    """Per segment (global: overall) exactly torch.topk's set of |memory + grad|, from the torch
    path's thresholds; the values are
    those entries of acc, from the largest |acc| within each segment (as the torch path's
    layer-wise order); the memory afterwards equals the torch path's, bit for bit; the indices
    are the wire positions."""
    n = sum(SIZES)
    mem, grad = data(n, 1, dtype, device)
    acc = (mem + grad).cpu()
    ref, ref_mem = torch_path(TopK(0.02, SIZES, scope, device=device), mem.clone(), grad)
    comp = TopK(0.02, SIZES, scope, device=device)
    wire = torch.empty(comp.k, dtype=comp.wire_dtype, device=device)
    got = fused.step(comp, mem, grad, out=torch.empty(comp.k, dtype=dtype, device=device), wire=wire)
    idx = got.indices.cpu()
    assert comp.fallbacks == 0 and (comp.large if scope == "layerwise" else True)
    if comp.large:  # the thresholds are the torch path's own, found from memory + grad
        want = comp._sample_thresholds(acc.abs()[comp.sample_idx.cpu()].to(device))
        assert torch.equal(comp._fused_plan.thr[comp._fused_plan.large], want)
    for pos, k, off, size in segments(comp):
        mine = idx[pos : pos + k]
        assert set(mine.tolist()) == set((torch.topk(acc[off : off + size].abs(), k).indices + off).tolist())
        mag = acc[mine].abs()
        assert bool((mag[1:] <= mag[:-1]).all())
    assert set(idx.tolist()) == set(ref.indices.cpu().tolist())
    assert torch.equal(got.values.cpu(), acc[idx]) and torch.equal(wire.cpu().long(), idx)
    assert torch.equal(got.positions.cpu(), idx)
    assert torch.equal(mem.cpu(), ref_mem.cpu())


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_topk_with_ties_sends_the_lowest_indices_among_equal_magnitudes(device, scope):
    """Many equal magnitudes: every entry above the k-th magnitude, then the tied ones of lowest
    index (the fast path's tie rule; torch.topk's own is unspecified)."""
    n = sum(SIZES)
    g = torch.Generator().manual_seed(5)
    grad = torch.randint(-9, 10, (n,), generator=g).to(torch.float32)
    mem = torch.zeros(n)
    comp = TopK(0.05, SIZES, scope, device=device)
    got = fused.step(comp, mem.to(device), grad.to(device))
    idx = got.indices.cpu()
    for pos, k, off, size in segments(comp):
        a = grad[off : off + size].abs()
        kth = torch.topk(a, k).values[-1]
        above = (torch.nonzero(a > kth).view(-1) + off).tolist()
        tied = (torch.nonzero(a == kth).view(-1) + off).tolist()[: k - len(above)]
        assert sorted(idx[pos : pos + k].tolist()) == sorted(above + tied)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_topk_falls_back_exactly_where_a_threshold_is_too_high(device, scope, dtype):
    """Each sample's largest value as the threshold (too few candidates): the large segments
    take the exact whole-segment selection; still torch.topk's sets and the torch path's memory."""
    n = sum(SIZES)
    mem, grad = data(n, 3, dtype, device)
    acc = (mem + grad).cpu()
    _, ref_mem = torch_path(TopK(0.02, SIZES, scope, device=device), mem.clone(), grad)
    comp = TopK(0.02, SIZES, scope, device=device)
    comp.sample_kth = torch.zeros_like(comp.sample_kth)  # the (0 + 1)-th largest sample
    got = fused.step(comp, mem, grad)
    idx = got.indices.cpu()
    assert comp.fallbacks == len(comp.large) > 0
    for pos, k, off, size in segments(comp):
        assert set(idx[pos : pos + k].tolist()) == set((torch.topk(acc[off : off + size].abs(), k).indices + off).tolist())
    assert torch.equal(got.values.cpu(), acc[idx]) and torch.equal(mem.cpu(), ref_mem.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("cls", [RandomK, BlockRandomK], ids=["randk", "blockk"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_gather_keeps_the_draws_and_equals_the_torch_path(device, cls, scope, dtype):
    """Random-k and block-k: the same draws (positions, indices, in order), values, wire section
    and memory as the torch path, bit for bit, over a few steps."""
    n = sum(SIZES)
    mem, _ = data(n, 4, dtype, device)
    ref_mem = mem.clone()
    comp, ref = cls(0.05, SIZES, scope, device=device), cls(0.05, SIZES, scope, device=device)
    for step in range(3):
        _, grad = data(n, 10 + step, dtype, device)
        seed = step_seed(7, step)
        wire = torch.empty(comp.num_positions, dtype=comp.wire_dtype, device=device)
        got = fused.step(comp, mem, grad, seed, out=torch.empty(comp.k, dtype=dtype, device=device), wire=wire)
        want, ref_mem = torch_path(ref, ref_mem, grad, seed)
        assert torch.equal(got.indices, want.indices) and torch.equal(got.positions, want.positions)
        assert torch.equal(got.values, want.values) and torch.equal(wire.long(), want.positions)
        assert torch.equal(mem, ref_mem)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_block_k_expands_wrapping_runs_and_the_short_last_block_as_the_torch_path(device):
    """Block-k's kernels expand the starts themselves: a layer-wise run that wraps around its
    tensor's end, a global draw that holds the short last block and the block cut at k, over
    many seeds (and blocks of 1 entry: more drawn blocks than the kernel expands, torch's
    expansion): the torch path's indices, values and memory, bit for bit."""
    n = sum(SIZES)
    wrapped = last = 0
    for scope, block_size in (("layerwise", 256), ("global", 40), ("global", 1)):
        comp = BlockRandomK(0.05, SIZES, scope, block_size=block_size, device=device)
        ref = BlockRandomK(0.05, SIZES, scope, block_size=block_size, device=device)
        mem, ref_mem = torch.zeros(n, device=device), torch.zeros(n, device=device)
        for seed in range(40):
            _, grad = data(n, 100 + seed, torch.float32, device)
            got = fused.step(comp, mem, grad, seed)
            want, ref_mem = torch_path(ref, ref_mem, grad, seed)
            assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
            assert torch.equal(mem, ref_mem)
            starts = got.positions.cpu()
            if scope == "layerwise":
                wrapped += sum(int(st) + k > size for st, k, size in zip(starts, comp.ks, SIZES, strict=True))
            else:
                last += int((starts == (comp.nb - 1) * block_size).any())
    assert wrapped > 0 and last > 0


def reducer(comp, aggregation, fast_path, device, dtype):
    return SparseReducer(comp, aggregation=aggregation, world_size=1, rank=0, seed=3, uncompressed_numel=5,
                         device=device, dtype=dtype, fast_path=fast_path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,aggregation,scope", [
    ("topk", "allgather", "layerwise"), ("topk", "allgather", "global"), ("randk", "allreduce", "layerwise"),
    ("randk", "allgather", "global"), ("blockk", "allreduce", "global"), ("blockk", "allgather", "layerwise")])
@pytest.mark.parametrize("device", DEVICES)
def test_reducer_with_the_fast_path_gives_the_same_update_and_memory(device, name, aggregation, scope, dtype):
    """``SparseReducer(fast_path=True)`` (what ``train.fast_path=true`` builds) over several steps:
    the update it writes back (whole tensors included) and its memory equal the torch path's,
    bit for bit; a step that measures the compression error runs the torch path, same numbers."""
    cls = {"topk": TopK, "randk": RandomK, "blockk": BlockRandomK}[name]
    n = sum(SIZES)
    fast = reducer(cls(0.03, SIZES, scope, device=device), aggregation, True, device, dtype)
    slow = reducer(cls(0.03, SIZES, scope, device=device), aggregation, False, device, dtype)
    assert fast.fast_path_reason is None and fast._fused is not None and slow._fused is None
    for step in range(3):
        grad, _ = data(n + 5, 20 + step, dtype, device)
        a, b = grad.clone(), grad.clone()
        sa = fast.reduce(a, step, NULL_TIMER, want_stats=step == 2)
        sb = slow.reduce(b, step, NULL_TIMER, want_stats=step == 2)
        assert torch.equal(a, b) and torch.equal(fast.memory.memory, slow.memory.memory)
        assert sa.compression_error == sb.compression_error and sa.memory_norm == sb.memory_norm


@pytest.mark.parametrize("device", DEVICES)
def test_a_logged_step_on_the_torch_path_stays_out_of_the_fast_paths_means(device):
    """Audit 3: a logged step measures its compression error on the torch path, and its time
    went into the means of a run that times the fast path (one step in ``log_every``)."""
    from sparsetrain.timing import PhaseTimer

    fast = reducer(TopK(0.03, SIZES, device=device), "allgather", True, device, torch.float32)
    timer = PhaseTimer(device, warmup_steps=0)
    for step in range(4):
        grad, _ = data(sum(SIZES) + 5, 20 + step, torch.float32, device)
        with timer.step():
            fast.reduce(grad, step, timer, want_stats=step == 2)
    assert timer.steps_seen == 4 and timer.counted_steps == 3


@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_says_why_not_and_changes_nothing_where_it_has_no_kernels(device):
    """A quantizer, error feedback switched off, or the CPU without the interpreter: the reducer
    says why and runs the torch path."""
    qsgd = reducer(QSGD(1.0, SIZES, levels=3, device=device), "allgather", True, device, torch.float16)
    assert qsgd._fused is None and qsgd.fast_path_reason == "dtype torch.float16 (float32 and float64 only)"
    off = SparseReducer(TopK(0.03, SIZES, device=device), aggregation="allgather", world_size=1, rank=0, seed=0,
                        error_feedback=False, device=device, fast_path=True)
    assert off._fused is None and "error feedback" in off.fast_path_reason
    assert fused.reason(TopK(0.03, SIZES), ErrorFeedback(sum(SIZES)), "meta", torch.float32) == \
        "it runs on CUDA (here meta)"
    assert "float16" in fused.reason(TopK(0.03, SIZES, device=device), ErrorFeedback(sum(SIZES)), device,
                                     torch.float16)


def test_fast_path_is_a_train_key_off_by_default_that_reaches_the_reducer(monkeypatch):
    """``train.fast_path``: false by default (nothing changes for existing runs), resuming may
    change it (the same messages), and the trainer's exchange passes it to the reducer."""
    from sparsetrain.config import compose
    from sparsetrain.models import build_model
    from sparsetrain.train.checkpoint import NOT_DEFINING
    from sparsetrain.train.components import exchange_from_config

    assert compose(["scheme=topk"]).train.fast_path is False and "train.fast_path" in NOT_DEFINING
    seen = []
    monkeypatch.setattr(SparseReducer, "__init__", lambda self, *a, **kw: seen.append(kw["fast_path"]) or
                        _real_init(self, *a, **kw))
    model = build_model("resnet20", 1, 10)
    for value in (False, True):
        cfg = compose(["scheme=topk", "world_size=1", "dist.overlap=false", f"train.fast_path={str(value).lower()}"])
        exchange_from_config(cfg, model, world_size=1, rank=0)
    assert seen == [False, True]


_real_init = SparseReducer.__init__


@pytest.mark.slow  # a benchmark; the fast path itself is checked bit for bit above
def test_benchmark_times_the_fast_path_beside_the_torch_path_on_a_tiny_gradient():
    """``sparsetrain.benchmarks.compress``'s fast rows (what `make gpu-check` times on the GPU)
    run here on CPU tensors under the interpreter: every scheme with kernels, both scopes, and
    their goals (top-k faster than torch.topk alone, random-k and block-k <= 2 copies)."""
    from sparsetrain.benchmarks import compress as bench
    from sparsetrain.compress import Layout

    cpu = torch.device("cpu")
    if not fused.interpreting():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    layout = Layout.from_sizes(SIZES)
    g = data(layout.total, 6, torch.float32, cpu)[0]
    rows = bench.fast_rows(layout, g, 0.02, 1, cpu)
    assert [(r["scheme"], r["scope"]) for r in rows] == [(f"{s}_fast", sc) for s in ("topk", "randk", "blockk",
                                                                                      "signsgd") for sc in SCOPES]
    assert all(r["compress_ef_ms"] > 0 and r["compress_ef_copies"] > 0 and r["decompress_ms"] > 0 for r in rows)
    goals = bench.goals({"device": "cpu", "schemes": rows, "references_copies": {"torch.topk(g.abs(),k)": 1.0}})
    assert {name.split(" = ")[0] for name in goals} == {
        "topk_fast/layerwise compress+EF faster than torch.topk alone",
        "topk_fast/global compress+EF faster than torch.topk alone",
        *(f"{s}_fast/{sc} {what} <= 2 copies" for s in ("randk", "blockk") for sc in SCOPES
          for what in ("compress+EF", "decompress")),
        *(f"signsgd_fast/{sc} {what}" for sc in SCOPES for what in ("compress+EF <= 4 copies",
                                                                     "decompress <= 2 copies"))}
    kernel_rows = bench.fast_kernel_rows(layout, g, 1, cpu)
    assert [(r["scheme"], r["scope"]) for r in kernel_rows] == [("signsgd_fast", "kernels"), ("qsgd_s1_fast", "kernels")]
    assert set(bench.goals({"device": "cuda", "schemes": kernel_rows, "references_copies": {}})) == {
        f"{s} {what} <= 4 copies" for s in ("signsgd_fast", "qsgd_s1_fast") for what in ("encode", "decode_add")}


# PowerSGD's tensors: shapes repeated at uneven gaps (a 1-D tensor between two of a shape), a
# matrix of rank below the rank asked (3 x 5), 1-D tensors (matrices of one column)
PSGD_SHAPES = [(8, 4, 3, 3), (5,), (8, 4, 3, 3), (8, 4, 3, 3), (8, 4, 3, 3), (6,), (8, 4, 3, 3), (16, 8), (3, 5),
               (16, 8)]


@pytest.mark.parametrize("rank", [2, 3], ids=["gram_schmidt", "qr"])
@pytest.mark.parametrize("device", DEVICES)
def test_powersgd_batched_by_shape_equals_the_unbatched_path(device, rank):
    """``train.fast_path`` for PowerSGD: the reducer batches its matmuls by shape (one bmm per
    run of same-shape matrices, fewer calls than matrices) and gives the same update, memory and
    Q as the torch path over several steps, within float rounding: bit for bit where the BLAS
    computes each product of ``torch.bmm`` as ``torch.mm`` does (the CPU of the AMD EPYC machines),
    not everywhere (an Intel Xeon's MKL sums in another order, as cuBLAS's batched kernels may)."""
    from sparsetrain.compress import Layout, PowerSGD
    from sparsetrain.compress.powersgd import ShapeBatches

    sizes = [math.prod(s) for s in PSGD_SHAPES]
    n = sum(sizes)

    def make(fast):
        comp = PowerSGD(1.0, Layout.from_sizes(sizes), shapes=PSGD_SHAPES, rank=rank, device=device)
        return reducer(comp, "allreduce", fast, device, torch.float32)

    fast, slow = make(True), make(False)
    assert fast.fast_path_reason is None and fast._fused is None and fast.compressor.batched
    assert not slow.compressor.batched
    runs = ShapeBatches(fast.compressor).runs
    assert len(runs) < len(PSGD_SHAPES) and max(r[1] for r in runs) >= 2
    def same(a, b):  # float32 rounding, compounded over 4 steps by the orthogonalisation: up to 5e-4
        return torch.allclose(a, b, rtol=1e-3, atol=1e-4)

    for step in range(4):
        grad, _ = data(n + 5, 30 + step, torch.float32, device)
        a, b = grad.clone(), grad.clone()
        fast.reduce(a, step, NULL_TIMER)
        slow.reduce(b, step, NULL_TIMER)
        assert same(a, b) and same(fast.memory.memory, slow.memory.memory)
        assert same(fast.compressor.q, slow.compressor.q)


HOOK_ROW = """
import json, math, sys
import torch
import torch.distributed as dist
from sparsetrain.benchmarks import compress as bench
shapes = [tuple(s) for s in json.loads(sys.argv[1])]
g = torch.Generator().manual_seed(8)
grad = torch.randn(sum(math.prod(s) for s in shapes), generator=g)
calls = []
try:
    row = bench.torch_hook_row(shapes, grad, 0.05, 2, torch.device("cpu"), calls)
    assert dist.is_initialized()  # its own group, kept for the profile's rerun of the hook
    calls[-1][1]()
finally:
    bench.close_group()
assert not dist.is_initialized()
print(json.dumps(row))
"""


@pytest.mark.slow  # a benchmark
def test_benchmark_times_powersgd_batched_and_torchs_hook_beside_ours_on_a_tiny_gradient():
    """The compressor benchmark's PowerSGD rows: ours, ours batched by shape (``powersgd_fast``,
    what `make gpu-check` times on the GPU) and torch's ``powerSGD_hook`` on the same gradient
    in a one-rank gloo group at the matched rank; the goal (ours no slower) for both of ours.
    torch's row runs in a child process that must exit cleanly: its group, freed on a gloo
    thread, once aborted the process at exit or in a later test (``close_group`` says why)."""
    import json
    import subprocess
    import sys

    from sparsetrain.benchmarks import compress as bench
    from sparsetrain.comm.ddp_hook import matched_powersgd_rank

    if not fused.interpreting():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    cpu = torch.device("cpu")
    g = data(sum(math.prod(s) for s in PSGD_SHAPES), 8, torch.float32, cpu)[0]
    rows = [bench.powersgd_row(PSGD_SHAPES, g, 0.05, 2, cpu),
            bench.powersgd_row(PSGD_SHAPES, g, 0.05, 2, cpu, fast_path=True)]
    child = subprocess.run([sys.executable, "-c", HOOK_ROW, json.dumps(PSGD_SHAPES)], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    rows.append(json.loads(child.stdout.splitlines()[-1]))
    assert [r["scheme"] for r in rows] == ["powersgd", "powersgd_fast", "torch_powersgd_hook"]
    assert rows[2]["rank"] == matched_powersgd_rank(PSGD_SHAPES, 0.05) and rows[2]["compress_ef_ms"] > 0
    goals = bench.goals({"device": "cpu", "schemes": rows, "references_copies": {}})
    assert sorted(name.split(" step")[0] for name in goals) == ["powersgd", "powersgd_fast"]
    assert all("<= torch's hook" in name for name in goals)


@pytest.fixture
def device_ops(monkeypatch):
    """The quantizers' torch path as it runs on a GPU (its batched device ops), here on CPU
    tensors: what the fast path's signSGD kernels are checked against."""
    quantizers_as_on_a_gpu(monkeypatch.setattr)


def quantizers_as_on_a_gpu(set_attr) -> None:
    """Point the quantizers' torch path at its batched device ops (``set_attr``: monkeypatch's,
    or ``setattr`` in a rank's own process)."""
    from sparsetrain.compress import quantize

    set_attr(quantize, "_numpy_ok", lambda t: False)
    set_attr(quantize, "_kernel_ok", lambda *t: False)
    set_attr(quantize, "_batched", lambda t: True)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_signsgd_encodes_decodes_and_forgets_as_the_torch_path(device, scope, dtype, device_ops):
    """signSGD's kernels (the scales by the torch path's own ops, then one kernel for the packed
    signs and the forget; one for the decode) against the torch path, bit for bit: scales,
    codes (an odd count: a last byte part full, zeros and negative zeros), decoded update, and
    error feedback's memory over a few steps."""
    n = sum(SIZES)
    mem, grad = data(n, 12, dtype, device)
    grad[::7] = 0.0
    grad[3::11] = -0.0
    ref_mem = mem.clone()
    comp, ref = SignSGD(1.0, SIZES, scope, device=device), SignSGD(1.0, SIZES, scope, device=device)
    for step in range(3):
        got = fused.step(comp, mem, grad)
        want, ref_mem = torch_path(ref, ref_mem, grad)
        assert torch.equal(got.values, want.values) and torch.equal(got.positions, want.positions)
        assert torch.equal(mem, ref_mem)
        out, ref_out = data(n, 40 + step, dtype, device)[0], None
        ref_out = out.clone()
        fused.sign_decode_add(comp, got.values, got.positions, out)
        ref.decode_add(want.values, want.positions, ref_out)
        assert torch.equal(out, ref_out)
        grad = data(n, 50 + step, dtype, device)[1]


@pytest.mark.parametrize("device", DEVICES)
def test_reducer_with_the_fast_path_runs_signsgds_kernels_with_the_same_update(device, device_ops):
    """``train.fast_path`` for signSGD (AllGather, error feedback): the reducer runs the fused
    step and decodes by the kernel, and its update and memory equal the torch path's."""
    fast = reducer(SignSGD(1.0, SIZES, device=device), "allgather", True, device, torch.float32)
    slow = reducer(SignSGD(1.0, SIZES, device=device), "allgather", False, device, torch.float32)
    assert fast._fused is not None and fast.compressor.fast_decode is fused.sign_decode_add
    assert slow.compressor.fast_decode is None
    for step in range(3):
        grad, _ = data(sum(SIZES) + 5, 60 + step, torch.float32, device)
        a, b = grad.clone(), grad.clone()
        fast.reduce(a, step, NULL_TIMER)
        slow.reduce(b, step, NULL_TIMER)
        assert torch.equal(a, b) and torch.equal(fast.memory.memory, slow.memory.memory)


def test_torchs_hook_row_is_left_out_in_one_line_where_no_group_can_be_set_up(monkeypatch, capsys):
    """A machine where the one-rank group fails (NCCL missing, say): no hook row, one line on
    stderr, and the benchmark's other rows still come."""
    import torch.distributed as dist

    from sparsetrain.benchmarks import compress as bench

    def refuse(*a, **kw):
        raise RuntimeError("no backend here")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    g = torch.randn(sum(math.prod(s) for s in PSGD_SHAPES))
    assert bench.torch_hook_row(PSGD_SHAPES, g, 0.05, 1, torch.device("cpu")) is None
    assert "torch_powersgd_hook: no row" in capsys.readouterr().err and not dist.is_initialized()


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("levels,generator", [(1, "counter"), (7, "pcg64"), (3, "counter"),
                                              pytest.param(127, "counter", marks=pytest.mark.slow),
                                              pytest.param(31, "pcg64", marks=pytest.mark.slow),
                                              pytest.param(63, "counter", marks=pytest.mark.slow),
                                              pytest.param(255, "counter", marks=pytest.mark.slow),
                                              pytest.param(65535, "pcg64", marks=pytest.mark.slow)],
                         ids=["s1_2bits", "s7_4bits_pcg64", "s3_3bits", "s127_8bits", "s31_6bits_pcg64",
                              "s63_7bits", "s255_9bits", "s65535_17bits_pcg64"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_qsgd_encodes_and_decodes_as_the_torch_path(device, levels, generator, dtype, device_ops):
    """QSGD's kernels (the norms, factors and uniforms by the torch path's ops, its generator's
    numbers as an input; one kernel for the levels and packed codes, one for the decode) against
    the torch path, bit for bit: norms, codes (an odd count, buckets cut short, zeros; whole codes
    in a byte at 2, 4 and 8 bits, codes crossing bytes at the other widths) and the decoded
    update, over a few seeds."""
    n = sum(SIZES)
    comp = QSGD(1.0, SIZES, levels=levels, bucket_size=64, generator=generator, device=device)
    assert fused.reason(comp, ErrorFeedback(n), device, dtype) is None
    ref = QSGD(1.0, SIZES, levels=levels, bucket_size=64, generator=generator, device=device)
    comp.fast_encode, comp.fast_decode = fused.qsgd_encode, fused.qsgd_decode_add
    for seed in range(2):
        acc, out = data(n, 70 + seed, dtype, device)
        acc[::9] = 0.0
        acc[600:616] = 0.0  # a small segment all zeros: norm 0
        got, want = comp.compress(acc, seed), ref.compress(acc, seed)
        assert torch.equal(got.values, want.values) and torch.equal(got.positions, want.positions)
        ref_out = out.clone()
        comp.decompress_add(got.values, got.positions, out)
        ref.decompress_add(want.values, want.positions, ref_out)
        assert torch.equal(out, ref_out)


@pytest.mark.parametrize("ef", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no_ef", "ef"])
@pytest.mark.parametrize("device", DEVICES)
def test_reducer_with_the_fast_path_runs_qsgds_kernels_with_the_same_update(device, ef, device_ops):
    """``train.fast_path`` for QSGD (its default: no error feedback; and with it): the reducer
    encodes and decodes by the kernels, and its update and memory equal the torch path's."""
    def make(fast):
        return SparseReducer(QSGD(1.0, SIZES, levels=1, device=device), aggregation="allgather", world_size=1,
                             rank=0, seed=3, uncompressed_numel=5, error_feedback=ef, device=device, fast_path=fast)

    fast, slow = make(True), make(False)
    assert fast.fast_path_reason is None and fast._fused is None
    assert fast.compressor.fast_encode is fused.qsgd_encode and slow.compressor.fast_encode is None
    for step in range(3):
        grad, _ = data(sum(SIZES) + 5, 80 + step, torch.float32, device)
        a, b = grad.clone(), grad.clone()
        fast.reduce(a, step, NULL_TIMER)
        slow.reduce(b, step, NULL_TIMER)
        assert torch.equal(a, b) and torch.equal(fast.memory.memory, slow.memory.memory)


HOOK_SCHEMES = ("topk", "randk", "blockk", "qsgd", "signsgd", "powersgd")


def _hook_with_and_without_fast_path(device: str, rank: int, world: int) -> dict:
    """Each of HOOK_SCHEMES trained 3 steps through DDP's hook (``sparse_hook``, layer-wise, small
    buckets), once with ``fast_path`` and once without: the weights, how often the fused step
    ran (top-k, random-k, block-k, signSGD) beside how often the hook ran, and whether the
    compressor was readied for its own fast rounds (QSGD's kernels, PowerSGD batched)."""
    import threading

    from conftest import compressor_for
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook

    if device == "cpu":
        from triton.runtime import interpreter

        # Triton's interpreter keeps one launch grid per process: kernels launched at once from
        # a collective's callback thread (decodes) and this one (encodes) would mix it up
        launch, one_at_a_time = interpreter.InterpretedFunction.run, threading.Lock()

        def serialised(self, *args, **kwargs):
            with one_at_a_time:
                return launch(self, *args, **kwargs)

        interpreter.InterpretedFunction.run = serialised
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    quantizers_as_on_a_gpu(setattr)  # as ``device_ops``: what signSGD's kernels match
    calls = []
    plain_step = fused.step

    def counted(*args, **kwargs):
        calls.append(1)
        return plain_step(*args, **kwargs)

    fused.step = counted
    out = {}
    for scheme in HOOK_SCHEMES:
        for fast in (False, True):
            torch.manual_seed(0)
            # biases travel whole (uncompressed="1d"): a bucket's compressed tensors lie in
            # several runs, gathered into one for the fused step
            net = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                      torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dev)
            ddp = DDP(net, bucket_cap_mb=0.003)  # a few buckets
            state = SparseHookState(ddp, scheme, "layerwise", "allgather", 0.1, seed=3,
                                    compressor=compressor_for(scheme), fast_path=fast)
            ddp.register_comm_hook(state, lambda st, bucket: calls.append(0) or sparse_hook(st, bucket))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(10 + rank)
            del calls[:]
            for _ in range(3):
                x, y = torch.randn(16, 24, generator=gen).to(dev), torch.randint(0, 4, (16,), generator=gen).to(dev)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            reducers = [plan.reducer for plan in state._buckets.values()]
            readied = all(getattr(r.compressor, "batched", False) or getattr(r.compressor, "fast_encode", None)
                          is not None for r in reducers)
            out[scheme, fast] = ([p.detach().cpu() for p in net.parameters()], (calls.count(1), calls.count(0)), len(reducers),
                                 [r.fast_path_reason for r in reducers], readied)
    fused.step = plain_step
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_ddp_hook_takes_the_fast_path_and_trains_as_without_it(device, tmp_path):
    """``dist.ddp=true`` with ``train.fast_path=true``: every bucket's reducer takes the fast path
    (no reason why not; the fused step runs for each bucket and step, or the compressor runs its
    own fast rounds) and trains as without it, on 2 gloo ranks (on CUDA: sharing one GPU; on the
    CPU under the interpreter, the quantizers' torch path as on a GPU): bit for bit, PowerSGD
    (batched matmuls) to float rounding."""
    from functools import partial

    from conftest import on_gloo_ranks

    for out in on_gloo_ranks(partial(_hook_with_and_without_fast_path, device), tmp_path):
        for scheme in HOOK_SCHEMES:
            (slow, slow_calls, n, _, _), (fast, fast_calls, n_fast, reasons, readied) = out[scheme, False], out[scheme, True]
            assert n == n_fast >= 2 and reasons == [None] * n and slow_calls[0] == 0, scheme
            assert fast_calls[1] >= 3, scheme  # the hook's calls: one a bucket, every step (DDP rebuilds its buckets after the first)
            if scheme in ("qsgd", "powersgd"):
                assert readied and fast_calls[0] == 0, scheme
            else:
                assert fast_calls[0] == fast_calls[1], scheme
            for a, b in zip(slow, fast, strict=True):
                if scheme == "powersgd":
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(a, b), scheme
