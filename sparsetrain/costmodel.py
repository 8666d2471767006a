"""An alpha-beta cost model of the exchange, and time per step predicted from it.

Collectives (ring algorithms, as gloo and NCCL use for large messages), for N workers and a message
of ``n`` bytes per worker:

    AllReduce  t = 2(N-1) alpha + 2(N-1)/N n beta
    AllGather  t =  (N-1) alpha +  (N-1)   n beta     (every worker receives the others' n bytes)

``alpha`` is the per-message latency (s), ``beta`` the seconds per byte. On a link of B bit/s,
``beta = max(wire / (B / 8), cpu)``: ``wire`` is the framing overhead of TCP/IP over Ethernet
(1538 bytes on the wire per 1448 of payload: 1.062) and ``cpu`` the per-byte cost the hosts need
at infinite bandwidth (copies, the reduction, the kernel's TCP stack; pipelined with sending, so
the slower of the two sets the pace): on a CPU box it bounds the collective at high rates. :func:`fit` finds alpha and beta per collective from a
micro-benchmark (``python -m sparsetrain.benchmarks.collectives``); :meth:`Collective.at_rate` re-targets the fitted
model to another bandwidth by keeping ``alpha`` and ``cpu`` (``floor_beta``, e.g. the beta fitted on
the fastest link measured) and replacing the wire term.

Time per step of a scheme = compute (forward + backward + optimizer, measured without exchange)
+ compress + decompress (measured) + exchange (predicted). Dense sends ``4 numel`` bytes with
AllReduce; random-k and block-k with a shared seed ``4 k`` with AllReduce; top-k ``4 k`` values
+ ``4 k`` int32 positions with AllGather, and decompresses N payloads instead of one.

No torch: plain floats, usable from notebooks and the analysis layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WIRE_OVERHEAD = 1538 / 1448  # Ethernet + IP + TCP (with timestamps) bytes per payload byte, MTU 1500

#: latency terms and byte terms per collective: (count of alpha, factor of n*beta) for N workers
_TERMS = {
    "allreduce": lambda N: (2 * (N - 1), 2 * (N - 1) / N),
    "allgather": lambda N: ((N - 1), (N - 1)),
}


def terms(collective: str, world: int) -> tuple[float, float]:
    """``(a, b)`` with ``t = a alpha + b n beta`` for this collective at ``world`` workers."""
    if world < 1:
        raise ValueError(f"world={world!r} must be >= 1")
    try:
        return _TERMS[collective](world)
    except KeyError:
        raise ValueError(f"collective={collective!r}; allowed: {', '.join(_TERMS)}") from None


def wire_bytes(collective: str | None, nbytes: float, world: int) -> float:
    """Bytes one worker sends over its link for one collective of ``nbytes`` per worker, as the
    ring algorithm moves them: AllReduce ``2(W-1)/W x n`` (reduce-scatter then all-gather of W
    chunks), AllGather ``(W-1) x n`` (every message passes every worker). 0 for one worker or no
    collective (``None``). The byte term of :func:`terms`: the same model that times the exchange.

    >>> wire_bytes("allreduce", 1000, 4), wire_bytes("allgather", 1000, 4), wire_bytes("allgather", 1000, 1)
    (1500.0, 3000.0, 0.0)
    """
    if collective is None:
        return 0.0
    return float(terms(collective, world)[1] * nbytes)


def allreduce_time(nbytes: float, world: int, alpha: float, beta: float) -> float:
    """Ring AllReduce: 2(N-1) alpha + 2(N-1)/N n beta (seconds)."""
    a, b = terms("allreduce", world)
    return a * alpha + b * nbytes * beta


def allgather_time(nbytes: float, world: int, alpha: float, beta: float) -> float:
    """Ring AllGather of n bytes per worker: (N-1) alpha + (N-1) n beta (seconds)."""
    a, b = terms("allgather", world)
    return a * alpha + b * nbytes * beta


@dataclass
class Collective:
    """A fitted alpha-beta model of one collective, measured at ``rate_bits`` (None: unlimited)."""

    name: str
    alpha: float
    beta: float
    rate_bits: float | None = None
    rel_rms: float | None = None  # fit quality: RMS of relative residuals over the fitted points
    #: seconds per byte the hosts need at any bandwidth (CPU-bound floor, e.g. fitted on a fast or
    #: unlimited link); None: the part of ``beta`` above the wire time at ``rate_bits``
    floor_beta: float | None = None

    @property
    def cpu_beta(self) -> float:
        """Seconds per byte that remain at infinite bandwidth."""
        if self.floor_beta is not None:
            return self.floor_beta
        wire = WIRE_OVERHEAD * 8 / self.rate_bits if self.rate_bits else 0.0
        return max(0.0, self.beta - wire)

    def at_rate(self, rate_bits: float) -> Collective:
        """The same collective on a link of ``rate_bits`` bit/s: alpha kept, and per byte the
        slower of the wire and the hosts (the ring pipelines sending with copying and reducing,
        so the two overlap: max, not sum)."""
        beta = max(WIRE_OVERHEAD * 8 / rate_bits, self.cpu_beta)
        return Collective(self.name, self.alpha, beta, rate_bits, floor_beta=self.floor_beta)

    def time(self, nbytes: float, world: int) -> float:
        a, b = terms(self.name, world)
        return a * self.alpha + b * nbytes * self.beta


def fit(collective: str, world: int, sizes: list[float], times: list[float], rate_bits=None) -> Collective:
    """Least squares for alpha, beta >= 0 from (bytes per worker, seconds) at ``world`` workers.

    Minimises relative error (each point weighted by 1/t), so that 4-byte and 64 MB messages both
    count; a negative solution for one parameter is clamped to 0 and the other refitted.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) points of equal count")
    a, b = terms(collective, world)
    # rows: [a/t, b n/t] . [alpha, beta] = 1
    x1 = [a / t for t in times]
    x2 = [b * n / t for n, t in zip(sizes, times, strict=True)]
    s11 = sum(v * v for v in x1)
    s22 = sum(v * v for v in x2)
    s12 = sum(u * v for u, v in zip(x1, x2, strict=True))
    r1, r2 = sum(x1), sum(x2)
    det = s11 * s22 - s12 * s12
    alpha = beta = -1.0
    if det > 0:
        alpha = (r1 * s22 - r2 * s12) / det
        beta = (r2 * s11 - r1 * s12) / det
    if alpha < 0 or beta < 0:
        if alpha < 0 and beta < 0 or det <= 0:
            alpha, beta = max(r1 / s11, 0.0), 0.0
            alt_b = max(r2 / s22, 0.0)
            if _rel_rms(a, b, 0.0, alt_b, sizes, times) < _rel_rms(a, b, alpha, 0.0, sizes, times):
                alpha, beta = 0.0, alt_b
        elif alpha < 0:
            alpha, beta = 0.0, max(r2 / s22, 0.0)
        else:
            alpha, beta = max(r1 / s11, 0.0), 0.0
    return Collective(collective, alpha, beta, rate_bits, _rel_rms(a, b, alpha, beta, sizes, times))


