"""Relativise the absolute paths of the machine that ran a study in its committed run folders.

    python scripts/strip_paths.py results                  # every run folder under results/
    python scripts/strip_paths.py results/headline --root /path/to/checkout

Hydra records where a run ran: ``.hydra/hydra.yaml`` (and a sweep's ``multirun.yaml``) hold the
working directory (``hydra.runtime.cwd``), the config folder under it, the run's
``runtime.output_dir`` and the sweep's folder, all absolute (``/work/wt-headline/results/...``).
Committed, they name a machine's folders and point nowhere on another. This rewrites them relative
to the repository root (``--root``, default: the working directory, which is the checkout a study
ran in): the working directory becomes ``.``, paths under it lose the prefix, and a run or sweep
folder that lived elsewhere (``hydra.sweep.dir=/tmp/x``) becomes the folder it is committed in.
Text is edited in place, nothing else in the file changes; running it twice changes nothing.
``scripts/reproduce.sh`` runs it on each study it copies into ``results/``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

FILES = (".hydra/hydra.yaml", "multirun.yaml")


def _get(data, *keys):
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _relative(folder: Path, root: Path) -> str:
    try:
        return folder.resolve().relative_to(root.resolve()).as_posix() or "."
    except ValueError:  # committed outside the root: at least not another machine's path
        return folder.resolve().as_posix()


def _replace_prefix(text: str, old: str, new: str) -> str:
    """``old`` where it stands as a whole path or a path's start (not inside another name)."""
    pattern = re.compile(r"(?<![\w./-])" + re.escape(old.rstrip("/")) + r"(?P<rest>/[^\s'\",\]]*)?(?![\w.-])")

    def sub(match: re.Match) -> str:
        rest = match.group("rest") or ""
        if new == ".":
            return rest[1:] if rest else "."
        return new + rest

    return pattern.sub(sub, text)


def strip_file(path: Path, root: Path) -> bool:
    """Rewrite one hydra.yaml or multirun.yaml; True when it changed."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    hydra = _get(data, "hydra") or {}
    # run.yaml sits in <run>/.hydra/, multirun.yaml in the sweep folder
    run_dir = path.parent.parent if path.parent.name == ".hydra" else None
    sweep_dir = path.parent if run_dir is None else run_dir.parent
    swaps: dict[str, str] = {}
    output_dir = _get(hydra, "runtime", "output_dir")
    if run_dir is not None and isinstance(output_dir, str) and output_dir.startswith("/"):
        swaps[output_dir] = _relative(run_dir, root)
    sweep = _get(hydra, "sweep", "dir")
    if isinstance(sweep, str) and sweep.startswith("/") and _get(hydra, "mode") != "RUN":
        swaps[sweep] = _relative(sweep_dir, root)
    cwd = _get(hydra, "runtime", "cwd")
    if isinstance(cwd, str) and cwd.startswith("/"):
        swaps[cwd] = "."
    new = text
    for old in sorted(swaps, key=len, reverse=True):  # the longest (most specific) first
        new = _replace_prefix(new, old, swaps[old])
    if new == text:
        return False
    path.write_text(new)
    return True


def strip_tree(*trees: str | Path, root: str | Path | None = None) -> list[Path]:
    """Every hydra.yaml and multirun.yaml under ``trees``, rewritten; the files that changed."""
    root = Path(root) if root is not None else Path.cwd()
    changed = []
    for tree in map(Path, trees):
        for name in FILES:
            for path in sorted(tree.rglob(name)):
                if strip_file(path, root):
                    changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/strip_paths.py", description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, metavar="RESULTS", help="results trees, sweeps or run folders")
    parser.add_argument("--root", type=Path, default=None,
                        help="the repository root the paths become relative to (default: the working directory)")
    args = parser.parse_args(argv)
    for tree in args.trees:
        if not tree.exists():
            parser.error(f"no such folder: {tree}")
    changed = strip_tree(*args.trees, root=args.root)
    print(f"strip_paths: {len(changed)} file(s) rewritten under {', '.join(map(str, args.trees))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
