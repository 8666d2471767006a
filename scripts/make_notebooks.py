"""Write notebooks/*.ipynb: thin callers of sparsetrain.analysis, one per research question.

    python scripts/make_notebooks.py        # then commit notebooks/ (they carry no outputs)

The notebooks are generated so that they stay thin and alike; edit this script, not the .ipynb.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

SETUP = '''import os
from pathlib import Path

from IPython.display import Image, Markdown, display

from sparsetrain import analysis as sa

# SPARSETRAIN_RESULTS / SPARSETRAIN_OUT point the notebook elsewhere without editing it (tests do).
RESULTS = sa.resolve_results(os.environ.get("SPARSETRAIN_RESULTS", RESULTS), {study!r})
OUT = Path(os.environ["SPARSETRAIN_OUT"]) / {name!r} if "SPARSETRAIN_OUT" in os.environ else Path(OUT)
runs = sa.load_runs(RESULTS)
curves = sa.load_curves(RESULTS)
print(f"{{len(runs)}} runs under {{RESULTS}}:", runs["status"].value_counts().to_dict())'''

RUNS_VIEW = '''columns = ["scheme", "scope", "aggregation", "ratio", "world_size", "seed", "status",
           "test_accuracy", "time_step_ms", "bytes_sent_per_step"]
runs[columns]'''

STUDIES = {
    "rq1_scope": (
        "RQ1: layer-wise vs global scope",
        "Does sparsifying each tensor with its own k (layer-wise) beat one k over the flattened model "
        "(global)? The paper: layer-wise wins for every scheme, since every layer takes part in each "
        "update; random-k suffers most globally.",
        "rq1_scope_table",
        [("accuracy_vs_epoch", "sa.plot_accuracy_vs_epoch(curves)"),
         ("accuracy_vs_bytes", "sa.plot_accuracy_vs_bytes(runs)")],
    ),
    "rq2_scheme": (
        "RQ2: top-k vs random-k vs block-random-k",
        "Accuracy against communication. The paper: top-k > block-random-k > random-k in accuracy.",
        "rq2_scheme_table",
        [("accuracy_vs_epoch", "sa.plot_accuracy_vs_epoch(curves)"),
         ("accuracy_vs_bytes", "sa.plot_accuracy_vs_bytes(runs)")],
    ),
    "rq3_aggregation": (
        "RQ3: AllReduce vs AllGather",
        "Shared random indices (AllReduce) vs each worker's own (AllGather). The paper: no visible "
        "difference for random-k; block-random-k with AllReduce loses accuracy as workers increase.",
        "rq3_aggregation_table",
        [("accuracy_vs_epoch", "sa.plot_accuracy_vs_epoch(curves)"),
         ("workers", "sa.plot_workers(runs)")],
    ),
    "rq4_workers": (
        "RQ4: number of workers",
        "Test accuracy and time per step as workers grow. The paper: a generalization gap appears "
        "with more workers in all settings, worse with global scope.",
        "rq4_workers_table",
        [("workers", "sa.plot_workers(runs)"),
         ("accuracy_vs_epoch", "sa.plot_accuracy_vs_epoch(curves)")],
    ),
    "rq5_speed": (
        "RQ5: time per step and speed-up over dense SGD",
        "Where does a step's time go, and is block-random-k faster than dense SGD? The paper: "
        "273 ms vs 375 ms per batch on 8 GPUs.",
        "rq5_speed_table",
        [("time_per_phase", "sa.plot_time_per_phase(runs)"),
         ("accuracy_vs_bytes", "sa.plot_accuracy_vs_bytes(runs)")],
    ),
}


def parameters_cell(results: str, out: str):
    cell = new_code_cell(f'RESULTS = "{results}"\nOUT = "{out}"')
    cell.metadata["tags"] = ["parameters"]
    return cell


def study_notebook(name: str, title: str, question: str, table: str, figures) -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            f"# {title}\n\n{question}\n\n"
            f"Runs come from `python -m sparsetrain.run -m experiment={name}`; the same tables and "
            f"figures come from `python -m sparsetrain.analysis results/{name} --out figures/{name}`. "
            "Failed or unfinished runs are left out of the numbers and listed under the table."
        ),
        parameters_cell(f"../results/{name}", f"../figures/{name}"),
        new_code_cell(SETUP.format(study=name, name=name)),
        new_code_cell(RUNS_VIEW),
        new_markdown_cell("## Table\n\nMean ± std over seeds, with the number of seeds n."),
        new_code_cell(f"table = sa.{table}(runs)\nsa.write_table(table, OUT)\ndisplay(Markdown(table.to_markdown()))"),
        new_markdown_cell("## Figures"),
    ]
    for figure, call in figures:
        # Shown from the saved PNG: what the notebook displays is what it wrote.
        cells.append(new_code_cell(
            f'fig = {call}\npaths = sa.save_figure(fig, OUT, "{figure}")\ndisplay(Image(filename=paths["png"]))'
        ))
    return new_notebook(cells=cells, metadata=METADATA)


def overview_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Overview: every study in the results folder\n\n"
            "Which runs exist, which completed, and the table of each research question found. "
            "One notebook per question (`rq1_scope.ipynb` ... `rq5_speed.ipynb`) has the figures. "
            "`make figures` writes all of it with `python -m sparsetrain.analysis`."
        ),
        parameters_cell("../results", "../figures"),
        new_code_cell(SETUP.format(study=None, name="00_overview")),
        new_markdown_cell("## Runs by status\n\nFailed, unfinished and absent runs are named below."),
        new_code_cell('status = sa.status_table(runs)\nsa.write_table(status, OUT)\ndisplay(Markdown(status.to_markdown()))'),
        new_markdown_cell("## One table per study"),
        new_code_cell(
            'for study in sorted(set(runs["experiment"].dropna())):\n'
            '    name = sa.study_of(study)\n'
            '    if name is None:\n'
            '        continue\n'
            '    table = sa.TABLES[name](runs[runs["experiment"] == study])\n'
            '    sa.write_table(table, OUT / name)\n'
            '    display(Markdown(table.to_markdown()))'
        ),
        new_markdown_cell("## All runs"),
        new_code_cell(RUNS_VIEW.replace('columns = ["scheme"', 'columns = ["experiment", "scheme"')),
    ]
    return new_notebook(cells=cells, metadata=METADATA)


METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def main() -> None:
    NOTEBOOKS.mkdir(exist_ok=True)
    notebooks = {"00_overview": overview_notebook()}
    notebooks.update({name: study_notebook(name, *spec) for name, spec in STUDIES.items()})
    for name, notebook in notebooks.items():
        for number, cell in enumerate(notebook.cells):
            cell.id = f"cell-{number}"  # stable ids: regenerating changes nothing in git
        nbformat.validate(notebook)
        path = NOTEBOOKS / f"{name}.ipynb"
        nbformat.write(notebook, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