def _rel_rms(a, b, alpha, beta, sizes, times) -> float:
    res = [(a * alpha + b * n * beta) / t - 1 for n, t in zip(sizes, times, strict=True)]
    return math.sqrt(sum(r * r for r in res) / len(res))


# ------------------------------------------------------------------------------------ schemes
@dataclass
class SchemeCost:
    """What a scheme puts on the wire and costs locally (milliseconds measured at ``world_ref``)."""

    name: str
    collective: str | None  # None: no exchange (compute only)
    nbytes: float  # bytes per worker per step
    compress_ms: float = 0.0
    decompress_ms: float = 0.0
    #: part of decompress_ms that is per received payload (AllGather adds N payloads)
    decompress_per_payload_ms: float = 0.0
    world_ref: int = 1
    #: the exchange runs once every ``period`` steps (local SGD, DiLoCo) with ``period x nbytes``
    #: bytes: its time, latency included, is spread over the period
    period: int = 1
    #: an exchange overlapped with backward (DDP's hooks, the dense reducer's buckets): per bucket
    #: in launch order ``(share of nbytes, lead ms)``, the lead being how long before backward's
    #: compute ended the bucket could start (measured: ``timing.BucketClock``); empty: the
    #: exchange starts after backward, all of it exposed
    buckets: tuple[tuple[float, float], ...] = ()


def exposed_ms(buckets, collective_ms) -> float:
    """How long after backward's compute ends an overlapped exchange finishes: each bucket's
    collective (``collective_ms(share)``, its own latency included) starts when the bucket is
    ready (``lead`` ms before the end) and the one before it has finished (one link, buckets in
    launch order, as DDP and gloo run them); 0 when all of it fits inside backward.

    >>> exposed_ms([(0.5, 30.0), (0.5, 0.0)], lambda share: 40 * share)  # 20 ms from -30; then 20
    20.0
    >>> exposed_ms([(1.0, 0.0)], lambda share: 40 * share)  # one bucket at the end: all exposed
    40.0
    """
    end = -math.inf
    for share, lead in buckets:
        end = max(end, -lead) + collective_ms(share)
    return max(0.0, end)


def mean_buckets(samples) -> tuple[tuple[float, float], ...]:
    """Several recordings of one exchange's buckets (``(share, lead)`` each) as one: the first
    recording's shares, each lead averaged over the recordings with those same shares (a
    recording with other buckets describes another layout); empty where there is none.

    >>> mean_buckets([[(0.5, 4.0), (0.5, 0.0)], [(1.0, 0.0)], [(0.5, 2.0), (0.5, 0.0)]])
    ((0.5, 3.0), (0.5, 0.0))
    """
    samples = [list(s) for s in samples if s]
    if not samples:
        return ()
    shares = [share for share, _ in samples[0]]
    same = [s for s in samples if [share for share, _ in s] == shares]
    return tuple((share, sum(s[i][1] for s in same) / len(same)) for i, share in enumerate(shares))


