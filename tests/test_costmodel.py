"""sparsetrain.costmodel: formulas, fit, predictions (fast, no cluster)."""

from __future__ import annotations

import math

import pytest

from sparsetrain.costmodel import (
    WIRE_OVERHEAD,
    Collective,
    CostModel,
    allgather_time,
    allreduce_time,
    fit,
    scheme_costs,
    terms,
)


def test_ring_formulas():
    # AllReduce: 2(N-1) alpha + 2(N-1)/N n beta ; AllGather: (N-1) alpha + (N-1) n beta
    assert allreduce_time(1000, 4, 1e-5, 1e-9) == pytest.approx(6e-5 + 1.5 * 1000 * 1e-9)
    assert allgather_time(1000, 4, 1e-5, 1e-9) == pytest.approx(3e-5 + 3 * 1000 * 1e-9)
    assert allreduce_time(10**9, 1, 1.0, 1.0) == 0.0  # one worker: nothing to exchange
    assert terms("allreduce", 1024) == (2046, pytest.approx(2 * 1023 / 1024))
    with pytest.raises(ValueError):
        terms("broadcast", 4)


@pytest.mark.parametrize("coll", ["allreduce", "allgather"])
def test_fit_recovers_alpha_beta(coll):
    alpha, beta = 50e-6, 8 / 1e9
    sizes = [4 * 4**i for i in range(13)]
    a, b = terms(coll, 4)
    times = [a * alpha + b * n * beta for n in sizes]
    c = fit(coll, 4, sizes, times)
    assert c.alpha == pytest.approx(alpha, rel=1e-6) and c.beta == pytest.approx(beta, rel=1e-6)
    assert c.rel_rms < 1e-9


def test_fit_clamps_to_non_negative():
    sizes = [4, 1e3, 1e6, 1e8]
    times = [1e-9 * s for s in sizes]  # pure bandwidth: alpha would come out ~0 or slightly negative
    c = fit("allreduce", 4, sizes, [t * (1.0 if i % 2 else 1.01) for i, t in enumerate(times)])
    assert c.alpha >= 0 and c.beta > 0


def test_at_rate_keeps_alpha_and_cpu_part():
    wire_1g = WIRE_OVERHEAD * 8 / 1e9
    c = Collective("allreduce", 20e-6, wire_1g + 0.5e-9, rate_bits=1e9)
    assert c.cpu_beta == pytest.approx(0.5e-9)
    d = c.at_rate(1e8)  # slow link: the wire sets the pace
    assert d.alpha == c.alpha and d.beta == pytest.approx(10 * wire_1g)
    f = Collective("allreduce", 20e-6, wire_1g, rate_bits=1e9, floor_beta=1e-9)
    assert f.at_rate(100e9).beta == pytest.approx(1e-9)  # fast link: the hosts set the pace
    assert f.at_rate(1e8).beta == pytest.approx(10 * wire_1g)


def test_scheme_bytes_and_step_prediction():
    numel, ratio = 11_173_962, 0.01
    k = round(ratio * numel)
    sent = {"dense": ("allreduce", 4 * numel), "topk": ("allgather", 8 * k), "randk": ("allreduce", 4 * k),
            "blockk": ("allreduce", 4 * k)}
    sc = scheme_costs(sent, {"blockk": {"compress": 5.0, "decompress": 3.0},
                             "topk": {"compress": 30.0, "decompress": 4.0}}, world_ref=4)
    assert sc["dense"].nbytes == 4 * numel and sc["dense"].collective == "allreduce"
    assert sc["topk"].nbytes == 8 * k and sc["topk"].collective == "allgather"
    assert sc["blockk"].nbytes == sc["randk"].nbytes == 4 * k
    col = {"allreduce": Collective("allreduce", 0.0, 8e-9, 1e9), "allgather": Collective("allgather", 0.0, 8e-9, 1e9)}
    cm = CostModel(col, compute_ms=100.0, schemes=sc)
    dense = cm.step_ms("dense", 4)
    assert dense == pytest.approx(100.0 + 1e3 * 1.5 * 4 * numel * 8e-9)
    assert cm.step_ms("blockk", 4) == pytest.approx(100.0 + 5.0 + 3.0 + 1e3 * 1.5 * 4 * k * 8e-9)
    # top-k decompresses one payload per worker: more workers, more decompress time
    assert cm.step_ms("topk", 8) - cm.exchange_ms(sc["topk"], 8) > cm.step_ms("topk", 4) - cm.exchange_ms(sc["topk"], 4)
    # at 1 worker nothing is exchanged
    assert cm.step_ms("dense", 1) == pytest.approx(100.0)


