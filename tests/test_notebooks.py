"""Every notebook runs headless (nbclient) against a results tree written by the contract."""

from __future__ import annotations

import json

import nbformat
import pytest
from test_analysis import (  # the contract's fake run folders
    assert_png,
    make_config,
    write_results,
    write_run,
    write_sweep,
)

from sparsetrain.analysis import SOURCES, STUDIES, TIME_TO_ACCURACY, TIME_TO_ACCURACY_RUNS
from sparsetrain.analysis.__main__ import main as sa_main
from sparsetrain.analysis.notebooks import NOTEBOOKS, NOTEBOOKS_DIR, run_all_notebooks

pytest.importorskip("nbclient")


def test_one_notebook_per_study():
    assert set(NOTEBOOKS) == {"00_overview", "protocol", *STUDIES} == {"00_overview", "protocol", *SOURCES}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_committed_without_outputs_and_parameterised(name):
    notebook = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{name} has outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and params[0].source.startswith('RESULTS = "../results')
    # by default a notebook writes under the untracked outputs/, never into the committed figures/
    assert f'OUT = "../outputs/notebooks/{name}"' in params[0].source
    assert any("SPARSETRAIN_RESULTS" in c.source for c in code)
    assert "import torch" not in "".join(c.source for c in code)


@pytest.mark.slow  # notebooks
def test_notebooks_are_what_the_generator_writes(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS_DIR.parent / "scripts" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "NOTEBOOKS", tmp_path)
    module.main()
    for name in NOTEBOOKS:
        assert (tmp_path / f"{name}.ipynb").read_text() == (NOTEBOOKS_DIR / f"{name}.ipynb").read_text(), (
            f"notebooks/{name}.ipynb is stale: run python scripts/make_notebooks.py"
        )


def check_notebook_outputs(executed: dict, out, failed_point: str | None = None) -> None:
    """What every notebook must leave behind: tables in md/csv/tex, figures as PNG and PDF.

    Reused by the end-to-end test on a real sweep; ``failed_point`` is a ``scheme=...`` text that
    the RQ1 table must name as missing.
    """
    for name, (tables, figures) in STUDIES.items():
        folder = out / name
        for table in tables:
            for ext in ("md", "csv", "tex"):
                assert (folder / f"{table}.{ext}").is_file(), (name, table, ext)
        for figure in figures:
            assert_png(folder / f"{figure}.png")
            assert (folder / f"{figure}.pdf").read_bytes()[:5] == b"%PDF-"
        images = [o for c in executed[name].cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if "image/png" in o.get("data", {})]
        assert len(images) >= len(figures), f"{name} displayed {len(images)} figures"
    assert (out / "00_overview" / "status.md").is_file()
    if failed_point:
        assert failed_point in (out / "rq1_scope" / "rq1_scope.md").read_text()


@pytest.mark.slow  # notebooks
def test_every_notebook_runs_on_a_results_tree(tmp_path):
    results = write_results(tmp_path / "results")
    for i, (lr, val) in enumerate(((0.05, 0.81), (0.1, 0.84))):  # two tuning trials
        config = make_config(optim__lr=lr, data__val_size=100)
        run = write_run(results / "tune" / str(i), config, experiment="tune")
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "val_accuracy": val}))
    # the break-even map's own runs (experiment=tta_frontier), beside the frontier's
    write_sweep(results / "tta_frontier", {"seed": "0,1", "scheme": "none,topk"}, "tta_frontier",
                fixed={"train.epochs": 4, "data.val_size": 100})
    out = tmp_path / "figures"
    executed = run_all_notebooks(results, out, timeout=300)
    # the protocol notebook: the tuning trials and choice, every declared study (pending here)
    trials = (out / "protocol" / "tune" / "trials.md").read_text()
    assert "| topk | layerwise | 0.1 |" in trials and "**chosen**" in trials
    assert_png(out / "protocol" / "tune" / "val_vs_lr.png")
    for study in ("verdicts", "local"):
        assert "pending" in (out / "protocol" / study / "verdicts.md").read_text()
    check_notebook_outputs(executed, out, failed_point="failed: scheme=topk, scope=global")
    md = (out / "rq1_scope" / "rq1_scope.md").read_text()
    assert "absent: scheme=blockk, scope=global" in md
    overview = (out / "00_overview" / "status.md").read_text()
    assert "rq5_speed" in overview and "unfinished: scheme=topk" in overview
    # The overview also tabulates each study it finds.
    assert (out / "00_overview" / "rq3_aggregation" / "rq3_aggregation.md").is_file()
    assert (out / "00_overview" / "findings" / "verdicts.md").is_file()
    # A study's notebook shows what `make figures` (--studies) writes: the same assembled tables.
    cli = tmp_path / "cli"
    assert sa_main(["--studies", str(results), "--out", str(cli), "--quiet"]) == 0
    for name, (tables, _) in STUDIES.items():
        for table in tables:
            assert (out / name / f"{table}.md").read_text() == (cli / name / f"{table}.md").read_text(), (name, table)
    for table in ("verdicts", "findings", "beyond_verdicts", "beyond_findings"):
        assert (out / "00_overview" / "findings" / f"{table}.md").read_text() == (cli / "findings" / f"{table}.md").read_text()
    # the frontier's time to accuracy and break-even map: its notebook and `make figures` alike
    for name, targets in TIME_TO_ACCURACY.items():
        tables = ["break_even", *(f"{table}_{round(100 * t)}" for t in targets
                                  for table in ("time_to_accuracy", "break_even"))]
        for table in tables:
            shown = (out / name / "time_to_accuracy" / f"{table}.md").read_text()
            assert shown == (cli / f"{name}_time_to_accuracy" / f"{table}.md").read_text()
        summary = (out / name / "time_to_accuracy" / "break_even.md").read_text()
        assert "/".join(f"{t:.0%}" for t in targets) in summary  # the three targets side by side
    # ... and from its own runs, where the tree holds them: the notebook and `make figures` alike
    for name, folder in TIME_TO_ACCURACY_RUNS.items():
        for table in ("break_even", *(f"time_to_accuracy_{round(100 * t)}" for t in TIME_TO_ACCURACY[name])):
            shown = (out / name / folder / f"{table}.md").read_text()
            assert shown == (cli / folder / f"{table}.md").read_text()
        assert "Time to 86%" in shown and "| top-k" in shown
