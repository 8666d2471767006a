import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _scheme_targets() -> dict[str, str | None]:
    """Every scheme in conf/scheme/, with the class its yaml's ``compressor._target_`` names (None:
    no compressor, as dense SGD and torch's hooks)."""
    import yaml

    out = {}
    for path in sorted((ROOT / "conf" / "scheme").glob("*.yaml")):
        node = (yaml.safe_load(path.read_text()) or {}).get("compressor")
        out[path.stem] = node.get("_target_") if isinstance(node, dict) else None
    return out


# Every scheme (conf/scheme/<name>.yaml), and the name of the class of those with a compressor: read
# from the yamls, as training reads them, so that a new scheme's yaml is a new test case.
SCHEME_TARGETS = _scheme_targets()
SCHEMES = tuple(SCHEME_TARGETS)
SCHEME_CLASSES = {name: target.rpartition(".")[2] for name, target in SCHEME_TARGETS.items() if target}


def _sync_schemes() -> frozenset[str]:
    import yaml

    return frozenset(p.stem for p in (ROOT / "conf" / "scheme").glob("*.yaml")
                     if (yaml.safe_load(p.read_text()) or {}).get("sync"))


# The schemes that synchronise every `period` steps (a sync node: local SGD, DiLoCo), which run
# through the trainer's exchange only
SYNC_SCHEMES = _sync_schemes()


