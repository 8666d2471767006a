"""netcluster: a bandwidth-limited cluster on one machine, one torchrun node per network namespace.

    sudo .venv/bin/python -m sparsetrain.launch.netcluster --nproc 4 --rate 1gbit -- \
        .venv/bin/python -m sparsetrain.run world_size=4 ...
    sudo .venv/bin/python -m sparsetrain.launch.netcluster cleanup   # leftovers of killed runs


Topology (per invocation, names start with a unique prefix, default st<pid>):

    netns <P>-r0  [<P>n0 10.77.0.1/24] --veth-- [<P>h0] --+
    netns <P>-r1  [<P>n1 10.77.0.2/24] --veth-- [<P>h1] --+-- bridge <P>br (no IP address)
    ...                                                   |

Every veth end is shaped with `tc` on its egress: the namespace end limits what a rank sends, the
bridge end limits what it receives. Links are full duplex at --rate each way, like ranks on a
switch with --rate ports. --delay is the one-way latency between two ranks (half of it on each of
the two hops; needs the kernel's sch_netem). The bridge has no address, so the root namespace and
the outside world cannot reach the ranks and their traffic stays inside these namespaces.

Each namespace is one node of a multi-node torchrun job: one real ``torchrun`` per namespace
(``--nnodes N --nproc-per-node 1 --rdzv-backend c10d``, the rendezvous store hosted by node 0 at
10.77.0.1:--master-port, ``--rdzv-id`` = the prefix, ``--local-addr`` = the namespace's address,
``--no-python``), which runs the command after `--` once, as root, in the current directory. So
the ranks get their RANK, WORLD_SIZE, LOCAL_RANK (0), GROUP_RANK, MASTER_ADDR/PORT and
TORCHELASTIC_* from torchrun's c10d rendezvous across the namespaces, exactly as on real nodes;
the rendezvous numbers nodes by address, so rank r runs in namespace r (up to 9 nodes; beyond, in
the addresses' string order). netcluster adds only what a node's environment would hold:
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME (the namespace's veth), ST_NETNS_*
(name, interface, address, node, rate, delay, prefix). Output
lines are prefixed with `[rN]` (N: the namespace).

When a node's torchrun exits non-zero (its worker failed) the other nodes get SIGTERM, then
SIGKILL after --kill-timeout seconds; netcluster exits with the failed worker's exit code (read
from torchrun's failure summary; torchrun's own code otherwise). Namespaces, veths, the bridge and
any process left inside the namespaces are removed on every exit path (normal, failure, Ctrl-C,
SIGTERM, SIGHUP). Only a SIGKILL of netcluster itself can leave something behind; `cleanup`
removes it.

Over 400 lines on purpose: one program whose parts (namespaces, links and their qdiscs, one
torchrun per node, output relay, cleanup of every trace on any exit) share one ``Cluster`` and
its naming; each part is short.
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
    print(f"[netcluster] {msg}", file=sys.stderr, flush=True)


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
        kill_ns_pids(*self.created_ns)
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


def kill_ns_pids(*namespaces: str, grace: float = 3.0) -> None:
    """End processes still inside these namespaces (ours: this program put them there): SIGTERM
    to all of them, SIGKILL to what is left after ``grace`` seconds."""

    def pids() -> list[int]:
        out = []
        for ns in namespaces:
            p = sh("ip", "netns", "pids", ns, check=False)
            out += [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != os.getpid()]
        return out

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


# ------------------------------------------------------------------------------------ nodes
_EXITCODE_RE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_GLOBAL_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)")


def default_torchrun() -> list[str]:
    """This python's ``-m torch.distributed.run`` when it has torch, else ``torchrun`` on PATH."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return [sys.executable, "-m", "torch.distributed.run"]
    if exe := shutil.which("torchrun"):
        return [exe]
    raise SetupError(f"no torch in {sys.executable} and no torchrun on PATH: run netcluster with "
                     "the venv's python, or give --torchrun")


def torchrun_command(cl: Cluster, node: int, port: int, cmd: list[str],
                     torchrun: list[str] | None = None) -> list[str]:
    """The torchrun that runs in namespace ``node``: one node of ``cl.n``, one process per node,
    c10d rendezvous at node 0's address (node 0 hosts the store), ``cmd`` run as is."""
    torchrun = torchrun or default_torchrun()
    return [
        *torchrun,
        f"--nnodes={cl.n}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={cl.addr(0)}:{port}",
        f"--rdzv-id={cl.p}",
        f"--rdzv-conf=is_host={1 if node == 0 else 0}",
        f"--local-addr={cl.addr(node)}",  # the node's name in the rendezvous: ranks sort by it
        "--max-restarts=0",
        "--monitor-interval=0.2",
        "--no-python",
        *cmd,
    ]


def node_env(cl: Cluster, node: int, base: dict[str, str]) -> dict[str, str]:
    """What every process in namespace ``node`` inherits (torchrun adds the rank variables)."""
    env = dict(base)
    env.update(
        {
            "GLOO_SOCKET_IFNAME": cl.inner(node),
            "NCCL_SOCKET_IFNAME": cl.inner(node),
            "TP_SOCKET_IFNAME": cl.inner(node),
            "ST_NETNS_NAME": cl.ns(node),
            "ST_NETNS_IFNAME": cl.inner(node),
            "ST_NETNS_ADDR": cl.addr(node),
            "ST_NETNS_NODE": str(node),
            "ST_NETNS_RATE": cl.rate,
            "ST_NETNS_RATE_BITS": f"{cl.rate_bps:.0f}",
            "ST_NETNS_DELAY_US": f"{cl.delay_us:g}",
            "ST_NETNS_PREFIX": cl.p,
            # every namespace is on this one machine: its CPUs are shared by all cl.n ranks, which
            # torchrun's LOCAL_WORLD_SIZE (1 per node) does not say (launch.env.rank_info reads it)
            "ST_NETNS_HOST_RANKS": str(cl.n),
        }
    )
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cl.n)))
    return env


