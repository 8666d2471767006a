"""The CUDA path: compressors, error feedback, reducers, the trainer and NCCL on a GPU.

Every check is parametrised over devices: ``cpu`` always (so that the logic of each check runs in
CI, which has no GPU) and ``cuda`` where a GPU is present (marked ``cuda``: ``pytest -m cuda``
runs only those; they skip with a reason elsewhere). On ``cpu`` the "device path" of top-k is its
torch-only method (``TopK._select_torch``, the one CUDA runs), checked against ``torch.topk`` and
the numpy CPU path. ``make gpu-check`` runs the ``cuda`` ones on a GPU.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsetrain.comm import SparseReducer, build_reducer
from sparsetrain.comm.group import resolve_backend
from sparsetrain.compress import BlockRandomK, ErrorFeedback, Layout, NoCompression, TopK, step_seed
from sparsetrain.config import ConfigError
from sparsetrain.timing import PHASES, PhaseTimer
from tests.conftest import compressor_for, read_json, read_jsonl, run_cli

HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False); run `make gpu-check` on a GPU machine"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices for NCCL, this machine has {GPUS}")

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, needs_cuda])
DEVICES = [CPU, CUDA]

SCOPES = ("layerwise", "global")
# small (<= TopK.SMALL: every entry a candidate) and large segments (sampled threshold path)
MIXED = Layout.from_sizes([432, 16, 16, 40000, 64, 20000, 10, 9000, 1, 12001])


def resnet18_layout() -> Layout:
    from sparsetrain.models import build_model

    return Layout.from_tensors(list(build_model("resnet18", 3, 10).parameters()))


def distinct_magnitudes(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """|acc| is a permutation of 1..n (exact in float32 up to 2**24): the top-k set is unique."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.randperm(n, generator=g).to(dtype) + 1
    sign = torch.randint(0, 2, (n,), generator=g).to(dtype) * 2 - 1
    return mag * sign


def int_grad(n: int, seed: int, device) -> torch.Tensor:
    """Integer-valued float64: every sum below is exact, so identities hold bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (n,), generator=g).to(torch.float64).to(device)


def make(name, ratio, scope, layout=MIXED, device="cpu", **kw):
    factory = compressor_for(name, block_size=kw.pop("block_size", 16)) if name != "none" else NoCompression
    return factory(ratio, layout, scope, device=device, **kw)


def device_path(comp, acc):
    """``(values, indices)`` from the method the device runs; on CPU top-k's torch-only path."""
    if acc.device.type == "cpu" and isinstance(comp, TopK):
        _, idx = comp._select_torch(acc)
        return acc[idx], idx
    p = comp.compress(acc, 0)
    return p.values, p.indices


def segments(comp):
    """(slot start, k, entry offset, entry count) of every segment of the compressor's scope."""
    out, pos = [], 0
    for off, n, k in zip(comp.layout.offsets, comp.layout.sizes, comp.ks, strict=True):
        out.append((pos, k, off, n))
        pos += k
    return out


