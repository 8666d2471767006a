"""Training through torch DDP (``dist.ddp=true``) from the command line: the same run files, bytes
and phases as the trainer's own exchange, and the same model where the two must agree.
(Bit-identical resume through this path: tests/test_launch.py.)"""

import math
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import SYNC_SCHEMES, TINY, on_gloo_ranks, read_json, read_jsonl, refusal, run_cli
from omegaconf import OmegaConf

from sparsetrain.config import CONF_DIR
from sparsetrain.results import TORCH_HOOK_SCHEMES

# every scheme that DDP runs through sparsetrain's sparse hook (not torch's own hooks, dense SGD,
# or the schemes that synchronise every `period` steps: tests/test_periodic.py) and whose
# exchange has no matrix products: PowerSGD's DDP path equals the trainer's within rounding, not
# to the bit (tests/test_powersgd.py says why and checks it)
SPARSE_HOOK_SCHEMES = sorted(p.stem for p in (CONF_DIR / "scheme").glob("*.yaml")
                             if p.stem not in (*TORCH_HOOK_SCHEMES, *SYNC_SCHEMES, "none", "powersgd"))

SHORT = (*TINY, "world_size=2", "train.max_steps=6", "train.log_every=1", "train.save_model=true")


def _run(tmp_path, name, *overrides):
    run = tmp_path / name
    proc = run_cli(*SHORT, *overrides, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, read_json(run / "summary.json")


@pytest.mark.slow  # a DDP run's files stay in the fast tier through the torch hooks' runs
def test_ddp_blockk_hook_run_files_bytes_and_phases(tmp_path):
    run, s = _run(tmp_path, "ddp", "scheme=blockk", "aggregation=allreduce", "dist.ddp=true",
                  "dist.bucket_cap_mb=0.05", "scheme.warmup_steps=2")
    assert s["status"] == "completed" and s["steps"] == 6
    assert s["bytes_sent_per_step"] < 0.05 * s["dense_bytes_per_step"]
    assert 0 < s["density"] < 0.05 and s["uncompressed_bytes_per_step"] > 0
    assert s["compression_start_step"] == 2 and s["memory_norm_max"] > 0
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["compressing"] for r in steps] == [False, False, True, True, True, True]
    # warm-up steps send the dense buffer; then what the summary says, per bucket summed
    assert [r["bytes_sent"] for r in steps[:2]] == [s["dense_bytes_per_step"]] * 2
    assert {r["bytes_sent"] for r in steps[2:]} == {s["bytes_sent_per_step"]}
    assert all(r["memory_norm"] is not None for r in steps[2:])
    assert s["bytes_sent_total"] == 2 * s["dense_bytes_per_step"] + 4 * s["bytes_sent_per_step"]
    # the hook's work is moved out of backward into its own phases; the phases add up to the step
    t = s["time_ms"]
    assert t["compress"] > 0 and t["exchange"] >= 0 and t["backward"] > 0
    parts = sum(v for k, v in t.items() if k != "step")
    assert math.isclose(parts, t["step"], rel_tol=0.05), t
    _assert_buckets(s["overlap_buckets"])


def _assert_buckets(buckets):
    """A run's overlapped buckets (timing.BucketClock): several at a 0.05 MB cap, their shares
    adding to 1, started in order, the last at backward's end (lead 0)."""
    assert len(buckets) > 2, buckets
    assert math.isclose(sum(b["share"] for b in buckets), 1.0, rel_tol=1e-12)
    leads = [b["lead_ms"] for b in buckets]
    assert leads == sorted(leads, reverse=True) and leads[-1] == 0.0 and leads[0] > 0, leads


