"""Old-format run folders (summary.json before its current schema_version) read through
analysis/legacy.py alone: an old summary loads to the same row as its upgraded form, a newer
layout than this code reads is refused in one line, and the loader holds no old-format branch."""

from __future__ import annotations

import ast
import copy
import json
import math
from pathlib import Path

import pytest
from conftest import ROOT

from sparsetrain.analysis import legacy, loader
from sparsetrain.costmodel import wire_bytes
from sparsetrain.results import SCHEMA_VERSION

# The keys a current config has and an old one lacks (each filled by legacy with what the run did).
CURRENT_CONFIG = {
    "scheme": {"name": "qsgd", "levels": 4, "error_feedback": True, "generator": "pcg64",
               "uncompressed": "none", "warmup_steps": 0},
    "scope": {"name": "layerwise"}, "aggregation": {"name": "allgather"}, "ratio": 0.01,
    "world_size": 4, "seed": 0, "model": {"name": "mlp"}, "data": {"name": "fashion_mnist"},
    "train": {"epochs": 2, "batch_size": 64, "bn_recalibrate": 0}, "optim": {"lr": 0.1, "momentum": 0.9},
    "dist": {"overlap": False},
}
STEPS, SENT, DENSE, WORLD = 40, 1000, 32000, 4
LOGGED = [(1, 2.0), (10, 1.0), (20, 0.9), (30, 1.5), (40, 0.5)]  # the peak from step 20 on: 1.5 at 30
# columns that say where a value came from, or which file: not the value
PROVENANCE = ("run_dir", "schema_version", "wire_bytes_source", "loss_peak_source", "config_digest")


def _old_config() -> dict:
    config = copy.deepcopy(CURRENT_CONFIG)
    for key in ("generator", "uncompressed", "warmup_steps"):
        del config["scheme"][key]
    del config["train"]["bn_recalibrate"]
    del config["dist"]["overlap"]
    return config


def _write(run: Path, summary: dict) -> Path:
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    lines = [{"kind": "step", "step": s, "train_loss": loss} for s, loss in LOGGED]
    lines += [{"kind": "epoch", "epoch": e, "step": 20 * e, "test_accuracy": 0.8 + 0.01 * e} for e in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def _common() -> dict:
    return {"status": "completed", "error": None, "world_size": WORLD, "steps": STEPS, "epochs": 2,
            "train_loss": 0.5, "test_accuracy": 0.82, "bytes_sent_per_step": SENT,
            "dense_bytes_per_step": DENSE, "bytes_sent_total": SENT * STEPS, "compression_start_step": 0}


def _old_summary() -> dict:
    """As a run wrote it before schema_version: no applies, kernels, wire bytes, loss peak."""
    return {**_common(), "config": _old_config()}


def _upgraded_summary() -> dict:
    """The same run in the current layout, with what the old one did."""
    per_step = float(wire_bytes("allgather", SENT, WORLD))
    return {**_common(), "schema_version": SCHEMA_VERSION, "config": copy.deepcopy(CURRENT_CONFIG),
            "applies": {"aggregation": True, "ratio": False}, "kernels": "numpy",
            "wire_bytes_per_step": per_step, "wire_bytes_total": per_step * STEPS,
            "train_loss_peak": {"after_step_20": {"train_loss": 1.5, "step": 30}}}


def test_an_old_summary_loads_to_the_row_of_its_upgraded_form(tmp_path):
    _write(tmp_path / "runs" / "old", _old_summary())
    _write(tmp_path / "runs" / "new", _upgraded_summary())
    runs = loader.load_runs(tmp_path / "runs").set_index("run_dir", drop=False)
    old = runs.loc[str((tmp_path / "runs" / "old").resolve())]
    new = runs.loc[str((tmp_path / "runs" / "new").resolve())]
    assert (old["schema_version"], new["schema_version"]) == (0, SCHEMA_VERSION)
    # the keys the old config lacks read as the current config's values: no column tells them apart
    assert not [c for c in runs.columns if "." in str(c)]
    differ = {c: (old[c], new[c]) for c in runs.columns if c not in PROVENANCE
              and not (old[c] == new[c] or (isinstance(old[c], float) and math.isnan(old[c]) and math.isnan(new[c])))}
    assert differ == {}
    assert (old["generator"], old["uncompressed"], old["warmup_steps"], old["kernels"]) == ("pcg64", "none", 0, "numpy")
    assert (old["aggregation"], old["ratio"]) == ("allgather", 1.0)  # QSGD sends every entry
    assert (old["wire_bytes_source"], new["wire_bytes_source"]) == ("computed", "summary")
    assert (old["loss_peak"], old["loss_peak_step"], old["loss_peak_source"]) == (1.5, 30.0, "logged steps")


def test_the_loader_reads_old_summaries_through_legacy_alone(tmp_path, monkeypatch):
    # with every summary taken as current, the old one's gaps stay gaps: no default of the loader's own
    monkeypatch.setattr(legacy, "is_old", lambda version: False)
    row = loader.row_from_summary(_old_summary(), None)
    assert (row["generator"], row["kernels"], row["warmup_steps"], row["bn_recalibrate"]) == (None, None, None, None)
    assert row["wire_bytes_source"] == "unknown"


def test_powersgd_recorded_without_compressor_is_torchs_hook():
    old = {**_common(), "config": {**_old_config(), "scheme": {"name": "powersgd"}}}
    assert loader.row_from_summary(old, None)["scheme"] == "torch_powersgd"
    assert legacy.upgrade_config(old["config"], SCHEMA_VERSION) is old["config"]  # current: as recorded


def test_a_newer_schema_version_is_refused_in_one_line(tmp_path):
    run = _write(tmp_path / "runs" / "future", {**_upgraded_summary(), "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(ValueError) as refused:
        loader.load_runs(tmp_path / "runs")
    message = str(refused.value)
    assert "\n" not in message and str(run.resolve()) in message
    assert f"schema_version {SCHEMA_VERSION + 1}" in message and f"up to {SCHEMA_VERSION}" in message


def test_the_loader_holds_no_old_format_branch():
    source = (ROOT / "sparsetrain" / "analysis" / "loader.py").read_text()
    tree = ast.parse(source)
    texts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    # the layout's version is read, and old values are written, in legacy.py only
    assert not {"schema_version", "numpy", "pcg64", "none", "logged steps", "computed"} & texts
    assert not {"recorded_scheme", "OLD_GENERATOR", "BEFORE_THE_KEY", "wire_bytes"} & names