def _gloo_worker(rank: int, world: int, port: int, path: str, scenario) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(scenario(rank, world), f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(scenario, path: Path, world: int = 2) -> list:
    """``scenario(rank, world)`` on ``world`` real gloo ranks (spawned processes, loopback); what
    each rank returned, in rank order. ``scenario`` is a module-level function (it is pickled)."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_worker, args=(world, port, str(path), scenario), nprocs=world, join=True)
    return [torch.load(Path(path) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def compressor_for(scheme: str, block_size: int | None = None):
    """What ``scheme.compressor`` instantiates to for ``scheme`` (a ``functools.partial`` of the
    class its yaml names; ``block_size`` applies to a class that takes it), for the library calls
    tests make by hand; None for a scheme without a compressor (dense SGD, ``scheme='none'``)."""
    import importlib
    import inspect
    from functools import partial

    target = SCHEME_TARGETS[scheme]
    if target is None:
        return None
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    takes = "block_size" in inspect.signature(cls).parameters
    options = {"block_size": block_size} if takes and block_size is not None else {}
    return partial(cls, **options)


def cli_env(**extra: str) -> dict:
    """The environment of a command a test runs: this checkout's package first on the path, also
    from another working directory (an editable install may point at another checkout), and no
    W&B key."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path, **extra}
    if "WANDB_API_KEY" not in extra:
        env.pop("WANDB_API_KEY", None)
    return env


def run_cli(*overrides: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    """Run ``python -m sparsetrain.run`` as a user would; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "sparsetrain.run", *overrides],
        cwd=cwd or ROOT,
        env=cli_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refusal(*overrides: str) -> str:
    """The one line a command with ``overrides`` is refused with before any rank starts, found
    in-process by the checks ``sparsetrain.launch.cli`` makes in that order: the override check,
    Hydra's composition against the schemas, then ``validate``. Fails the test when nothing
    refuses it. (Each error class keeps one test through the command line, for its exit code and
    its one line on stderr: docs/testing.md.)"""
    from sparsetrain.config import ConfigError, check_overrides, compose, validate

    try:
        check_overrides(list(overrides))
        validate(compose(list(overrides)), env={})
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message, message
        return message
    pytest.fail(f"{' '.join(overrides)} was not refused")


def analysis_cli(*args, module: str = "sparsetrain.analysis", cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m <module> *args`` run in this process (its ``main``, in ``cwd``), as a
    CompletedProcess: what it printed, and its exit code. The analysis needs no torch and no
    ranks, so a process of its own adds only start-up time; tests/test_analysis.py keeps one
    through the real command for its exit codes."""
    import contextlib
    import importlib
    import io
    import warnings

    # a package's main is in its __main__ (python -m sparsetrain.analysis), a module's in itself
    main = importlib.import_module(f"{module}.__main__" if module == "sparsetrain.analysis" else module).main
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        # as `python -m`: warnings shown once each, as in a fresh process
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.simplefilter("default")
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse's refusals and --help
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess([module, *map(str, args)], code or 0, out.getvalue(), err.getvalue())


def wait_until(cond, proc: subprocess.Popen, what: str, timeout: float = 300, poll: float = 0.05) -> None:
    """Poll ``cond()`` until it holds; fail if ``proc`` ends first or ``timeout`` passes (then
    ``proc`` is killed). A file being replaced while read counts as 'not yet'."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the process ended before {what}: {proc.communicate()[1][-3000:]}")
        try:
            if cond():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(poll)
    proc.kill()
    pytest.fail(f"no {what} after {timeout} s")


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# Small, fast settings for end-to-end runs on 2 CPU cores (conf/debug/tiny.yaml: synthetic data,
# ResNet-20, 512/128 examples, batch 32, one thread, no progress bar, W&B disabled). Overrides
# given after it win over it.
TINY = ("debug=tiny",)


@pytest.fixture(scope="session")
def real_sweep(tmp_path_factory) -> Path:
    """A results tree holding one real tiny sweep (results/rq1_scope: dense SGD and block-k at 2
    ranks, 3 steps, and top-k with AllReduce, which is refused: a failed point), run once a
    session for every test that only reads it (the analysis, the notebooks). Returns the tree."""
    results = tmp_path_factory.mktemp("real_sweep") / "results"
    sweep = results / "rq1_scope"
    proc = run_cli(*TINY, "-m", "scheme=none,blockk,topk", "aggregation=allreduce", "world_size=2",
                   "train.max_steps=3", f"hydra.sweep.dir={sweep}")
    assert proc.returncode != 0  # top-k with AllReduce is refused; the others complete
    statuses = sorted(read_json(p)["status"] for p in sweep.glob("*/summary.json"))
    assert statuses == ["completed", "completed", "failed"], proc.stderr[-3000:]
    # each job's config files where the analysis reads them (cli._settle_hydra_files), none left staged
    assert all((job / ".hydra" / "overrides.yaml").is_file() and not (job / ".hydra.attempt").exists()
               for job in sweep.glob("[0-9]")), sorted(map(str, sweep.rglob("*")))
    return results


@pytest.fixture
def tiny():
    return TINY


def read_terminal(master: int, proc, timeout: float, each=None) -> bytes:
    """Everything a process writes to the pty ``master`` until it closes the terminal or exits
    (or ``timeout`` seconds pass). ``each()`` is called after every read or idle poll (the
    tests type keys from it)."""
    import os
    import select

    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
        if each is not None:
            each()
    return out


def slurm_state() -> str:
    """The SLURM node's state and the queue, for a failure message."""
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], capture_output=True, text=True,
                           timeout=30).stdout.strip()
    return f"node: {node!r}; queue: {queue or 'empty'!r}"


@pytest.fixture
def empty_slurm_queue():
    """Start a SLURM test on an empty queue. A job an earlier test cancelled holds the node's CPUs
    while it completes, and a 2-task job needs both, so it would wait behind it and eat into the
    test's own timeouts (CI once failed that way)."""
    deadline = time.monotonic() + 300
    while subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30).stdout.strip():
        if time.monotonic() > deadline:
            pytest.fail(f"the SLURM cluster still has jobs after 300 s: {slurm_state()}")
        time.sleep(1)


# ---- what a tier costs (docs/testing.md) --------------------------------------------------------
# SPARSETRAIN_TEST_COST=<file> makes every Python interpreter the tests start (a command, a rank, a
# SLURM job: any that inherits the environment) append its test's id to <file>, through a
# sitecustomize put first on PYTHONPATH; commands that are not Python (git, make, srun) are counted
# where the test starts them. Each test's wall time and CPU time (its own and its finished
# child processes': on a loaded machine the CPU time still says what the test costs) go there too.
# At the end pytest prints the totals and the tests that cost most.
_COST_FILE = os.environ.get("SPARSETRAIN_TEST_COST")
_SITECUSTOMIZE = """import os
with open(os.environ["SPARSETRAIN_TEST_COST"], "a") as f:
    f.write("python\\t" + os.environ.get("SPARSETRAIN_TEST_ID", "?") + "\\n")
"""


