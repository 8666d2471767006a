"""scripts/reproduce.sh across sessions: with RESUME=1 and DEST, a fresh worktree gets back the
jobs that completed in DEST, so the sweep skips them instead of running them again; and
results/timings.txt records only sweeps that ran something."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Stands in for the venv's python: the sweep call records what the study folder holds when the
# sweep starts; strip_paths.py does nothing.
FAKE_PY = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = sparsetrain.run ]; then
  for arg in "$@"; do case $arg in hydra.sweep.dir=*) dir=${arg#hydra.sweep.dir=};; esac; done
  mkdir -p "$dir"
  shopt -s nullglob; (cd "$dir" && for j in */; do echo "${j%/}:$(cat "$j/marker" 2>/dev/null)"; done) > "$SEEN"
  [ -z "${FINISH:-}" ] || echo '{"status": "completed"}' > "$dir/$FINISH/summary.json"
fi
"""


def _job(folder: Path, status: str, marker: str) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"status": status}, indent=1))
    (folder / "marker").write_text(marker)


def _run(tmp_path: Path, resume: bool, finish: str = "") -> list[str]:
    work, dest = tmp_path / "wt", tmp_path / "dest"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "reproduce.sh", work / "scripts")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    _job(dest / "results" / "tune" / "a", "completed", "dest")      # done last session
    _job(dest / "results" / "tune" / "b", "running", "dest")        # a PARTIAL copy never holds it
    _job(dest / "results" / "tune" / "c", "completed", "dest")
    _job(work / "results" / "tune" / "c", "completed", "worktree")  # done here: kept as it is
    _job(work / "results" / "tune" / "d", "running", "worktree")    # interrupted here: resumes
    seen = tmp_path / "seen"
    env = {**os.environ, "PY": str(fake), "DEST": str(dest), "COMMIT": "0", "SEEN": str(seen),
           "RESUME": "1" if resume else "0", "FINISH": finish}
    subprocess.run(["bash", "scripts/reproduce.sh", "tune"], cwd=work, env=env, check=True,
                   capture_output=True, text=True)
    return seen.read_text().split()


def test_resume_brings_back_the_jobs_completed_in_dest(tmp_path):
    assert _run(tmp_path, resume=True) == ["a:dest", "c:worktree", "d:worktree"]


def test_a_fresh_start_copies_nothing(tmp_path):
    assert _run(tmp_path, resume=False) == []


def _timings(tmp_path: Path) -> list[str]:
    return [p.read_text() if p.exists() else "" for p in (tmp_path / "wt" / "results" / "timings.txt",
                                                          tmp_path / "dest" / "results" / "timings.txt")]


def test_a_resume_that_completes_a_job_records_its_time(tmp_path):
    _run(tmp_path, resume=True, finish="d")
    here, dest = _timings(tmp_path)
    assert here == dest and here.startswith("tune exit=0 seconds=") and " jobs=1 " in here


def test_a_resume_with_nothing_left_records_no_time(tmp_path):
    # every job completed before: a line here would count a few seconds of skipping as a study's cost
    _run(tmp_path, resume=True)
    assert _timings(tmp_path) == ["", ""]
