"""netcluster (``python -m sparsetrain.launch.netcluster``): one
torchrun node per rate-limited network namespace, joined by c10d rendezvous, cleaned up on every
exit.

Needs root, `ip netns` and tc's tbf qdisc; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULE = ["-m", "sparsetrain.launch.netcluster"]
pytestmark = [pytest.mark.netns, pytest.mark.slow]


def _netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    probe = f"stprobe{os.getpid() % 100000}"
    try:
        p = subprocess.run(
            ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10
        )
        if p.returncode != 0:
            return f"`ip netns add` does not work here: {p.stderr.strip()}"
        p = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1gbit",
                "burst",
                "64kb",
                "latency",
                "10ms",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if p.returncode != 0:
            return f"tc tbf qdisc unavailable: {p.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


_PROBLEM = _netns_problem()
requires_netns = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


def _prefix(tag: str) -> str:
    return f"st{tag}{os.getpid() % 100000}"


def _leftovers(prefix: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = os.listdir("/sys/class/net")
    hosts = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    return [n for n in ns + links + hosts if n.startswith(prefix)]


def _run(args, timeout=180, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *MODULE, *args], capture_output=True, text=True, timeout=timeout,
        cwd=REPO, env=env, **kw
    )


_BENCH = textwrap.dedent(
    """
    import datetime, json, os, subprocess, time
    import torch, torch.distributed as dist
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", os.environ["ST_NETNS_IFNAME"]],
                           capture_output=True, text=True).stdout
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    x = torch.ones(MB * 2**20 // 4)
    dist.all_reduce(torch.ones(16))  # connections up
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    dt = time.perf_counter() - t0
    ok = bool((x == dist.get_world_size()).all())
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
           "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID",
           "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "ST_NETNS_NODE",
           "ST_NETNS_NAME")}
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(bytes(1), b" ").decode()
    netns = subprocess.run(["ip", "netns", "identify", str(os.getppid())], capture_output=True,
                           text=True).stdout.strip()
    print("RESULT " + json.dumps(dict(rank=dist.get_rank(), dt=dt, ok=ok, qdisc=qdisc, env=env,
                                      parent=parent, parent_netns=netns)), flush=True)
    dist.destroy_process_group()
    """
)


@requires_netns
def test_gloo_allreduce_is_rate_limited_and_cleaned_up(tmp_path):
    mb, rate_mbit = 4, 50
    script = tmp_path / "bench.py"
    script.write_text(_BENCH.replace("MB", str(mb)))
    prefix = _prefix("t")
    p = _run(
        [
            "--nproc",
            "2",
            "--rate",
            f"{rate_mbit}mbit",
            "--prefix",
            prefix,
            "--",
            sys.executable,
            str(script),
        ],
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in p.stdout.splitlines()
        if "RESULT " in line
    ]
    assert sorted(r["rank"] for r in res) == [0, 1], p.stdout
    for r in res:
        assert r["ok"]
        # The shaper is really there, at the configured rate, on the rank's own veth.
        assert "tbf" in r["qdisc"] and f"rate {rate_mbit}Mbit" in r["qdisc"], r["qdisc"]
        e = r["env"]
        assert e["WORLD_SIZE"] == "2" and e["MASTER_ADDR"] == "10.77.0.1"
        assert e["GLOO_SOCKET_IFNAME"] == f"{prefix}n{r['rank']}"
        assert e["TORCHELASTIC_RUN_ID"] == prefix
        # One torchrun per namespace, each a node of a 2-node job through c10d rendezvous: every
        # rank is local rank 0 of its own node, node r in namespace r, its parent a torchrun
        # running in the same namespace.
        assert e["LOCAL_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["GROUP_RANK"] == e["RANK"] == e["ST_NETNS_NODE"] == str(r["rank"])
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert "torch.distributed.run" in r["parent"] and "--rdzv-backend=c10d" in r["parent"]
        assert r["parent_netns"] == e["ST_NETNS_NAME"] == f"{prefix}-r{r['rank']}"
    # A 2-rank ring all-reduce sends the whole tensor once each way: mb MiB at rate_mbit.
    expected = mb * 2**20 * 8 / (rate_mbit * 1e6)
    dt = max(r["dt"] for r in res)
    assert expected / 2 < dt < expected * 3, (dt, expected)
    assert _leftovers(prefix) == []


@requires_netns
def test_failing_rank_stops_others_exits_nonzero_and_cleans_up():
    prefix = _prefix("f")
    t0 = time.monotonic()
    p = _run(
        [
            "--nproc",
            "3",
            "--rate",
            "100mbit",
            "--prefix",
            prefix,
            "--kill-timeout",
            "3",
            "--",
            "bash",
            "-c",
            'if [ "$RANK" = 1 ]; then exit 3; fi; trap "" TERM; sleep 120',
        ],
        timeout=60,
    )
    elapsed = time.monotonic() - t0
    # the failed worker's own exit code, read from its torchrun's failure summary
    assert p.returncode == 3, p.stderr
    # the others were killed (they ignore SIGTERM: SIGKILL after 3 s), not left to sleep 120 s;
    # torchrun's start-up and rendezvous take ~10 s of this on a loaded 2-core box
    assert elapsed < 60, elapsed
    assert f"rank 1 (netns {prefix}-r1) exited with 3" in p.stderr
    assert _leftovers(prefix) == []


def _wait_for_namespaces(prefix: str, timeout: float = 30) -> None:
    """Until the launcher has made the last rank's namespace (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while (
        time.monotonic() < deadline
        and f"{prefix}-r1"
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    ):
        time.sleep(0.1)


@requires_netns
def test_sigterm_to_launcher_cleans_up():
    prefix = _prefix("s")
    proc = subprocess.Popen(
        [sys.executable, *MODULE, "--nproc", "2", "--prefix", prefix, "--", "sleep", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_namespaces(prefix)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert _leftovers(prefix) == []


@requires_netns
def test_cleanup_subcommand_removes_leftovers_of_a_killed_run():
    prefix = _prefix("k")
    proc = subprocess.Popen(
        [sys.executable, *MODULE, "--nproc", "2", "--prefix", prefix, "--", "sleep", "120"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_namespaces(prefix)
    time.sleep(0.5)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait()
    assert _leftovers(prefix), "expected leftovers after SIGKILL"
    p = _run(["cleanup", "--prefix", prefix], timeout=60)
    assert p.returncode == 0, p.stderr
    assert _leftovers(prefix) == []


@requires_netns
def test_training_run_measures_its_time_to_a_target_on_the_emulated_link(tmp_path):
    """A training run on 2 namespaces at 200 Mbit/s with ``train.stop_at_accuracy``: its summary
    records the link and when the target was reached, and the end-to-end check lists it (a tiny
    run on random data does not train, so it is listed with that status and not compared:
    tests/test_time_to_accuracy.py checks the comparison)."""
    run = tmp_path / "run"
    prefix = _prefix("e")
    p = _run(["--nproc", "2", "--rate", "200mbit", "--prefix", prefix, "--", sys.executable, "-m",
              "sparsetrain.run", "debug=tiny", "world_size=2", "scheme=randk", "aggregation=allreduce",
              "data.val_size=64", "train.curve_points=4", "train.curve_size=64", "train.stop_at_accuracy=0.01",
              f"hydra.run.dir={run}"], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["link"] == {"rate": "200mbit", "rate_bits": 2e8, "delay_us": 0.0}
    assert s["target"]["reached"] and s["steps"] == s["target"]["step"] > 0
    assert s["load"]["local_ranks"] == 2  # both namespaces' ranks share this machine (1 thread each here)
    check = subprocess.run([sys.executable, "-m", "sparsetrain.analysis.cluster_check", "--runs", str(run)],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert check.returncode in (0, 1), check.stderr
    row = [line for line in check.stdout.splitlines() if "randk" in line]
    assert len(row) == 1 and ("did not train" in row[0] or "completed" in row[0]), check.stdout
    assert _leftovers(prefix) == []
