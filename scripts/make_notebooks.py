"""Write notebooks/*.ipynb: thin callers of sparsetrain.analysis, one per research question.

    python scripts/make_notebooks.py        # then commit notebooks/ (they carry no outputs)

The notebooks are generated so that they stay thin and alike; edit this script, not the .ipynb.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from sparsetrain.analysis.report import SOURCES, STUDIES, TIME_TO_ACCURACY, TIME_TO_ACCURACY_RUNS

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

SETUP = '''import os
from pathlib import Path

from IPython.display import Image, Markdown, display

from sparsetrain import analysis as sa

# SPARSETRAIN_RESULTS / SPARSETRAIN_OUT point the notebook elsewhere without editing it (tests do).
# By default it writes under outputs/notebooks/ (not tracked), never into the committed figures/.
RESULTS = Path(os.environ.get("SPARSETRAIN_RESULTS", RESULTS))
OUT = Path(os.environ["SPARSETRAIN_OUT"]) / {name!r} if "SPARSETRAIN_OUT" in os.environ else Path(OUT)
{load}
print(f"{{len(runs)}} runs:", runs["status"].value_counts().to_dict())'''

LOAD_STUDY = '''# The study's points from every sweep that holds them (sa.SOURCES): what `make figures` shows.
print("from", ", ".join(str(p) for p in sa.study_folders(RESULTS, {study!r})))
runs, curves = sa.load_study(RESULTS, {study!r})'''
LOAD_ALL = '''runs = sa.load_runs(RESULTS)'''

RUNS_VIEW = '''columns = ["experiment", "scheme", "scope", "aggregation", "ratio", "world_size", "seed", "status",
           "test_accuracy", "time_step_ms", "bytes_sent_per_step"]
runs[[c for c in columns if c in runs]]'''

# Title and question of each study's notebook; its tables, figures and folders come from
# sparsetrain.analysis (STUDIES, SOURCES), so a notebook shows what `make figures` writes.
QUESTIONS = {
    "stability": (
        "Stabilisers: what makes the sparse schemes train",
        "Random-k and block-random-k at 1% with every tensor compressed, with and without sending "
        "the 1-D tensors (batch-norm weights, biases) whole and a dense warm-up; how many seeds "
        "trained (final train loss below ln 10), and at what cost in bytes.",
    ),
    "ablation": (
        "Ablation: the stabilisers at the second pass's scale",
        "Random-k and block-random-k at 1% on all 60,000 images for 2 epochs, with and without "
        "whole 1-D tensors and a 100-step dense warm-up (one seed): what each stabiliser changes "
        "at the scale of the research questions.",
    ),
    "rq1_scope": (
        "RQ1: layer-wise vs global scope",
        "Does sparsifying each tensor with its own k (layer-wise) beat one k over the flattened model "
        "(global)? The paper: layer-wise wins for every scheme, since every layer takes part in each "
        "update; random-k suffers most globally.",
    ),
    "rq2_scheme": (
        "RQ2: top-k vs random-k vs block-random-k",
        "Accuracy against communication. The paper: top-k > block-random-k > random-k in accuracy.",
    ),
    "rq3_aggregation": (
        "RQ3: AllReduce vs AllGather",
        "Shared random indices (AllReduce) vs each worker's own (AllGather). The paper: no visible "
        "difference for random-k; block-random-k with AllReduce loses accuracy as workers increase.",
    ),
    "rq4_workers": (
        "RQ4: number of workers",
        "Test accuracy and time per step as workers grow. The paper: a generalization gap appears "
        "with more workers in all settings, worse with global scope.",
    ),
    "rq5_speed": (
        "RQ5: time per step and speed-up over dense SGD",
        "Where does a step's time go, and is block-random-k faster than dense SGD? The paper: "
        "273 ms vs 375 ms per batch on 8 GPUs.",
    ),
    "ddp_hooks": (
        "DDP communication hooks",
        "The sparse schemes as torch DDP communication hooks beside torch's own PowerSGD and fp16 "
        "hooks and dense DDP: accuracy, bytes and time per step.",
    ),
    "budget": (
        "Budget: how far from a plateau",
        "Every scheme at 1% (layer-wise) after 2 and after 4 epochs, the lr schedule stretched with "
        "the budget: what a longer run would change in the 2-epoch studies' numbers.",
    ),
    "headline": (
        "The headline protocol: RQ1 and RQ2 at 1% near the plateau",
        "Every scheme at both scopes and dense SGD, 4 epochs at 2 workers, 5 seeds shared by every "
        "configuration (paired comparisons), and block-k at the ratio whose bytes match top-k's at "
        "1%: scope and order judged at equal entries and at equal bytes.",
    ),
    "ddp_fair": (
        "DDP: block-k against PowerSGD at equal bytes",
        "Sparsetrain's block-k DDP hook (AllGather) against torch's PowerSGD hook at rank 1, both at "
        "about 31 KB per step and with the same 2 dense warm-up steps, 4 epochs, 3 seeds.",
    ),
    "frontier": (
        "Beyond the paper: the compression families side by side",
        "Top-k, random-k, block-random-k, signSGD, QSGD, PowerSGD, fp16 and bf16 at the headline "
        "budget (4 epochs, 2 workers), at about 1.5% and 3.6% of dense SGD's bytes per step (PowerSGD "
        "and QSGD at their fewest), seeds 0-4 at the two byte levels and 0-2 for the other points, beside "
        "the headline protocol's dense SGD and block-k runs; local SGD and DiLoCo at the same two byte "
        "levels (experiment=local) where their runs are there.",
    ),
}

# How each figure is drawn in a notebook (the same functions `make figures` calls).
FIGURE_CALLS = {
    "accuracy_vs_epoch": "sa.plot_accuracy_vs_epoch(curves)",
    "accuracy_vs_bytes": "sa.plot_accuracy_vs_bytes(runs)",
    "workers": "sa.plot_workers(runs)",
    "time_per_phase": "sa.plot_time_per_phase(runs)",
}


def parameters_cell(results: str, out: str):
    cell = new_code_cell(f'RESULTS = "{results}"\nOUT = "{out}"')
    cell.metadata["tags"] = ["parameters"]
    return cell


def study_notebook(name: str, title: str, question: str) -> nbformat.NotebookNode:
    tables, figures = STUDIES[name]
    folders = ", ".join(f"`results/{folder}`" for folder in SOURCES[name][0])
    where = SOURCES[name][1]
    kept = ("; runs kept: " + ", ".join(f"{axis} in {{{', '.join(values)}}}" for axis, values in where.items())
            if where else "")
    cells = [
        new_markdown_cell(
            f"# {title}\n\n{question}\n\n"
            f"Points from {folders} (those present){kept}. Runs come from `python -m sparsetrain.run -m "
            f"experiment={name}`; `make figures` writes the same tables and figures (`python -m "
            f"sparsetrain.analysis --studies results --out figures`). Runs that failed, did not finish "
            "or did not train (final train loss not below ln 10, or final test accuracy below 20%) are "
            "left out of the numbers and listed under each table; runs that blew up early and recovered "
            "count, and each table says how many did."
        ),
        parameters_cell("../results", f"../outputs/notebooks/{name}"),
        new_code_cell(SETUP.format(name=name, load=LOAD_STUDY.format(study=name))),
        new_code_cell(RUNS_VIEW),
        new_markdown_cell("## Tables\n\nMean ± std over seeds, with the number of seeds n."),
    ]
    for table in tables:
        cells.append(new_code_cell(
            f"table = sa.TABLES[{table!r}](runs)\nsa.write_table(table, OUT)\ndisplay(Markdown(table.to_markdown()))"
        ))
    cells.append(new_markdown_cell("## Figures"))
    for figure in figures:
        # Shown from the saved PNG: what the notebook displays is what it wrote.
        cells.append(new_code_cell(
            f'fig = {FIGURE_CALLS[figure]}\npaths = sa.save_figure(fig, OUT, "{figure}")\n'
            'display(Image(filename=paths["png"]))'
        ))
    if name in TIME_TO_ACCURACY:
        cells += [
            new_markdown_cell(
                f"## Time to {'/'.join(f'{t:.0%}' for t in TIME_TO_ACCURACY[name])} accuracy and the break-even map\n\n"
                "Predicted for each configuration at 1, 10 and 100 Gbit/s and 8 and 64 workers: its "
                "measured compute and compress + decompress per step, the exchange of its bytes from "
                "the default alpha-beta cost model, and the steps its runs took to each target. The "
                "break-even map names, at each point, the configuration that gets there first and "
                "its speed-up over the best dense baseline (dense SGD, fp16, bf16) on matched seeds; "
                "a ranking is called only where it holds at every target. Timings are from a shared "
                "machine: predictions, not measurements."
            ),
            new_code_cell(
                f'written = sa.write_time_to_accuracy(runs, sa.TIME_TO_ACCURACY[{name!r}], OUT / "time_to_accuracy")\n'
                'for path in written:\n'
                '    if path.suffix == ".md":\n'
                '        display(Markdown(path.read_text()))\n'
                '    elif path.suffix == ".png":\n'
                '        display(Image(filename=path))'
            ),
        ]
    if name in TIME_TO_ACCURACY_RUNS:
        folder = TIME_TO_ACCURACY_RUNS[name]
        cells += [
            new_markdown_cell(
                "## The break-even map from its own runs\n\n"
                f"`experiment={folder}` ran the same points for time to accuracy: validation curves "
                "8 points an epoch, each run stopping at the highest target, timed one after another "
                "on a quiet machine. The same tables from those runs, once they are in the results "
                f"tree (`{folder}/`); `make figures` writes them to `figures/{folder}/`."
            ),
            new_code_cell(
                f'own = RESULTS / "{folder}"\n'
                'if own.is_dir():\n'
                f'    written = sa.write_time_to_accuracy(sa.load_runs(own), sa.TIME_TO_ACCURACY[{name!r}], OUT / "{folder}")\n'
                '    for path in written:\n'
                '        if path.suffix == ".md":\n'
                '            display(Markdown(path.read_text()))\n'
                '        elif path.suffix == ".png":\n'
                '            display(Image(filename=path))\n'
                'else:\n'
                '    print(f"no {own} yet: its runs have not been made")'
            ),
        ]
    return new_notebook(cells=cells, metadata=METADATA)


def overview_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Overview: every study in the results folder\n\n"
            "Which runs exist, which completed, and the table of each research question found. "
            "One notebook per study (`rq1_scope.ipynb` ... `budget.ipynb`) has its figures, from "
            "the sweeps that hold its points. "
            "`make figures` writes all of it with `python -m sparsetrain.analysis`."
        ),
        parameters_cell("../results", "../outputs/notebooks/00_overview"),
        new_code_cell(SETUP.format(name="00_overview", load=LOAD_ALL)),
        new_markdown_cell("## Runs by status\n\nFailed, unfinished and absent runs are named below."),
        new_code_cell('status = sa.status_table(runs)\nsa.write_table(status, OUT)\ndisplay(Markdown(status.to_markdown()))'),
        new_markdown_cell("## The tables of each study found\n\nEach from the sweeps that hold its points, as in the study's own notebook."),
        new_code_cell(
            'for study in sa.studies_present(RESULTS):  # one of its own sweeps is there\n'
            '    study_runs, _ = sa.load_study(RESULTS, study)\n'
            '    for name in sa.STUDIES[study][0]:\n'
            '        table = sa.TABLES[name](study_runs)\n'
            '        sa.write_table(table, OUT / study)\n'
            '        display(Markdown(table.to_markdown()))'
        ),
        new_markdown_cell("## The findings\n\nThe paper's, the second pass's own comparisons, and "
                          "those beyond the paper (no claim to reproduce), as `make figures` writes "
                          "them to `figures/findings/`. Each comparison "
                          "(`sparsetrain/analysis/findings.py`) is a difference in points with its 95% "
                          "interval and p-value: a paired t-test on per-seed differences where both "
                          "sides ran the same seeds, Welch's t-test otherwise (scipy.stats), "
                          "Holm-adjusted within a finding; outside the noise means adjusted p < 0.05, "
                          "and a side with one run is shown, never judged."),
        new_code_cell(
            'for table in sa.all_findings_tables(runs):\n'
            '    sa.write_table(table, OUT / "findings")\n'
            '    display(Markdown(table.to_markdown()))'
        ),
        new_markdown_cell("## All runs"),
        new_code_cell(RUNS_VIEW),
    ]
    return new_notebook(cells=cells, metadata=METADATA)


def protocol_notebook() -> nbformat.NotebookNode:
    """The tuned protocol: the tuning study's trials and choices, and every study declared before
    its runs (conf/declared/*.yaml), judged from the results tree."""
    cells = [
        new_markdown_cell(
            "# The tuned protocol: tuning on validation data, verdicts declared before their runs\n\n"
            "Each scheme's peak learning rate and warm-up are chosen on a held-out validation split "
            "(the same search for every scheme, dense SGD included; the test accuracy is shown, never "
            "read), then each declared study (`conf/declared/*.yaml`: its points, Holm families, "
            "equivalence margin, budgets and seeds, committed before its runs) is judged from its runs. "
            "`make figures` writes the same tables (`figures/tune/`, `figures/verdicts_tuned/`, "
            "`figures/local/`); docs/protocol.md says how each piece works."
        ),
        parameters_cell("../results", "../outputs/notebooks/protocol"),
        new_code_cell(
            "import os\nfrom pathlib import Path\n\nfrom IPython.display import Image, Markdown, display\n\n"
            "from sparsetrain import analysis as sa\nfrom sparsetrain.analysis import declared, tuning\n"
            "from sparsetrain.config import CONF_DIR\n\n"
            "# SPARSETRAIN_RESULTS / SPARSETRAIN_OUT point the notebook elsewhere without editing it (tests do).\n"
            "# By default it writes under outputs/notebooks/ (not tracked), never into the committed figures/.\n"
            'RESULTS = Path(os.environ.get("SPARSETRAIN_RESULTS", RESULTS))\n'
            "OUT = Path(os.environ[\"SPARSETRAIN_OUT\"]) / 'protocol' if \"SPARSETRAIN_OUT\" in os.environ else Path(OUT)\n\n\n"
            "def show(paths):\n"
            "    for path in paths:\n"
            '        if path.suffix == ".md":\n'
            "            display(Markdown(path.read_text()))\n"
            '        elif path.suffix == ".png":\n'
            "            display(Image(filename=path))"
        ),
        new_markdown_cell("## Tuning\n\nEvery trial (one run, seed 100) and the choice per scheme and scope: "
                          "its trained trial with the highest final validation accuracy."),
        new_code_cell(
            "folders = tuning.sweeps(RESULTS)\n"
            'print("from", ", ".join(str(p) for p in folders) or f"nothing: no tuning sweep under {RESULTS}")\n'
            "if folders:\n"
            '    show(tuning.write(sa.load_runs(*folders), OUT / "tune"))'
        ),
        new_markdown_cell("## Verdicts declared before their runs\n\nEach comparison at each budget: a "
                          "difference in points with its 95% interval, a paired t over the declared seeds, "
                          "Holm within its finding; a family is judged only once every run it needs has ended."),
        new_code_cell(
            'for path in sorted((CONF_DIR / "declared").glob("*.yaml")):\n'
            "    show(declared.write(path, RESULTS, OUT / path.stem))"
        ),
    ]
    return new_notebook(cells=cells, metadata=METADATA)


METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def main() -> None:
    NOTEBOOKS.mkdir(exist_ok=True)
    notebooks = {"00_overview": overview_notebook(), "protocol": protocol_notebook()}
    notebooks.update({name: study_notebook(name, *QUESTIONS[name]) for name in SOURCES})
    for name, notebook in notebooks.items():
        for number, cell in enumerate(notebook.cells):
            cell.id = f"cell-{number}"  # stable ids: regenerating changes nothing in git
        nbformat.validate(notebook)
        path = NOTEBOOKS / f"{name}.ipynb"
        nbformat.write(notebook, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
