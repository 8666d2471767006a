"""A real tiny sweep from the trainer, then the analysis CLI and every notebook on it."""

import subprocess
import sys

from conftest import ROOT, TINY, read_json, run_cli
from test_notebooks import check_notebook_outputs

from sparsetrain.analysis.notebooks import run_all_notebooks


def test_cli_and_notebooks_on_a_real_sweep_with_a_failed_point(tmp_path):
    sweep = tmp_path / "results" / "rq1_scope"
    proc = run_cli(*TINY, "-m", "scheme=none,blockk,topk", "aggregation=allreduce", "world_size=2",
                   "train.max_steps=3", f"hydra.sweep.dir={sweep}")
    assert proc.returncode != 0  # top-k with AllReduce is refused; the others complete
    statuses = sorted(read_json(p)["status"] for p in sweep.glob("*/summary.json"))
    assert statuses == ["completed", "completed", "failed"]

    out = tmp_path / "figures"
    cli = subprocess.run([sys.executable, "-m", "sparsetrain.analysis", str(tmp_path / "results"),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "failed: scheme=topk" in cli.stdout  # the table names the missing point
    assert "block-random-k" in cli.stdout or "blockk" in cli.stdout

    executed = run_all_notebooks(tmp_path / "results", tmp_path / "nb", timeout=300)
    check_notebook_outputs(executed, tmp_path / "nb", failed_point="failed: scheme=topk")
