"""sparsetrain's PowerSGD (``scheme=powersgd``): the arithmetic (float64, exact where it is exact),
torch's hook on the same gradients, the trainer's exchange (its two rounds) and the DDP hook on
real gloo ranks, bytes, checkpoints, the one-line errors and an end-to-end run from the command
line."""

import io
import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TINY, on_gloo_ranks, read_json, read_jsonl, run_cli
from test_ddp_hook import Net

from sparsetrain.comm import SparseReducer, build_exchange, build_reducer
from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook
from sparsetrain.comm.sparse import Placement
from sparsetrain.compress import Layout, PowerSGD, compressed_first, uncompressed_flags
from sparsetrain.compress.powersgd import closest_rank, factor_entries, matrix_shape, orthogonalise
from sparsetrain.timing import PhaseTimer

F64 = torch.float64
# a convolution (n < m), a tall matrix (n > m), a rank-2 one (Gram-Schmidt at full rank), a row,
# vectors (whole under "1d"), and repeated shapes (grouped: one orthogonalisation per shape)
SHAPES = [(6, 3, 3, 3), (6,), (12, 5), (2, 9), (6, 3, 3, 3), (7,), (1, 30), (12, 5)]
# for torch's min_compression_rate=1: every matrix worth compressing at rank <= 3, vectors not
SHAPES_1D = [(6, 3, 3, 3), (6,), (12, 5), (16, 8), (6, 3, 3, 3), (7,), (4, 20), (12, 5)]
NUMEL = sum(math.prod(s) for s in SHAPES)
FULL = 64  # >= min(n, m) of every matrix above: full rank
STEPS, SEED = 5, 7


def grad(rank, step, numel=NUMEL):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + step), dtype=F64)


class InPlace:
    """The trainer's exchange for ``scheme=powersgd`` on a buffer whose tensors stay in their own
    order (whole ones among them, as in a DDP bucket): ``SparseReducer`` with a ``Placement``."""

    def __init__(self, shapes, rule, rank, world, me, **kw):
        flags = uncompressed_flags(shapes, rule)
        order = compressed_first(flags)
        self.red = build_reducer("powersgd", "layerwise", "allreduce", 0.01,
                                 Layout.from_sizes(math.prod(shapes[i]) for i in order),
                                 uncompressed=[flags[i] for i in order], shapes=[shapes[i] for i in order],
                                 compressor=partial(PowerSGD, rank=rank), world_size=world, rank=me,
                                 seed=SEED, dtype=F64, **kw)
        self.placement = Placement.of([math.prod(s) for s in shapes], flags)

    def reduce(self, flat, step, timer, want_stats=False):
        return self.red.reduce(flat, step, timer, want_stats, placement=self.placement)

    def __getattr__(self, name):
        return getattr(self.red, name)


def reducer(shapes=SHAPES, rule="1d", rank=FULL, world=1, me=0, **kw):
    return InPlace(shapes, rule, rank, world, me, **kw)


def timer():
    return PhaseTimer("cpu", warmup_steps=0)


def compressed_mask(shapes=SHAPES, rule="1d"):
    """True at the entries of the compressed tensors of the flat buffer."""
    return torch.cat([torch.full((math.prod(s),), not f) for s, f in zip(shapes, uncompressed_flags(shapes, rule))])


# ------------------------------------------------------------------------- the arithmetic, one rank
def test_matrix_view_and_entries():
    assert matrix_shape((16, 8, 3, 3)) == (16, 72) and matrix_shape((10,)) == (10, 1)
    assert factor_entries([(16, 8, 3, 3), (12, 5)], 2) == 2 * (16 + 72) + 2 * (12 + 5)
    assert factor_entries([(12, 5)], 64) == 5 * 17  # r = min(n, m, rank)
    assert closest_rank(lambda r: 10 * r, 34) == 3 and closest_rank(lambda r: 10 * r, 35) == 3  # ties: smaller


