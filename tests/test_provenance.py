"""Which code a run ran (issue 22, item 5): the commit and a dirty flag in summary.json, every
commit of a resumed run, and a resume on other code refused in one line unless asked for."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import read_json, run_cli
from test_failure_paths import RESUME, _error_lines, _interrupted_run

from sparsetrain.errors import ConfigError
from sparsetrain.provenance import code_version, describe, host, same_code
from sparsetrain.train.checkpoint import check_same_code


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git checkout shaped like sparsetrain's: code under sparsetrain/ and conf/."""
    (tmp_path / "sparsetrain").mkdir()
    (tmp_path / "sparsetrain" / "core.py").write_text("x = 1\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("a: 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return tmp_path


def test_a_clean_checkout_names_its_commit(repo):
    code = code_version(repo / "sparsetrain")
    assert code == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False, "diff": None}
    assert describe(code) == code["commit"][:12] and describe(code, full=True) == code["commit"]


def test_results_written_into_the_checkout_do_not_make_it_dirty(repo):
    (repo / "results" / "study" / "0").mkdir(parents=True)
    (repo / "results" / "study" / "0" / "summary.json").write_text("{}")
    assert code_version(repo)["dirty"] is False


def test_edits_and_new_files_make_it_dirty_and_are_told_apart(repo):
    (repo / "sparsetrain" / "core.py").write_text("x = 2\n")
    first = code_version(repo)
    assert first["dirty"] is True and len(first["diff"]) == 12
    assert describe(first).endswith(f"+dirty({first['diff']})")
    (repo / "conf" / "new.yaml").write_text("b: 2\n")  # untracked code counts, by its content
    second = code_version(repo)
    assert second["dirty"] and second["diff"] != first["diff"]
    assert not same_code(first, second)
    (repo / "conf" / "new.yaml").write_text("b: 3\n")
    assert code_version(repo)["diff"] != second["diff"]


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    code = code_version(tmp_path)
    assert code == {"commit": "unknown", "dirty": None, "diff": None}
    assert describe(code) == "unknown" and same_code(code, {"commit": "a" * 40, "dirty": False})


def test_check_same_code_names_both_versions():
    a = {"commit": "a" * 40, "dirty": False, "diff": None}
    b = {"commit": "b" * 40, "dirty": False, "diff": None}
    check_same_code(a, dict(a), allow=False, path="run/checkpoint.pt")
    check_same_code(None, b, allow=False, path="run/checkpoint.pt")  # written before records
    check_same_code(a, b, allow=True, path="run/checkpoint.pt")
    with pytest.raises(ConfigError) as err:
        check_same_code(a, b, allow=False, path="run/checkpoint.pt")
    msg = str(err.value)
    assert "a" * 12 in msg and "b" * 12 in msg and "train.allow_code_change=true" in msg
    assert "\n" not in msg


@pytest.mark.slow  # two runs
def test_summary_records_the_code_and_resume_on_other_code_is_refused(tmp_path):
    run = tmp_path / "run"
    before = _interrupted_run(run, *RESUME, "scheme=blockk")
    here = code_version()
    assert before["code"] == here and before["code_commits"] == [describe(here, full=True)]
    # tiny runs 1 thread a rank (conf/debug/tiny.yaml); one rank: no process group, no backend
    machine = {**host(), "torch": str(torch.__version__), "gpu": None, "threads": 1, "backend": None}
    assert before["hosts"] == [machine] and machine["cpu"] and machine["cpus"] >= 1

    # The checkpoint as another commit would have written it.
    path = run / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    other = {"commit": "0123456789ab" + "0" * 28, "dirty": False, "diff": None}
    state["code"], state["code_commits"] = other, [other["commit"]]
    elsewhere = {"cpu": "Another CPU", "cpus": 64, "system": "Linux 6.1", "torch": "2.4.0", "gpu": None}
    state["hosts"] = [elsewhere]  # ... on another machine
    torch.save(state, path)
    files = {p: p.read_bytes() for p in (path, run / "metrics.jsonl", run / "summary.json")}

    refused = run_cli(*RESUME, "scheme=blockk", f"hydra.run.dir={run}", timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = _error_lines(refused.stderr)
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "0123456789ab" in lines[0] and describe(here) in lines[0]
    assert "train.allow_code_change=true" in lines[0]
    assert {p: p.read_bytes() for p in files} == files  # nothing written is lost or changed

    resumed = run_cli(*RESUME, "scheme=blockk", "train.allow_code_change=true",
                      f"hydra.run.dir={run}", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    s = read_json(run / "summary.json")
    assert s["status"] == "completed" and s["resumed_from_step"] == before["steps"]
    assert s["code_commits"] == [other["commit"], describe(here, full=True)]
    assert s["hosts"] == [elsewhere, machine]  # every machine it ran on
    from sparsetrain.analysis import load_runs

    (row,) = load_runs(run).to_dict("records")
    assert row["host"] == f"Another CPU x64;{machine['cpu']} x{machine['cpus']}"
    assert (row["threads"], row["backend"]) == ("1", None)  # the one entry that recorded them
