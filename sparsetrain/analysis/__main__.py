"""python -m sparsetrain.analysis SWEEP_DIR... --out DIR

Prints the tables of the runs under the given sweep or run folders and writes them (Markdown, CSV,
LaTeX) with the figures (PNG, PDF) into DIR. Exit codes: 0 done, 1 no runs found, 2 bad arguments
or a folder that does not exist, 3 with --strict when some runs did not complete.

With ``--studies`` the one path is a results tree (``results/``): every study whose sweep is there
gets its tables and figures in ``DIR/<study>/``, each from the folders and runs that
``report.SOURCES`` names (dense SGD from ``baseline``, ...): what `make figures` and the notebooks show.

With ``--tuning`` the paths are the tuning study's sweeps (``results/tune results/tune_dense``):
every trial, the choice per scheme and scope by validation accuracy (``trials.md``, ``trials.csv``,
``val_vs_lr.png``; ``sparsetrain.analysis.tuning``) and, with ``--write-tuned DIR``, the files
the tuned protocol reads (``conf/tuned``).

With ``--declared DECLARATION`` the one path is a results tree: the study declared in that file
(``conf/declared/verdicts.yaml``, ``local.yaml``) judged from its sweeps there (and the earlier
sweeps it is judged against), each comparison at each budget, with the check that the
declaration's commit precedes every run's (``verdicts``, ``comparisons``, and ``budget_change``
for two budgets or more; ``sparsetrain.analysis.declared``).

With ``--time-to-accuracy TARGET`` it makes the time-to-accuracy table and figure instead
(``time_to_accuracy.{md,csv,tex,png,pdf}``; see ``sparsetrain.analysis.time_to_accuracy``):
``--bandwidth`` (Gbit/s) and ``--workers`` lists, ``--costmodel`` a fitted ``costmodel.json``
(default: the cost model's default alpha and beta), ``--alpha-us`` the default's latency.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .group import repeat_notes
from .loader import completed, load_runs, not_completed
from .report import STUDIES, select, write_report, write_studies, write_time_to_accuracy
from .time_to_accuracy import BANDWIDTHS_GBIT, WORKERS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparsetrain.analysis",
        description="Tables and figures from sparsetrain run folders (sweeps or single runs).",
    )
    parser.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR", help="sweep or run folders, searched recursively")
    parser.add_argument("--out", type=Path, required=True, help="folder for tables (md/csv/tex) and figures (png/pdf)")
    parser.add_argument("--study", choices=sorted(STUDIES), help="make this study's tables and figures from all runs (default: group runs by experiment preset)")
    parser.add_argument("--studies", action="store_true",
                        help="the path is a results tree: every study found there into OUT/<study>, "
                             "each from the folders it is made of (report.SOURCES)")
    parser.add_argument("--where", action="append", default=[], metavar="AXIS=V1,V2",
                        help="keep runs whose axis takes one of these values (repeatable), e.g. --where scope=layerwise")
    parser.add_argument("--include-failed", action="store_true",
                        help="put every run into the tables' numbers and the learning curves: those that did not "
                             "complete (failed, interrupted, unfinished) and those that completed but did not "
                             "train (the other figures, the verdicts and --time-to-accuracy leave both out)")
    parser.add_argument("--strict", action="store_true", help="exit 3 when any run did not complete")
    parser.add_argument("--quiet", action="store_true", help="do not print the tables")
    parser.add_argument("--tuning", action="store_true",
                        help="the paths are tuning sweeps (experiment=tune): every trial and the choice per "
                             "scheme and scope by validation accuracy, into OUT")
    parser.add_argument("--write-tuned", type=Path, metavar="DIR",
                        help="with --tuning: write the choices where experiment=protocol reads them (conf/tuned)")
    parser.add_argument("--declared", type=Path, metavar="YAML",
                        help="the path is a results tree: judge the study declared in YAML (conf/declared/) "
                             "from its sweeps there, into OUT")
    parser.add_argument("--time-to-accuracy", metavar="TARGET[,TARGET...]",
                        help="predicted time to reach this accuracy (validation where runs held a split, else "
                             "test; a fraction, e.g. 0.85) per scheme, bandwidth and worker count, instead of the "
                             "study tables; several targets (0.84,0.85,0.86): each one's tables, and a break-even "
                             "map that calls a ranking only where it holds at every target")
    bandwidths, workers = (",".join(map(str, values)) for values in (BANDWIDTHS_GBIT, WORKERS))
    parser.add_argument("--bandwidth", default=bandwidths, metavar="GBIT,...",
                        help=f"link bandwidths in Gbit/s for --time-to-accuracy (default {bandwidths})")
    parser.add_argument("--workers", default=workers, metavar="N,...",
                        help=f"worker counts for --time-to-accuracy (default {workers})")
    parser.add_argument("--costmodel", type=Path, metavar="JSON",
                        help="fitted alpha-beta (sparsetrain.benchmarks.collectives' costmodel.json) for "
                             "--time-to-accuracy; default: the cost model's default alpha and beta")
    parser.add_argument("--alpha-us", type=float, default=None,
                        help="per-message latency of the default model in microseconds (default 50)")
    args = parser.parse_args(argv)

    for path in args.paths:
        if not path.exists():
            parser.error(f"no such results folder: {path}")
    where = {}
    for item in args.where:
        axis, sep, values = item.partition("=")
        if not sep or not values:
            parser.error(f"--where {item!r}: expected AXIS=VALUE[,VALUE...]")
        where.setdefault(axis, []).extend(values.split(","))
    if args.write_tuned is not None and not args.tuning:
        parser.error("--write-tuned goes with --tuning")
    if args.tuning:
        return _tuning(args, where)
    if args.declared is not None:
        if len(args.paths) != 1 or where:
            parser.error("--declared takes one results tree and no --where (the declaration says what counts)")
        if not args.declared.is_file():
            parser.error(f"no such declaration: {args.declared}")
        from .declared import write as write_declared

        try:
            written = write_declared(args.declared, args.paths[0], args.out, None if args.quiet else print)
        except ValueError as err:
            parser.error(str(err))
        print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
        return 0
    if args.time_to_accuracy is not None:
        return _time_to_accuracy(parser, args, where)
    if args.studies:
        if len(args.paths) != 1 or args.study or where:
            parser.error("--studies takes one results tree and no --study or --where (each study has its own)")
        try:
            written = write_studies(args.paths[0], args.out, args.include_failed, None if args.quiet else print)
        except LookupError:  # not the reproduction's tree (one's own sweeps): tables of its runs
            print(f"{args.paths[0]} holds none of the studies' folders: tables of the runs under it",
                  file=sys.stderr)
            try:
                written = write_report(args.paths[0], out=args.out, include_failed=args.include_failed,
                                       echo=None if args.quiet else print)
            except LookupError as err:
                print(f"error: {err} (a run folder holds summary.json or .hydra/config.yaml)", file=sys.stderr)
                return 1
        print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
        return 0
    try:
        written = write_report(*args.paths, out=args.out, include_failed=args.include_failed,
                               study=args.study, echo=None if args.quiet else print, where=where)
    except ValueError as err:
        parser.error(str(err))
    except LookupError as err:
        print(f"error: {err} (a run folder holds summary.json or .hydra/config.yaml)", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    runs = select(load_runs(*args.paths), where)
    for line in repeat_notes(completed(runs)):  # shown apart in the tables: say so here too
        print(f"warning: {line}", file=sys.stderr)
    missing = not_completed(runs)
    if len(missing):
        counts = ", ".join(f"{n} {status}" for status, n in missing["status"].value_counts().items())
        if args.include_failed:  # they are in the numbers: say so, not that they are left out
            print(f"warning: {len(missing)} runs that did not complete or did not train are in the numbers "
                  f"({counts}; --include-failed)", file=sys.stderr)
        else:
            print(f"warning: {len(missing)} runs are not in the numbers ({counts}); each is named under "
                  "the tables", file=sys.stderr)
        if args.strict:
            print(f"error: {len(missing)} runs are not in the numbers ({counts}) (--strict)", file=sys.stderr)
            return 3
    return 0


def _tuning(args, where) -> int:
    from .tuning import write

    runs = select(load_runs(*args.paths), where)
    if runs.empty:
        print(f"error: no runs found under {', '.join(map(str, args.paths))}", file=sys.stderr)
        return 1
    try:
        written = write(runs, args.out, args.write_tuned)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not args.quiet:
        print((args.out / "trials.md").read_text())
    print(f"wrote {len(written)} files ({args.out}{', ' + str(args.write_tuned) if args.write_tuned else ''})",
          file=sys.stderr)
    return 0


def _numbers(parser, flag: str, text: str, kind=float) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: expected numbers separated by commas")
    if not values or any(v <= 0 for v in values):
        parser.error(f"{flag} {text!r}: expected positive numbers separated by commas")
    return values


def _time_to_accuracy(parser, args, where) -> int:
    from .time_to_accuracy import default_model, fitted_model

    targets = _numbers(parser, "--time-to-accuracy", args.time_to_accuracy)
    if not all(0 < t <= 1 for t in targets) or len(set(targets)) < len(targets):
        parser.error(f"--time-to-accuracy {args.time_to_accuracy}: expected distinct fractions in (0, 1], "
                     "e.g. 0.85 or 0.84,0.85,0.86")
    target = tuple(sorted(targets)) if len(targets) > 1 else targets[0]
    bandwidths = _numbers(parser, "--bandwidth", args.bandwidth)
    workers = _numbers(parser, "--workers", args.workers, int)
    if args.costmodel is not None and args.alpha_us is not None:
        parser.error("--alpha-us sets the default model's latency; --costmodel brings its own alpha")
    if args.costmodel is not None:
        if not args.costmodel.is_file():
            parser.error(f"no such cost model file: {args.costmodel}")
        model = fitted_model(args.costmodel)
    else:
        model = default_model(1e-6 * args.alpha_us) if args.alpha_us is not None else default_model()
    try:
        runs = select(load_runs(*args.paths), where)
    except ValueError as err:
        parser.error(str(err))
    if runs.empty:
        print(f"error: no runs found under {', '.join(map(str, args.paths))} (a run folder holds "
              "summary.json or .hydra/config.yaml)", file=sys.stderr)
        return 1
    written = write_time_to_accuracy(runs, target, args.out, bandwidths, workers, model,
                                     echo=None if args.quiet else print)
    print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        sys.exit(main())
