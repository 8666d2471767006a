import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The tests' own table from a scheme's name to its class; training has no such table, it takes the
# class from conf/scheme/<name>.yaml (tests/test_config.py checks that the two agree).
SCHEME_CLASSES = {"none": "NoCompression", "topk": "TopK", "randk": "RandomK", "blockk": "BlockRandomK",
                  "powersgd": "PowerSGD", "signsgd": "SignSGD", "qsgd": "QSGD"}


def compressor_for(scheme: str, block_size: int | None = None):
    """What ``scheme.compressor`` instantiates to for ``scheme`` (a ``functools.partial`` of the
    class; ``block_size`` applies to block-k only), for the library calls tests make by hand;
    None for dense SGD (``scheme='none'``)."""
    from functools import partial

    import sparsetrain.compress as compress

    if scheme == "none":
        return None
    options = {"block_size": block_size} if scheme == "blockk" and block_size is not None else {}
    return partial(getattr(compress, SCHEME_CLASSES[scheme]), **options)


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
