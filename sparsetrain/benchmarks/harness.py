"""Shared machinery of the cluster benchmarks (``step``, ``ddp``, ``collectives``).

Driver side (root namespace, no torch): run a worker command on a fresh netcluster at one rate
(``run_on_cluster``), the paper-like rate, signals. Worker side (one rank per namespace, started
by torchrun): the rows built from the studies' own config (``study_config``,
``train.components``: the trainer's own build), the timing loop over
``train.step.TrainStep`` (``timed_steps``), interleaved rounds (``timing_stats.round_order``) and their
summary (``summarize``: the slowest rank per step, a round's median, the median over rounds with
its 95% interval).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sparsetrain.benchmarks.timing_stats import COMPUTE, median_interval, paired_ratio
from sparsetrain.costmodel import wire_bytes

REPO = Path(__file__).resolve().parents[2]
PAPER_SHARE = 0.27  # exchange / step for dense in the paper: (375 - 273) / 375


# ------------------------------------------------------------------------------------ driver
def rate_str(bits: float) -> str:
    return f"{bits / 1e6:.0f}mbit"


def dense_wire_bits(numel: int, world: int) -> float:
    """Bits one rank sends in a ring AllReduce of numel float32 (``costmodel.wire_bytes``)."""
    return 8 * wire_bytes("allreduce", 4 * numel, world)


def paper_rate(first: dict) -> float:
    """Bandwidth B where dense's exchange ~ 0.27 x its step, from a run at a known rate R.

    exchange(B) = overhead + wire_bits / B with overhead = exchange(R) - wire_bits / R (the
    CPU-bound part of the collective), and dense step = compute + exchange. Solve
    exchange = share/(1-share) x (dense step - exchange(R)).
    """
    m, s = first["meta"], first["schemes"]
    bits = dense_wire_bits(m["numel"], m["world_size"])
    ex_r = s["dense"]["phases_ms"]["exchange"] / 1e3
    rest = s["dense"]["step_ms"] / 1e3 - ex_r
    overhead = max(0.0, ex_r - bits / m["rate_bits"])
    target = PAPER_SHARE / (1 - PAPER_SHARE) * rest
    avail = max(target - overhead, 1e-3)
    return bits / avail


def run_on_cluster(worker: list[str], *, nproc: int, rate: str, tag: str, name: str,
                   burst: str | None = None, timeout: float = 3600, port_base: int = 29600) -> dict:
    """Run ``worker + ["--json", PATH]`` on a fresh netcluster of ``nproc`` torchrun nodes at
    ``rate``; return the JSON its rank 0 wrote there, with ``meta.wall_s``. netcluster removes
    its namespaces on every exit path, also when this raises (timeout, Ctrl-C, SIGTERM)."""
    tmp = Path(tempfile.gettempdir()) / f"st_{name}_{os.getpid()}_{tag}.json"
    tmp.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sparsetrain.launch.netcluster", "--nproc", str(nproc),
           "--rate", rate, "--prefix", f"s{name[0]}{os.getpid() % 10000}{tag}"[:9],
           "--kill-timeout", "5", *(["--burst", burst] if burst else []),
           "--master-port", str(port_base + int(tag)), "--", *worker, "--json", str(tmp)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except BaseException:
        p.terminate()
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
        raise
    if p.returncode != 0 or not tmp.exists():
        raise RuntimeError(f"rate {rate}: netcluster exited {p.returncode}{worker_errors(stdout)}\n"
                           f"{stdout[-3000:]}\n{stderr[-3000:]}")
    res = json.loads(tmp.read_text())
    tmp.unlink()
    res["meta"]["wall_s"] = time.time() - t0
    return res


def worker_errors(output: str, limit: int = 4) -> str:
    """The workers' own exception lines in netcluster's output (torchrun's summaries aside)."""
    seen = []
    for line in output.splitlines():
        text = re.sub(r"^(\[[^\]]*\]:? )+", "", line).strip()  # "[r0] [rank0]: " prefixes
        if re.match(r"^[\w.]+(Error|Exception): ", text) and "ChildFailedError" not in text and text not in seen:
            seen.append(text)
    return (": " + " | ".join(seen[:limit])) if seen else ""


def stop_on_signals() -> None:
    """SIGTERM / SIGHUP raise KeyboardInterrupt, so that ``run_on_cluster`` cleans up."""

    def _stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)


def need_root(prog: str) -> bool:
    if os.geteuid() != 0:
        print(f"{prog} needs root (network namespaces): run with sudo", file=sys.stderr)
        return False
    return True


