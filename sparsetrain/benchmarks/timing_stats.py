"""Statistics of the interleaved benchmarks (no torch): a median with a distribution-free
interval, the overlap flag against compute-only, and compute-only's flatness across bandwidths.

The unit is a round: every configuration is rebuilt and timed once per round, rounds interleave
the configurations (``round_order``), and a round's value is the median of its timed steps. Over
the rounds, the median's 95% interval is the order-statistic (binomial, sign-test) interval
[x_(j), x_(n+1-j)] with the largest j whose coverage 1 - 2 P(Bin(n, 1/2) < j) is still >= 95%: it
assumes only that rounds are independent draws of one distribution, not normality. It needs
n >= 6 rounds to reach 95% with [min, max]; below that the level it reaches is reported (5
rounds: 93.75%).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    median: float
    low: float
    high: float
    level: float  # the interval's exact coverage of the true median
    n: int

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def as_dict(self) -> dict:
        return asdict(self)


def coverage(n: int, j: int) -> float:
    """P(x_(j) <= true median <= x_(n+1-j)) for n independent draws of a continuous variable."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n


def median_interval(values, level: float = LEVEL) -> Interval:
    """Median of ``values`` and the narrowest symmetric order-statistic interval whose coverage
    is >= ``level``; with too few values [min, max] and the coverage it has."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval of no values")
    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(n, j + 1) >= level:
        j += 1
    return Interval(statistics.median(xs), xs[j - 1], xs[n - j], coverage(n, j), n)


def round_order(names: list[str], r: int) -> list[str]:
    """Round r's order: the list rotated by r, so that no configuration always runs first."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def paired_ratio(values: list[float], base: list[float], level: float = LEVEL) -> Interval:
    """Median and interval of the per-round ratios values[r] / base[r]: rounds pair the two
    configurations in time, so load drifts between rounds cancel out of the ratio."""
    if len(values) != len(base):
        raise ValueError(f"{len(values)} rounds against {len(base)}")
    return median_interval([v / b for v, b in zip(values, base)], level)


COMPUTE = "compute"


def compute_flags(rows: dict[str, Interval], compute: str = COMPUTE) -> dict[str, str]:
    """Rows that claim to beat compute-only (median below its median), which does the same
    forward, backward and optimizer work with no exchange at all:

    - ``ties compute-only``: its interval overlaps compute-only's, so the claim is within noise;
    - ``below compute-only``: its interval lies wholly below, which no step that contains
      compute-only's work can do: the measurement is suspect (the machine's load changed).
    """
    if compute not in rows:
        return {}
    c = rows[compute]
    flags = {}
    for name, r in rows.items():
        if name == compute or r.median >= c.median:
            continue
        flags[name] = "ties compute-only" if r.overlaps(c) else "below compute-only"
    return flags


@dataclass(frozen=True)
class Flatness:
    flat: bool
    low: float | None  # the range every interval shares (None when there is none)
    high: float | None
    outliers: tuple[str, ...]  # labels whose interval misses the value most intervals share

    def as_dict(self) -> dict:
        return asdict(self)


def flatness(intervals: dict[str, Interval]) -> Flatness:
    """Is compute-only flat across bandwidths within its intervals? It exchanges nothing, so the
    link rate cannot change it: flat when one value lies in every rate's interval (their
    intersection is not empty). Otherwise ``outliers`` names the rates whose interval misses the
    point covered by the most intervals (the benchmark's own noise check failed there)."""
    if not intervals:
        return Flatness(True, None, None, ())
    lo = max(i.low for i in intervals.values())
    hi = min(i.high for i in intervals.values())
    if lo <= hi:
        return Flatness(True, lo, hi, ())
    points = sorted({i.low for i in intervals.values()} | {i.high for i in intervals.values()})
    best = max(points, key=lambda x: sum(i.low <= x <= i.high for i in intervals.values()))
    out = tuple(k for k, i in intervals.items() if not i.low <= best <= i.high)
    return Flatness(False, None, None, out)
