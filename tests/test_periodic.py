"""Local SGD and DiLoCo (``scheme=localsgd``, ``scheme=diloco``: sparsetrain.comm.periodic) on two
real gloo ranks in float64 against their definitions, and from the command line: bytes, resume in
the middle of a period, the analysis' axes, the one-line errors."""

from __future__ import annotations

import signal
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROOT, TINY, cli_env, on_gloo_ranks, read_json, read_jsonl, run_cli
from test_ddp_hook import Net
from test_launch import _wait_for_steps

from sparsetrain.comm import build_exchange
from sparsetrain.comm.periodic import PeriodicSync
from sparsetrain.compress import RandomK
from sparsetrain.timing import PhaseTimer
from sparsetrain.train.step import TrainStep

F64 = torch.float64
STEPS = 8


def _net():
    torch.manual_seed(0)
    return Net().to(F64)


def _batches(rank):
    for step in range(10_000):
        g = torch.Generator().manual_seed(1000 * rank + step)
        yield torch.randn(4, 3, 8, 8, generator=g).to(F64), torch.randint(0, 10, (4,), generator=g)


def _run(world, rank, scheme="none", sync=None, compressor=None, steps=STEPS):
    """``steps`` train steps of the small CNN (SGD with momentum, Nesterov and weight decay);
    the parameters after each step."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    flat, params, red = build_exchange(list(model.parameters()), scheme, "layerwise", "allreduce", 0.25,
                                       world_size=world, rank=rank, seed=1, dtype=F64, compressor=compressor)
    if sync is not None:
        red = sync(params, list(model.buffers()), red)
    step = TrainStep(model, opt, red, flat, PhaseTimer("cpu", warmup_steps=0), "cpu")
    batches = _batches(rank)
    out = []
    for i in range(steps):
        step(batches, i)
        out.append([p.detach().clone() for p in model.parameters()])
    model.exchange = red
    return out, model


def _by_hand_local_sgd(world, rank, period, outer_lr=1.0, momentum=0.0):
    """Local SGD / DiLoCo written out: local steps, then the anchor stepped by a hand-made outer
    Nesterov SGD on the mean of (anchor - model), the model set to the anchor."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    anchor = [p.detach().clone() for p in model.parameters()]
    velocity = None
    batches = _batches(rank)
    out = []
    for i in range(STEPS):
        x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if (i + 1) % period == 0:
            with torch.no_grad():
                delta = [a - p for a, p in zip(anchor, model.parameters())]
                for d in delta:
                    dist.all_reduce(d)
                    d.div_(world)
                if momentum:
                    velocity = delta if velocity is None else [momentum * v + d for v, d in zip(velocity, delta)]
                    step = [d + momentum * v for d, v in zip(delta, velocity)]
                else:
                    step = delta
                anchor = [a - outer_lr * s for a, s in zip(anchor, step)]
                for p, a in zip(model.parameters(), anchor):
                    p.copy_(a)
                for b in model.buffers():
                    if b.is_floating_point():
                        dist.all_reduce(b)
                        b.div_(world)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _torch_post_local_sgd(world, rank, period, warmup, steps):
    """Post-local SGD as torch builds it: DDP with the post-local-SGD hook (gradients AllReduced
    for ``warmup`` steps, local after) and ``PeriodicModelAverager`` after each optimizer step."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.nn.parallel import DistributedDataParallel

    model = _net()
    net = DistributedDataParallel(model)
    net.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=warmup,
                                             post_local_gradient_allreduce=False), post_localSGD_hook)
    # torch's averager counts its calls from 0 and averages at warmup_steps, then every period:
    # at the last step of each of our periods, which start when the warm-up ends
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup + period - 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    batches = _batches(rank)
    out = []
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        averager.average_parameters(model.parameters())
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _diff(a, b):
    return max(max(float((x - y).abs().max()) for x, y in zip(sa, sb)) for sa, sb in zip(a, b))


def _scenarios(rank, world):
    dense, _ = _run(world, rank)
    local1, model = _run(world, rank, sync=partial(PeriodicSync, period=1))
    local4, _ = _run(world, rank, sync=partial(PeriodicSync, period=4))
    diloco, _ = _run(world, rank, sync=partial(PeriodicSync, period=4, outer_lr=0.7, outer_momentum=0.9))
    # DiLoCo's node with outer lr 1 and no momentum (Nesterov asked for): local SGD's update
    diloco_plain, _ = _run(world, rank, sync=partial(PeriodicSync, period=4, outer_lr=1.0, outer_momentum=0.0,
                                                     nesterov=True))
    buffers = [b.clone() for b in model.buffers() if b.is_floating_point()]
    mid, mid_model = _run(world, rank, sync=partial(PeriodicSync, period=4), steps=6)
    with mid_model.exchange.synchronised():
        evaluated = [p.detach().clone() for p in mid_model.parameters()]
    after = [p.detach().clone() for p in mid_model.parameters()]
    compressed, _ = _run(world, rank, "randk", sync=partial(PeriodicSync, period=4), compressor=RandomK)
    post_local, _ = _run(world, rank, sync=partial(PeriodicSync, period=4, warmup_steps=2), steps=10)
    return {"dense_vs_local1": _diff(dense, local1),
            "local4_vs_hand": _diff(local4, _by_hand_local_sgd(world, rank, 4)),
            "diloco_vs_hand": _diff(diloco, _by_hand_local_sgd(world, rank, 4, 0.7, 0.9)),
            "post_local_vs_torch": _diff(post_local, _torch_post_local_sgd(world, rank, 4, 2, 10)),
            "diloco_plain_is_local": all(torch.equal(a, b) for sa, sb in zip(diloco_plain, local4)
                                         for a, b in zip(sa, sb)),
            "local4": local4, "diloco": diloco, "compressed": compressed, "buffers": buffers,
            "evaluated": evaluated, "after": after, "mid": mid}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return on_gloo_ranks(_scenarios, tmp_path_factory.mktemp("periodic"))


def test_local_sgd_with_period_one_is_dense_sgd(two):
    """H = 1: each rank steps on its own gradient, then the models are averaged. With SGD's
    momentum, Nesterov and weight decay all linear in the gradient, that is dense SGD's step
    (float64, within rounding)."""
    for r in range(2):
        assert two[r]["dense_vs_local1"] < 1e-12, two[r]["dense_vs_local1"]


def test_local_sgd_and_diloco_follow_their_definitions(two):
    """H = 4 against the method written out by hand (mean of anchor - model, outer Nesterov SGD,
    batch-norm statistics averaged): local SGD (outer lr 1, no momentum) and DiLoCo (0.7, 0.9)."""
    for r in range(2):
        assert two[r]["local4_vs_hand"] < 1e-12 and two[r]["diloco_vs_hand"] < 1e-12, two[r]


def test_diloco_with_outer_lr_one_and_no_momentum_is_local_sgd(two):
    """Bit for bit, and the two schemes' yaml differ only in those options."""
    from sparsetrain.config import compose

    assert two[0]["diloco_plain_is_local"] and two[1]["diloco_plain_is_local"]
    local = compose(["scheme=localsgd"]).scheme.sync
    plain = compose(["scheme=diloco", "scheme.sync.outer_lr=1.0", "scheme.sync.outer_momentum=0.0"]).scheme.sync
    assert {k: v for k, v in plain.items() if k != "nesterov"} == dict(local)