class _Node:
    """One torchrun in its namespace; remembers the failed worker's exit code torchrun reports."""

    def __init__(self, index: int, proc: subprocess.Popen):
        self.index = index
        self.proc = proc
        self.worker_exitcode: int | None = None
        self.worker_rank: int | None = None
        self.pump: threading.Thread | None = None

    def read(self, stream, prefix: str, out) -> None:
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace")
            if (m := _EXITCODE_RE.search(text)) and self.worker_exitcode is None:
                self.worker_exitcode = int(m.group(1))
            if (m := _GLOBAL_RANK_RE.match(text)) and self.worker_rank is None:
                self.worker_rank = int(m.group(1))
            out.buffer.write(prefix.encode() + line)
            out.buffer.flush()
        stream.close()

    def code(self, rc: int) -> int:
        """The exit code to report: the worker's (torchrun's failure summary) over torchrun's 1."""
        if rc != 0 and self.worker_exitcode not in (None, 0):
            return self.worker_exitcode
        return rc


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_nodes(
    cl: Cluster,
    cmd: list[str],
    port: int,
    kill_timeout: float,
    prefix_output: bool,
    stop: threading.Event,
    torchrun: list[str] | None = None,
) -> int:
    """Start one torchrun per namespace and wait. When one exits non-zero (or on ``stop``) the
    others get SIGTERM, then SIGKILL after ``kill_timeout``; returns the first failure's code
    (the worker's, from torchrun's summary), 130 on ``stop``, else 0."""
    torchrun = torchrun or default_torchrun()
    base = dict(os.environ)
    nodes: list[_Node] = []
    for r in range(cl.n):
        p = subprocess.Popen(
            ["ip", "netns", "exec", cl.ns(r), *torchrun_command(cl, r, port, cmd, torchrun)],
            env=node_env(cl, r, base),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        node = _Node(r, p)
        node.pump = threading.Thread(
            target=node.read, args=(p.stdout, f"[r{r}] " if prefix_output else "", sys.stdout),
            daemon=True,
        )
        node.pump.start()
        nodes.append(node)

    codes: list[int | None] = [None] * cl.n
    first_fail: int | None = None
    deadline: float | None = None
    while any(c is None for c in codes):
        for r, node in enumerate(nodes):
            if codes[r] is None and (rc := node.proc.poll()) is not None:
                if node.pump is not None:
                    node.pump.join(timeout=2)  # its failure summary is read
                codes[r] = node.code(rc)
                if codes[r] != 0 and first_fail is None:
                    first_fail = r
        if (first_fail is not None or stop.is_set()) and deadline is None:
            if first_fail is not None:
                rank = nodes[first_fail].worker_rank
                who = f"rank {rank}" if rank is not None else f"node {first_fail}"
                why = f"{who} (netns {cl.ns(first_fail)}) exited with {codes[first_fail]}"
            else:
                why = "signal"
            if any(c is None for c in codes):
                log(f"{why}: stopping the other nodes (SIGTERM, SIGKILL after {kill_timeout:g} s)")
            else:
                log(why)
            for r, node in enumerate(nodes):
                if codes[r] is None:
                    kill_group(node.proc, signal.SIGTERM)
            deadline = time.monotonic() + kill_timeout
        if deadline is not None and time.monotonic() > deadline:
            for r, node in enumerate(nodes):
                if codes[r] is None:
                    kill_group(node.proc, signal.SIGKILL)
            deadline = time.monotonic() + 3600  # killed; just reap
        time.sleep(0.05)
    for node in nodes:
        if node.pump is not None:
            node.pump.join(timeout=2)
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
                cmdline = f.read()
            alive = b"netns_cluster" in cmdline or b"netcluster" in cmdline
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
        ap = argparse.ArgumentParser(prog="netcluster cleanup")
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
        prog="netcluster", description="N torchrun nodes in rate-limited network namespaces"
    )
    ap.add_argument("--nproc", type=int, default=2, help="number of nodes = namespaces = ranks (default 2)")
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
    ap.add_argument("--master-port", type=int, default=29500,
                    help="port of the c10d rendezvous store on node 0 (default 29500)")
    ap.add_argument("--torchrun", default=None,
                    help="torchrun command, split on spaces (default: this python -m torch.distributed.run)")
    ap.add_argument("--prefix", default=f"st{os.getpid()}", help="name prefix (default st<pid>)")
    ap.add_argument(
        "--kill-timeout",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL for the other nodes when one fails",
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
            f"{a.nproc} torchrun nodes in netns {cl.ns(0)}..{cl.ns(a.nproc - 1)}, {a.rate} each way, "
            f"delay {cl.delay_us:g} us one-way, burst {cl.burst}, rendezvous {cl.addr(0)}:{a.master_port}"
        )
        if stop.is_set():
            return 130
        rc = run_nodes(cl, cmd, a.master_port, a.kill_timeout, not a.no_prefix_output, stop,
                       a.torchrun.split() if a.torchrun else None)
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
                    f"WARNING: could not remove {' '.join(left)}; run "
                    f"`python -m sparsetrain.launch.netcluster cleanup --prefix {cl.p}`"
                )
                rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
