#!/usr/bin/env python3
"""A bandwidth-limited cluster on one machine: N ranks in N network namespaces.

    sudo scripts/netns_cluster.py --nproc 4 --rate 1gbit -- .venv/bin/python -m sparsetrain.run ...
    sudo scripts/netns_cluster.py cleanup            # remove leftovers of killed runs

Topology (per invocation, names start with a unique prefix, default st<pid>):

    netns <P>-r0  [<P>n0 10.77.0.1/24] --veth-- [<P>h0] --+
    netns <P>-r1  [<P>n1 10.77.0.2/24] --veth-- [<P>h1] --+-- bridge <P>br (no IP address)
    ...                                                   |

Every veth end is shaped with `tc` on its egress: the namespace end limits what a rank sends, the
bridge end limits what it receives. Links are full duplex at --rate each way, like ranks on a
switch with --rate ports. --delay is the one-way latency between two ranks (half of it on each of
the two hops; needs the kernel's sch_netem). The bridge has no address, so the root namespace and
the outside world cannot reach the ranks and their traffic stays inside these namespaces.

The command after `--` runs once per rank inside its namespace (as root, in the current directory)
with torchrun-style variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR (rank 0's address), MASTER_PORT, TORCHELASTIC_RUN_ID, plus SPARSETRAIN_LAUNCHER=external,
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME (the namespace's veth) and ST_NETNS_*
(name, interface, address, rate, delay). Output lines are prefixed with `[rN]`.

When a rank exits non-zero the others get SIGTERM, then SIGKILL after --kill-timeout seconds; the
script exits with the first failing rank's code. Namespaces, veths and the bridge are removed on
every exit path (normal, rank failure, Ctrl-C, SIGTERM, SIGHUP). Only a SIGKILL of this script can
leave something behind; `cleanup` removes it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

SUBNET_DEFAULT = "10.77.0"
_RATE_RE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*$", re.I)
_TIME_RE = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s)?\s*$", re.I)


class SetupError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[netns_cluster] {msg}", file=sys.stderr, flush=True)


def sh(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SetupError(f"`{' '.join(args)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9, '100mbit' -> 1e8, '50mbps' (bytes) -> 4e8. Same units as tc."""
    m = _RATE_RE.match(rate)
    if not m:
        raise SetupError(f"--rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit")
    val = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    return val * (8 if (m.group(3) or "").lower() == "bps" else 1)


def default_burst(rate: str) -> str:
    """tbf bucket: max(96 KiB, 1 ms of traffic at the rate). A 64 KiB GSO segment plus headers
    must fit in the bucket, otherwise tbf drops it and TCP crawls (measured with a 64 KiB bucket:
    0.32 instead of 0.49 Gbit/s at 500mbit)."""
    return f"{max(96 * 1024, int(rate_bits(rate) / 8 / 1000))}b"


def time_us(t: str) -> float:
    m = _TIME_RE.match(t)
    if not m:
        raise SetupError(f"time {t!r}: expected e.g. 0, 100us, 0.1ms, 2ms")
    return (
        float(m.group(1))
        * {"us": 1, "ms": 1e3, "s": 1e6, None: 1e3}[m.group(2).lower() if m.group(2) else None]
    )


# ------------------------------------------------------------------------------------ topology
class Cluster:
    def __init__(
        self,
        prefix: str,
        nproc: int,
        subnet: str,
        rate: str,
        delay: str,
        burst: str | None,
        queue: str,
        mtu: int,
    ):
        self.p = prefix
        self.n = nproc
        self.subnet = subnet
        self.rate = rate
        self.delay_us = time_us(delay)
        self.rate_bps = rate_bits(rate)
        self.burst = burst or default_burst(rate)
        self.queue = queue
        self.mtu = mtu
        self.bridge = f"{prefix}br"
        self.created_ns: list[str] = []
        self.created_links: list[str] = []

    def ns(self, r: int) -> str:
        return f"{self.p}-r{r}"

    def inner(self, r: int) -> str:
        return f"{self.p}n{r}"

    def outer(self, r: int) -> str:
        return f"{self.p}h{r}"

    def addr(self, r: int) -> str:
        return f"{self.subnet}.{r + 1}"

    def _shape(self, dev: str, netns: str | None) -> None:
        pre = ["ip", "netns", "exec", netns] if netns else []
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.queue]
        half_delay = self.delay_us / 2
        if half_delay > 0:
            p = sh(
                *pre,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{half_delay:g}us",
                "limit",
                "100000",
                check=False,
            )
            if p.returncode != 0:
                raise SetupError(
                    f"--delay needs the kernel's netem qdisc (sch_netem), which this kernel lacks "
                    f"({p.stderr.strip()}); run with --delay 0 or on a kernel with CONFIG_NET_SCH_NETEM"
                )
            sh(*pre, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)

    def up(self) -> None:
        if self.n > 253:
            raise SetupError("--nproc must be <= 253 (one /24)")
        for name in (self.bridge, self.outer(self.n - 1), self.inner(self.n - 1)):
            if len(name) > 15:
                raise SetupError(
                    f"interface name {name!r} longer than 15 characters: use a shorter --prefix"
                )
        sh(
            "ip",
            "link",
            "add",
            self.bridge,
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        )
        self.created_links.append(self.bridge)
        # Bridged frames must not go through the host's iptables (br_netfilter), whatever it holds.
        for opt in ("nf_call_iptables", "nf_call_ip6tables", "nf_call_arptables"):
            sh("ip", "link", "set", self.bridge, "type", "bridge", opt, "0", check=False)
        sh("ip", "link", "set", self.bridge, "up")
        for r in range(self.n):
            ns, inner, outer = self.ns(r), self.inner(r), self.outer(r)
            sh("ip", "netns", "add", ns)
            self.created_ns.append(ns)
            sh(
                "ip",
                "link",
                "add",
                outer,
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                inner,
                "mtu",
                str(self.mtu),
                "netns",
                ns,
            )
            self.created_links.append(outer)
            sh("ip", "link", "set", outer, "master", self.bridge)
            sh("ip", "link", "set", outer, "up")
            ex = ["ip", "netns", "exec", ns]
            sh(*ex, "ip", "link", "set", "lo", "up")
            # IPv4 only: gloo picks the interface's first address, and an IPv6 link-local one
            # would need a scope id it does not give.
            sh(*ex, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", check=False)
            sh(*ex, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1", check=False)
            sh(*ex, "ip", "addr", "add", f"{self.addr(r)}/24", "dev", inner)
            sh(*ex, "ip", "link", "set", inner, "up")
            self._shape(inner, ns)  # what rank r sends
            self._shape(outer, None)  # what rank r receives
        self._write_hosts()

    def _write_hosts(self) -> None:
        """`ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: inside rank r the
        machine's hostname resolves to r's veth address and every rank has a name (<P>-rN), so
        reverse lookups of peers work (quiets c10d's "hostname ... cannot be retrieved")."""
        host = socket.gethostname()
        names = "".join(f"{self.addr(q)}\t{self.ns(q)}\n" for q in range(self.n))
        for r in range(self.n):
            d = f"/etc/netns/{self.ns(r)}"
            os.makedirs(d, exist_ok=True)
            with open(f"{d}/hosts", "w") as f:
                f.write(f"127.0.0.1\tlocalhost\n{self.addr(r)}\t{host}\n{names}")

    def down(self) -> list[str]:
        """Remove everything this cluster created; returns what could not be removed."""
        left = []
        for ns in self.created_ns:
            kill_ns_pids(ns)
        for ns in self.created_ns:
            if sh("ip", "netns", "del", ns, check=False).returncode != 0 and ns in list_netns():
                left.append(ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for link in self.created_links:  # veth peers vanish with their namespace
            if link_exists(link):
                sh("ip", "link", "del", link, check=False)
                if link_exists(link):
                    left.append(link)
        self.created_ns.clear()
        self.created_links.clear()
        return left


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def list_netns() -> list[str]:
    p = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def kill_ns_pids(ns: str, grace: float = 3.0) -> None:
    """End processes still inside namespace ns (ours: this script put them there)."""

    def pids() -> list[int]:
        p = sh("ip", "netns", "pids", ns, check=False)
        return [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != os.getpid()]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        live = pids()
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and pids():
            time.sleep(0.05)


# ------------------------------------------------------------------------------------ ranks
def pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.buffer.write(prefix.encode() + line)
        out.buffer.flush()
    stream.close()


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_ranks(
    cl: Cluster,
    cmd: list[str],
    master_port: int,
    kill_timeout: float,
    prefix_output: bool,
    stop: threading.Event,
) -> int:
    base = dict(os.environ)
    threads_per_rank = max(1, (os.cpu_count() or 1) // cl.n)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for r in range(cl.n):
        env = dict(base)
        env.update(
            {
                "RANK": str(r),
                "WORLD_SIZE": str(cl.n),
                # All ranks share this machine's devices: local rank = rank, one "group" (node).
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(cl.n),
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "ROLE_RANK": str(r),
                "ROLE_WORLD_SIZE": str(cl.n),
                "MASTER_ADDR": cl.addr(0),
                "MASTER_PORT": str(master_port),
                "TORCHELASTIC_RUN_ID": cl.p,
                "SPARSETRAIN_LAUNCHER": "external",
                "GLOO_SOCKET_IFNAME": cl.inner(r),
                "NCCL_SOCKET_IFNAME": cl.inner(r),
                "TP_SOCKET_IFNAME": cl.inner(r),
                "ST_NETNS_NAME": cl.ns(r),
                "ST_NETNS_IFNAME": cl.inner(r),
                "ST_NETNS_ADDR": cl.addr(r),
                "ST_NETNS_RATE": cl.rate,
                "ST_NETNS_RATE_BITS": f"{cl.rate_bps:.0f}",
                "ST_NETNS_DELAY_US": f"{cl.delay_us:g}",
                "ST_NETNS_PREFIX": cl.p,
            }
        )
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
        out = subprocess.PIPE if prefix_output else None
        p = subprocess.Popen(
            ["ip", "netns", "exec", cl.ns(r), *cmd],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if prefix_output else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(p)
        if prefix_output:
            t = threading.Thread(target=pump, args=(p.stdout, f"[r{r}] ", sys.stdout), daemon=True)
            t.start()
            pumps.append(t)

    codes: list[int | None] = [None] * cl.n
    first_fail: int | None = None
    deadline: float | None = None
    while any(c is None for c in codes):
        for r, p in enumerate(procs):
            if codes[r] is None and (rc := p.poll()) is not None:
                codes[r] = rc
                if rc != 0 and first_fail is None:
                    first_fail = r
        if (first_fail is not None or stop.is_set()) and deadline is None:
            why = (
                f"rank {first_fail} exited with {codes[first_fail]}"
                if first_fail is not None
                else "signal"
            )
            if any(c is None for c in codes):
                log(f"{why}: stopping the other ranks (SIGTERM, SIGKILL after {kill_timeout:g} s)")
            for r, p in enumerate(procs):
                if codes[r] is None:
                    kill_group(p, signal.SIGTERM)
            deadline = time.monotonic() + kill_timeout
        if deadline is not None and time.monotonic() > deadline:
            for r, p in enumerate(procs):
                if codes[r] is None:
                    kill_group(p, signal.SIGKILL)
            deadline = time.monotonic() + 3600  # killed; just reap
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=2)
    log("exit codes: " + " ".join(f"r{r}={c}" for r, c in enumerate(codes)))
    if first_fail is not None:
        c = codes[first_fail]
        return c if c and c > 0 else 128 + (-c if c else 1)
    if stop.is_set():
        return 130
    return 0


# ------------------------------------------------------------------------------------ commands
def check_env() -> None:
    if os.geteuid() != 0:
        raise SetupError("needs root (network namespaces, veth, tc): run with sudo")
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            raise SetupError(f"`{tool}` not found: apt-get install iproute2 procps")


def cleanup(prefix: str | None) -> int:
    """Remove namespaces and links of dead invocations (st<pid> with no live pid), or all with prefix."""

    def dead_prefix(name: str) -> str | None:
        if prefix is not None:
            return prefix if name.startswith(prefix) else None
        m = re.match(r"^(st\d+)(?:-r\d+|n\d+|h\d+|br)$", name)
        if not m:
            return None
        pid = int(m.group(1)[2:])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                alive = b"netns_cluster" in f.read()
        except OSError:
            alive = False
        return None if alive else m.group(1)

    removed = []
    for ns in list_netns():
        if dead_prefix(ns):
            kill_ns_pids(ns)
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    if os.path.isdir("/etc/netns"):
        for ns in os.listdir("/etc/netns"):
            if dead_prefix(ns):
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    for name in sorted(os.listdir("/sys/class/net")):
        if dead_prefix(name) and link_exists(name):
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
    log("removed: " + (" ".join(removed) if removed else "nothing"))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["cleanup"]:
        ap = argparse.ArgumentParser(prog="netns_cluster.py cleanup")
        ap.add_argument(
            "--prefix",
            default=None,
            help="remove everything whose name starts with this (default: st<pid> of dead runs)",
        )
        a = ap.parse_args(argv[1:])
        check_env()
        return cleanup(a.prefix)

    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        print("error: give the command after `--`", file=sys.stderr)
        return 2
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="netns_cluster.py", description="N ranks in rate-limited network namespaces"
    )
    ap.add_argument("--nproc", type=int, default=2, help="number of ranks / namespaces (default 2)")
    ap.add_argument(
        "--rate", default="1gbit", help="per-link rate each way, tc units (default 1gbit)"
    )
    ap.add_argument(
        "--delay",
        default="0",
        help="one-way latency between two ranks, e.g. 0.1ms (needs sch_netem)",
    )
    ap.add_argument("--burst", default=None, help="tbf burst (default max(96KiB, 1 ms at --rate))")
    ap.add_argument("--queue", default="100ms", help="tbf queue as latency (default 100ms)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--subnet", default=SUBNET_DEFAULT, help="first three octets (default 10.77.0)")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--prefix", default=f"st{os.getpid()}", help="name prefix (default st<pid>)")
    ap.add_argument(
        "--kill-timeout",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL for the other ranks when one fails",
    )
    ap.add_argument(
        "--no-prefix-output", action="store_true", help="do not prefix output lines with [rN]"
    )
    a = ap.parse_args(opts)
    if not cmd:
        ap.error("empty command after --")
    if a.nproc < 1:
        ap.error("--nproc must be >= 1")

    stop = threading.Event()
    got_signal: list[int] = []
    cl: Cluster | None = None

    def on_signal(signum, _frame):
        if stop.is_set():
            return
        got_signal.append(signum)
        stop.set()
        log(f"got signal {signum}: stopping ranks and cleaning up")
        if cl is None or not cl.created_ns:
            raise KeyboardInterrupt

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    rc = 1
    try:
        check_env()
        cl = Cluster(a.prefix, a.nproc, a.subnet, a.rate, a.delay, a.burst, a.queue, a.mtu)
        cl.up()
        log(
            f"{a.nproc} ranks in netns {cl.ns(0)}..{cl.ns(a.nproc - 1)}, {a.rate} each way, "
            f"delay {cl.delay_us:g} us one-way, burst {cl.burst}, master {cl.addr(0)}:{a.master_port}"
        )
        if stop.is_set():
            return 130
        rc = run_ranks(cl, cmd, a.master_port, a.kill_timeout, not a.no_prefix_output, stop)
        if got_signal:
            rc = 128 + got_signal[0]
    except SetupError as e:
        log(f"ERROR: {e}")
        rc = 2
    except KeyboardInterrupt:
        rc = 128 + (got_signal[0] if got_signal else signal.SIGINT)
    finally:
        if cl is not None:
            # Signals during cleanup must not interrupt it.
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            left = cl.down()
            if left:
                log(
                    f"WARNING: could not remove {' '.join(left)}; run `{sys.argv[0]} cleanup --prefix {cl.p}`"
                )
                rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