# ------------------------------------------------------------------------------------ worker
def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def init_worker(threads: int):
    """torch threads, the gloo process group from torchrun's environment; (rank, world)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size()


def link() -> dict:
    """The emulated link this rank runs on (netcluster's ST_NETNS_* variables; NaN bits off it)."""
    from sparsetrain.launch.env import emulated_link

    found = emulated_link() or {"rate": None, "rate_bits": math.nan}
    return {"rate": found["rate"], "rate_bits": found["rate_bits"]}


def study_config(overrides: list[str], world: int):
    """The config the accuracy studies compose, with ``overrides`` (scheme, aggregation, preset,
    model, ...) and ``world_size`` = the ranks here, validated as ``python -m sparsetrain.run``
    validates it (top-k with AllReduce is refused the same way)."""
    from sparsetrain.config import compose, validate

    cfg = compose([*overrides, f"world_size={world}"])
    validate(cfg, env={})
    return cfg


def model_from_config(cfg, in_channels: int = 3, num_classes: int = 10):
    """The trainer's model: ``conf/model/<name>.yaml`` instantiated, seeded as the trainer seeds."""
    import torch
    from hydra.utils import instantiate

    torch.manual_seed(cfg.seed)
    return instantiate(cfg.model)(in_channels=in_channels, num_classes=num_classes)


def row_options(cfg) -> dict:
    """What defines a row's exchange, for the JSON (the studies' keys)."""
    return {"scheme": cfg.scheme.name, "scope": cfg.scope.name, "aggregation": cfg.aggregation.name,
            "ratio": cfg.ratio, "uncompressed": cfg.scheme.uncompressed,
            "error_feedback": cfg.scheme.error_feedback, "block_size": cfg.scheme.get("block_size"),
            "warmup_steps": cfg.scheme.warmup_steps, "overlap": cfg.dist.overlap, "ddp": cfg.dist.ddp,
            "model": cfg.model.name, "seed": cfg.seed}


def timed_steps(run_step, batches, warmup: int, steps: int) -> list[float]:
    """``warmup + steps`` calls of a ``TrainStep``, every rank starting each step together (a
    barrier, untimed); returns this rank's step times (ms) of the timed steps. The step's
    ``PhaseTimer`` (built with ``warmup_steps=warmup``) holds their phases."""
    import torch.distributed as dist

    out = []
    for i in range(warmup + steps):
        dist.barrier()
        run_step(batches, i)
        if i >= warmup:
            out.append(run_step.timer.last["step"])
    return out


def gather(obj) -> list | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    allr = [None] * dist.get_world_size()
    dist.all_gather_object(allr, obj)
    return allr if dist.get_rank() == 0 else None


def summarize(allr: list[dict], names: list[str], rounds: int) -> dict:
    """Per configuration, from every rank's ``{name: {"rounds": [[step ms, ...], ...],
    "phases": [{phase: ms}, ...]}}``: a step's time is its slowest rank's (they start together);
    a round's value is the median of its steps; the figure is the median over rounds with its
    95% interval; phases are the median over rounds of the median over ranks; ``x_compute`` is
    the median and interval of the per-round ratio to compute-only."""
    world = len(allr)
    out = {}
    for c in names:
        steps = [[max(allr[q][c]["rounds"][r][i] for q in range(world))
                  for i in range(len(allr[0][c]["rounds"][r]))] for r in range(rounds)]
        phase_rounds = {ph: [statistics.median(allr[q][c]["phases"][r].get(ph, 0.0) for q in range(world))
                             for r in range(rounds)] for ph in allr[0][c]["phases"][0]}
        out[c] = {"steps_ms": steps, "phase_rounds_ms": phase_rounds}
    return summarize_rounds(out)


def summarize_rounds(rows: dict) -> dict:
    """The figures of ``summarize`` from round-level values, per configuration ``{"steps_ms":
    [[slowest rank's step ms, ...] per round], "phase_rounds_ms": {phase: [per round]}}`` (plus
    anything else, kept): rounds of several runs can be concatenated and summarized together,
    as long as every configuration ran in each of them (the per-round ratios pair them)."""
    out = {}
    for c, row in rows.items():
        round_ms = [statistics.median(s) for s in row["steps_ms"]]
        ci = median_interval(round_ms)
        phases = {ph: statistics.median(v) for ph, v in row["phase_rounds_ms"].items()}
        out[c] = {**row, "step_ms": ci.median, "ci_low_ms": ci.low, "ci_high_ms": ci.high,
                  "ci_level": ci.level, "round_ms": round_ms, "phases_ms": phases}
    names = list(out)
    if COMPUTE in out:
        base = out[COMPUTE]["round_ms"]
        for c in names:
            ratio = paired_ratio(out[c]["round_ms"], base)
            out[c]["x_compute"] = ratio.median
            out[c]["x_compute_ci"] = [ratio.low, ratio.high]
    return out


def bandwidth_axis(ax, results: list[dict]) -> None:
    """The x axis of a step-time-vs-bandwidth figure: log scale with a tick per measured rate,
    the paper-like rate dotted. ``results``: one dict per rate with ``meta.rate_bits``/``label``."""
    rates = sorted({r["meta"]["rate_bits"] / 1e9 for r in results})
    for r in results:
        if r["meta"]["label"] == "paper":
            ax.axvline(r["meta"]["rate_bits"] / 1e9, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xticks(rates, [f"{t:.3g}" for t in rates])
    ax.minorticks_off()
    ax.set_xlabel("link bandwidth per rank, each way (Gbit/s, tc tbf; no added latency)")