def test_post_local_sgd_is_torchs(two):
    """Two dense warm-up steps, then local SGD at H = 4 equals torch's own: DDP with the
    post-local-SGD hook and PeriodicModelAverager (the parameters; torch averages no buffers)."""
    for r in range(2):
        assert two[r]["post_local_vs_torch"] < 1e-12, two[r]["post_local_vs_torch"]


def test_ranks_agree_at_each_synchronisation_and_differ_between(two):
    for key in ("local4", "diloco", "compressed"):
        for i in range(STEPS):
            same = all(torch.equal(a, b) for a, b in zip(two[0][key][i], two[1][key][i]))
            assert same == ((i + 1) % 4 == 0), (key, i)
    assert all(torch.equal(a, b) for a, b in zip(two[0]["buffers"], two[1]["buffers"]))
    assert two[0]["compressed"][-1][0].ne(two[0]["local4"][-1][0]).any()  # random-k's delta: another model


def test_evaluation_sees_the_synchronised_model(two):
    """Mid-period (6 steps, period 4) the evaluated model is the last synchronisation's (step 4),
    the same on both ranks; afterwards each rank has its own model back, bit for bit."""
    for r in range(2):
        res = two[r]
        assert all(torch.equal(a, b) for a, b in zip(res["evaluated"], res["mid"][3]))
        assert all(torch.equal(a, b) for a, b in zip(res["after"], res["mid"][5]))
    assert all(torch.equal(a, b) for a, b in zip(two[0]["evaluated"], two[1]["evaluated"]))
    assert not all(torch.equal(a, b) for a, b in zip(two[0]["after"], two[1]["after"]))


# ------------------------------------------------------------------------- from the command line
SHORT = (*TINY, "world_size=2", "train.log_every=1", "train.save_model=true")


