"""python -m sparsetrain.analysis SWEEP_DIR... --out DIR

Prints the tables of the runs under the given sweep or run folders and writes them (Markdown, CSV,
LaTeX) with the figures (PNG, PDF) into DIR. Exit codes: 0 done, 1 no runs found, 2 bad arguments
or a folder that does not exist, 3 with --strict when some runs did not complete.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .loader import load_runs, not_completed
from .report import STUDIES, select, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparsetrain.analysis",
        description="Tables and figures from sparsetrain run folders (sweeps or single runs).",
    )
    parser.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR", help="sweep or run folders, searched recursively")
    parser.add_argument("--out", type=Path, required=True, help="folder for tables (md/csv/tex) and figures (png/pdf)")
    parser.add_argument("--study", choices=sorted(STUDIES), help="make this study's tables and figures from all runs (default: group runs by experiment preset)")
    parser.add_argument("--where", action="append", default=[], metavar="AXIS=V1,V2",
                        help="keep runs whose axis takes one of these values (repeatable), e.g. --where scope=layerwise")
    parser.add_argument("--include-failed", action="store_true", help="put runs that did not complete into the numbers")
    parser.add_argument("--strict", action="store_true", help="exit 3 when any run did not complete")
    parser.add_argument("--quiet", action="store_true", help="do not print the tables")
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
    try:
        written = write_report(*args.paths, out=args.out, include_failed=args.include_failed,
                               study=args.study, echo=None if args.quiet else print, where=where)
    except ValueError as err:
        parser.error(str(err))
    except LookupError as err:
        print(f"error: {err} (a run folder holds summary.json or .hydra/config.yaml)", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    missing = not_completed(select(load_runs(*args.paths), where))
    if len(missing):
        print(f"warning: {len(missing)} runs did not complete and are named under the tables", file=sys.stderr)
        if args.strict:
            print(f"error: {len(missing)} runs did not complete (--strict)", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        sys.exit(main())
