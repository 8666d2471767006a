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


def _dgc_env() -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(DGC)])}


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


def _run(tmp_path, name, *extra, scheme=DGC_ARGS):
    run = tmp_path / name
    proc = run_cli(*scheme, *TINY, "world_size=2", "train.epochs=4", "train.max_steps=30",
                   "train.log_every=1", "train.save_model=true", "dist.bucket_cap_mb=0.05", *extra,
                   f"hydra.run.dir={run}", env=_dgc_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, read_json(run / "summary.json")


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


def test_dgc_resumes_bit_for_bit_under_ddp(tmp_path):
    """Both buffers of the example's memory are checkpointed and re-homed across DDP's bucket
    rebuild: SIGTERM in the second epoch, resume, the same weights and metrics as a straight run."""
    args = (*DGC_ARGS, *TINY, "world_size=2", "train.epochs=2", "train.log_every=1", "train.save_model=true",
            "data.train_size=384", "dist.ddp=true", "dist.bucket_cap_mb=0.05")
    straight = run_cli(*args, f"hydra.run.dir={tmp_path / 'straight'}", env=_dgc_env())
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "sparsetrain.run", *args, f"hydra.run.dir={run}"], cwd=ROOT,
                            env=cli_env(**_dgc_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(run, 8, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert read_json(run / "summary.json")["status"] == "failed"
    resumed = run_cli(*args, f"hydra.run.dir={run}", env=_dgc_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_json(run / "summary.json")["resumed_from_step"] > 0
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("time_ms", "elapsed_s")} for r in rs]  # noqa: E731
    assert strip(read_jsonl(run / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


@pytest.mark.netns
@requires_netns
def test_dgc_runs_through_the_step_benchmark(tmp_path):
    """The step benchmark times a row of one's own (``--row``) beside its rows, on the
    bandwidth-limited cluster: the example's scheme found through the search path."""
    cmd = [sys.executable, "-m", "sparsetrain.benchmarks.step", "--rates", "2gbit", "--nproc", "2", "--batch", "2",
           "--steps", "1", "--warmup", "0", "--rounds", "1", "--visits", "1",
           "--override", f"hydra.searchpath=[file://{DGC / 'conf'}]",
           "--row", "dgc=scheme=dgc_randk optim.momentum=0 optim.nesterov=false",
           "--schemes", "compute,dense,randk_ag,dgc", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=cli_env(**_dgc_env()))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "step.json").read_text())["results"][0]["schemes"]
    assert rows["dgc"]["options"]["scheme"] == "dgc_randk"
    # the same entries as random-k's row: DGC changes the memory, not the message
    assert rows["dgc"]["bytes_sent_per_step"] == rows["randk_ag"]["bytes_sent_per_step"] > 0
    assert rows["dgc"]["phases_ms"]["compress"] > 0
