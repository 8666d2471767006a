"""The stabilisers of the sparse schemes, end to end from the command line: whole 1-D tensors,
compression warm-up, a divergence that stops every rank, batch-norm recalibration."""

import math

import pytest
from conftest import TINY, read_json, read_jsonl, refusal, run_cli

from sparsetrain.results import untrained_reason


def test_divergence_stops_every_rank_with_the_step_and_keeps_the_checkpoint(tmp_path):
    """lr jumps to 1e29 at the milestone (after epoch 1 of 2): the loss turns non-finite, both
    ranks stop at the same check, the summary says where, the epoch-1 checkpoint stays."""
    run = tmp_path / "run"
    proc = run_cli(*TINY, "scheme=randk", "world_size=2", "train.epochs=2", "optim.milestones=[0.5]",
                   "optim.gamma=1e30", "optim.warmup_epochs=0", "train.log_every=2",
                   "dist.timeout_s=600", f"hydra.run.dir={run}", timeout=240)
    assert proc.returncode != 0
    s = read_json(run / "summary.json")
    assert s["status"] == "failed"
    assert "diverged at step" in s["error"] and ("loss=nan" in s["error"] or "loss=inf" in s["error"])
    step = int(s["error"].split("diverged at step ")[1].split()[0])
    assert 8 < step <= s["steps"] <= step + 2  # after the milestone; caught at the next check
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "diverged at step" in lines[0], proc.stderr[-2000:]
    assert (run / "checkpoint.pt").exists()  # the last good state, for a rerun with a lower lr
    epochs = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1]  # the diverged state was never evaluated


@pytest.mark.slow  # a run; warm-up through the command line: test_ddp_trainer.py's block-k hook run
def test_warmup_then_compression_and_whole_vectors_in_the_summary(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*TINY, "scheme=blockk", "world_size=2", "train.max_steps=6", "train.log_every=1",
                   "scheme.warmup_steps=3", "train.bn_recalibrate=2", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["compression_start_step"] == 3
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["compressing"] for r in steps] == [False] * 3 + [True] * 3
    assert all(r["bytes_sent"] == s["dense_bytes_per_step"] for r in steps[:3])
    assert all(r["bytes_sent"] == s["bytes_sent_per_step"] for r in steps[3:])
    assert [r["memory_norm"] == 0.0 for r in steps] == [True] * 3 + [False] * 3
    # ResNet-20: the 1-D tensors (batch-norm weights and biases, the classifier's bias) go whole.
    assert s["config"]["scheme"]["uncompressed"] == "1d"
    assert 0 < s["uncompressed_bytes_per_step"] < s["bytes_sent_per_step"]
    assert s["uncompressed_share"] == pytest.approx(s["uncompressed_bytes_per_step"] / s["bytes_sent_per_step"])
    assert s["num_classes"] == 10 and 0.01 < s["density"] < 0.05
    assert math.isfinite(s["test_accuracy"])
    assert s["bytes_sent_total"] == 3 * s["dense_bytes_per_step"] + 3 * s["bytes_sent_per_step"]
    # wire bytes (ring, per rank): at 2 ranks AllGather moves (2-1) x the message and the warm-up's
    # dense AllReduce 2(2-1)/2 x the buffer, so both equal the payload here
    assert s["wire_bytes_per_step"] == s["bytes_sent_per_step"]
    assert s["wire_bytes_total"] == s["bytes_sent_total"]
    assert [r["wire_bytes"] for r in steps] == [r["bytes_sent"] for r in steps]
    # recalibration scores the model both ways, so every run measures what it changes
    last = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "epoch"][-1]
    assert 0 <= last["test_accuracy_running_bn"] <= 1
    assert s["test_accuracy_running_bn"] == last["test_accuracy_running_bn"]


@pytest.mark.slow
def test_uncompressed_none_restores_every_tensor_compressed(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(*TINY, "scheme=randk", "world_size=1", "train.max_steps=2", "aggregation=allreduce",
                   "scheme.uncompressed=none", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["uncompressed_bytes_per_step"] == 0
    # k_i = max(1, round(0.01 * n_i)) of every tensor, values only (shared positions)
    assert s["bytes_sent_per_step"] == 4 * round(s["density"] * s["num_parameters"])


BAD_STABILISERS = [
    ("scheme.uncompressed=2d", "scheme.uncompressed='2d' is not allowed; allowed: none, 1d, or a positive integer N"),
    ("scheme.uncompressed=0", "scheme.uncompressed='0' is not allowed"),
    ("scheme.warmup_steps=-1", "scheme.warmup_steps=-1 is not allowed; it must be >= 0"),
    ("train.bn_recalibrate=-2", "train.bn_recalibrate=-2 is not allowed; it must be >= 0"),
]


@pytest.mark.parametrize("override, needle", BAD_STABILISERS)
def test_bad_stabiliser_settings_are_refused_with_one_line(override, needle):
    assert needle in refusal(*TINY, "scheme=randk", override)


@pytest.mark.slow  # the same checks through the command line (test_cli.py has one in the fast tier)
@pytest.mark.parametrize("override, needle", BAD_STABILISERS)
def test_bad_stabiliser_settings_are_one_line(override, needle, tmp_path):
    proc = run_cli(*TINY, "scheme=randk", override, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize(
    "summary, verdict",
    [
        ({"status": "completed", "train_loss": 0.4, "num_classes": 10}, None),
        ({"status": "completed", "train_loss": 2.4, "num_classes": 10}, "2.4 >= ln(10) = 2.30"),
        ({"status": "completed", "train_loss": 2.4, "num_classes": 100}, None),
        ({"status": "completed", "train_loss": None}, "not finite"),
        ({"status": "failed", "train_loss": 9.0}, None),  # failed runs are reported as failed
    ],
)
def test_untrained_reason(summary, verdict):
    reason = untrained_reason(summary)
    assert reason is None if verdict is None else verdict in reason
