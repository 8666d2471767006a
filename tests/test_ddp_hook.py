"""sparsetrain.comm.ddp_hook: the DDP communication hook on real gloo process groups (2 and 3 ranks).

Checked against DDP's own AllReduce (ratio 1, warm-up) and against a hand-computed reference
(float64; each rank's gradient without DDP, memory and masks by hand, with the bucket layouts
DDP used at each step, which change when DDP rebuilds its buckets after the first iteration).
"""

import io
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import compressor_for
from test_exchange import COMBOS  # every valid scheme x scope x aggregation
from torch import nn

from sparsetrain.comm import check_combination
from sparsetrain.comm.ddp_hook import SparseHookState, bucket_seed, sparse_hook
from sparsetrain.compress import BlockRandomK, Layout, TopK, step_seed, uncompressed_flags

CAP_MB = 0.002  # a few KB: several buckets, most holding conv weights and batch-norm vectors
SEED, RATIO, BLOCK, STEPS, LR = 5, 0.1, 16, 4, 0.1


class Net(nn.Module):
    """A small CNN with batch norm: buckets hold 1-D (whole) and n-D (compressed) tensors."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c3, self.b3 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        x = F.relu(self.b3(self.c3(x)))
        return self.fc(x.mean((2, 3)))


def net(dtype=torch.float32):
    torch.manual_seed(0)
    return Net().to(dtype)


def batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 3, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (4,), generator=g)


def state_for(model, scheme, scope, agg, ratio, **kw):
    return SparseHookState(model, scheme, scope, agg, ratio, seed=SEED,
                           compressor=compressor_for(scheme, block_size=BLOCK), **kw)


def recording(state_keys, layouts):
    """sparse_hook, also recording (step, bucket index, parameter positions) per call."""

    def hook(state, bucket):
        layouts.append((state.step, bucket.index(), [state_keys[id(p)] for p in bucket.parameters()]))
        return sparse_hook(state, bucket)

    return hook


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    g = grads(model)
    opt.step()
    return float(loss), g


# ------------------------------------------------------------------------------ rank scenarios
def ratio_one(rank, world):
    """ratio 1: every combination (and scheme none) against DDP without a hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for scheme, scope, agg in COMBOS + [("none", "layerwise", "allgather")]:
        ref, hooked = DDP(net(), bucket_cap_mb=CAP_MB), DDP(net(), bucket_cap_mb=CAP_MB)
        layouts = []
        hook = recording({id(p): i for i, p in enumerate(hooked.parameters())}, layouts)
        hooked.register_comm_hook(state_for(hooked, scheme, scope, agg, 1.0), hook)
        opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref, hooked)]
        diff = 0.0
        for step in range(STEPS):
            x, y = batch(rank, step)
            _, g_ref = train_step(ref, opts[0], x, y)
            _, g_hook = train_step(hooked, opts[1], x, y)
            diff = max(diff, max_diff(g_ref, g_hook))
        out[(scheme, scope, agg)] = {"diff": diff, "params": max_diff(list(ref.parameters()), list(hooked.parameters())),
                                     "buckets": sum(1 for s, _, _ in layouts if s == STEPS - 1)}
    return out


def with_memory(rank, world):
    """ratio 0.1, error feedback, float64: what the reference in the test process replays."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for scheme, scope, agg in COMBOS:
        model = DDP(net(torch.float64), bucket_cap_mb=CAP_MB)
        state = state_for(model, scheme, scope, agg, RATIO)
        layouts = []
        model.register_comm_hook(state, recording({id(p): i for i, p in enumerate(model.parameters())}, layouts))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        steps = []
        for step in range(STEPS):
            steps.append(train_step(model, opt, *batch(rank, step, torch.float64))[1])
        out[(scheme, scope, agg)] = {"grads": steps, "layouts": layouts, "state": state.state_dict()}
    return out


def warmup(rank, world):
    """warmup_steps=2: DDP's AllReduce for two iterations, then compression with empty memory."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref, hooked = DDP(net(), bucket_cap_mb=CAP_MB), DDP(net(), bucket_cap_mb=CAP_MB)
    state = state_for(hooked, "blockk", "layerwise", "allreduce", 0.01, warmup_steps=2)
    hooked.register_comm_hook(state, sparse_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref, hooked)]
    out = {"diff": [], "bytes": [], "dense": [], "memory_buckets": []}
    for step in range(4):
        x, y = batch(rank, step)
        out["memory_buckets"].append(len(state.state_dict()["buckets"]))
        _, g_ref = train_step(ref, opts[0], x, y)
        _, g_hook = train_step(hooked, opts[1], x, y)
        out["diff"].append(max_diff(g_ref, g_hook))
        out["bytes"].append(state.bytes_sent_per_step)
        out["dense"].append(state.dense_bytes_per_step)
    return out


