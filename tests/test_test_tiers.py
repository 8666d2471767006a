"""The test tiers' own machinery (tests/conftest.py): CI's time budget."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["in-process", "xdist"])
def test_tests_past_cis_time_budget_are_skipped_and_named(workers):
    """With SPARSETRAIN_TEST_DEADLINE passed, no test starts: each is skipped, saying why, and
    the summary names every one (.ci/run sets it for the full tier, so CI reports instead of
    being cut off at its limit); the run itself does not fail. The same with the Makefile's
    pytest-xdist workers, whose skips reach the summary only as reports."""
    target = "tests/test_costmodel.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, target],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "SPARSETRAIN_TEST_DEADLINE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("time budget: "))
    count = int(lines[header].split()[2])
    named = lines[header + 1 : header + 1 + count]
    assert count > 0 and all(line.startswith(f"  {target}::") for line in named), proc.stdout[-3000:]
    assert f"{count} skipped" in proc.stdout and "passed" not in proc.stdout
    assert "SPARSETRAIN_TEST_DEADLINE=$deadline make test-rest" in (ROOT / ".ci" / "run").read_text()