def test_orthogonalise_gram_schmidt_and_qr_give_orthonormal_columns_and_keep_zero_columns():
    for r in (1, 2, 3, 5):
        m = torch.randn(3, 9, r, dtype=F64, generator=torch.Generator().manual_seed(r))
        orthogonalise(m)
        eye = torch.eye(r, dtype=F64).expand(3, r, r)
        torch.testing.assert_close(m.transpose(1, 2) @ m, eye, rtol=0, atol=1e-14)
    zero = torch.zeros(1, 6, 2, dtype=F64)
    orthogonalise(zero)  # torch's epsilon-free Gram-Schmidt gives NaN here
    assert torch.equal(zero, torch.zeros_like(zero))


def test_full_rank_returns_the_gradient_on_one_rank():
    red = reducer()
    for step in range(STEPS):
        g = grad(0, step)
        flat = g.clone()
        red.reduce(flat, step, timer())
        assert float((flat - g).abs().max()) < 1e-12, step
        assert float(red.memory.memory.abs().max()) < 1e-12  # nothing left behind


def test_error_feedback_conserves_what_was_not_sent():
    """memory + decompressed = accumulated (= gradient + memory before), step after step, at
    rank 1 (far from exact); the whole tensors pass unchanged and never enter the memory."""
    red = reducer(rank=1)
    mask = compressed_mask()
    assert red.memory.memory.numel() == int(mask.sum())
    for step in range(STEPS):
        g = grad(0, step)
        acc = g[mask] + red.memory.memory
        flat = g.clone()
        red.reduce(flat, step, timer())
        torch.testing.assert_close(red.memory.memory + flat[mask], acc, rtol=0, atol=1e-14)
        assert torch.equal(flat[~mask], g[~mask])
        assert float(red.memory.memory.abs().max()) > 1e-3  # rank 1 leaves something behind


def test_error_feedback_off_keeps_memory_zero_and_reports_the_error():
    red = reducer(rank=1, error_feedback=False)
    g = grad(0, 0)
    flat = g.clone()
    stats = red.reduce(flat, 0, timer(), want_stats=True)
    assert float(red.memory.memory.abs().max()) == 0.0 and stats.memory_norm == 0.0
    mask = compressed_mask()
    want = float((g[mask] - flat[mask]).norm() / g[mask].norm())
    assert stats.compression_error == pytest.approx(want, rel=1e-12)


def test_stats_with_memory_are_its_norm_over_the_accumulated_norm():
    red = reducer(rank=1)
    g = grad(0, 0)
    mask = compressed_mask()
    stats = red.reduce(g.clone(), 0, timer(), want_stats=True)
    norm = float(red.memory.memory.norm())
    assert stats.memory_norm == pytest.approx(norm, rel=1e-12)
    assert stats.compression_error == pytest.approx(norm / float(g[mask].norm()), rel=1e-12)


def test_bytes_counted_as_sent():
    """P and Q of every compressed matrix and the whole tensors, all counted as sent; one
    collective kind, AllReduce; the same on every step after warm-up, dense during it."""
    for rank in (1, 2, FULL):
        red = reducer(rank=rank, warmup_steps=1)
        flags = uncompressed_flags(SHAPES, "1d")
        factors = sum(min(*matrix_shape(s), rank) * sum(matrix_shape(s)) for s, f in zip(SHAPES, flags) if not f)
        whole = sum(math.prod(s) for s, f in zip(SHAPES, flags) if f)
        assert red.entries_sent == factors + whole == red.compressor.k + red.uncompressed_numel
        assert red.bytes_sent_per_step == 8 * (factors + whole) and red.dense_bytes_per_step == 8 * NUMEL
        assert red.uncompressed_bytes_per_step == 8 * whole and red.density == (factors + whole) / NUMEL
        warm = red.reduce(grad(0, 0), 0, timer())
        assert (warm.bytes_sent, warm.collective) == (8 * NUMEL, "allreduce")
        sent = red.reduce(grad(0, 1), 1, timer())
        assert (sent.bytes_sent, sent.collective, sent.density) == (red.bytes_sent_per_step, "allreduce", red.density)


