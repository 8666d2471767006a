"""Before/after of the compressor benchmark: two checkouts' code, run in alternation.

    .venv/bin/python scripts/ab_compress.py --base /path/to/main --runs 8 --json ab.json

Runs ``python -m sparsetrain.benchmarks.compress --device cpu --rounds 1`` with ``PYTHONPATH``
set to the base checkout, then to this one, ``--runs`` times (A B A B ...), each a fresh process
with the same interpreter (``sys.executable``), and prints per scheme and scope the median and
the range over runs of the "copies" of compress + error feedback and of decompress (each run's
number already the median of its repeats, each repeat's time divided by a copy timed just
before it), and the layer-wise / global ratio per run. Alternating keeps a shared machine's load
changes out of the comparison as far as they are slower than one run (~20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def one_run(checkout: Path, args, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", "sparsetrain.benchmarks.compress", "--device", "cpu", "--rounds", "1",
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--ratio", str(args.ratio),
           "--json", str(out)]
    subprocess.run(cmd, env=env, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())["runs"][0]
    rows = {f"{r['scheme']}/{r['scope']}": r for r in res["schemes"]}
    for scheme in ("topk", "randk", "blockk"):
        rows[f"{scheme} layerwise/global"] = {
            "compress_ef_copies": rows[f"{scheme}/layerwise"]["compress_ef_copies"]
            / rows[f"{scheme}/global"]["compress_ef_copies"]}
    return rows


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def alternate(args, one) -> dict[str, list[dict]]:
    """``one(checkout, i)`` for the base and the new checkout in turn, ``args.runs`` times (A B A
    B ...): each side's list of results."""
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for i in range(args.runs):
        for side in ("base", "new"):
            runs[side].append(one(getattr(args, side).resolve(), f"{side}{i}"))
            print(f"run {i + 1}/{args.runs} {side} done", file=sys.stderr)
    return runs


def write_json(args, runs: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps({"base": str(args.base), "new": str(args.new), "runs": runs}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path, help="the checkout to compare against (e.g. main's)")
    ap.add_argument("--new", type=Path, default=HERE, help="default: this checkout")
    ap.add_argument("--runs", type=int, default=6, help="runs per side, alternated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--json", default=None, help="write every run's rows here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = alternate(args, lambda checkout, name: one_run(checkout, args, Path(tmp) / f"{name}.json"))
    print(f"base: {args.base}\nnew:  {args.new}\n{args.runs} alternated runs per side; "
          "median (range) over runs, in copies of the gradient")
    print(f"{'':<28}{'compress+EF base':>22}{'compress+EF new':>22}{'decompress base':>22}{'decompress new':>22}")
    for key in dict.fromkeys([*runs["base"][0], *runs["new"][0]]):  # rows of either side
        cells = []
        for field in ("compress_ef_copies", "decompress_copies"):
            for side in ("base", "new"):
                vals = [r[key][field] for r in runs[side] if key in r and field in r[key]]
                cells.append(summary(vals) if vals else "")
        print(f"{key:<28}" + "".join(f"{c:>22}" for c in cells))
    write_json(args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