# ------------------------------------------------------------------------------------ top-k
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("ratio", [0.01, 0.1])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_topk_same_set_on_device_as_cpu(device, scope, ratio, dtype):
    acc = distinct_magnitudes(MIXED.total, 7, dtype)
    cpu = make("topk", ratio, scope)
    cpu_idx = cpu.compress(acc).indices
    dev = make("topk", ratio, scope, device=device)
    values, idx = device_path(dev, acc.to(device))
    assert idx.device.type == values.device.type == device
    idx, values = idx.cpu(), values.cpu()
    assert idx.dtype == torch.int64 and idx.numel() == cpu.k
    for pos, k, off, n in segments(cpu):
        ref = set((torch.topk(acc[off : off + n].abs(), k).indices + off).tolist())
        assert set(idx[pos : pos + k].tolist()) == ref  # the device picks torch.topk's set
        assert set(cpu_idx[pos : pos + k].tolist()) == ref  # and so does the CPU path
    assert torch.equal(values, acc[idx])
    assert dev.fallbacks == 0  # the sampled thresholds sufficed


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scope", SCOPES)
def test_topk_resnet18_gradient_same_set_on_cuda_as_cpu(scope):
    layout = resnet18_layout()
    acc = distinct_magnitudes(layout.total, 3)
    cpu = make("topk", 0.01, scope, layout)
    cuda = make("topk", 0.01, scope, layout, device="cuda")
    a = cpu.compress(acc).indices
    b = cuda.compress(acc.cuda()).indices.cpu()
    for pos, k, _, _ in segments(cpu):
        assert torch.equal(a[pos : pos + k].sort().values, b[pos : pos + k].sort().values)
    assert cuda.fallbacks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_topk_device_path_falls_back_exactly_where_a_threshold_is_too_high(device, scope, dtype, monkeypatch):
    """The large segments' thresholds set too high (too few candidates there): those segments,
    and only those, take the exact fallback, between segments that did not; torch.topk's sets."""
    dev = make("topk", 0.01, scope, device=device)
    thresholds = dev._segment_thresholds
    large = torch.zeros(len(dev.layout), dtype=torch.bool, device=device)
    large[dev.large] = True
    monkeypatch.setattr(dev, "_segment_thresholds", lambda sc: thresholds(sc).masked_fill(large, float("inf")))
    acc = distinct_magnitudes(MIXED.total, 11, dtype)
    values, idx = device_path(dev, acc.to(device))
    idx = idx.cpu()
    for pos, k, off, n in segments(dev):
        assert set(idx[pos : pos + k].tolist()) == set((torch.topk(acc[off : off + n].abs(), k).indices + off).tolist())
    assert torch.equal(values.cpu(), acc[idx]) and dev.fallbacks == len(dev.large) > 0


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_topk_with_ties_sends_the_k_largest_magnitudes(device, scope):
    """Many equal magnitudes: the set is not unique, but its magnitudes are."""
    g = torch.Generator().manual_seed(5)
    acc = torch.randint(-40, 41, (MIXED.total,), generator=g).to(torch.float32)
    comp = make("topk", 0.05, scope, device=device)
    values, idx = device_path(comp, acc.to(device))
    values, idx = values.cpu(), idx.cpu()
    for pos, k, off, n in segments(comp):
        seg = idx[pos : pos + k]
        assert seg.unique().numel() == k and bool(((seg >= off) & (seg < off + n)).all())
        ref = torch.topk(acc[off : off + n].abs(), k).values.sort().values
        assert torch.equal(values[pos : pos + k].abs().sort().values, ref)


# ------------------------------------------------------------------------- random schemes
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", ["randk", "blockk"])
@pytest.mark.parametrize("device", DEVICES)
def test_random_schemes_pick_valid_sets(device, name, scope):
    comp = make(name, 0.05, scope, device=device)
    acc = torch.zeros(MIXED.total, device=device)
    seen = set()
    for seed in range(12):
        p = comp.compress(acc, step_seed(1, seed))
        assert p.indices.device.type == p.positions.device.type == device
        idx = p.indices.cpu()
        assert idx.dtype == torch.int64 and idx.numel() == comp.k  # exactly k
        assert idx.unique().numel() == comp.k  # distinct
        for pos, k, off, n in segments(comp):  # within bounds, per segment for layerwise
            seg = idx[pos : pos + k]
            assert bool(((seg >= off) & (seg < off + n)).all())
        # what travels on the wire expands to the same entries, on the device
        assert torch.equal(comp.indices(p.positions.to(torch.int32)).cpu(), idx)
        again = comp.compress(acc, step_seed(1, seed)).indices.cpu()
        assert torch.equal(again, idx)  # deterministic from the seed
        seen.add(tuple(idx.tolist()))
    assert len(seen) == 12  # and different for different seeds
    if name == "blockk" and scope == "layerwise":  # one contiguous run per tensor, wrapping
        p = comp.compress(acc, 3)
        for s, (pos, k, off, n) in enumerate(segments(comp)):
            start = int(p.positions[s])
            assert torch.equal(p.indices[pos : pos + k].cpu(), (start + torch.arange(k)) % n + off)
    if name == "blockk" and scope == "global":  # whole blocks of 16, from the drawn starts
        p = comp.compress(acc, 3)
        starts = set(p.positions.cpu().tolist())
        assert all(s % 16 == 0 for s in starts)
        assert set((p.indices.cpu() // 16 * 16).tolist()) <= starts


def _frequencies(comp, device, trials):
    acc = torch.zeros(comp.numel, device=device)
    counts = torch.zeros(comp.numel, dtype=torch.float64, device=device)
    block_counts = None
    for t in range(trials):
        p = comp.compress(acc, step_seed(9, t))
        counts.index_add_(0, p.indices, torch.ones(comp.k, dtype=torch.float64, device=device))
        if isinstance(comp, BlockRandomK) and comp.scope == "global":
            b = torch.zeros(comp.nb, dtype=torch.float64, device=device)
            b[p.positions // comp.block_size] = 1
            block_counts = b if block_counts is None else block_counts + b
    return counts.cpu() / trials, None if block_counts is None else block_counts.cpu() / trials


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", ["randk", "blockk"])
@pytest.mark.parametrize("device", DEVICES)
def test_random_schemes_are_uniform(device, name, scope):
    """Every entry is sent with probability k_s / n_s (every block drawn with blocks_drawn / nb for
    global block-k), within 5 standard errors, over 1500 seeded draws."""
    layout = Layout.from_sizes([40, 16, 300])
    comp = make(name, 0.25, scope, layout, device=device)
    trials = 1500
    freq, blocks = _frequencies(comp, device, trials)
    if blocks is not None:
        p = comp.blocks_drawn / comp.nb
        assert float((blocks - p).abs().max()) < 5 * (p * (1 - p) / trials) ** 0.5
        return
    for _, k, off, n in segments(comp):
        p = k / n
        f = freq[off : off + n]
        assert float((f - p).abs().max()) < 5 * (p * (1 - p) / trials) ** 0.5 + 1e-12


# ------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", ["none", "topk", "randk", "blockk"])
@pytest.mark.parametrize("device", DEVICES)
def test_error_feedback_identities_float64(device, name, scope):
    """acc = grad + memory; memory = acc - sent; sent + memory conserved, bit for bit."""
    n = MIXED.total
    comp = make(name, 0.05, scope, device=device)
    ef = ErrorFeedback(n, device=device, dtype=torch.float64)
    assert ef.memory.device.type == device
    total_in = torch.zeros(n, dtype=torch.float64, device=device)
    total_sent = torch.zeros(n, dtype=torch.float64, device=device)
    for step in range(5):
        g = int_grad(n, step, device)
        before = ef.memory.clone()
        acc = ef.accumulate(g)
        assert torch.equal(acc, g + before)  # acc = grad + memory
        acc_copy = acc.clone()
        p = comp.compress(acc, step_seed(4, step))
        ef.forget(p, comp)
        sent = comp.decompress(p.values, p.positions, dtype=torch.float64)
        assert sent.device.type == device
        assert torch.equal(ef.memory, acc_copy - sent)  # memory = acc - sent
        assert torch.equal(p.values, acc_copy[p.indices] if p.indices is not None else acc_copy)
        total_in += g
        total_sent += sent
        assert torch.equal(total_sent + ef.memory, total_in)  # nothing lost, nothing made up
    if name != "none":
        assert bool(ef.memory.abs().sum() > 0)


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("device", DEVICES)
def test_topk_error_feedback_same_trajectory_on_device_as_cpu(device, scope):
    """Top-k is deterministic in its input: memory and sent values agree with the CPU, step by
    step (float64, integer-valued gradients, so no rounding can differ)."""
    n = MIXED.total
    cpu, dev = make("topk", 0.02, scope), make("topk", 0.02, scope, device=device)
    ef_cpu = ErrorFeedback(n, dtype=torch.float64)
    ef_dev = ErrorFeedback(n, device=device, dtype=torch.float64)
    for step in range(4):
        g = int_grad(n, 100 + step, "cpu") + 0.5 * distinct_magnitudes(n, step, torch.float64) / n
        a = ef_cpu.step(g, cpu)
        acc = ef_dev.accumulate(g.to(device))
        _, idx = device_path(dev, acc)
        b_idx = idx.cpu()
        ef_dev.memory.index_fill_(0, idx, 0)
        assert set(a.indices.tolist()) == set(b_idx.tolist())
        assert torch.equal(ef_dev.memory.cpu(), ef_cpu.memory)


# --------------------------------------------------------------------- reducer, one rank
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize(
    "scheme,agg",
    [("topk", "allgather"), ("randk", "allreduce"), ("randk", "allgather"), ("blockk", "allreduce"),
     ("blockk", "allgather")],
)
@pytest.mark.parametrize("device", DEVICES)
def test_reducer_one_rank_on_device(device, scheme, agg, scope):
    """One rank, no process group: update + new memory = grad + old memory, exactly; the byte
    buffers of AllGather (float values and int positions viewed from uint8) work on the device."""
    red = build_reducer(scheme, scope, agg, 0.05, MIXED, world_size=1, rank=0, seed=3,
                        compressor=compressor_for(scheme, block_size=16), device=device, dtype=torch.float64)
    assert isinstance(red, SparseReducer) and red.memory.memory.device.type == device
    timer = PhaseTimer(device, warmup_steps=0)
    for step in range(3):
        flat = int_grad(MIXED.total, step, device)
        expect = flat + red.memory.memory
        with timer.step():
            stats = red.reduce(flat, step, timer, want_stats=True)
        assert flat.device.type == device
        assert torch.equal(flat + red.memory.memory, expect)
        assert int(torch.count_nonzero(flat)) <= red.compressor.k
        assert 0.0 <= stats.compression_error <= 1.0
        assert {"compress", "exchange", "decompress", "step"} <= set(timer.last)


# ------------------------------------------------------------------------- device checks
def test_compressor_refuses_a_tensor_on_another_device():
    for name in ("topk", "randk", "blockk"):
        comp = make(name, 0.1, "layerwise", device="meta")
        with pytest.raises(ValueError, match="built for device meta but acc is on cpu"):
            comp.compress(torch.zeros(MIXED.total))


@pytest.mark.cuda
@needs_cuda
def test_cuda_compressor_device_checks():
    for name in ("topk", "randk", "blockk"):
        with pytest.raises(ValueError, match="built for device cpu but acc is on cuda"):
            make(name, 0.1, "layerwise").compress(torch.zeros(MIXED.total, device="cuda"))
        comp = make(name, 0.1, "global", device="cuda")  # "cuda" is the current device, cuda:0
        assert comp.device == torch.device("cuda", torch.cuda.current_device())
        assert comp.compress(torch.ones(MIXED.total, device="cuda:0")).values.is_cuda


def test_backend_choice():
    cuda0, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_backend("auto", cpu, 4) == "gloo"
    assert resolve_backend("auto", cuda0, 2, gpus=2) == "nccl"
    assert resolve_backend("gloo", cuda0, 4, gpus=1) == "gloo"  # gloo may share a GPU
    with pytest.raises(ConfigError, match="NCCL needs CUDA tensors"):
        resolve_backend("nccl", cpu, 2)
    with pytest.raises(ConfigError, match="2 ranks on a machine with 1 GPU"):
        resolve_backend("auto", cuda0, 2, gpus=1)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_per_rank_state_goes_to_cpu(device):
    """What every rank contributes to the checkpoint is moved to the CPU before
    all_gather_object pickles it (a CUDA tensor would be unpickled onto the sender's GPU)."""
    from sparsetrain.train.record import _to_cpu

    t = torch.arange(4.0, device=device)
    state = {"reducer": {"error_feedback": {"enabled": True, "memory": t}}, "epoch_stats": [t, (t, 3)]}
    out = _to_cpu(state)
    mem = out["reducer"]["error_feedback"]["memory"]
    assert mem.device.type == "cpu" and torch.equal(mem, t.cpu())
    assert out["reducer"]["error_feedback"]["enabled"] is True
    assert isinstance(out["epoch_stats"][1], tuple) and out["epoch_stats"][1][1] == 3
    assert out["epoch_stats"][1][0].device.type == "cpu"


# --------------------------------------------------------------------- reducer, two ranks
REDUCER_COMBOS = [("topk", "layerwise", "allgather"), ("topk", "global", "allgather"),
                  ("randk", "layerwise", "allreduce"), ("randk", "global", "allgather"),
                  ("blockk", "layerwise", "allreduce"), ("blockk", "global", "allgather"),
                  ("none", "layerwise", "allreduce")]
BACKENDS = [
    pytest.param("cpu", "gloo", id="cpu-gloo"),
    pytest.param("cuda", "gloo", id="cuda-gloo", marks=[pytest.mark.cuda, needs_cuda]),
    pytest.param("cuda", "nccl", id="cuda-nccl", marks=[pytest.mark.cuda, needs_2_gpus]),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_grad(rank, step):
    """Normal values on a 2**-20 grid: every sum and halving below is exact, ties improbable."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.round(torch.randn(MIXED.total, generator=g, dtype=torch.float64) * 2**20) / 2**20


def _reducer_worker(rank, world, port, path, device_type, backend):
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if device_type == "cuda":  # nccl: one GPU per rank; gloo: ranks may share one
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **kw)
    try:
        results = {}
        for scheme, scope, agg in REDUCER_COMBOS:
            red = build_reducer(scheme, scope, agg, 0.05, MIXED, world_size=world, rank=rank, seed=5,
                                compressor=compressor_for(scheme, block_size=16), device=device,
                                dtype=torch.float64)
            outs = []
            for step in range(3):
                flat = _two_rank_grad(rank, step).to(device)
                red.reduce(flat, step, PhaseTimer(device, warmup_steps=0))
                outs.append(flat.cpu())
            mem = red.memory.memory.cpu() if isinstance(red, SparseReducer) else None
            results[(scheme, scope, agg)] = (outs, mem)
        torch.save(results, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_two_ranks_reduce_on_device(tmp_path, device, backend):
    """Two ranks exchange through gloo or NCCL: every rank gets the same update, and it is the
    average of what each rank chose from grad + memory, computed here on the same device by
    hand (random positions come from the device's generator, so the reference runs there)."""
    world = 2
    mp.spawn(_reducer_worker, args=(world, _free_port(), str(tmp_path), device, backend),
             nprocs=world, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for scheme, scope, agg in REDUCER_COMBOS:
        (outs0, mem0), (outs1, mem1) = res[0][(scheme, scope, agg)], res[1][(scheme, scope, agg)]
        comp = make(scheme, 0.05, scope, device=device) if scheme != "none" else None
        memory = [torch.zeros(MIXED.total, dtype=torch.float64, device=device) for _ in range(world)]
        for step in range(3):
            assert torch.equal(outs0[step], outs1[step]), (scheme, scope, agg, step)
            avg = torch.zeros(MIXED.total, dtype=torch.float64, device=device)
            for r in range(world):
                acc = _two_rank_grad(r, step).to(device) + memory[r]
                if comp is None:
                    avg += acc
                    continue
                _, idx = comp.select(acc, step_seed(5, step, None if agg == "allreduce" else r))
                mask = torch.zeros(MIXED.total, dtype=torch.bool, device=device)
                mask[idx] = True
                avg += torch.where(mask, acc, 0.0)
                memory[r] = torch.where(mask, 0.0, acc)
            assert torch.equal(outs0[step], (avg / world).cpu()), (scheme, scope, agg, step)
        if comp is not None:
            assert torch.equal(mem0, memory[0].cpu()) and torch.equal(mem1, memory[1].cpu())


# ------------------------------------------------------------------- the trainer, end to end
def _run(tmp_path, device, *extra, world_size=1):
    run_dir = tmp_path / "run"
    p = run_cli(
        f"train.device={device}", f"world_size={world_size}", "data=synthetic", "model=resnet20",
        "train.threads=1", "train.progress=false", "wandb.mode=disabled", *extra,
        f"hydra.run.dir={run_dir}", timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["status"] == "completed", summary.get("error")
    return run_dir, summary


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_run_phases_and_peak_memory(tmp_path, device):
    """``python -m sparsetrain.run train.device=cuda world_size=1``: completes; the phases add up
    to the step (on CUDA within 10%: the timer synchronises at phase boundaries only); peak
    memory comes from CUDA's allocator."""
    cuda = device == "cuda"
    steps, warmup = (40, 10) if cuda else (3, 1)
    run_dir, s = _run(tmp_path, device, "scheme=topk", "aggregation=allgather", "data.train_size=2048",
                      "data.test_size=256", "train.batch_size=32", f"train.max_steps={steps}",
                      f"train.timing_warmup={warmup}", "train.log_every=5")
    assert s["device"].startswith(device) and s["steps"] == steps
    assert s["timed_steps"] == steps - warmup
    t = s["time_ms"]
    assert set(t) == set(PHASES)
    parts = sum(v for k, v in t.items() if k != "step")
    assert all(t[k] > 0 for k in ("data", "forward", "backward", "compress", "decompress", "optimizer"))
    # phases are disjoint intervals inside the step, read from one clock: never more than it
    assert parts <= t["step"] * (1 + 1e-9)
    if cuda:
        assert parts >= 0.9 * t["step"], t  # the requirement: within 10%
    assert s["peak_memory_of"] == ("cuda_max_allocated" if cuda else "process_max_rss")
    # at least weights + gradients + error-feedback memory + momentum, float32 each
    assert s["peak_memory_mb"] >= 4 * 4 * s["num_parameters"] / 2**20
    if cuda:
        total_mb = torch.cuda.get_device_properties(0).total_memory / 2**20
        assert s["peak_memory_mb"] < min(total_mb, 4096)  # a 0.27M model with batch 32
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "step"]
    assert records and all(r["time_ms"]["step"] > 0 for r in records)
    assert s["test_accuracy"] is not None


@pytest.mark.cuda
@pytest.mark.parametrize(
    "backend,scheme,agg,ddp",
    [pytest.param("nccl", "topk", "allgather", False, marks=needs_2_gpus),
     pytest.param("nccl", "blockk", "allreduce", False, marks=needs_2_gpus),
     pytest.param("nccl", "topk", "allgather", True, marks=needs_2_gpus),
     pytest.param("gloo", "randk", "allgather", False, marks=needs_cuda),
     pytest.param("gloo", "topk", "allgather", True, marks=needs_cuda),
     pytest.param("gloo", "blockk", "allreduce", True, marks=needs_cuda)],
    ids=lambda v: ("ddp" if v else "trainer") if isinstance(v, bool) else None,
)
def test_two_rank_cuda_run(tmp_path, backend, scheme, agg, ddp):
    """Two ranks on CUDA: NCCL with one GPU each (needs 2 GPUs), gloo on CUDA tensors (ranks may
    share one GPU); through the trainer's own exchange and through torch DDP with sparsetrain's
    hook (``dist.ddp=true``, small buckets: several hook calls per step). 8 steps per epoch, so
    an epoch-end checkpoint (every rank's error-feedback memory gathered to rank 0) is written on
    the way."""
    extra = ("dist.ddp=true", "dist.bucket_cap_mb=0.05") if ddp else ()
    _, s = _run(tmp_path, "cuda", f"scheme={scheme}", f"aggregation={agg}", f"dist.backend={backend}",
                "data.train_size=512", "data.test_size=128", "train.batch_size=32",
                "train.max_steps=12", "train.timing_warmup=2", *extra, world_size=2)
    assert s["world_size"] == 2 and s["steps"] == 12
    assert s["device"].startswith("cuda") and s["peak_memory_of"] == "cuda_max_allocated"
    assert s["train_loss"] == s["train_loss"]  # not NaN
    # through DDP the hook's wait may hide inside backward (overlap): only the trainer's is > 0
    assert s["time_ms"]["exchange"] >= 0 if ddp else s["time_ms"]["exchange"] > 0
    assert 0 < s["bytes_sent_per_step"] < 0.05 * s["dense_bytes_per_step"]
    if ddp:
        assert len(s["overlap_buckets"]) > 2 and s["time_ms"]["compress"] > 0


# ------------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", ["signsgd", "qsgd"])
@pytest.mark.parametrize("device", DEVICES)
def test_quantizers_on_device(device, name, scope):
    """signSGD and QSGD where the device runs them (torch's ops on CUDA, numpy's on the CPU): a
    message decodes to the CPU's numbers, bit for bit; signSGD encodes the CPU's signs and, to
    rounding, its scales; memory = acc - decoded exactly (float64); QSGD (buckets of 512: MIXED's
    large tensors end in short ones) unbiased there too, with buckets of 16."""
    cpu = compressor_for(name)(1.0, MIXED, scope)
    dev = compressor_for(name)(1.0, MIXED, scope, device=device)
    x = int_grad(MIXED.total, 1, "cpu") / 7
    p = cpu.compress(x, 5)
    got = dev.decompress(p.values.to(device), p.positions.to(device))
    assert got.device.type == device and torch.equal(got.cpu(), cpu.decompress(p.values, p.positions))
    q = dev.compress(x.to(device), 5)
    if name == "signsgd":
        assert torch.equal(q.positions.cpu(), p.positions)
        torch.testing.assert_close(q.values.cpu(), p.values, rtol=1e-13, atol=0)
    ef = ErrorFeedback(MIXED.total, device=device, dtype=torch.float64)
    for step in range(3):
        g = int_grad(MIXED.total, step, device) / 3
        acc = ef.memory + g
        sent = ef.step(g, dev, seed=step_seed(4, step))
        assert torch.equal(ef.memory, acc - dev.decompress(sent.values, sent.positions))
    if name == "qsgd":
        small = Layout.from_sizes([5, 40, 203])
        # buckets of 16: a segment shorter than one (5), segments ending in a short bucket
        comp = compressor_for(name)(1.0, small, scope, device=device, bucket_size=16)
        y = int_grad(small.total, 9, device) / 11
        trials = 500
        mean = torch.zeros_like(y)
        for seed in range(trials):
            m = comp.compress(y, seed)
            mean += comp.decompress(m.values, m.positions) / trials
        norm = torch.cat([y[i:j].norm().expand(j - i) for i, j in comp.bucket_spans()])
        assert torch.all((mean - y).abs() <= 5 * norm / (2 * comp.levels * trials**0.5))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name,options", [("signsgd", {}), ("qsgd", {"generator": "counter"}),
                                          ("qsgd", {"generator": "counter", "bucket_size": None})])
def test_quantizers_batched_device_path_on_the_cpu(monkeypatch, name, options, scope):
    """The device path batches what the CPU loops over segments and buckets (every segment's
    norm in one kernel, the full buckets' norms by rows of one matrix, per-segment numbers
    spread over the entries by one gather). Run here on the CPU in place of the numpy paths:
    the CPU's message decodes to the same bits, and it encodes the same codes and, to rounding,
    the same floats; error feedback's memory is acc - decoded exactly."""
    from sparsetrain.compress import quantize

    ref = compressor_for(name)(1.0, MIXED, scope, **options)
    x = int_grad(MIXED.total, 1, "cpu") / 7
    p = ref.compress(x, 5)
    decoded = ref.decompress(p.values, p.positions)
    monkeypatch.setattr(quantize, "_batched", lambda t: True)
    monkeypatch.setattr(quantize, "_numpy_ok", lambda t: False)
    monkeypatch.setattr(quantize, "_kernel_ok", lambda *t: False)
    dev = compressor_for(name)(1.0, MIXED, scope, **options)
    assert torch.equal(dev.decompress(p.values, p.positions), decoded)
    q = dev.compress(x, 5)
    assert torch.equal(q.positions, p.positions)
    torch.testing.assert_close(q.values, p.values, rtol=1e-13, atol=0)
    ef = ErrorFeedback(MIXED.total, dtype=torch.float64)
    g = int_grad(MIXED.total, 2, "cpu") / 3
    sent = ef.step(g, dev, seed=3)
    assert torch.equal(ef.memory, g - dev.decompress(sent.values, sent.positions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_qsgd_counter_generator_rounds_alike_on_the_cpu_and_the_device(device, dtype):
    """QSGD with ``generator="counter"`` (SplitMix64, counter-based): the device draws the CPU's
    uniforms and sends the CPU's message, byte for byte (with PCG64 the two draw differently)."""
    from sparsetrain.compress import QSGD
    from sparsetrain.compress.quantize import counter_uniforms

    n = MIXED.total
    cpu_u = counter_uniforms(77, n, dtype, "cpu", out=np.empty(n, torch.empty((), dtype=dtype).numpy().dtype))
    assert counter_uniforms(77, n, dtype, device).cpu().numpy().tobytes() == cpu_u.tobytes()
    x = (int_grad(n, 2, "cpu") / 7).to(dtype)
    for levels in (1, 127):
        cpu = QSGD(1.0, MIXED, levels=levels, generator="counter").compress(x, 77)
        dev = QSGD(1.0, MIXED, levels=levels, generator="counter", device=device).compress(x.to(device), 77)
        assert torch.equal(dev.positions.cpu(), cpu.positions)