@pytest.mark.slow  # two runs
def test_ddp_hook_at_ratio_one_trains_the_dense_model(tmp_path):
    """random-k at ratio 1 with AllReduce sends every entry: through DDP's hook the model after
    6 steps is the dense run's (the trainer's own exchange), up to rounding."""
    dense, s_dense = _run(tmp_path, "dense", "scheme=none", "dist.overlap_bucket_mb=0.05",
                          "dist.overlap_first_bucket_mb=0.05")
    _assert_buckets(s_dense["overlap_buckets"])  # the trainer's dense exchange overlaps backward too
    ddp, s = _run(tmp_path, "ddp", "scheme=randk", "ratio=1", "aggregation=allreduce", "dist.ddp=true",
                  "dist.bucket_cap_mb=0.05")
    assert s["density"] == 1.0
    a = torch.load(dense / "model.pt", weights_only=True)
    b = torch.load(ddp / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst < 1e-5, worst


BIT_FOR_BIT = [(s, "allgather") for s in SPARSE_HOOK_SCHEMES] + [("randk", "allreduce")]


def _both_paths(out: str, rank: int, world: int) -> dict:
    """Every case of BIT_FOR_BIT trained for 6 steps through the trainer's exchange and through
    DDP's hook, in this rank's process: each run's summary and, on rank 0, its model."""
    from sparsetrain.config import compose, validate
    from sparsetrain.rank import RankInfo
    from sparsetrain.train import Trainer

    info = RankInfo(rank, world, rank, world, "spawn")
    runs = {}
    for scheme, aggregation in BIT_FOR_BIT:
        for path, extra in (("trainer", ()), ("ddp", ("dist.ddp=true",))):
            cfg = compose([*SHORT, f"scheme={scheme}", f"aggregation={aggregation}", "scope=layerwise",
                           "train.epochs=4", "train.max_steps=6", "dist.bucket_cap_mb=0.05", *extra])
            validate(cfg, env={})
            run = Path(out) / f"{scheme}-{aggregation}-{path}"
            summary = Trainer(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), info, run,
                              torch.device("cpu")).fit()
            model = torch.load(run / "model.pt", weights_only=True) if rank == 0 else None
            runs[scheme, aggregation, path] = (summary, model)
    return runs


def test_ddp_hook_trains_bit_for_bit_as_the_trainer_for_every_compressor(tmp_path):
    """The matrix below in one pair of gloo ranks, without the command line (its 30-step runs
    through the command line are in the full tier): for every sparse scheme the same weights,
    train loss and bytes through DDP's hook as through the trainer's exchange."""
    assert {"topk", "randk", "blockk", "signsgd", "qsgd"} <= set(SPARSE_HOOK_SCHEMES)
    runs = on_gloo_ranks(partial(_both_paths, str(tmp_path)), tmp_path)[0]
    for scheme, aggregation in BIT_FOR_BIT:
        (s_flat, a), (s_ddp, b) = runs[scheme, aggregation, "trainer"], runs[scheme, aggregation, "ddp"]
        case = f"{scheme} {aggregation}"
        assert s_flat["steps"] == s_ddp["steps"] == 6, case
        assert s_flat["overlap_buckets"] is None and len(s_ddp["overlap_buckets"]) > 2, case
        assert s_flat["train_loss"] == s_ddp["train_loss"], case
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), (case, [k for k in a if not torch.equal(a[k], b[k])])
        for key in ("density", "uncompressed_bytes_per_step", "dense_bytes_per_step"):
            assert s_flat[key] == s_ddp[key], (case, key)
        if aggregation == "allreduce":
            assert s_flat["bytes_sent_per_step"] == s_ddp["bytes_sent_per_step"], case


