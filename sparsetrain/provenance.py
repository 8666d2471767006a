"""Which code a run ran: the git commit of the sparsetrain checkout and whether its code had
uncommitted changes. ``summary.json`` records it (``code``, and ``code_commits``: every commit a
resumed run ran on); a checkpoint written by other code is not resumed unless
``train.allow_code_change=true``.

The checkout is the one that holds the imported package (an editable install or a git worktree),
not the working directory. "Code" is what changes what a run computes: ``sparsetrain/``, ``conf/``,
``hydra_plugins/`` and ``pyproject.toml``. Results written into the checkout (``results/``, run
folders) do not make it dirty, so a study run from a worktree keeps a clean record. Outside a git
checkout (an installed wheel, no git) the commit is ``"unknown"``.

One's own classes outside the checkout (a scheme's compressor, memory or sync): their files'
digest (``compressor_code``), in ``summary.json`` and the checkpoint; a resume on another
version of them is refused the same way (``compressor_code_versions``: every one a resumed run
ran on).

Which machine: ``host()``, the processor, its logical CPUs and the system, which a run's
timings depend on (``summary.json``'s ``hosts``: every machine a resumed run ran on).

No torch, no Hydra: the CLI checks a checkpoint with it before any rank starts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import platform
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

CODE_PATHS = ("sparsetrain", "conf", "hydra_plugins", "pyproject.toml")
UNKNOWN = "unknown"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout


def code_version(root: str | Path | None = None) -> dict:
    """``{"commit": sha or "unknown", "dirty": bool or None, "diff": short hash or None}``.

    ``diff`` fingerprints the uncommitted changes (tracked diffs and untracked files under the
    code paths), so two runs on the same dirty tree can be told from runs on different edits."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").strip())
        commit = _git(top, "rev-parse", "HEAD").strip()
        paths = [p for p in CODE_PATHS if (top / p).exists()]
        status = _git(top, "status", "--porcelain", "--", *paths)
    except (OSError, subprocess.SubprocessError):
        return {"commit": UNKNOWN, "dirty": None, "diff": None}
    if not status.strip():
        return {"commit": commit, "dirty": False, "diff": None}
    digest = hashlib.sha256(_git(top, "diff", "HEAD", "--", *paths).encode())
    for line in sorted(status.splitlines()):
        if line.startswith("??"):  # untracked: its name and content
            path = top / line[3:].strip()
            digest.update(line.encode())
            for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
                if f.is_file() and "__pycache__" not in f.parts:
                    digest.update(f.read_bytes())
    return {"commit": commit, "dirty": True, "diff": digest.hexdigest()[:12]}


def describe(code: dict | None, full: bool = False) -> str:
    """``abc123def456``, ``abc123def456+dirty(<diff>)`` or ``unknown``: one version in one word
    (``full``: the whole 40-digit commit)."""
    if not code or code.get("commit", UNKNOWN) == UNKNOWN:
        return UNKNOWN
    short = code["commit"] if full else code["commit"][:12]
    return f"{short}+dirty({code.get('diff')})" if code.get("dirty") else short


def same_code(a: dict | None, b: dict | None) -> bool:
    """Whether two records name the same code. An unknown side cannot be compared: it matches."""
    if describe(a) == UNKNOWN or describe(b) == UNKNOWN:
        return True
    return describe(a) == describe(b)


SCHEME_NODES = ("compressor", "memory", "sync")  # the scheme's nodes that name a class


def scheme_targets(scheme: dict | None) -> list[str]:
    """The classes a scheme's nodes name (``scheme.compressor`` / ``memory`` / ``sync``
    ``._target_``), in that order; nodes that are null are left out."""
    nodes = [(scheme or {}).get(node) for node in SCHEME_NODES]
    return [str(n["_target_"]) for n in nodes if isinstance(n, dict) and n.get("_target_")]