def test_resnet20_bytes_and_the_rank_rule_shared_with_torchs_hook():
    """ResNet-20 (Fashion-MNIST): rank null at the default ratio 0.01 is rank 1, 7,773 entries
    (31,092 B) per step, torch's hook's bytes at its matched rank; the rule is the one
    ``sparsetrain.comm.ddp_hook.matched_powersgd_rank`` applies to torch's hook (``closest_rank``)."""
    from sparsetrain.comm.ddp_hook import matched_powersgd_rank, powersgd_numel
    from sparsetrain.models import build_model

    model = build_model("resnet20", 1, 10)
    for rank, ratio, sent in ((None, 0.01, 31_092), (1, 0.01, 31_092), (2, 0.01, 56_640), (None, 0.05, 56_640)):
        _, params, red = build_exchange(model.parameters(), "powersgd", ratio=ratio, world_size=1, rank=0,
                                        seed=0, compressor=partial(PowerSGD, rank=rank))
        assert isinstance(red, SparseReducer) and red.bytes_sent_per_step == sent, (rank, ratio)
        assert [r.op for r in red.rounds] == ["sum", "sum"] and red.collective == "allreduce"
        shapes = [tuple(p.shape) for p in params]
        if rank is None:
            assert red.compressor.rank == matched_powersgd_rank(shapes, ratio)
            assert sent == 4 * powersgd_numel(shapes, red.compressor.rank)


def test_warmup_is_dense_and_leaves_memory_and_q_alone():
    red = reducer(rank=1, warmup_steps=2)
    for step in range(2):
        g = grad(0, step)
        flat = g.clone()
        red.reduce(flat, step, timer())
        assert torch.equal(flat, g) and red.compressor.q is None
        assert red.state_dict()["compressor"]["q"] is None and float(red.memory.memory.abs().max()) == 0.0
    red.reduce(grad(0, 2), 2, timer())
    assert red.compressor.q is not None and float(red.memory.memory.abs().max()) > 0


def test_checkpoint_resume_is_bit_exact():
    """Memory and Q through torch.save / torch.load(weights_only=True) into a new reducer: the
    steps after it are the uninterrupted run's, bit for bit (warm start included). A checkpoint
    written before the rounds protocol (Q beside the memory, ``q``) loads alike."""
    straight = reducer(rank=2, warmup_steps=1)
    outs = []
    for step in range(STEPS):
        flat = grad(0, step)
        straight.reduce(flat, step, timer())
        outs.append(flat)
    first = reducer(rank=2, warmup_steps=1)
    for step in range(3):
        first.reduce(grad(0, step), step, timer())
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    old_format = {"error_feedback": saved["error_feedback"], "q": saved["compressor"]["q"]}
    for state in (saved, old_format):
        resumed = reducer(rank=2, warmup_steps=1)
        resumed.load_state_dict(state)
        for step in range(3, STEPS):
            flat = grad(0, step)
            resumed.reduce(flat, step, timer())
            assert torch.equal(flat, outs[step]), step


def test_phases_are_compress_exchange_decompress():
    red = reducer(rank=1)
    t = PhaseTimer("cpu", warmup_steps=0)
    with t.step():
        red.reduce(grad(0, 0), 0, t)
    assert {"compress", "exchange", "decompress"} <= set(t.last)


# ----------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize("rank", [0, -2, 1.5, True])
def test_bad_rank_is_one_line(rank):
    with pytest.raises(ValueError) as info:
        PowerSGD(0.01, Layout.from_sizes([60]), "layerwise", rank=rank, shapes=[(12, 5)])
    assert str(info.value).startswith(f"scheme.rank={rank!r} is not allowed") and "\n" not in str(info.value)


