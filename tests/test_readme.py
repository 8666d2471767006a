"""The documentation's code must run as written: the core library's snippet (docs/library.md,
moved there from README.md) and the DDP hook's (docs/ddp.md)."""

import os
import re
import socket
import subprocess
import sys

from conftest import ROOT

DOCS = ("README.md", "docs/library.md", "docs/ddp.md")


def _blocks():
    blocks = []
    for name in DOCS:
        found = re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), flags=re.S)
        assert found or name == "README.md", f"no python block in {name}"
        blocks += found
    return blocks


def test_core_library_snippet_runs():
    for code in _blocks():
        if "register_comm_hook" in code:  # a torchrun script: test_ddp_hook_snippet_runs
            continue
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "sent" in proc.stdout


def test_ddp_hook_snippet_runs(tmp_path):
    """The DDP hook example, on 2 gloo ranks with the variables torchrun sets."""
    (code,) = [c for c in _blocks() if "register_comm_hook" in c]
    script = tmp_path / "script.py"
    script.write_text(code)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        sent, dense = map(int, re.search(rf"rank {rank}: sent (\d+) of (\d+) bytes", out).groups())
        assert 0 < sent < dense / 5
