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
