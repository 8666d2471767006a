"""A researcher's own compressor, kept outside the checkout (issue 35, "A researcher's trial"):
a module and a scheme yaml in their own folder, found through ``--config-dir`` or
``hydra.searchpath``; its options are part of what a run is; mistakes point the right way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ROOT, TINY, read_json, run_cli

SCHEME_YAML = """\
defaults:
  - base_scheme
  - _self_
name: rrandk
compressor:
  _target_: mypkg.RRandK
  _partial_: true
"""
MODULE = """\
from sparsetrain.compress import RandomK


class RRandK(RandomK):
    def __init__(self, ratio, layout, scope="layerwise", *, rescale: bool = True, **kw):
        super().__init__(ratio, layout, scope, **kw)
        self.rescale = rescale
"""


@pytest.fixture
def mine(tmp_path) -> Path:
    """``mine/conf/scheme/rrandk.yaml`` and ``mine/mypkg.py`` under ``tmp_path`` (the cwd of the
    commands); also ``mine/mycfg/`` (a package holding the same yaml, for ``pkg://``)."""
    folder = tmp_path / "mine"
    (folder / "conf" / "scheme").mkdir(parents=True)
    (folder / "conf" / "scheme" / "rrandk.yaml").write_text(SCHEME_YAML)
    (folder / "mypkg.py").write_text(MODULE)
    (folder / "mycfg" / "scheme").mkdir(parents=True)
    (folder / "mycfg" / "__init__.py").write_text("")
    (folder / "mycfg" / "scheme" / "rrandk.yaml").write_text(SCHEME_YAML)
    return folder


def _mine_env() -> dict:
    """PYTHONPATH=mine (relative, as a researcher types it), this checkout first."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), "mine"])}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---- 1. the search path ------------------------------------------------------------------------
def test_the_pre_check_reads_the_search_path_hydra_will(mine, monkeypatch):
    from sparsetrain.config import check_overrides, group_options, help_text, search_dirs

    conf = (mine / "conf").resolve()
    monkeypatch.chdir(mine.parent)
    monkeypatch.syspath_prepend(str(mine))
    for args in (["--config-dir", "mine/conf"], ["-cd", str(conf)], [f"--config-dir={conf}"],
                 [f"hydra.searchpath=[file://{conf}]"], ["hydra.searchpath=[pkg://mycfg]"]):
        dirs = search_dirs(args)
        assert [d.name for d in dirs] == ["mycfg" if "pkg://" in args[0] else "conf"], args
        assert "rrandk" in group_options("scheme", dirs) and "topk" in group_options("scheme", dirs)
        check_overrides([*args, "scheme=rrandk"])
        check_overrides([*args, "-m", "scheme=rrandk,topk"])
    assert search_dirs(["scheme=topk"]) == () and "rrandk" not in group_options("scheme")
    assert "rrandk" in help_text(search_dirs(["--config-dir", "mine/conf"]))


@pytest.mark.parametrize("where", ["--config-dir", "hydra.searchpath"])
def test_a_scheme_outside_the_checkout_runs_end_to_end(mine, where):
    tmp = mine.parent
    found = (["--config-dir", "mine/conf"] if where == "--config-dir"
             else [f"hydra.searchpath=[file://{mine / 'conf'}]"])
    proc = run_cli(*found, *TINY, "scheme=rrandk", "world_size=2", "train.max_steps=4", "hydra.run.dir=run",
                   cwd=tmp, env=_mine_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(tmp / "run" / "summary.json")
    assert s["status"] == "completed" and s["steps"] == 4, s
    assert s["config"]["scheme"]["name"] == "rrandk"
    assert s["config"]["scheme"]["compressor"]["_target_"] == "mypkg.RRandK"