def compressor_code(targets: str | list[str] | None) -> dict | None:
    """The source of a scheme's out-of-tree classes: ``{"target", "targets", "files", "digest"}``
    for the classes ``targets`` names (``scheme_targets``: the compressor's, the memory's, the
    sync's ``_target_``, ``mypkg.codecs.MyCodec``; one name alone is the compressor's) that are not
    sparsetrain's own: the files that define them and their bases outside sparsetrain (never the
    standard library or installed packages other than its own; relative to the working directory
    where under it), and one sha256 over their names and bytes, wherever they lie (``target``:
    the first own class; ``targets``: all of them). One own compressor gives the digest it gave
    before memories and syncs were digested too.
    A commit does not say which version of one's own code ran; this does, so that the analysis
    never averages two versions. None where every class is sparsetrain's, none is named, or one
    cannot be imported (the run has already failed to build it then)."""
    own_targets, files = [], []
    for target in [targets] if isinstance(targets, str) else (targets or []):
        found = _own_files(target)
        if found:
            own_targets.append(str(target))
            files.extend(f for f in found if f not in files)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return {"target": own_targets[0], "targets": own_targets, "files": [_shown(p) for p in files],
            "digest": digest.hexdigest()[:16]}


@functools.cache
def installed_roots() -> tuple[str, ...]:
    """Where the standard library and installed packages live, each ending in the path separator:
    a file under one of them is not one's own code (``str.startswith`` takes the tuple)."""
    paths = sysconfig.get_paths()
    return tuple(os.path.realpath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := paths.get(key)))


def _own_files(target: str | None) -> list[Path]:
    """The files outside sparsetrain that define the class ``target`` and its bases (see
    ``compressor_code``); [] for sparsetrain's classes, no target, or one that cannot be imported."""
    if not target or str(target).split(".")[0] == "sparsetrain":
        return []
    module_name, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return []
    installed = installed_roots()
    own = Path(__file__).resolve().parent  # the sparsetrain package
    files: list[Path] = []
    for i, klass in enumerate(getattr(cls, "__mro__", (cls,))):
        try:
            path = Path(inspect.getsourcefile(klass) or "").resolve()
        except TypeError:  # builtins: no source
            continue
        if not path.is_file() or own in path.parents:
            continue
        # the class named is always its own code; a base only outside installed packages
        if i and str(path).startswith(installed):
            continue
        if path not in files:
            files.append(path)
    # ... and the modules of one's own that those files import, and theirs in turn (a helper
    # module: `from mine_helpers import order`), so that an edit there is another version too
    queue = [m for k in getattr(cls, "__mro__", (cls,)) if (m := sys.modules.get(getattr(k, "__module__", "")))
             and getattr(m, "__file__", None) and Path(m.__file__).resolve() in files]
    seen: set[str] = set()
    while queue:
        module = queue.pop(0)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for value in list(vars(module).values()):
            used = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", None) or "")
            path = Path(getattr(used, "__file__", None) or "")
            if used is None or used.__name__ in seen or not path.is_file():
                continue
            path = path.resolve()
            if own in path.parents or str(path).startswith(installed):
                continue
            if path not in files:
                files.append(path)
            queue.append(used)
    return files


def same_own_code(a: dict | None, b: dict | None) -> bool:
    """Whether two ``compressor_code`` records name the same source (None: sparsetrain's own)."""
    return (a or {}).get("digest") == (b or {}).get("digest")


def describe_own(code: dict | None) -> str:
    """``own code mycomp.MyRandK@8b0bcc85536067c2`` (every own class, then the digest), or
    ``sparsetrain's own classes``: one version of one's own code."""
    if not code:
        return "sparsetrain's own classes"
    return f"own code {'+'.join(code.get('targets') or [code.get('target')])}@{code.get('digest')}"


def _shown(path: Path) -> str:
    """Relative to the working directory when under it (as summary.json's run_dir): a committed
    run folder then names no machine's folders."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def host() -> dict:
    """The machine this process runs on: ``cpu`` (the processor's model), ``cpus`` (logical
    CPUs) and ``system``. Two runs timed on different machines do not compare (the caller adds
    the torch build and the GPU)."""
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(), "system": f"{platform.system()} {platform.release()}"}


def _cpu_model() -> str:
    try:  # Linux names the model here; platform.processor() is often empty or just the architecture
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN
