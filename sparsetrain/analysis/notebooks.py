"""Execute the project's notebooks headless against any results folder (tests, CI, scripts).

Each notebook reads ``SPARSETRAIN_RESULTS`` (a results tree, or one sweep) and writes its tables and
figures under ``SPARSETRAIN_OUT/<notebook>``; without them it uses its ``parameters`` cell
(``../results`` and ``../outputs/notebooks/<notebook>``: never the committed ``figures/``, which
`make figures` writes). A study notebook takes its points from the folders
``report.SOURCES`` names, as `make figures` does. Needs the dev extra (nbclient, ipykernel).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from .report import SOURCES

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = ("00_overview", "protocol", *SOURCES)  # protocol: tuning and the declared studies


@contextmanager
def _environ(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_notebook(name: str, results: str | Path, out: str | Path, timeout: int = 600,
                 notebooks_dir: str | Path = NOTEBOOKS_DIR):
    """Execute ``notebooks/<name>.ipynb`` on ``results``, writing into ``out/<name>``.

    Returns the executed notebook (nbformat node, outputs filled in); the file on disk is left as
    committed, without outputs. A cell that raises fails the call with nbclient's
    ``CellExecutionError`` naming the cell.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(notebooks_dir) / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    # The kernel imports the same sparsetrain as this process: an editable install may point at
    # another checkout (a git worktree's tests would otherwise run the main checkout's analysis).
    package_root = str(Path(__file__).resolve().parents[2])
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with _environ(SPARSETRAIN_RESULTS=str(Path(results).resolve()), SPARSETRAIN_OUT=str(Path(out).resolve()),
                  PYTHONPATH=python_path):
        client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    return notebook


def run_all_notebooks(results: str | Path, out: str | Path, timeout: int = 600) -> dict:
    """Every notebook on ``results``; returns {name: executed notebook}."""
    return {name: run_notebook(name, results, out, timeout) for name in NOTEBOOKS}