@pytest.mark.slow  # two runs; local SGD and DiLoCo follow their definitions above, in-process
def test_cli_bytes_per_synchronisation_and_per_step(tmp_path):
    """Bytes by hand: a synchronisation sends the parameters (4 bytes an entry) and the float
    batch-norm buffers, on the last step of each period; per step, that over the period. The
    compressed delta sends random-k's values and the 1-D tensors whole."""
    run = tmp_path / "local"
    proc = run_cli(*SHORT, "scheme=localsgd", "scheme.sync.period=4", "train.max_steps=8", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    from sparsetrain.models import build_model

    model = build_model("resnet20", 3, 10)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    per_sync = 4 * (params + buffers)
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["bytes_sent"] for r in steps] == [0, 0, 0, per_sync] * 2
    assert s["bytes_sent_per_step"] == per_sync / 4 and s["bytes_sent_total"] == 2 * per_sync
    sync = s["sync"]  # a synchronisation's own figures beside the per-step means
    assert (sync["period"], sync["syncs"], sync["bytes_per_sync"]) == (4, 2, per_sync)
    assert 0 < sync["time_ms_per_sync"] < 4 * s["time_ms"]["step"]
    assert s["applies"] == {"ratio": False, "aggregation": False, "scope": False}
    t = s["time_ms"]
    assert t["exchange"] > 0 and t["compress"] > 0
    assert abs(sum(v for k, v in t.items() if k != "step") - t["step"]) < 0.05 * t["step"], t  # no double count
    rk = tmp_path / "randk"
    proc = run_cli(*SHORT, "scheme=localsgd", "scheme.sync.period=4", "train.max_steps=4", "ratio=0.1",
                   "+scheme.compressor._target_=sparsetrain.compress.RandomK", "+scheme.compressor._partial_=true",
                   "aggregation=allreduce", f"hydra.run.dir={rk}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(rk / "summary.json")
    assert 0.05 * per_sync < s["bytes_sent_per_step"] * 4 < 0.2 * per_sync
    assert s["applies"] == {"ratio": True, "aggregation": True, "scope": True}


@pytest.mark.slow  # four runs
def test_ddp_runs_local_sgd_and_diloco_as_the_trainer(tmp_path):
    """``dist.ddp=true``: torch's post-local-SGD hook averages the gradients during warm-up and
    leaves them local after; the synchronisation is the trainer's. The same weights, losses and
    bytes to the last bit, dense and with a compressed delta."""
    for name, extra in (("diloco", ()), ("localsgd", ("ratio=0.1", "aggregation=allreduce",
                                                      "+scheme.compressor._target_=sparsetrain.compress.RandomK",
                                                      "+scheme.compressor._partial_=true"))):
        common = (*SHORT, f"scheme={name}", "scheme.sync.period=3", "scheme.warmup_steps=2",
                  "train.max_steps=10", *extra)
        runs = {}
        for ddp in ("false", "true"):
            run = tmp_path / f"{name}-{ddp}"
            proc = run_cli(*common, f"dist.ddp={ddp}", f"hydra.run.dir={run}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
            runs[ddp] = (read_json(run / "summary.json"), torch.load(run / "model.pt", weights_only=True), steps)
        (s_flat, a, flat_steps), (s_ddp, b, ddp_steps) = runs["false"], runs["true"]
        assert s_flat["train_loss"] == s_ddp["train_loss"] and s_flat["steps"] == 10
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert [r["bytes_sent"] for r in flat_steps] == [r["bytes_sent"] for r in ddp_steps]
        assert [r["train_loss"] for r in flat_steps] == [r["train_loss"] for r in ddp_steps]
        assert flat_steps[0]["bytes_sent"] == s_flat["dense_bytes_per_step"]  # warm-up: dense SGD
        assert [r["bytes_sent"] > 0 for r in flat_steps[2:]] == [False, False, True] * 2 + [False, False]


@pytest.mark.slow  # the resume matrix: three runs each
@pytest.mark.parametrize("ddp", [False, True], ids=["trainer", "ddp"])
def test_cli_resumes_in_the_middle_of_a_period_bit_for_bit(ddp, tmp_path):
    """DiLoCo's anchor, outer momentum and the step within the period are checkpointed: SIGTERM
    mid-period, resume, the same weights and metrics as a straight run. Through DDP, after a
    warm-up (torch's hook counts its steps until local SGD starts)."""
    args = (*TINY, "world_size=2", "train.epochs=2", "train.log_every=1", "train.save_model=true",
            "data.train_size=384", "scheme=diloco", "scheme.sync.period=5",
            *(("dist.ddp=true", "scheme.warmup_steps=2") if ddp else ()))
    straight = run_cli(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "sparsetrain.run", *args, f"hydra.run.dir={run}"], cwd=ROOT,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run, 7, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert read_json(run / "summary.json")["status"] == "failed"
    resumed = run_cli(*args, f"hydra.run.dir={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_json(run / "summary.json")["resumed_from_step"] % 5 != 0  # in the middle of a period
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time_ms", "elapsed_s")} for r in rs]  # noqa: E731
    assert strip(read_jsonl(run / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


@pytest.mark.parametrize("override, message", [
    ("scheme.sync.outer_lr=0", "scheme.sync.outer_lr=0 is not allowed; it must be a number > 0"),
    ("scheme.sync.period=0", "scheme.sync.period=0 is not allowed; it must be an integer >= 1"),
    ("scheme.sync.outer_momentum=1.0", "scheme.sync.outer_momentum=1.0 is not allowed; it must be in [0, 1)"),
])
def test_bad_sync_options_are_one_line(override, message):
    from sparsetrain.config import ConfigError, compose, validate

    with pytest.raises(ConfigError) as info:
        validate(compose(["scheme=diloco", override]), env={})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_analysis_tells_synchronisation_settings_apart():
    """The sync node is an axis (its class and options); without one, a run syncs every step. A
    dense local SGD run shows scope, aggregation and ratio as not applying."""
    from sparsetrain.analysis.loader import NOT_APPLICABLE, row_from_summary

    node = {"_target_": "sparsetrain.comm.periodic.PeriodicSync", "_partial_": True, "period": 8,
            "outer_lr": 1.0, "outer_momentum": 0.0}
    cfg = {"scheme": {"name": "localsgd", "sync": node}, "scope": {"name": "layerwise"},
           "aggregation": {"name": "allgather"}, "ratio": 0.01}
    row = row_from_summary({"status": "completed", "config": cfg,
                            "applies": {"ratio": False, "aggregation": False, "scope": False}}, None)
    assert row["sync"] == "PeriodicSync(outer_lr=1.0, outer_momentum=0.0, period=8)"
    assert row["delta"] == "dense"
    # what compresses the delta is an axis of its own: top-k and random-k deltas are told apart
    for cls in ("TopK", "RandomK"):
        compressed = {**cfg, "scheme": {**cfg["scheme"], "compressor": {"_target_": f"sparsetrain.compress.{cls}"}}}
        assert row_from_summary({"status": "completed", "config": compressed}, None)["delta"] == cls
    assert (row["scope"], row["aggregation"], row["ratio"]) == (NOT_APPLICABLE, NOT_APPLICABLE, 1.0)
    plain = row_from_summary({"status": "completed", "config": {**cfg, "scheme": {"name": "topk"}}}, None)
    assert plain["sync"] is None  # load_runs shows it as "every step" where some run synchronised less
    assert plain["delta"] is None  # and "-" for its delta


def test_the_end_of_run_table_rounds_a_periods_mean_bytes():
    """bytes_sent_per_step of local SGD is a mean over a period (1,083,240 B / 28 = 38,687.14...):
    the table a run ends with shows it to the byte, not with its fraction."""
    from sparsetrain.launch.report import runs_table

    s = {"status": "completed", "steps": 56, "train_loss": 1.0, "test_accuracy": 0.5,
         "bytes_sent_per_step": 1_083_240 / 28, "dense_bytes_per_step": 1_077_736, "time_ms": {"step": 400.0}}
    table = runs_table([(["localsgd"], s)])
    assert "38,687 " in table and "38,687.1" not in table and "0.0359" in table


@pytest.mark.slow  # a 2-rank run, then the test set scored again
def test_model_pt_is_the_model_the_final_evaluation_scored(tmp_path):
    """Audit 7: with train.bn_recalibrate, local SGD's final evaluation recalibrated the anchor's
    batch norm inside synchronised(), which restores each rank's own buffers on leaving it; model.pt
    was saved in a second synchronised() and held the buffers before recalibration (it scored
    8.7% where the run reported 17.7%). It is saved inside the first now: scored again in one
    process, it predicts every test image as the run's test_predictions.npz says."""
    import numpy as np
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from sparsetrain.data import load_dataset
    from sparsetrain.results import read_test_predictions

    run = tmp_path / "run"
    proc = run_cli(*TINY, "world_size=2", "scheme=localsgd", "scheme.sync.period=4", "data.train_size=700",
                   "data.test_size=333", "train.epochs=2", "train.bn_recalibrate=3", "train.save_model=true",
                   f"hydra.run.dir={run}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = OmegaConf.create(read_json(run / "summary.json")["config"])
    data = load_dataset(cfg.data.name, cfg.data.root, download=False, train_size=cfg.data.train_size,
                        test_size=cfg.data.test_size, seed=cfg.seed, val_size=cfg.data.get("val_size", 0))
    model = instantiate(cfg.model)(in_channels=data.in_channels, num_classes=data.num_classes)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(data.test_x[i:i + 100]).argmax(1) for i in range(0, len(data.test_y), 100)])
    saved, label = read_test_predictions(run)
    assert np.array_equal(label, data.test_y.numpy())
    assert np.array_equal(predicted.numpy(), saved)