def resume(rank, world):
    """state_dict / load_state_dict into a fresh DDP (whose first iteration has other buckets)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for scheme, scope, agg in [("topk", "layerwise", "allgather"), ("blockk", "layerwise", "allreduce")]:
        def run(model, state, opt, steps):
            model.register_comm_hook(state, sparse_hook)
            return [train_step(model, opt, *batch(rank, s, torch.float64))[1] for s in steps]

        m = DDP(net(torch.float64), bucket_cap_mb=CAP_MB)
        s = state_for(m, scheme, scope, agg, RATIO)
        o = torch.optim.SGD(m.parameters(), lr=LR)
        straight = run(m, s, o, range(STEPS))
        m = DDP(net(torch.float64), bucket_cap_mb=CAP_MB)
        s = state_for(m, scheme, scope, agg, RATIO)
        o = torch.optim.SGD(m.parameters(), lr=LR)
        run(m, s, o, range(2))
        buf = io.BytesIO()
        torch.save({"model": m.module.state_dict(), "hook": s.state_dict()}, buf)
        saved_state = s.state_dict()
        buf.seek(0)
        ck = torch.load(buf, weights_only=True)
        m2 = DDP(net(torch.float64), bucket_cap_mb=CAP_MB)
        m2.module.load_state_dict(ck["model"])
        s2 = state_for(m2, scheme, scope, agg, RATIO)
        s2.load_state_dict(ck["hook"])
        o2 = torch.optim.SGD(m2.parameters(), lr=LR)
        resumed = run(m2, s2, o2, range(2, STEPS))
        out[(scheme, scope, agg)] = {"step": s2.step, "saved": saved_state,
                                     "diff": [max_diff(a, b) for a, b in zip(straight[2:], resumed)]}
    return out


def one_rank(rank, world):
    """world_size=1 (a one-rank group): the hook returns the rank's own compressed gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.new_group([0])  # every rank takes part in creating it
    out = {}
    if rank != 0:
        return out
    for scheme, scope, agg in COMBOS:
        for ratio in (1.0, RATIO):
            model = DDP(net(), bucket_cap_mb=CAP_MB, process_group=group)
            plain = net()
            state = state_for(model, scheme, scope, agg, ratio, warmup_steps=1, process_group=group)
            model.register_comm_hook(state, sparse_hook)
            diffs = []
            for step in range(3):
                x, y = batch(rank, step)
                model.zero_grad()
                plain.zero_grad()
                F.cross_entropy(model(x), y).backward()
                F.cross_entropy(plain(x), y).backward()
                diffs.append(max_diff(grads(plain), grads(model)))
            out[(scheme, scope, agg, ratio)] = diffs
    return out


def trains(rank, world):
    """Each combination trains a tiny problem (a fixed batch per rank): the loss goes down."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long()
    out = {}
    for scheme, scope, agg in COMBOS:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)), bucket_cap_mb=0.004)
        model.register_comm_hook(state_for(model, scheme, scope, agg, RATIO), sparse_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        losses = [train_step(model, opt, x, y)[0] for _ in range(30)]
        out[(scheme, scope, agg)] = losses
    return out


SCENARIOS = {f.__name__: f for f in (ratio_one, with_memory, warmup, resume, one_rank, trains)}


def _worker(rank, world, port, names, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save({n: SCENARIOS[n](rank, world) for n in names}, f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world, names, tmp):
    mp.spawn(_worker, args=(world, _free_port(), names, str(tmp)), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return spawn(2, list(SCENARIOS), tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return spawn(3, ["ratio_one"], tmp_path_factory.mktemp("three"))


# ------------------------------------------------------------------------------------- tests
@pytest.mark.slow  # 29 s; the DDP path is in the fast tier through every compressor (test_ddp_trainer)
@pytest.mark.parametrize("world", [2, 3])
def test_ratio_one_equals_ddp_allreduce(world, two, three):
    results = two if world == 2 else three
    for r in results:
        for combo, res in r["ratio_one"].items():
            assert res["diff"] < 1e-6, (world, combo, res)
            assert res["params"] < 1e-6, (world, combo, res)
            assert res["buckets"] >= 3, (combo, res)  # several buckets after the rebuild


def reference(scheme, scope, agg, layouts, world=2):
    """Replays the run by hand: per step each rank's gradient without DDP, then per bucket (as DDP
    laid them out at that step; layer-wise, the whole model at once, as the trainer draws its
    positions) acc = grad + memory, the chosen entries masked and averaged, the
    rest kept in that rank's memory, kept per parameter. Whole (1-D) tensors plainly averaged."""
    model = net(torch.float64)
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    whole = uncompressed_flags(shapes, "1d")
    memory = [{i: torch.zeros(p.numel(), dtype=torch.float64) for i, p in enumerate(params)} for _ in range(world)]
    out = []
    for step in range(STEPS):
        per_rank = []
        for r in range(world):
            model.zero_grad()
            F.cross_entropy(model(batch(r, step, torch.float64)[0]), batch(r, step)[1]).backward()
            per_rank.append([p.grad.detach().reshape(-1).clone() for p in params])
        avg = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
        buckets = [(b, keys) for s, b, keys in layouts if s == step]
        assert sorted(k for _, keys in buckets for k in keys) == list(range(len(params)))
        if scope == "layerwise":  # a tensor's positions follow it, not its bucket: the trainer's
            buckets = [(None, list(range(len(params))))]
        for b, keys in buckets:
            comp_keys = [k for k in keys if not whole[k]]
            for k in keys:
                if whole[k]:
                    for r in range(world):
                        avg[k] += per_rank[r][k] / world
            if not comp_keys:
                continue
            sizes = [params[k].numel() for k in comp_keys]
            comp = compressor_for(scheme, block_size=BLOCK)(RATIO, Layout.from_sizes(sizes), scope)
            for r in range(world):
                acc = torch.cat([per_rank[r][k] + memory[r][k] for k in comp_keys])
                rank = None if agg == "allreduce" else r
                seed = step_seed(SEED, step, rank) if b is None else bucket_seed(SEED, step, b, rank)
                _, idx = comp.select(acc.clone(), seed)
                mask = torch.zeros(acc.numel(), dtype=torch.bool)
                mask[idx] = True
                assert int(mask.sum()) == comp.k
                sent, kept = torch.where(mask, acc, 0.0), torch.where(mask, 0.0, acc)
                for k, s_, m_ in zip(comp_keys, sent.split(sizes), kept.split(sizes)):
                    avg[k] += s_ / world
                    memory[r][k] = m_
        out.append([a.view(s) for a, s in zip(avg, shapes)])
        with torch.no_grad():
            for p, a in zip(params, out[-1]):
                p -= LR * a
    return out, memory


@pytest.mark.slow  # the fast tier checks DDP = trainer bit for bit and the trainer against hand references
def test_error_feedback_equals_hand_reference(two):
    for combo in COMBOS:
        layouts = two[0]["with_memory"][combo]["layouts"]
        assert layouts == two[1]["with_memory"][combo]["layouts"]
        # DDP rebuilt its buckets after the first iteration: one bucket, then several
        assert len([1 for s, _, _ in layouts if s == 0]) == 1
        assert len([1 for s, _, _ in layouts if s == 1]) >= 3
        want, memory = reference(*combo, layouts)
        for r in range(2):
            res = two[r]["with_memory"][combo]
            for step in range(STEPS):
                assert max_diff(res["grads"][step], want[step]) < 1e-12, (combo, r, step)
            # the memory after the last step, per parameter, as the hook's state_dict holds it
            saved = res["state"]
            assert saved["step"] == STEPS and not saved["pending"]
            got = {}
            for entry in saved["buckets"].values():
                sizes = [memory[r][k].numel() for k in entry["params"]]
                assert sum(sizes) == entry["memory"].numel()
                got.update(zip(entry["params"], entry["memory"].split(sizes)))
            assert sorted(got) == [0, 4, 8, 12]  # the conv weights and the linear weight
            for k, m in got.items():
                assert float((m - memory[r][k]).abs().max()) < 1e-12, (combo, r, k)