def test_a_fused_decode_grows_by_its_measured_share():
    """signSGD's compiled decode of W messages costs a + b W copies: at 4 ranks only the b W part
    is per payload, so 16 ranks cost a + 16 b, not 4x the decode at 4. Every other decode (and
    signSGD's on numpy's path, a run from before the kernels) grows linearly through 0."""
    from sparsetrain.costmodel import FUSED_DECODE_COPIES, growing_share

    a, b = FUSED_DECODE_COPIES["signsgd"]
    assert growing_share("signsgd", 4, "numba 0.68.1") == pytest.approx(4 * b / (a + 4 * b))
    assert growing_share("signsgd", 4, "numpy") == growing_share("signsgd", 4, None) == 1.0
    assert growing_share("qsgd", 4, "numba 0.68.1") == growing_share("topk", 4, "numba 0.68.1") == 1.0
    sent = {"signsgd": ("allgather", 1e6)}
    col = {"allgather": Collective("allgather", 0.0, 0.0, 1e9)}
    for kernels, expect in (("numba 0.68.1", 40.0 * (a + 16 * b) / (a + 4 * b)), ("numpy", 160.0)):
        sc = scheme_costs(sent, {"signsgd": {"decompress": 40.0}}, world_ref=4, kernels=kernels)
        assert CostModel(col, 0.0, sc).step_ms("signsgd", 16) == pytest.approx(expect)


def test_break_even_direction():
    sc = scheme_costs({"dense": ("allreduce", 4e7), "blockk": ("allreduce", 4e5)},
                      {"blockk": {"compress": 5.0, "decompress": 3.0}})
    col = {"allreduce": Collective("allreduce", 1e-5, WIRE_OVERHEAD * 8 / 1e9, 1e9),
           "allgather": Collective("allgather", 1e-5, WIRE_OVERHEAD * 8 / 1e9, 1e9)}
    cm = CostModel(col, compute_ms=100.0, schemes=sc)
    be = cm.break_even([2, 64], [1e9, 100e9])["blockk"]
    assert be[0][0] < 1  # slow network: block-k wins
    assert be[0][0] < be[0][1]  # the faster the network, the smaller its advantage
    assert all(math.isfinite(v) for row in be for v in row)


@pytest.mark.parametrize("world, allreduce, allgather", [(1, 0, 0), (2, 1000, 1000), (4, 1500, 3000)])
def test_wire_bytes_ring(world, allreduce, allgather):
    # per rank: ring AllReduce 2(W-1)/W x buffer, ring AllGather (W-1) x message, nothing at W=1
    from sparsetrain.costmodel import wire_bytes

    assert wire_bytes("allreduce", 1000, world) == allreduce
    assert wire_bytes("allgather", 1000, world) == allgather
    assert wire_bytes(None, 1000, world) == 0
    # the same byte term the model times the exchange with
    assert allreduce_time(1000, world, 0.0, 1.0) == pytest.approx(allreduce)
    assert allgather_time(1000, world, 0.0, 1.0) == pytest.approx(allgather)


def test_the_model_takes_bytes_from_the_built_reducer():
    """make figures' cost-model check uses the bytes each benchmark row's reducer sent (step.json),
    not ratio x numel: block-k AllReduce sends its k values and the whole 1-D tensors."""
    import json
    from pathlib import Path

    from sparsetrain.benchmarks.collectives import COLLECTIVE, step_results

    doc = json.loads((Path(__file__).resolve().parents[1] / "results" / "bench" / "step.json").read_text())
    s = step_results(doc)[0]["schemes"]
    sent = {name: (COLLECTIVE[name], s[name]["bytes_sent_per_step"]) for name in COLLECTIVE}
    sc = scheme_costs(sent)
    assert sc["blockk"].nbytes == 485_020 and sc["topk"].nbytes == 931_600  # as sent, 1-D whole
    assert sc["dense"].nbytes == 4 * 11_173_962 and sc["topk"].collective == "allgather"


def test_a_refit_in_its_own_folder_takes_the_step_benchmark_from_step(tmp_path, capsys):
    """collectives --model-only --out DIR refits DIR/collectives.json; the cost model needs a step
    benchmark to calibrate its latency: --step names one elsewhere, and without one the run says
    that costmodel.json was not written instead of leaving it silently absent."""
    import json
    import shutil
    from pathlib import Path

    from sparsetrain.benchmarks import collectives

    bench = Path(__file__).resolve().parents[1] / "results" / "bench"
    shutil.copy(bench / "collectives.json", tmp_path / "collectives.json")
    assert collectives.main(["--model-only", "--out", str(tmp_path)]) == 0
    assert "costmodel.json and the map not written" in capsys.readouterr().out
    assert not (tmp_path / "costmodel.json").exists()

    assert collectives.main(["--model-only", "--out", str(tmp_path), "--step", str(bench / "step.json")]) == 0
    doc = json.loads((tmp_path / "costmodel.json").read_text())
    assert doc["fit_rate_bits"] > 0 and set(doc["collectives"]) == {"allreduce", "allgather"}
    assert doc["checks"] and all(c["predicted_exchange_ms"] > 0 for c in doc["checks"])

    assert collectives.main(["--model-only", "--out", str(tmp_path), "--step", str(tmp_path / "nope.json")]) == 2
    assert "--step: " in capsys.readouterr().err