def _count_launches(tmp_dir: Path) -> None:
    (tmp_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_dir), os.environ.get("PYTHONPATH")) if p)
    init = subprocess.Popen.__init__

    def counted(self, args, *rest, **kwargs):
        program = Path(str(args[0] if isinstance(args, (list, tuple)) else str(args).split()[0])).name
        env = kwargs.get("env") or os.environ
        # a Python one counts itself, unless its environment drops the sitecustomize
        if not program.startswith("python") or str(tmp_dir) not in env.get("PYTHONPATH", ""):
            with open(_COST_FILE, "a") as f:
                kind = "python" if program.startswith("python") else program
                f.write(f"{kind}\t{os.environ.get('SPARSETRAIN_TEST_ID', '?')}\n")
        init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = counted


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config):
    if _COST_FILE:
        import tempfile

        _count_launches(Path(tempfile.mkdtemp(prefix="sparsetrain-cost-")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _COST_FILE:
        yield
        return
    os.environ["SPARSETRAIN_TEST_ID"] = item.nodeid
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    with open(_COST_FILE, "a") as f:
        f.write(f"cost\t{item.nodeid}\t{time.monotonic() - wall:.2f}\t{_cpu_seconds() - cpu:.2f}\n")


# SPARSETRAIN_TEST_DEADLINE=<Unix time>: CI's time budget for the full tier (.ci/run sets it so
# that CI ends inside its hard limit). A test that would start after it is skipped, saying so, and
# the summary names every one: a slow CI machine then lands with a list of what did not run,
# instead of being cut off at the limit with no report at all.
_DEADLINE = float(os.environ.get("SPARSETRAIN_TEST_DEADLINE") or "inf")
_PAST_DEADLINE = "not run: past CI's time budget (SPARSETRAIN_TEST_DEADLINE)"


def pytest_runtest_setup(item):
    if time.time() > _DEADLINE:
        pytest.skip(_PAST_DEADLINE)


def _skip_reason(report) -> str:
    """A skipped test's reason, as the process that ran it sent it (a tuple (path, line, reason)
    in-process and from pytest-xdist's workers alike)."""
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter):
    # Read from the reports, not from a list the hook fills: under pytest-xdist the skips happen in
    # the workers, and only their reports reach this process.
    past = [r.nodeid for r in terminalreporter.stats.get("skipped", []) if _PAST_DEADLINE in _skip_reason(r)]
    if past:
        terminalreporter.write_line(f"time budget: {len(past)} tests not run, past "
                                    "SPARSETRAIN_TEST_DEADLINE:", red=True)
        for nodeid in sorted(past):
            terminalreporter.write_line(f"  {nodeid}")
    if not _COST_FILE or not Path(_COST_FILE).exists():
        return
    from collections import Counter

    rows = [line.split("\t") for line in Path(_COST_FILE).read_text().splitlines()]
    launches = [row for row in rows if row[0] != "cost"]
    costs = {row[1]: (float(row[2]), float(row[3])) for row in rows if row[0] == "cost"}
    per_test = Counter(row[1] for row in launches)
    python = sum(row[0] == "python" for row in launches)
    write = terminalreporter.write_line
    write(f"cost: {len(costs)} tests, {sum(w for w, _ in costs.values()):.0f} s wall, "
          f"{sum(c for _, c in costs.values()):.0f} s CPU; processes started: {len(launches)} "
          f"({python} Python interpreters, {len(launches) - python} other commands) by {len(per_test)} tests")
    for test, (w, c) in sorted(costs.items(), key=lambda kv: -kv[1][1])[:25]:
        write(f"  {c:7.1f} s CPU {w:7.1f} s wall {per_test.get(test, 0):4d} processes  {test}")