def test_global_scope_and_missing_shapes_refused_in_one_line():
    from sparsetrain.comm import check_combination

    want = ("scope='global' is not allowed for scheme='powersgd' (PowerSGD compresses each tensor as a "
            "matrix of its own); allowed: layerwise")
    with pytest.raises(ValueError) as info:
        check_combination("powersgd", "global", "allgather", 0.01, partial(PowerSGD, rank=None))
    assert str(info.value) == want
    with pytest.raises(ValueError, match=r"^scheme='powersgd' needs the shape of each of the 2 tensors"):
        build_reducer("powersgd", "layerwise", "allreduce", 0.01, Layout.from_sizes([60, 5]), world_size=1,
                      rank=0, seed=0, compressor=PowerSGD)


@pytest.mark.parametrize("overrides, message", [
    (["scheme.rank=0"], "scheme.rank=0 is not allowed; it must be an integer >= 1 (or null: the rank whose bytes "
                        "come closest to the sparse schemes' at ratio)"),
    (["scheme.rank=-3"], "scheme.rank=-3 is not allowed; it must be an integer >= 1 (or null: the rank whose bytes "
                         "come closest to the sparse schemes' at ratio)"),
    (["scope=global"], "scope='global' is not allowed for scheme='powersgd' (PowerSGD compresses each tensor "
                       "as a matrix of its own); allowed: layerwise"),
])
def test_config_refuses_bad_rank_and_global_scope_in_one_line(overrides, message):
    from sparsetrain.config import ConfigError, compose, validate

    with pytest.raises(ConfigError) as info:
        validate(compose(["scheme=powersgd", *overrides]), env={})
    assert str(info.value) == message


def test_config_composes_it_and_aggregation_does_not_apply():
    from sparsetrain.config import compose, scheme_compressor, validate

    for agg in ("allgather", "allreduce"):
        cfg = compose(["scheme=powersgd", f"aggregation={agg}", "scheme.rank=3"])
        validate(cfg, env={})  # quiet: both collectives are AllReduces whatever the key says
        factory = scheme_compressor(cfg.scheme)
        assert factory.func is PowerSGD and factory.keywords == {"rank": 3}
    validate(compose(["scheme=powersgd"]), env={})  # no dist.ddp needed: its own exchange
    validate(compose(["scheme=powersgd", "dist.ddp=true"]), env={})


# ------------------------------------------------------------------- old runs: torch's hook
def test_old_powersgd_runs_load_as_torchs_hook():
    from sparsetrain.analysis.loader import collective_of, row_from_summary
    from sparsetrain.train.checkpoint import config_differences

    old = {"scheme": {"name": "powersgd", "compressor": None, "rank": None}, "scope": {"name": "layerwise"},
           "aggregation": {"name": "allreduce"}, "ratio": 0.024, "dist": {"ddp": True}}
    new = {**old, "scheme": {"name": "powersgd", "compressor": {"_target_": "sparsetrain.compress.PowerSGD"},
                             "rank": None}, "dist": {"ddp": False}}
    torch_row = row_from_summary({"status": "completed", "config": old}, None)
    assert (torch_row["scheme"], torch_row["aggregation"], torch_row["ratio"]) == ("torch_powersgd", "-", 0.024)
    ours = row_from_summary({"status": "completed", "config": new}, None)
    assert (ours["scheme"], ours["aggregation"], ours["scope"]) == ("powersgd", "-", "layerwise")
    assert collective_of(ours) == "allreduce" == collective_of(torch_row)  # torch's hook AllReduces too
    # a run recorded as scheme=powersgd before issue 24 is scheme=torch_powersgd's (resume, skip)
    renamed = {**old, "scheme": {"name": "torch_powersgd", "compressor": None, "rank": None}}
    assert config_differences(old, renamed) == []
    assert [k for k, *_ in config_differences(old, {**new, "dist": {"ddp": True}})] == ["scheme.name"]