@pytest.mark.slow  # every scheme through the command line, 30 steps; the fast tier has the test above
@pytest.mark.parametrize("scheme, aggregation", BIT_FOR_BIT)
def test_ddp_hook_trains_bit_for_bit_as_the_trainer(scheme, aggregation, tmp_path):
    """Layer-wise, the hook runs the trainer's exchange on each bucket and every tensor draws what
    the trainer draws for it: 2 ranks, 30 steps, several buckets, the same weights and train loss
    to the last bit, for every scheme (random-k, block-k and QSGD drew per bucket before)."""
    assert {"topk", "randk", "blockk", "signsgd", "qsgd"} <= set(SPARSE_HOOK_SCHEMES)
    common = (f"scheme={scheme}", f"aggregation={aggregation}", "scope=layerwise", "train.epochs=4", "train.max_steps=30",
              "dist.bucket_cap_mb=0.05")
    flat, s_flat = _run(tmp_path, "trainer", *common)
    ddp, s_ddp = _run(tmp_path, "ddp", *common, "dist.ddp=true")
    assert s_flat["steps"] == s_ddp["steps"] == 30
    assert s_flat["overlap_buckets"] is None and len(s_ddp["overlap_buckets"]) > 2  # after backward; inside it
    assert s_flat["train_loss"] == s_ddp["train_loss"]
    a = torch.load(flat / "model.pt", weights_only=True)
    b = torch.load(ddp / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    # the bytes from the same count: the same entries sent, whole tensors and share; AllReduce's
    # values to the byte (AllGather's messages are one per bucket, each aligned)
    for key in ("density", "uncompressed_bytes_per_step", "dense_bytes_per_step"):
        assert s_flat[key] == s_ddp[key], key
    if aggregation == "allreduce":
        assert s_flat["bytes_sent_per_step"] == s_ddp["bytes_sent_per_step"]


@pytest.mark.slow  # two runs
def test_dense_sgd_sends_everything_whole_on_both_paths(tmp_path):
    """Dense SGD's share of uncompressed bytes is 1 through the trainer and through DDP alike."""
    for name, extra in (("trainer", ()), ("ddp", ("dist.ddp=true",))):
        _, s = _run(tmp_path, name, "scheme=none", "train.max_steps=2", *extra)
        assert s["uncompressed_bytes_per_step"] == s["bytes_sent_per_step"] == s["dense_bytes_per_step"], name
        assert s["uncompressed_share"] == 1.0, name


@pytest.mark.parametrize("scheme, bytes_per_entry", [("torch_powersgd", None), pytest.param("fp16", 2, marks=pytest.mark.slow),
                                                      pytest.param("bf16", 2, marks=pytest.mark.slow)])
def test_ddp_torch_hooks_train_and_report_their_bytes(scheme, bytes_per_entry, tmp_path):
    run, s = _run(tmp_path, scheme, f"scheme={scheme}", "dist.ddp=true")
    assert s["status"] == "completed" and s["train_loss"] is not None
    numel = s["dense_bytes_per_step"] // 4
    if bytes_per_entry is not None:
        assert s["bytes_sent_per_step"] == bytes_per_entry * numel
    else:  # the rank matched to 1% layer-wise: far fewer bytes than dense, from step 2 on
        assert s["bytes_sent_per_step"] < 0.1 * s["dense_bytes_per_step"]
        assert s["compression_start_step"] == 2
        steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
        assert [r["bytes_sent"] == s["bytes_sent_per_step"] for r in steps] == [False] * 2 + [True] * 4


def test_ddp_keys_define_a_run_and_default_for_older_checkpoints():
    """Resume and rerun checks: dist.ddp and dist.bucket_cap_mb define a run (other dist.* keys do
    not); a checkpoint or summary written before these keys existed ran with their defaults."""
    from sparsetrain.train.checkpoint import config_differences

    old = {"scheme": {"name": "blockk"}, "dist": {"backend": "auto"}}
    new = {"scheme": {"name": "blockk", "rank": None},
           "dist": {"backend": "gloo", "ddp": False, "bucket_cap_mb": 25.0}}
    assert config_differences(old, new) == []
    changed = {**new, "dist": {"ddp": True, "bucket_cap_mb": 1.0}}
    assert [key for key, *_ in config_differences(old, changed)] == ["dist.bucket_cap_mb", "dist.ddp"]


def test_a_memory_or_error_feedback_that_no_step_runs_is_refused():
    """Audit 4: torch's hooks (and dense SGD) accepted a ``scheme.memory`` that never runs, and
    fp16 / bf16 ``scheme.error_feedback=true``, which they cannot do; the summary recorded both."""
    ef = "scheme.memory={_target_: sparsetrain.compress.ErrorFeedback, _partial_: true}"
    for scheme in ("fp16", "bf16", "torch_powersgd"):
        line = refusal(f"scheme={scheme}", "dist.ddp=true", ef)
        assert line.startswith("scheme.memory=sparsetrain.compress.ErrorFeedback is not allowed with "
                               f"scheme={scheme}: torch's hook keeps its own state"), line
    assert "it has no compressor" in refusal("scheme=none", ef)
    line = refusal("scheme=bf16", "dist.ddp=true", "scheme.error_feedback=true")
    assert line == ("scheme.error_feedback=true is not allowed with scheme=bf16: torch's bf16 hook casts "
                    "every entry and keeps no memory; use scheme.error_feedback=false")