def test_rebuild_rehomes_memory(two):
    """After the first iteration (one bucket) every parameter's memory moved to its new bucket:
    the step-1 result above depends on it; here the keys and sizes of the saved memory."""
    res = two[0]["with_memory"][("blockk", "layerwise", "allreduce")]
    params = list(net().parameters())
    compressed = [i for i, f in enumerate(uncompressed_flags([p.shape for p in params], "1d")) if not f]
    buckets = res["state"]["buckets"]
    assert len(buckets) >= 2  # memory lives in several buckets after the rebuild
    keys = [k for e in buckets.values() for k in e["params"]]
    assert sorted(keys) == compressed
    for e in buckets.values():
        assert e["memory"].numel() == sum(params[k].numel() for k in e["params"])
        assert float(e["memory"].abs().sum()) > 0


def test_warmup_is_dense_then_compresses(two):
    for r in two:
        w = r["warmup"]
        assert w["diff"][0] < 1e-6 and w["diff"][1] < 1e-6
        assert w["diff"][2] > 1e-4  # compressed from step 2 on
        assert w["bytes"][:2] == w["dense"][:2] and w["bytes"][2] < w["dense"][2] / 10
        assert w["memory_buckets"][:3] == [0, 0, 0]  # memory starts empty at step 2


def test_state_dict_resume(two):
    for r in two:
        for combo, res in r["resume"].items():
            assert res["step"] == STEPS
            assert res["saved"]["step"] == 2 and res["saved"]["buckets"]
            if combo[0] == "topk":
                # top-k layer-wise does not depend on the bucket layout: bit-identical
                assert max(res["diff"]) == 0.0, (combo, res["diff"])
            else:
                # random positions are drawn per bucket: the first iteration after a restart runs
                # on DDP's initial single bucket, so it draws other positions (see sparsetrain.comm.ddp_hook)
                assert all(d < 1.0 for d in res["diff"]), (combo, res["diff"])


def test_one_rank(two):
    for combo, diffs in two[0]["one_rank"].items():
        *_, ratio = combo
        assert diffs[0] < 1e-6  # warm-up: dense
        if ratio == 1.0:
            assert max(diffs) < 1e-6, (combo, diffs)
        else:
            assert diffs[1] > 1e-4, (combo, diffs)


def test_every_combination_trains(two):
    for r in two:
        for combo, losses in r["trains"].items():
            assert sum(losses[-5:]) / 5 < 0.7 * losses[0], (combo, losses[0], losses[-5:])


def test_topk_allreduce_refused_like_the_config():
    with pytest.raises(ValueError) as hook_error:
        SparseHookState(nn.Linear(2, 2), "topk", "layerwise", "allreduce", 0.01, compressor=TopK)
    with pytest.raises(ValueError) as config_error:
        check_combination("topk", "layerwise", "allreduce", 0.01, TopK)
    assert str(hook_error.value) == str(config_error.value)
    assert "\n" not in str(hook_error.value) and "aggregation='allreduce'" in str(hook_error.value)
    with pytest.raises(ValueError, match="scheme.uncompressed"):
        SparseHookState(nn.Linear(2, 2), "blockk", uncompressed="2d", compressor=BlockRandomK)
    with pytest.raises(ValueError, match="scheme='blockk' has no compressor"):  # the class is not looked up by name
        SparseHookState(nn.Linear(2, 2), "blockk")


def test_each_bucket_draws_from_its_own_seed_in_global_scope_and_the_runs_seed_layer_wise(tmp_path):
    """Global scope is global within a bucket: bucket b's reducer draws from step_seed(seed, b)
    (bucket_seed then adds the step); layer-wise every bucket has the run's seed, so a tensor's
    positions do not depend on its bucket. (A hook seeding every bucket alike survived the fast
    tier: only the slow hand reference replayed the draws.)"""

    class Bucket:
        def __init__(self, index, params):
            self._index, self._params = index, params

        def index(self):
            return self._index

        def parameters(self):
            return self._params

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = net()
        params = list(model.parameters())
        halves = [params[: len(params) // 2], params[len(params) // 2:]]
        for scope in ("global", "layerwise"):
            state = state_for(model, "randk", scope, "allreduce", RATIO)
            seeds = [state._plan(Bucket(b, ps), torch.cat([p.detach().reshape(-1) for p in ps])).reducer.seed
                     for b, ps in enumerate(halves)]
            assert seeds == ([step_seed(SEED, 0), step_seed(SEED, 1)] if scope == "global" else [SEED, SEED])
    finally:
        dist.destroy_process_group()
