"""`make gpu-check`'s pieces that run without a GPU: the refusal without one, the step-time table
on the CPU, the compressor benchmark's goals per device."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _script(name):
    return importlib.import_module(f"sparsetrain.benchmarks.{name}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: gpu-check would run")
@pytest.mark.slow  # the script and two benchmarks, each a process
def test_gpu_check_without_a_gpu_says_so_in_one_line_and_fails():
    env = {**os.environ, "PY": sys.executable}
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2
    assert p.stdout == "" and p.stderr.count("\n") == 1 and "no CUDA GPU" in p.stderr
    for name in ("compress", "step_device"):
        q = subprocess.run([sys.executable, "-m", f"sparsetrain.benchmarks.{name}", "--device", "cuda"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        assert q.returncode == 2 and "no CUDA GPU" in q.stderr and q.stderr.count("\n") == 1


def test_step_table_runs_on_cpu(tmp_path, capsys):
    mod = _script("step_device")
    assert mod.main(["--device", "cpu", "--model", "resnet20", "--batch", "2", "--steps", "1",
                     "--warmup", "1", "--threads", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cpu_step.json").read_text())
    rows = doc["rows"]
    assert [(r["scheme"], r["scope"]) for r in rows] == [(s, sc) for s, sc, _ in mod.ROWS]
    for r in rows:
        assert 0 < r["phase_sum_over_step"] <= 1 + 1e-9  # phases are disjoint parts of the step
        assert r["phases_ms"]["forward"] > 0 and r["phases_ms"]["backward"] > 0
        if r["scheme"] != "none":  # QSGD at its default 127 levels: 8 bits an entry
            share = 3 if r["scheme"] == "qsgd" else 10
            assert r["phases_ms"]["compress"] > 0 and r["bytes_sent_per_step"] < rows[0]["bytes_sent_per_step"] / share
    text = (tmp_path / "cpu_step.txt").read_text()
    assert text.startswith("device: cpu") and "x dense" in text and "phases add up" in text


@pytest.mark.slow  # every row twice, the fast path's kernels in Triton's interpreter (about 45 s)
def test_step_table_fast_path_rows_train_as_the_torch_path_under_the_interpreter(tmp_path):
    """``--fast-path on`` on the CPU under ``TRITON_INTERPRET=1``: every compressed row again as
    ``<scheme>+F`` through the trainer's step, and its second step's loss (after one update) equals
    the torch path's: bit for bit where the kernels compute what the CPU's torch path does; to
    float rounding for PowerSGD (batched matmuls sum in another order) and signSGD (its kernel's
    scale, a mean, sums as the GPU's torch path does, not as the CPU's). Without the interpreter
    the option is refused in one line."""
    pytest.importorskip("triton", reason="triton is not installed: the fast path's kernels need it")
    mod = _script("step_device")
    args = ["--device", "cpu", "--model", "resnet20", "--batch", "2", "--steps", "1", "--warmup", "1",
            "--threads", "1", "--fast-path", "on", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "sparsetrain.benchmarks.step_device", *args], capture_output=True,
                       text=True, env=env, timeout=120, cwd=REPO)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "TRITON_INTERPRET=1" in p.stderr
    p = subprocess.run([sys.executable, "-m", "sparsetrain.benchmarks.step_device", *args], capture_output=True,
                       text=True, env={**env, "TRITON_INTERPRET": "1"}, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "cpu_step.json").read_text())["rows"]
    torch_path = {(r["scheme"], r["scope"]): r for r in rows if not r["fast_path"]}
    fast = {(r["scheme"], r["scope"]): r for r in rows if r["fast_path"]}
    assert list(fast) == [(s, sc) for s, sc, _ in mod.FAST_ROWS] and len(fast) == len(torch_path) - 1
    for key, row in fast.items():
        assert row["bytes_sent_per_step"] == torch_path[key]["bytes_sent_per_step"]
        if key[0] in ("powersgd", "signsgd"):
            assert row["loss"] == pytest.approx(torch_path[key]["loss"], rel=1e-5)
        else:
            assert row["loss"] == torch_path[key]["loss"], key
    assert "\npowersgd+F layerwise " in (tmp_path / "cpu_step.txt").read_text()


def test_compress_goals_per_device():
    mod = _script("compress")
    rows = [{"scheme": s, "scope": sc, "compress_ef_copies": c, "decompress_copies": 1.0}
            for s, sc, c in [("topk", "layerwise", 4.0), ("topk", "global", 6.0),
                             ("randk", "layerwise", 1.9), ("randk", "global", 2.1),
                             ("blockk", "layerwise", 1.0), ("blockk", "global", 1.0)]]
    for device, need in (("cuda:0", 5), ("cpu", 12)):
        res = {"device": device, "schemes": rows, "references_copies": {"torch.topk(g.abs(),k)": 30.0}}
        goals = mod.goals(res)
        assert goals["topk/layerwise compress+EF <= 5 copies"] is True
        assert goals["topk/global compress+EF <= 5 copies"] is False
        assert goals["randk/global compress+EF <= 2 copies"] is False
        speed = {k: v for k, v in goals.items() if "speed-up" in k}
        assert speed == {f"topk/layerwise speed-up over torch.topk = 7.5x >= {need}": need == 5,
                         f"topk/global speed-up over torch.topk = 5.0x >= {need}": need == 5}


def test_fast_path_goals():
    """The fast path's rows (``<scheme>_fast``): top-k's compress + EF against torch.topk alone
    (faster: below its copies), random-k's and block-k's <= 2 copies."""
    mod = _script("compress")
    rows = [{"scheme": s, "scope": sc, "compress_ef_copies": c, "decompress_copies": 1.0}
            for s, sc, c in [("topk_fast", "layerwise", 9.0), ("topk_fast", "global", 12.0),
                             ("randk_fast", "layerwise", 1.5), ("blockk_fast", "global", 2.5)]]
    goals = mod.goals({"device": "cuda:0", "schemes": rows, "references_copies": {"torch.topk(g.abs(),k)": 11.0}})
    assert goals["topk_fast/layerwise compress+EF faster than torch.topk alone = 1.2x > 1"] is True
    assert goals["topk_fast/global compress+EF faster than torch.topk alone = 0.9x > 1"] is False
    assert goals["randk_fast/layerwise compress+EF <= 2 copies"] is True
    assert goals["blockk_fast/global compress+EF <= 2 copies"] is False


def test_quantizer_kernel_goals_per_device():
    """signSGD's and QSGD's encode and decode_add alone: <= 2 and 4 copies (encode), <= 2
    (decode) on the CPU; <= 4 copies each on a GPU."""
    mod = _script("compress")
    rows = [{"scheme": "signsgd", "scope": "kernels", "compress_ef_copies": 3.0, "decompress_copies": 3.0},
            {"scheme": "qsgd_s1", "scope": "kernels", "compress_ef_copies": 3.5, "decompress_copies": 4.5},
            {"scheme": "qsgd_s1_pcg64", "scope": "kernels", "compress_ef_copies": 9.0, "decompress_copies": 9.0}]
    res = {"device": "cuda:0", "schemes": rows, "references_copies": {}}
    assert mod.goals(res) == {"signsgd encode <= 4 copies": True, "signsgd decode_add <= 4 copies": True,
                              "qsgd_s1 encode <= 4 copies": True, "qsgd_s1 decode_add <= 4 copies": False}
    res["device"] = "cpu"
    assert mod.goals(res) == {"signsgd encode <= 2 copies": False, "signsgd decode_add <= 2 copies": False,
                              "qsgd_s1 encode <= 4 copies": True, "qsgd_s1 decode_add <= 2 copies": False}


def test_cpu_clock_times_a_call():
    mod = _script("compress")
    ms = mod.clock(torch.device("cpu"))
    assert ms(lambda: None) >= 0
    assert mod.timeit(lambda: torch.zeros(10).sum(), 3, torch.device("cpu")) >= 0


def test_profile_counts_what_each_timed_call_does():
    """``--profile``: each timed call profiled (here the quantizers' rows on a small layout, on
    the CPU): the ops called per call, the top ops by time."""
    from sparsetrain.benchmarks.compress import profile_calls, quantizer_rows
    from sparsetrain.compress import Layout

    x = torch.ones(100)
    text = profile_calls([("two adds", lambda: x.add(1).add(2)), ("one mul", lambda: x.mul(3))], torch.device("cpu"), 2)
    assert "== two adds: 2 aten ops called per call" in text and "== one mul: 1 aten ops called per call" in text
    calls = []
    layout = Layout.from_sizes([4096, 300, 7])
    quantizer_rows(layout, torch.randn(layout.total), 1, torch.device("cpu"), calls)
    assert [name for name, _ in calls] == [f"{s}/kernels {op}" for s in ("signsgd", "qsgd_s1", "qsgd_s1_pcg64")
                                           for op in ("encode", "decode_add")]
    text = profile_calls(calls, torch.device("cpu"), 1)
    assert text.count("aten ops called per call") == 6 and "Self CPU" in text
