"""Power of the verdicts' tests, and the seeds a declared study needs (no torch).

An ``=`` claim is judged by TOST on the paired differences A - B over seeds: it holds when both
one-sided t-tests reject at ``alpha``, i.e. when the mean difference lies inside
``(-margin + t s / sqrt(n), margin - t s / sqrt(n))``. Its power is computed exactly, not by the
usual normal approximation: conditional on the sample SD ``s`` the mean is normal, so the power is
one integral over ``s``'s scaled chi distribution (scipy's quad). ``seeds_for_power`` is the
smallest n that reaches a target power. conf/declared/verdicts2.yaml sizes its seeds by an
internal pilot: the SD measured on its first seeds decides how many more run
(``seeds_by_internal_pilot``); ``internal_pilot_rates`` simulates that rule's type I error and power.

``python -m sparsetrain.analysis.power --sd 1.40 --margin 1`` prints the power at each n and the
n needed; ``--seed-rule 6 20`` simulates the seed rule at that SD; ``--endpoint <pilot sweep>``
reads how much dense SGD still gains from 16 to 32 epochs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from scipy import integrate, stats


def tost_power(n: int, sd: float, margin: float, alpha: float = 0.05, delta: float = 0.0) -> float:
    """P(TOST at ``margin`` shows equivalence) for ``n`` paired differences drawn from
    N(delta, sd^2), each one-sided test at level ``alpha``."""
    if n < 2:
        return 0.0
    df = n - 1
    t = stats.t.ppf(1 - alpha, df)
    se_scale = sd / math.sqrt(n)  # the mean's SD

    def inner(s: float) -> float:
        # With the sample SD at s, equivalence needs |mean| inside margin - t s / sqrt(n).
        half = margin - t * s / math.sqrt(n)
        if half <= 0:
            return 0.0
        return stats.norm.cdf((half - delta) / se_scale) - stats.norm.cdf((-half - delta) / se_scale)

    # s = sd * sqrt(X / df), X ~ chi2(df): integrate over X's density.
    def integrand(x: float) -> float:
        return inner(sd * math.sqrt(x / df)) * stats.chi2.pdf(x, df)

    # Beyond this X the interval is empty (half <= 0), so the integrand is 0.
    x_max = df * (margin * math.sqrt(n) / (t * sd)) ** 2
    value, _ = integrate.quad(integrand, 0.0, x_max, limit=200)
    return float(min(max(value, 0.0), 1.0))


def seeds_for_power(sd: float, margin: float, power: float = 0.8, alpha: float = 0.05,
                    delta: float = 0.0, n_max: int = 1000) -> int:
    """The smallest number of seeds at which TOST reaches ``power``."""
    for n in range(2, n_max + 1):
        if tost_power(n, sd, margin, alpha, delta) >= power:
            return n
    raise ValueError(f"TOST does not reach power {power} with {n_max} seeds at sd={sd}, margin={margin}")


def simulated_power(n: int, sd: float, margin: float, alpha: float = 0.05, delta: float = 0.0,
                    draws: int = 20000, seed: int = 0) -> float:
    """The same power by simulation (for the tests: a check of the integral, not a second method)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(delta, sd, size=(draws, n))
    mean, s = x.mean(axis=1), x.std(axis=1, ddof=1)
    t = stats.t.ppf(1 - alpha, n - 1)
    se = s / math.sqrt(n)
    return float(np.mean(((mean + margin) / se > t) & ((margin - mean) / se > t)))


def sd_upper(sd_measured: float, n: int, level: float) -> float:
    """The one-sided ``level`` upper confidence bound of an SD measured on ``n`` values (chi-square):
    sizing on it rather than on the estimate keeps the power when the first seeds happen to agree."""
    return sd_measured * math.sqrt((n - 1) / stats.chi2.ppf(1 - level, n - 1))


def seeds_by_internal_pilot(sd_measured: float, margin: float, n_first: int, n_cap: int,
                            power: float = 0.8, alpha: float = 0.05, level: float = 0.8,
                            n_measured: int | None = None) -> int:
    """verdicts2.yaml's seed rule: after the first ``n_first`` seeds, the seeds TOST needs for
    ``power`` at the ``level`` upper bound of the SD measured on them, never fewer than ran, never
    more than ``n_cap``. ``n_measured``: how many differences the SD came from, where a seed of
    the pair failed (default ``n_first``): the bound widens with fewer."""
    n_measured = n_first if n_measured is None else n_measured
    if n_first < 2 or n_cap < n_first or not 2 <= n_measured <= n_first:
        raise ValueError(f"the seed rule needs 2 <= n_measured <= n_first <= n_cap; got n_measured={n_measured}, "
                         f"n_first={n_first}, n_cap={n_cap}")
    sd = sd_upper(sd_measured, n_measured, level)
    for n in range(n_first, n_cap + 1):
        if tost_power(n, sd, margin, alpha) >= power:
            return n
    return n_cap


def _sd_limits(margin: float, n_first: int, n_cap: int, power: float, alpha: float) -> np.ndarray:
    """For each n in n_first..n_cap, the largest SD at which n seeds reach ``power`` (bisection:
    the power falls as the SD grows)."""
    limits = []
    for n in range(n_first, n_cap + 1):
        lo, hi = 1e-6, 10.0 * margin  # 20 halvings: to 1e-5 of the margin
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tost_power(n, mid, margin, alpha) >= power else (lo, mid)
        limits.append(lo)
    return np.array(limits)


