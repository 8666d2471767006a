"""scripts/strip_paths.py: committed run folders carry no absolute paths of the machine that ran
them (issue 39, item 6), and the analysis reads them as before."""

from __future__ import annotations

import importlib.util

import pandas as pd
import yaml
from conftest import ROOT
from test_analysis import write_sweep

from sparsetrain import analysis as sa


def _strip_paths():
    spec = importlib.util.spec_from_file_location("strip_paths", ROOT / "scripts" / "strip_paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _as_hydra_wrote_it(path, cwd: str, output_dir: str | None, sweep_dir: str) -> None:
    data = yaml.safe_load(path.read_text())
    hydra = data["hydra"]
    hydra["mode"] = "MULTIRUN"
    hydra["sweep"] = {"dir": sweep_dir, "subdir": "${hydra.job.num}"}
    hydra.setdefault("overrides", {})["hydra"] = [f"hydra.sweep.dir={sweep_dir}", "hydra.mode=MULTIRUN"]
    runtime = hydra.setdefault("runtime", {})
    runtime.update(cwd=cwd, config_sources=[{"path": "hydra.conf"}, {"path": f"{cwd}/conf"}])
    if output_dir:
        runtime["output_dir"] = output_dir
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_absolute_paths_become_relative_to_the_repository_and_the_runs_still_load(tmp_path):
    repo = tmp_path / "checkout"
    sweep = write_sweep(repo / "results" / "rq1_scope", {"scheme": "topk,randk"}, "rq1_scope")
    ran_in = "/work/wt-elsewhere"  # the worktree the study ran in, on another machine
    _as_hydra_wrote_it(sweep / "0" / ".hydra" / "hydra.yaml", ran_in, f"{ran_in}/results/rq1_scope/0",
                       f"{ran_in}/results/rq1_scope")
    _as_hydra_wrote_it(sweep / "1" / ".hydra" / "hydra.yaml", ran_in, "/tmp/sweep/1", "/tmp/sweep")  # run elsewhere
    _as_hydra_wrote_it(sweep / "multirun.yaml", ran_in, None, "/tmp/sweep")
    before = sa.load_runs(sweep)

    strip = _strip_paths()
    changed = strip.strip_tree(repo / "results", root=repo)
    assert len(changed) == 3
    for job in ("0", "1"):
        hydra = yaml.safe_load((sweep / job / ".hydra" / "hydra.yaml").read_text())["hydra"]
        assert hydra["runtime"]["cwd"] == "."
        assert hydra["runtime"]["output_dir"] == f"results/rq1_scope/{job}"
        assert hydra["runtime"]["config_sources"][1]["path"] == "conf"
        assert hydra["sweep"]["dir"] == "results/rq1_scope"
        assert hydra["overrides"]["hydra"][0] == "hydra.sweep.dir=results/rq1_scope"
    text = "".join(p.read_text() for p in changed)
    assert "/work/" not in text and "/tmp/" not in text
    assert strip.strip_tree(repo / "results", root=repo) == []  # a second pass changes nothing

    after = sa.load_runs(sweep)
    pd.testing.assert_frame_equal(before, after)
    assert list(after["status"]) == ["completed", "completed"]


def test_reproduce_strips_each_study_it_commits():
    text = (ROOT / "scripts" / "reproduce.sh").read_text()
    assert text.count("scripts/strip_paths.py") == 2  # the study it ran, and PARTIAL's copy