#: Decoding W gathered messages with the compiled kernels (``compress.kernels.decode_many``: one
#: sweep over the output, every message added in it) costs ``a + b W`` gradient copies. Least
#: squares over W = 1, 2, 4, 8, 16 of the quiet A/B of 1e9cb84 (results/bench/
#: ab_quantizers_compiled.json, medians of 4 runs): signSGD a = 0.528, b = 0.338 (the sweep's
#: memory traffic is a fixed part; a message's bits add little); QSGD s = 1 a = -0.006, b = 0.757,
#: i.e. linear, as every other decode is.
FUSED_DECODE_COPIES = {"signsgd": (0.528, 0.338)}


def growing_share(scheme: str | None, world: int, kernels: str | None = None) -> float:
    """The part of a decode measured at ``world`` ranks that grows with the ranks: 1 (linear
    through 0, one payload after another) except where ``FUSED_DECODE_COPIES`` has the
    scheme's fit and its compiled kernels ran (``kernels``: ``numba <version>``, as
    ``summary.json`` records it)."""
    fit = FUSED_DECODE_COPIES.get(scheme or "") if str(kernels or "").startswith("numba") else None
    if fit is None or world < 1:
        return 1.0
    a, b = fit
    return b * world / (a + b * world)


def per_payload_ms(scheme: str | None, collective: str | None, decompress_ms: float, world_ref: int,
                   kernels: str | None = None) -> float:
    """``SchemeCost.decompress_per_payload_ms`` of a decode measured at ``world_ref`` ranks: with
    AllGather its growing part (``growing_share``) per received payload; 0 otherwise (one summed
    message, whatever the ranks)."""
    if collective != "allgather":
        return 0.0
    return decompress_ms * growing_share(scheme, world_ref, kernels) / max(world_ref, 1)


def scheme_costs(sent: dict[str, tuple[str, float]], measured: dict | None = None,
                 world_ref: int = 4, kernels: str | None = None) -> dict[str, SchemeCost]:
    """The schemes' costs: ``sent[scheme] = (collective, bytes per worker per step)`` as the
    built reducer reports them (``bytes_sent_per_step``: the model never counts bytes itself),
    local costs from ``measured[scheme] = {"compress": ms, "decompress": ms}`` at ``world_ref``
    workers. With AllGather the decompression is per received payload, so it grows with workers
    (the part ``growing_share`` gives: all of it, but for a fused decode under ``kernels``)."""
    m = measured or {}

    def mc(s, key):
        return float(m.get(s, {}).get(key, 0.0))

    out = {}
    for name, (collective, nbytes) in sent.items():
        compress = 0.0 if name == "dense" else mc(name, "compress")
        out[name] = SchemeCost(name, collective, float(nbytes), compress, mc(name, "decompress"),
                               per_payload_ms(name, collective, mc(name, "decompress"), world_ref, kernels), world_ref)
    return out


@dataclass
class CostModel:
    """Fitted collectives + measured compute: predicts exchange and step times."""

    collectives: dict[str, Collective]
    compute_ms: float = 0.0
    schemes: dict[str, SchemeCost] = field(default_factory=dict)

    def exchange_ms(self, scheme: SchemeCost, world: int, rate_bits: float | None = None) -> float:
        if scheme.collective is None or world <= 1:
            return 0.0
        col = self.collectives[scheme.collective]
        if rate_bits is not None:
            col = col.at_rate(rate_bits)
        if scheme.buckets and scheme.period == 1:  # what backward does not hide
            return exposed_ms(scheme.buckets, lambda share: 1e3 * col.time(scheme.nbytes * share, world))
        return 1e3 * col.time(scheme.nbytes * scheme.period, world) / scheme.period

    def step_ms(self, name: str, world: int, rate_bits: float | None = None) -> float:
        s = self.schemes[name]
        extra = s.decompress_per_payload_ms * (world - s.world_ref)
        return self.compute_ms + s.compress_ms + max(0.0, s.decompress_ms + extra) + self.exchange_ms(s, world, rate_bits)

    def break_even(self, worlds, rates_bits) -> dict[str, list[list[float]]]:
        """``ratio[scheme][i][j]`` = step(scheme) / step(dense) at worlds[i], rates_bits[j]
        (< 1: the scheme is faster than dense there)."""
        out = {}
        for name in self.schemes:
            if name == "dense":
                continue
            out[name] = [[self.step_ms(name, w, r) / self.step_ms("dense", w, r) for r in rates_bits] for w in worlds]
        return out


__all__ = [
    "WIRE_OVERHEAD",
    "Collective",
    "CostModel",
    "SchemeCost",
    "allgather_time",
    "allreduce_time",
    "exposed_ms",
    "fit",
    "mean_buckets",
    "scheme_costs",
    "terms",
    "wire_bytes",
]
