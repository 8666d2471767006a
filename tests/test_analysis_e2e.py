"""A real tiny sweep from the trainer (conftest's real_sweep, run once a session), then the
analysis CLI and every notebook on it."""

import subprocess
import sys

import pytest
from conftest import ROOT
from test_notebooks import check_notebook_outputs

from sparsetrain.analysis.notebooks import run_all_notebooks


def test_cli_on_a_real_sweep_with_a_failed_point(real_sweep, tmp_path):
    out = tmp_path / "figures"
    cli = subprocess.run([sys.executable, "-m", "sparsetrain.analysis", str(real_sweep),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "failed: scheme=topk" in cli.stdout  # the table names the missing point
    assert "block-random-k" in cli.stdout or "blockk" in cli.stdout


@pytest.mark.slow  # every notebook, each in a kernel of its own
def test_notebooks_on_a_real_sweep_with_a_failed_point(real_sweep, tmp_path):
    executed = run_all_notebooks(real_sweep, tmp_path / "nb", timeout=300)
    check_notebook_outputs(executed, tmp_path / "nb", failed_point="failed: scheme=topk")