# --------------------------------------------------------------------------- 2 gloo ranks
class FakeBucket:
    """What torch's PowerSGD hook reads of a DDP bucket: one bucket of the given tensors."""

    def __init__(self, buf, shapes):
        self.buf, self.shapes = buf, shapes

    def buffer(self):
        return self.buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        out, o = [], 0
        for s in self.shapes:
            out.append(self.buf[o : o + math.prod(s)].view(s))
            o += math.prod(s)
        return out


# (rank, uncompressed rule, torch's min_compression_rate, shapes): the same tensors compressed by both
TORCH_CASES = [(2, "none", 0.0, SHAPES), (3, "1d", 1.0, SHAPES_1D), (1, "1d", 1.0, SHAPES_1D)]


def _net():  # the sparse hook tests' small CNN (1-D and n-D tensors in the same buckets)
    torch.manual_seed(0)
    return Net().to(F64)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, 8, 8, generator=g).to(F64), torch.randint(0, 10, (4,), generator=g)


def _train(model, steps, state=None, hook=None, opt=None):
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in steps:
        opt.zero_grad()
        F.cross_entropy(model(_batch(dist.get_rank(), step)[0]), _batch(dist.get_rank(), step)[1]).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    return out


def _train_flat(model, steps, rank, world, me, warmup_steps=1):
    """``_train`` through the trainer's exchange (``build_exchange``: the flat buffer, in the
    model's order, whole tensors last) instead of DDP: the gradients it applied, per step."""
    from sparsetrain.timing import NULL_TIMER

    flat, _, red = build_exchange(model.parameters(), "powersgd", ratio=0.01, world_size=world, rank=me, seed=SEED,
                                  warmup_steps=warmup_steps, dtype=F64, compressor=partial(PowerSGD, rank=rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in steps:
        flat.zero_()
        x, y = _batch(dist.get_rank(), step)
        F.cross_entropy(model(x), y).backward()
        red.reduce(flat, step, NULL_TIMER)
        out.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    return out


def _hook_state(model, rank, **kw):
    """The DDP hook for ``scheme=powersgd`` (the sparse hook: the trainer's exchange per bucket)."""
    return SparseHookState(model, "powersgd", "layerwise", "allreduce", 0.01,
                           compressor=partial(PowerSGD, rank=rank), seed=SEED, **kw)


def _diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _scenarios(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    # the trainer's reducer at full rank: the average; error feedback conserves, per rank
    red = reducer(world=world, me=rank)
    low = reducer(rank=1, world=world, me=rank)
    mask = compressed_mask()
    full, conserve = [], []
    for step in range(STEPS):
        flat = grad(rank, step)
        red.reduce(flat, step, timer())
        full.append(flat)
        g = grad(rank, step)
        acc = g[mask] + low.memory.memory
        low.reduce(g, step, timer())
        conserve.append(float((low.memory.memory + g[mask] - acc).abs().max()))
    out["full"], out["conserve"] = full, conserve
    # torch's hook on the same gradients (float64, both with 2 dense warm-up steps)
    for rk, rule, rate, shapes in TORCH_CASES:
        n = sum(math.prod(s) for s in shapes)
        state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rk, start_powerSGD_iter=2,
                                 min_compression_rate=rate, use_error_feedback=True, warm_start=True,
                                 orthogonalization_epsilon=0, random_seed=SEED)
        ours = reducer(shapes, rule, rk, world=world, me=rank, warmup_steps=2)
        diffs = []
        for step in range(STEPS + 2):
            a = grad(rank, step, n)
            b = a.clone()
            got = ph.powerSGD_hook(state, FakeBucket(a, shapes)).wait()
            ours.reduce(b, step, timer())
            diffs.append(float(((got[0] if isinstance(got, list) else got) - b).abs().max()))
        out[("torch", rk, rule)] = diffs
    # several buckets (and DDP's rebuild after the first iteration): the DDP hook against the
    # trainer's exchange over the flat buffer, at rank 2, training 6 steps on the same batches
    cap = 0.002
    hooked = DDP(_net(), bucket_cap_mb=cap)
    g_hook = _train(hooked, range(6), _hook_state(hooked, 2, warmup_steps=1), sparse_hook)
    out["ddp_trainer"] = [_diff(a, b) for a, b in zip(_train_flat(_net(), range(6), 2, world, rank), g_hook)]
    # several buckets (and DDP's rebuild after the first iteration): full rank = DDP's AllReduce
    plain, hooked = DDP(_net(), bucket_cap_mb=cap), DDP(_net(), bucket_cap_mb=cap)
    state = _hook_state(hooked, FULL, warmup_steps=1)
    g_plain, g_hook = _train(plain, range(4)), _train(hooked, range(4), state, sparse_hook)
    out["ddp_full"] = {"diff": [_diff(a, b) for a, b in zip(g_plain, g_hook)], "buckets": len(state._buckets),
                       "bytes": state.bytes_sent_per_step, "sizes": state.sizes()}
    # a checkpoint of the hook's state into a fresh DDP (another first-iteration bucket layout)
    m = DDP(_net(), bucket_cap_mb=cap)
    straight = _train(m, range(5), _hook_state(m, 2), sparse_hook)
    m = DDP(_net(), bucket_cap_mb=cap)
    s = _hook_state(m, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    _train(m, range(3), s, sparse_hook, o)
    buf = io.BytesIO()
    torch.save({"model": m.module.state_dict(), "opt": o.state_dict(), "hook": s.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = DDP(_net(), bucket_cap_mb=cap)
    m2.module.load_state_dict(ck["model"])
    s2 = _hook_state(m2, 2)
    s2.load_state_dict(ck["hook"])
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    o2.load_state_dict(ck["opt"])
    resumed = _train(m2, range(3, 5), s2, sparse_hook, o2)
    out["ddp_resume"] = {"diff": [_diff(a, b) for a, b in zip(straight[3:], resumed)], "step": s2.step,
                         "norm": s2.memory_norm()}
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return on_gloo_ranks(_scenarios, tmp_path_factory.mktemp("psgd"))


def test_full_rank_returns_the_average_on_two_ranks(two):
    for step in range(STEPS):
        mean = (grad(0, step) + grad(1, step)) / 2
        for r in range(2):
            assert float((two[r]["full"][step] - mean).abs().max()) < 1e-12, (r, step)
        assert torch.equal(two[0]["full"][step], two[1]["full"][step])  # every rank the same update


def test_error_feedback_conserves_on_two_ranks(two):
    for r in range(2):
        assert max(two[r]["conserve"]) < 1e-14, two[r]["conserve"]


@pytest.mark.parametrize("case", [c[:2] for c in TORCH_CASES])
def test_matches_torchs_powersgd_hook_on_the_same_gradients(two, case):
    """torch's powerSGD_hook (error feedback, warm start, epsilon 0, the same random_seed, 2
    warm-up steps) and the trainer's exchange on each rank's same float64 gradients: equal within
    rounding at every step (rank 2: Gram-Schmidt, rank 3: QR; every tensor compressed, or the
    vectors whole in both)."""
    for r in range(2):
        diffs = two[r][("torch", *case)]
        assert diffs[:2] == [0.0, 0.0]  # the dense warm-up
        assert max(diffs) < 1e-13, diffs


def test_ddp_hook_trains_as_the_trainers_exchange_across_buckets(two):
    """The DDP hook runs the trainer's exchange per bucket, Q's start drawn for each tensor as the
    trainer draws it and the rank chosen over the model: 6 training steps on the same batches
    give the trainer's gradients within float64 rounding (not to the bit: a matrix product's
    last bit depends on where its output lies in memory, and a bucket lays the factors out at
    other offsets than the model's flat buffer; the sparse schemes, with no products, are equal
    to the bit: tests/test_ddp_trainer.py)."""
    for r in range(2):
        diffs = two[r]["ddp_trainer"]
        assert diffs[0] == 0.0 and max(diffs) < 1e-12, diffs  # step 0: the dense warm-up


def test_ddp_hook_at_full_rank_equals_ddps_allreduce_across_buckets(two):
    for r in range(2):
        res = two[r]["ddp_full"]
        assert max(res["diff"]) < 1e-12, res["diff"]
        assert res["buckets"] >= 3  # several buckets after DDP's rebuild
        assert res["bytes"] == res["sizes"]["bytes_sent"] > 0


def test_ddp_hook_checkpoint_resumes_into_other_buckets(two):
    """Memory and Q are kept per parameter: a fresh DDP's first iteration (one initial bucket)
    takes them back; the resumed steps are the uninterrupted run's within rounding."""
    for r in range(2):
        res = two[r]["ddp_resume"]
        assert res["step"] == 5 and res["norm"] > 0
        assert max(res["diff"]) < 1e-12, res["diff"]


# ------------------------------------------------------------------------- from the command line
SHORT = (*TINY, "world_size=2", "train.max_steps=6", "train.log_every=1", "train.save_model=true")


# the DDP hook through the command line in the full tier (in-process above: the same as the trainer)
@pytest.mark.parametrize("path", ["trainer", pytest.param("ddp", marks=pytest.mark.slow)])
def test_cli_run_trains_end_to_end(path, tmp_path):
    """``python -m sparsetrain.run scheme=powersgd world_size=2 debug=tiny``: the trainer's exchange
    (and, with dist.ddp=true and several buckets, sparsetrain's PowerSGD hook) trains, counts
    its bytes as sent and times compress / exchange / decompress."""
    extra = ("dist.ddp=true", "dist.bucket_cap_mb=0.05", "scheme.warmup_steps=2") if path == "ddp" else ()
    run = tmp_path / path
    proc = run_cli(*SHORT, "scheme=powersgd", *extra, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["steps"] == 6 and s["train_loss"] is not None
    from sparsetrain.models import build_model

    model = build_model("resnet20", 3, 10)  # debug=tiny: CIFAR-shaped synthetic data
    want = build_exchange(model.parameters(), "powersgd", world_size=1, rank=0, seed=0,
                          compressor=partial(PowerSGD, rank=None))[2]
    assert want.compressor.rank == 1 and s["bytes_sent_per_step"] == want.bytes_sent_per_step
    assert s["uncompressed_bytes_per_step"] > 0 and 0 < s["density"] < 0.05
    assert s["memory_norm_max"] > 0
    warm = 2 if path == "ddp" else 0
    assert s["compression_start_step"] == warm
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["bytes_sent"] for r in steps[warm:]] == [s["bytes_sent_per_step"]] * (6 - warm)
    assert s["wire_bytes_per_step"] == s["bytes_sent_per_step"]  # AllReduce, 2 ranks: 2(W-1)/W = 1
    t = s["time_ms"]
    assert t["compress"] > 0 and t["exchange"] > 0 and t["decompress"] > 0
    assert math.isclose(sum(v for k, v in t.items() if k != "step"), t["step"], rel_tol=0.05), t


# ------------------------------------------------------------------------------- the benchmarks
def test_compressor_benchmark_row():
    """python -m sparsetrain.benchmarks.compress: PowerSGD's row, in gradient copies, as training
    builds it (the composed scheme=powersgd, 1-D tensors whole)."""
    from sparsetrain.benchmarks.compress import powersgd_row
    from sparsetrain.models import build_model

    shapes = [tuple(p.shape) for p in build_model("resnet20", 3, 10).parameters()]
    g = torch.randn(sum(math.prod(s) for s in shapes))
    row = powersgd_row(shapes, g, 0.01, 2, torch.device("cpu"))
    assert (row["scheme"], row["scope"], row["rank"]) == ("powersgd", "layerwise", 1)
    assert row["k"] == 7_791  # rank 1: P and Q of every matrix, the 1-D tensors whole
    assert row["compress_ef_copies"] > 0 and row["decompress_copies"] > 0


def test_a_set_rank_is_the_runs_axis_and_ratio_then_picks_nothing():
    """scheme.rank set: tables and labels say rank=1, not the ratio it ignores; null: the rank was
    matched to `ratio`'s bytes, so the ratio stays what tells runs apart."""
    from sparsetrain.analysis.loader import MATCHED_TO_RATIO, NOT_APPLICABLE, row_from_summary

    base = {"scope": {"name": "layerwise"}, "aggregation": {"name": "allgather"}, "ratio": 0.01, "dist": {}}
    ours = {"name": "powersgd", "compressor": {"_target_": "sparsetrain.compress.PowerSGD"}}
    set_rank = row_from_summary({"status": "completed", "config": {**base, "scheme": {**ours, "rank": 1}}}, None)
    assert (set_rank["rank"], set_rank["ratio"]) == (1, NOT_APPLICABLE)
    matched = row_from_summary({"status": "completed", "config": {**base, "scheme": {**ours, "rank": None}}}, None)
    assert (matched["rank"], matched["ratio"]) == (MATCHED_TO_RATIO, 0.01)
    torch_hook = {"name": "torch_powersgd", "compressor": None, "rank": 2}
    row = row_from_summary({"status": "completed", "config": {**base, "scheme": torch_hook, "dist": {"ddp": True}}}, None)
    assert (row["rank"], row["ratio"]) == (2, NOT_APPLICABLE)
    topk = row_from_summary({"status": "completed", "config": {**base, "scheme": {"name": "topk"}}}, None)
    assert (topk["rank"], topk["ratio"]) == (NOT_APPLICABLE, 0.01)


def test_error_feedback_off_reports_the_error_on_the_trainers_flat_buffer_too():
    """Without error feedback on the trainer's flat buffer (compressed tensors first, no
    placement), the accumulated vector is the gradient buffer itself, which the exchange
    overwrites with the decoded update: the error must be measured on a copy taken before (a
    reducer that measured it after reported 0.0 where it is about 0.86; only the interleaved
    placement above was tested)."""
    flags = uncompressed_flags(SHAPES, "1d")
    order = compressed_first(flags)
    shapes = [SHAPES[i] for i in order]
    red = build_reducer("powersgd", "layerwise", "allreduce", 0.01, Layout.from_sizes(math.prod(s) for s in shapes),
                        uncompressed=[flags[i] for i in order], shapes=shapes, compressor=partial(PowerSGD, rank=1),
                        world_size=1, rank=0, seed=SEED, dtype=F64, error_feedback=False)
    g = grad(0, 0)
    flat = g.clone()
    stats = red.reduce(flat, 0, timer(), want_stats=True)
    mask = compressed_mask(shapes)
    want = float((g[mask] - flat[mask]).norm() / g[mask].norm())
    assert want > 0.1 and stats.compression_error == pytest.approx(want, rel=1e-12)


def test_a_saved_state_is_a_copy_not_the_live_buffers():
    """state_dict() is what a checkpoint keeps: training on must not change it (an alias would
    change an in-memory checkpoint, or a state compared later, without a word)."""
    red = reducer(rank=1)
    red.reduce(grad(0, 0), 0, timer())
    saved = red.state_dict()
    tensors = {name: t.clone() for name, t in saved["error_feedback"].items() if torch.is_tensor(t)}
    assert tensors and float(red.memory.memory.abs().sum()) > 0
    red.reduce(grad(0, 1), 1, timer())
    for name, before in tensors.items():
        assert torch.equal(saved["error_feedback"][name], before), name
    assert saved["error_feedback"]["memory"].data_ptr() != red.memory.memory.data_ptr()