def internal_pilot_rates(sd: float, margin: float, n_first: int, n_cap: int, power: float = 0.8,
                         alpha: float = 0.05, level: float = 0.8, test_alpha: float | None = None,
                         sims: int = 20000, seed: int = 0) -> dict:
    """The seed rule's operating characteristics by simulation, the SD being re-estimated from the
    first seeds (an internal pilot, which can inflate the type I error a little): the rate at which
    TOST over all the seeds, each side at ``test_alpha`` (default ``alpha``), shows equivalence when the true difference sits on the margin (type I
    error; nominal ``alpha``) and when it is 0 (power), and the mean number of seeds run."""
    rng = np.random.default_rng(seed)
    limits = _sd_limits(margin, n_first, n_cap, power, alpha)
    out = {}
    for name, delta in (("type1", margin), ("power", 0.0)):
        x = rng.normal(delta, sd, size=(sims, n_cap))
        s_first = sd_upper(1.0, n_first, level) * x[:, :n_first].std(axis=1, ddof=1)
        # the smallest n whose SD limit covers the measured SD; n_cap where none does
        index = np.minimum((s_first[:, None] > limits[None, :]).sum(axis=1), len(limits) - 1)
        n = n_first + index
        mask = np.arange(n_cap)[None, :] < n[:, None]
        mean = (x * mask).sum(axis=1) / n
        var = (((x - mean[:, None]) * mask) ** 2).sum(axis=1) / (n - 1)
        se = np.sqrt(var / n)
        t = stats.t.ppf(1 - (alpha if test_alpha is None else test_alpha), n - 1)
        out[name] = float(np.mean(((mean + margin) / se > t) & ((margin - mean) / se > t)))
        out["mean_seeds"] = float(n.mean())
    return out


# The primary endpoint's check (verdicts2.yaml): how much dense SGD's validation accuracy still
# gains from SHORT to LONG epochs, paired by seed, against its seeds' spread at SHORT (the SD over
# seeds). Shown beside the verdicts; it does not change the declared budget.
ENDPOINT_SHORT, ENDPOINT_LONG = 16, 32


def endpoint(val_by_budget: dict[int, dict[int, float]], short: int = ENDPOINT_SHORT,
             long: int = ENDPOINT_LONG) -> dict:
    """{epochs: {seed: final validation accuracy}} -> the gain from ``short`` to ``long`` epochs
    with its 95% t interval, the spread at ``short``, and whether the gain is inside that spread."""
    seeds = sorted(set(val_by_budget.get(short, {})) & set(val_by_budget.get(long, {})))
    if len(seeds) < 2:
        raise ValueError(f"the endpoint check needs at least 2 seeds run at both {short} and {long} "
                         f"epochs; found {len(seeds)}: {seeds}")
    at_short = np.array([val_by_budget[short][s] for s in seeds])
    gains = np.array([val_by_budget[long][s] for s in seeds]) - at_short
    spread = float(at_short.std(ddof=1))
    gain = float(gains.mean())
    half = float(stats.t.ppf(0.975, len(seeds) - 1) * gains.std(ddof=1) / math.sqrt(len(seeds)))
    return {"seeds": seeds, "gain": gain, "gain_ci": (gain - half, gain + half), "spread": spread,
            "plateau": gain <= spread}


def _pilot(path: str | Path) -> dict[int, dict[int, float]]:
    from .loader import load_runs

    runs = load_runs(path)
    runs = runs[runs["status"] == "completed"]
    out: dict[int, dict[int, float]] = {}
    for row in runs.itertuples():
        out.setdefault(int(row.epochs_planned), {})[int(row.seed)] = 100.0 * float(row.val_accuracy)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsetrain.analysis.power", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sd", type=float, help="SD of the paired differences (points)")
    parser.add_argument("--margin", type=float, default=1.0, help="equivalence margin (points)")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--power", type=float, default=0.8, help="target power")
    parser.add_argument("--endpoint", metavar="PILOT", help="dense SGD's gain from 16 to 32 epochs in a pilot sweep")
    parser.add_argument("--seed-rule", nargs=2, type=int, metavar=("FIRST", "CAP"),
                        help="simulate the internal-pilot seed rule at --sd: type I error, power, mean seeds")
    args = parser.parse_args(argv)
    if args.endpoint:
        pick = endpoint(_pilot(args.endpoint))
        lo, hi = pick["gain_ci"]
        print(f"dense SGD, validation accuracy gain {ENDPOINT_SHORT} -> {ENDPOINT_LONG} epochs over seeds "
              f"{pick['seeds']}: {pick['gain']:+.2f} points [{lo:+.2f}, {hi:+.2f}]; spread at "
              f"{ENDPOINT_SHORT} (SD over seeds): {pick['spread']:.2f}: "
              + ("inside the spread" if pick["plateau"] else "still gaining beyond the spread"))
        return 0
    if args.sd is None:
        parser.error("give --sd (or --endpoint)")
    if args.seed_rule:
        first, cap = args.seed_rule
        rates = internal_pilot_rates(args.sd, args.margin, first, cap, args.power, args.alpha)
        print(f"seed rule {first}..{cap} at sd {args.sd}: type I error {rates['type1']:.4f} (each side tested at "
              f"{args.alpha}), power {rates['power']:.3f}, mean seeds {rates['mean_seeds']:.1f}")
        return 0
    n = seeds_for_power(args.sd, args.margin, args.power, args.alpha)
    for k in sorted({5, 10, 15, n - 1, n, 20, 25}):
        if k >= 2:
            print(f"n={k:3d}  power {tost_power(k, args.sd, args.margin, args.alpha):.3f}")
    print(f"seeds needed for power {args.power} (TOST at +-{args.margin}, sd {args.sd}, alpha {args.alpha}): {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
