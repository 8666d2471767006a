"""The layout's promises: one Reducer protocol, one reader of the launchers' environment, imports
that point one way (no cycles), a core without torch.distributed or Hydra, old import paths."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

PKG = ROOT / "sparsetrain"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK")
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "SUBMITIT_")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path], anywhere: bool = False) -> set[str]:
    """Project modules ``name`` imports at module level (``anywhere``: inside functions too)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if anywhere else tree.body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a package's own parents
                out.add(t)
    return out


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_only_launch_env_reads_the_launchers_environment():
    offenders = []
    for name, path in _modules().items():
        if name in ("sparsetrain.launch.env",):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                v = node.value
                if v in LAUNCH_ENV or v.startswith(LAUNCH_PREFIXES):
                    offenders.append(f"{name}: {v!r}")
    assert not offenders, offenders


def test_errors_is_a_leaf_and_core_has_no_distributed_or_hydra():
    mods = _modules()
    assert _imports("sparsetrain.errors", mods["sparsetrain.errors"], mods) == set()
    for name, path in mods.items():
        if not name.startswith("sparsetrain.compress"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert not n.startswith(("torch.distributed", "hydra", "omegaconf")), (name, n)


def test_results_and_analysis_import_no_torch():
    code = ("import sys, sparsetrain.results, sparsetrain.analysis, sparsetrain.errors; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_both_reducers_implement_the_protocol():
    from sparsetrain.comm import DenseReducer, Reducer, build_reducer
    from sparsetrain.compress import BlockRandomK, Layout

    dense = DenseReducer(10)
    sparse = build_reducer("blockk", "layerwise", "allreduce", 0.1, Layout.from_sizes([50, 50]),
                           world_size=1, rank=0, seed=0, compressor=BlockRandomK)
    assert isinstance(dense, Reducer) and isinstance(sparse, Reducer)
    assert sparse.attach([], None) is sparse


def test_hydra_plugins_is_declared_as_a_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"hydra_plugins*"' in text
    for path in [*PKG.rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")]:
        assert "sys.path" not in path.read_text(), path


def _declared_layers() -> list[list[str]]:
    """The layers docs/architecture.md's block declares, top (imports nothing of ours) first:
    each line ``sparsetrain/<name>`` (``, <name>`` for more on the line) is one layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("# Architecture"):]
    block = block[block.index("```") + 3:]
    block = block[: block.index("```")]
    layers = []
    for line in block.splitlines():
        head = line.split("  ")[0].strip()
        if not head.startswith(("sparsetrain/", "hydra_plugins/")):
            continue
        first, *more = [h.strip() for h in head.split(",")]
        folder = first.rsplit("/", 1)[0] if "/" in first.rstrip("/") else ""
        names = [first, *(f"{folder}/{m}" for m in more)]
        layers.append([n.rstrip("/").removesuffix(".py").replace("/", ".") for n in names])
    return layers


def test_imports_point_one_way_as_the_architecture_page_declares():
    """Every import, module level or inside a function, goes to a layer docs/architecture.md lists
    above the importer (or to the importer's own layer, without a cycle); every module belongs to
    a layer."""
    mods = _modules()
    layers = _declared_layers()
    assert len(layers) >= 10, layers

    def layer_of(module: str) -> int:
        for i, names in enumerate(layers):
            if any(module == n or module.startswith(n + ".") for n in names):
                return i
        return -1

    unplaced = [m for m in mods if m != "sparsetrain" and layer_of(m) < 0]
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"
    upward, graph = [], {}
    for name, path in mods.items():
        graph[name] = _imports(name, path, mods, anywhere=True)
        for target in graph[name]:
            if target != "sparsetrain" and layer_of(target) > layer_of(name):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports against docs/architecture.md's layering: " + "; ".join(sorted(upward))
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle (function-level imports included): " + " -> ".join(stack + [m, n]))
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
