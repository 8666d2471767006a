"""The out-of-tree examples (examples/<name>/: one module and one scheme yaml each, nothing in
sparsetrain/ edited) run as a researcher runs them: the trainer, the DDP path (equal to the
trainer's, bit for bit), an interrupted run resumed bit for bit, and the analysis of their own
results. The method itself is checked against its definition in float64."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, cli_env, read_json, read_jsonl, run_cli
from test_launch import _wait_for_steps
from test_netns import requires_netns

from sparsetrain.compress import Layout, RandomK

EXAMPLES = ROOT / "examples"


def _module(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_example_is_one_module_and_one_yaml():
    for folder in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                       and "__pycache__" not in p.parts)
        assert len(files) == 2 and files[0].startswith("conf/scheme/") and files[1].endswith(".py"), files


# ---- DGC: random-k with momentum correction ------------------------------------------------------
DGC = EXAMPLES / "dgc"
DGC_ARGS = ("--config-dir", str(DGC / "conf"), "scheme=dgc_randk", "optim.momentum=0", "optim.nesterov=false")
# the same run with error feedback and the optimizer's momentum: the method DGC changes
EF_ARGS = ("--config-dir", str(DGC / "conf"), "scheme=randk")


def _env(folder) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)])}


def _dgc_env() -> dict:
    return _env(DGC)


def test_momentum_correction_follows_its_definition():
    """u = m u + g; v = v + u; send random-k of v; v = v - sent; u = 0 where sent (float64, by hand)."""
    dgc = _module("dgc", DGC / "dgc.py")
    layout = Layout.from_sizes([50, 30])
    comp = RandomK(0.2, layout, "layerwise")
    mem = dgc.MomentumCorrection(layout.total, momentum=0.8, dtype=torch.float64)
    u = torch.zeros(layout.total, dtype=torch.float64)
    v = torch.zeros(layout.total, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        g = torch.randn(layout.total, generator=gen, dtype=torch.float64)
        u = 0.8 * u + g
        v = v + u
        payload = mem.step(g, comp, seed=step)
        sent = torch.zeros_like(v)
        sent[payload.indices] = v[payload.indices]
        assert torch.equal(payload.values, v[payload.indices])
        v, u = v - sent, u.index_fill(0, payload.indices, 0.0)
        torch.testing.assert_close(mem.velocity, v, rtol=0, atol=1e-12)
        torch.testing.assert_close(mem.momentum, u, rtol=0, atol=1e-12)
    assert mem.norm() == pytest.approx(float(v.norm()))
    with pytest.raises(ValueError, match=r"scheme.memory.momentum=1.0 is not allowed"):
        dgc.MomentumCorrection(4, momentum=1.0)


def _run(tmp_path, name, *extra, scheme=DGC_ARGS, env=None):
    run = tmp_path / name
    proc = run_cli(*scheme, *TINY, "world_size=2", "train.epochs=4", "train.max_steps=30",
                   "train.log_every=1", "train.save_model=true", "dist.bucket_cap_mb=0.05", *extra,
                   f"hydra.run.dir={run}", env=env or _dgc_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, read_json(run / "summary.json")


@pytest.mark.slow  # the example matrix: three runs each
def test_dgc_trains_through_the_trainer_and_ddp_alike_and_is_analysed(tmp_path):
    flat, s_flat = _run(tmp_path, "trainer")
    ddp, s_ddp = _run(tmp_path, "ddp", "dist.ddp=true")
    assert s_flat["status"] == s_ddp["status"] == "completed" and s_flat["steps"] == 30
    assert s_flat["train_loss"] == s_ddp["train_loss"]
    a = torch.load(flat / "model.pt", weights_only=True)
    b = torch.load(ddp / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the memory is the example's: its norm is logged, and differs from error feedback's run
    steps = [r for r in read_jsonl(flat / "metrics.jsonl") if r["kind"] == "step"]
    assert all(r["memory_norm"] > 0 for r in steps[1:])
    _, s_ef = _run(tmp_path, "ef", scheme=EF_ARGS)
    assert s_ef["train_loss"] != s_flat["train_loss"]
    # the analysis of the researcher's own results: one row per scheme, DGC's by its name
    proc = subprocess.run([sys.executable, "-m", "sparsetrain.analysis", str(tmp_path), "--out",
                           str(tmp_path / "figures")], cwd=ROOT, env=cli_env(**_dgc_env()),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dgc_randk" in proc.stdout and "randk" in proc.stdout.replace("dgc_randk", "")
    from sparsetrain.analysis import load_runs

    runs = load_runs(tmp_path)
    assert dict(zip(runs["scheme"], runs["memory"])) == {"dgc_randk": "MomentumCorrection(momentum=0.9)",
                                                         "randk": "error feedback"}


def test_a_memory_option_defines_the_run():
    """scheme.memory.momentum is part of what a run is: another value is another run (resume and
    rerun refuse it), and error feedback's runs from before the memory node compare equal."""
    from sparsetrain.train.checkpoint import config_differences

    node = {"_target_": "dgc.MomentumCorrection", "_partial_": True, "momentum": 0.9}
    run = {"scheme": {"name": "dgc_randk", "memory": node}}
    assert config_differences(run, {"scheme": {"name": "dgc_randk", "memory": {**node, "momentum": 0.8}}}) == [
        ("scheme.memory.momentum", 0.9, 0.8)]
    assert config_differences({"scheme": {"name": "randk"}}, {"scheme": {"name": "randk", "memory": None}}) == []


@pytest.mark.slow  # three runs each
@pytest.mark.parametrize("example", ["dgc", "thc", "ef21"])
def test_example_resumes_bit_for_bit_under_ddp(example, tmp_path):
    """Every buffer of the example's memory is checkpointed and re-homed across DDP's bucket
    rebuild: SIGTERM in the second epoch, resume, the same weights and metrics as a straight run
    (EF21: its g_i and its shared g, which is the update applied)."""
    scheme_args, env = {"dgc": (DGC_ARGS, _dgc_env()), "thc": (THC_ARGS, _env(THC)),
                        "ef21": (EF21_ARGS, _env(EF21))}[example]
    args = (*scheme_args, *TINY, "world_size=2", "train.epochs=2", "train.log_every=1", "train.save_model=true",
            "data.train_size=384", "dist.ddp=true", "dist.bucket_cap_mb=0.05")
    straight = run_cli(*args, f"hydra.run.dir={tmp_path / 'straight'}", env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "sparsetrain.run", *args, f"hydra.run.dir={run}"], cwd=ROOT,
                            env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run, 8, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert read_json(run / "summary.json")["status"] == "failed"
    resumed = run_cli(*args, f"hydra.run.dir={run}", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_json(run / "summary.json")["resumed_from_step"] > 0
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time_ms", "elapsed_s")} for r in rs]  # noqa: E731
    assert strip(read_jsonl(run / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


@pytest.mark.slow  # netns
@pytest.mark.netns
@requires_netns
def test_examples_run_through_the_step_benchmark(tmp_path):
    """The step benchmark times rows of one's own (``--row``) beside its rows, on the
    bandwidth-limited cluster: the examples' schemes found through the search path."""
    cmd = [sys.executable, "-m", "sparsetrain.benchmarks.step", "--rates", "2gbit", "--nproc", "2", "--batch", "2",
           "--steps", "1", "--warmup", "0", "--rounds", "1", "--visits", "1",
           "--override", f"hydra.searchpath=[file://{DGC / 'conf'},file://{THC / 'conf'}]",
           "--row", "dgc=scheme=dgc_randk optim.momentum=0 optim.nesterov=false", "--row", "thc=scheme=thc",
           "--schemes", "compute,dense,randk_ag,dgc,thc", "--out", str(tmp_path)]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(DGC), str(THC)])}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=cli_env(**env))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "step.json").read_text())["results"][0]["schemes"]
    assert rows["dgc"]["options"]["scheme"] == "dgc_randk" and rows["thc"]["options"]["scheme"] == "thc"
    # the same entries as random-k's row: DGC changes the memory, not the message
    assert rows["dgc"]["bytes_sent_per_step"] == rows["randk_ag"]["bytes_sent_per_step"] > 0
    assert rows["dgc"]["phases_ms"]["compress"] > 0
    # THC: a byte per entry (and a float per tensor), between random-k's and dense's
    assert rows["randk_ag"]["bytes_sent_per_step"] < rows["thc"]["bytes_sent_per_step"] < \
        rows["dense"]["bytes_sent_per_step"] / 3
    assert rows["thc"]["phases_ms"]["compress"] > 0


# ---- THC: an integer-sum quantizer (a shared scale by MAX, then int8 codes summed) ---------------
THC = EXAMPLES / "thc"
THC_ARGS = ("--config-dir", str(THC / "conf"), "scheme=thc")


def _thc_exchange(levels=15, uncompressed=40, dtype=torch.float64):
    from functools import partial

    from sparsetrain.comm import build_reducer

    thc = _module("thc", THC / "thc.py")
    layout = Layout.from_sizes([50, 30, uncompressed])
    return thc, build_reducer("thc", "layerwise", "allreduce", 1.0, layout, world_size=1, rank=0, seed=3,
                              uncompressed=[False, False, True], dtype=dtype,
                              compressor=partial(thc.IntegerSum, levels=levels))


def test_integer_sum_follows_its_definition():
    """One rank, float64: the rounds it declares (the whole tensors in a sum round of their own,
    first), its bytes, the update on the shared grid (codes x s / L, within s / L of acc), error
    feedback keeping acc - update exactly, and stochastic rounding unbiased over seeds."""
    from sparsetrain.timing import NULL_TIMER

    thc, red = _thc_exchange()
    assert [(r.op, r.floats, r.ints, r.int_dtype) for r in red.rounds] == [
        ("sum", 0, 0, torch.int32), ("max", 2, 0, torch.int32), ("sum", 0, 80, torch.int8)]
    assert red.bytes_sent_per_step == 40 * 8 + 2 * 8 + 80 and red.collective == "allreduce"
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(120, generator=gen, dtype=torch.float64)
    mem_before = red.memory.memory.clone()
    flat = g.clone()
    red.reduce(flat, 0, NULL_TIMER)
    acc = g[:80] + mem_before
    scale = torch.cat([acc[:50].abs().max().expand(50), acc[50:].abs().max().expand(30)])
    codes = flat[:80] / scale * 15
    assert float((codes - codes.round()).abs().max()) < 1e-9 and float(codes.abs().max()) <= 15  # on the grid
    assert float(((flat[:80] - acc).abs() / scale).max()) < 1 / 15 + 1e-12
    torch.testing.assert_close(red.memory.memory + flat[:80], acc, rtol=0, atol=1e-15)
    assert torch.equal(flat[80:], g[80:])  # the whole tensors unchanged (one rank)
    # unbiased: the mean of many draws (fresh memory each) approaches acc
    mean = torch.zeros(80, dtype=torch.float64)
    for seed in range(400):
        _, red = _thc_exchange()
        red.seed = seed
        flat = g.clone()
        red.reduce(flat, 0, NULL_TIMER)
        mean += flat[:80] / 400
    assert float(((mean - g[:80]).abs() / scale).max()) < 0.01
    # the levels that cannot fit int8's sum, in one line
    comp = thc.IntegerSum(1.0, Layout.from_sizes([4]), levels=15)
    from sparsetrain.compress.base import Message, StepState

    step = StepState(torch.ones(4), 0, 0, 16, 0, "allreduce", scratch={"scale": torch.ones(1)})
    with pytest.raises(ValueError, match=r"^scheme.compressor.levels=15 is not allowed with world_size=16: "):
        comp.send(1, step, Message(torch.empty(0), torch.empty(4, dtype=torch.int8)))


@pytest.mark.slow  # two runs and the analysis
def test_thc_trains_through_the_trainer_and_ddp_alike_and_is_analysed(tmp_path):
    """The example's three rounds (whole tensors, MAX of the scales, the int8 codes' sum) through
    the trainer and, per bucket, the DDP hook: the same weights and train loss to the bit; its
    bytes a quarter of dense's (a byte per entry); its own row in the analysis."""
    env = _env(THC)
    flat, s_flat = _run(tmp_path, "trainer", scheme=THC_ARGS, env=env)
    ddp, s_ddp = _run(tmp_path, "ddp", "dist.ddp=true", scheme=THC_ARGS, env=env)
    assert s_flat["status"] == s_ddp["status"] == "completed" and s_flat["steps"] == 30
    assert s_flat["train_loss"] == s_ddp["train_loss"] < 2.3  # below a uniform guess: it trains
    a = torch.load(flat / "model.pt", weights_only=True)
    b = torch.load(ddp / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    share = s_flat["bytes_sent_per_step"] / s_flat["dense_bytes_per_step"]
    assert 0.25 < share < 0.26, share  # int8 codes, a float per tensor, the 1-D tensors whole
    proc = subprocess.run([sys.executable, "-m", "sparsetrain.analysis", str(tmp_path), "--out",
                           str(tmp_path / "figures")], cwd=ROOT, env=cli_env(**env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "thc" in proc.stdout
    # what the run's axes mean comes from the compressor, recorded in the summary: its rounds are
    # the same whatever aggregation says, and it sends every entry whatever the ratio
    assert s_flat["collective"] == s_ddp["collective"] == "allreduce"
    applies = {"ratio": False, "aggregation": False, "scope": True}
    assert s_flat["applies"] == s_ddp["applies"] == applies
    from sparsetrain.analysis import load_runs
    from sparsetrain.analysis.loader import NOT_APPLICABLE

    runs = load_runs(tmp_path)
    assert set(runs["aggregation"]) == {NOT_APPLICABLE} and set(runs["ratio"]) == {1.0}
    assert set(runs["collective"]) == {"allreduce"}


# ---- EF21: a memory that changes the applied update (the shared estimate g) ----------------------
EF21 = EXAMPLES / "ef21"
EF21_ARGS = ("--config-dir", str(EF21 / "conf"), "scheme=ef21_topk")


def _ranks_in_one_process(reducers, grads, step, monkeypatch):
    """``reducers`` (one per rank, world_size = their number) exchange ``grads`` in this process:
    each rank's one gather round is sent, then every rank's message is put into every rank's
    receive buffer (the AllGather, by hand), then each rank decodes. Returns each rank's buffer."""
    from sparsetrain.comm.sparse import _RoundBuffers

    monkeypatch.setattr(_RoundBuffers, "communicate", lambda self, group, async_op: None)
    bufs = [g.clone() for g in grads]
    pending = [red.start(buf, step) for red, buf in zip(reducers, bufs, strict=True)]
    gathered = torch.cat([red._buffers[0].send for red in reducers])
    for red, p in zip(reducers, pending, strict=True):
        assert [r.op for r in red.rounds] == ["gather"]
        red._buffers[0].recv.copy_(gathered)
        red.finish(p)
    return bufs


def test_ef21_applies_its_shared_estimate(monkeypatch):
    """Three ranks through the exchange (in one process, float64) against EF21 written out:
    c_i = top-k(grad_i - g_i); g_i += c_i; g += mean_i(c_i); the optimizer applies g. The whole
    tensors are averaged as always; every rank applies the same update; g_i and g are the memory's
    state."""
    from sparsetrain.comm import build_reducer
    from sparsetrain.compress import TopK

    ef21 = _module("ef21", EF21 / "ef21.py")
    world, sizes, ratio = 3, [50, 30], 0.2
    layout = Layout.from_sizes([*sizes, 8])
    reducers = [build_reducer("ef21_topk", "layerwise", "allgather", ratio, layout, world_size=world, rank=r,
                              seed=0, uncompressed=[False, False, True], dtype=torch.float64, compressor=TopK,
                              memory=ef21.EF21) for r in range(world)]
    n = sum(sizes)
    g_i = torch.zeros(world, n, dtype=torch.float64)
    g = torch.zeros(n, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        grads = [torch.randn(layout.total, generator=gen, dtype=torch.float64) for _ in range(world)]
        c = torch.zeros(world, n, dtype=torch.float64)
        for r in range(world):
            d = grads[r][:n] - g_i[r]
            start = 0
            for size in sizes:  # top-k of each tensor: the k largest |d|
                k = max(1, round(ratio * size))
                idx = start + torch.topk(d[start : start + size].abs(), k).indices
                c[r, idx] = d[idx]
                start += size
        g_i += c
        g += c.mean(0)
        applied = _ranks_in_one_process(reducers, grads, step, monkeypatch)
        for r in range(world):
            assert torch.equal(applied[r], applied[0])
            torch.testing.assert_close(applied[r][:n], g, rtol=0, atol=1e-12)
            torch.testing.assert_close(applied[r][n:], sum(gr[n:] for gr in grads) / world, rtol=0, atol=1e-12)
            torch.testing.assert_close(reducers[r].memory.g_i, g_i[r], rtol=0, atol=1e-12)
            assert torch.equal(reducers[r].memory.g, applied[r][:n])
        assert step == 0 or not torch.allclose(g, c.mean(0))  # from step 1 on, g is not the averaged message
    assert reducers[0].memory.norm() == pytest.approx(float(g_i[0].norm()))
    assert set(reducers[0].state_dict()["error_feedback"]) == {"enabled", "g_i", "g"}


@pytest.mark.slow  # two runs through the command line (the float64 check above stays fast)
def test_ef21_trains_through_the_trainer_and_ddp_alike(tmp_path):
    """The example through the trainer and, per bucket, the DDP hook: the same weights and train
    loss to the bit. It trains because the shared estimate is applied: the averaged messages
    alone (top-k of each gradient's change) would leave the loss near a uniform guess's 2.3."""
    env = _env(EF21)
    flat, s_flat = _run(tmp_path, "trainer", scheme=EF21_ARGS, env=env)
    ddp, s_ddp = _run(tmp_path, "ddp", "dist.ddp=true", scheme=EF21_ARGS, env=env)
    assert s_flat["status"] == s_ddp["status"] == "completed" and s_flat["steps"] == 30
    assert s_flat["train_loss"] == s_ddp["train_loss"] < 2.0
    a = torch.load(flat / "model.pt", weights_only=True)
    b = torch.load(ddp / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r for r in read_jsonl(flat / "metrics.jsonl") if r["kind"] == "step"]
    assert all(r["memory_norm"] > 0 for r in steps)  # ||g_i||, logged as the memory's norm


def test_ef21_reads_the_decoded_update_before_applying_g():
    """With a compressor that gives the update every rank decoded (PowerSGD: P Q^T, in the buffer
    the exchange then applies), the memory's forget reads it before its update replaces it with
    g: on one rank g_i and g then both add up the decoded updates, and stay equal."""
    from functools import partial

    from sparsetrain.comm import build_reducer
    from sparsetrain.compress import PowerSGD
    from sparsetrain.timing import NULL_TIMER

    ef21 = _module("ef21", EF21 / "ef21.py")
    shapes = [(8, 6), (5, 4)]
    red = build_reducer("powersgd", "layerwise", "allreduce", 0.5, [48, 20], world_size=1, rank=0, seed=0,
                        dtype=torch.float64, compressor=partial(PowerSGD, rank=1), memory=ef21.EF21, shapes=shapes)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        flat = torch.randn(68, generator=gen, dtype=torch.float64)
        red.reduce(flat, step, NULL_TIMER)
        assert torch.equal(red.memory.g, flat)  # the update applied is g
        assert torch.equal(red.memory.g_i, red.memory.g) and float(red.memory.g.norm()) > 0
