"""The statistics behind every verdict: a difference in points with its 95 % interval and p-value.

- Both sides ran the same seeds (same initial weights, same data order): a **paired** t-test on
  the per-seed differences (``scipy.stats.ttest_rel``), the stronger test that the design allows.
- Otherwise: **Welch's** t-test (``scipy.stats.ttest_ind(equal_var=False)``), which does not
  assume equal spreads.
- A side with one run (or a pairing with one seed) is **shown, never judged**: no interval, no p.
- A finding's comparisons are corrected together for multiplicity with **Holm**'s step-down
  method; a difference is **outside the noise** when its Holm-adjusted p is below 0.05.
- "No difference" is a claim of its own: **equivalence** within a stated margin (+-1 point by
  default) by two one-sided t-tests (TOST, paired or Welch as above): equivalent when the larger
  of the two one-sided p-values is below 0.05, with the matching 90 % interval inside the margin.
  A large p of the difference test alone says only "not told apart".

Per-seed values are first averaged over repeated runs of one seed (a rerun is not a replicate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
from scipy import stats

ALPHA = 0.05
PAIRED, WELCH, SHOWN = "paired t", "Welch t", "not judged"


@dataclass(frozen=True)
class Difference:
    """A minus B (points), its 95 % interval and the test's two-sided p-value (NaN: not judged)."""

    diff: float
    low: float
    high: float
    p: float
    test: str  # PAIRED, WELCH or SHOWN
    n_a: int
    n_b: int
    n_pairs: int = 0

    @property
    def judged(self) -> bool:
        return not math.isnan(self.p)


def per_seed(values: pd.Series, seeds: pd.Series) -> pd.Series:
    """One value per seed (the mean of a seed's repeated runs), indexed by seed, sorted."""
    return pd.Series(values.to_numpy(dtype=float), index=seeds.to_numpy()).groupby(level=0).mean().sort_index()


def compare(a: pd.Series, b: pd.Series, confidence: float = 0.95) -> Difference:
    """A - B for two per-seed series (index: seed). Paired when both hold exactly the same seeds
    (two or more), Welch otherwise (two or more on each side); else shown, not judged."""
    a, b = a.dropna(), b.dropna()
    n_a, n_b = len(a), len(b)
    nan = math.nan
    if n_a == 0 or n_b == 0:
        return Difference(nan, nan, nan, nan, SHOWN, n_a, n_b)
    diff = float(a.mean() - b.mean())
    if set(a.index) == set(b.index) and n_a >= 2:
        b = b.loc[a.index]
        d = a.to_numpy() - b.to_numpy()
        if (d == d[0]).all():  # no spread in the differences: t is undefined
            return Difference(diff, diff, diff, 0.0 if d[0] != 0 else 1.0, PAIRED, n_a, n_b, n_a)
        res = stats.ttest_rel(a.to_numpy(), b.to_numpy())
        ci = res.confidence_interval(confidence)
        return Difference(diff, float(ci.low), float(ci.high), float(res.pvalue), PAIRED, n_a, n_b, n_a)
    if n_a >= 2 and n_b >= 2:
        if a.std(ddof=1) == 0 and b.std(ddof=1) == 0:
            return Difference(diff, diff, diff, 0.0 if diff != 0 else 1.0, WELCH, n_a, n_b)
        res = stats.ttest_ind(a.to_numpy(), b.to_numpy(), equal_var=False)
        ci = res.confidence_interval(confidence)
        return Difference(diff, float(ci.low), float(ci.high), float(res.pvalue), WELCH, n_a, n_b)
    return Difference(diff, nan, nan, nan, SHOWN, n_a, n_b)


EQUIVALENCE_MARGIN = 1.0  # points: the default margin of an "=" claim


@dataclass(frozen=True)
class Equivalence:
    """TOST of |A - B| < ``margin`` (points): ``p`` the larger one-sided p-value (NaN: not judged),
    ``low``/``high`` the 90 % interval (1 - 2 alpha) that lies inside the margin when p < alpha."""

    margin: float
    p: float
    low: float
    high: float
    test: str

    @property
    def judged(self) -> bool:
        return not math.isnan(self.p)


def equivalence(a: pd.Series, b: pd.Series, margin: float = EQUIVALENCE_MARGIN,
                alpha: float = ALPHA) -> Equivalence:
    """Two one-sided t-tests of A - B against -``margin`` and +``margin`` for two per-seed series
    (index: seed), paired where both hold the same seeds, Welch otherwise, as ``compare`` pairs.
    Each one-sided test is scipy's (``ttest_1samp`` on the paired differences, ``ttest_ind`` on A
    shifted by the margin), so the p-values come from the same code as every other verdict."""
    a, b = a.dropna(), b.dropna()
    nan = math.nan
    confidence = 1 - 2 * alpha
    if set(a.index) == set(b.index) and len(a) >= 2:
        d = a.to_numpy() - b.loc[a.index].to_numpy()
        if (d == d[0]).all():  # no spread: equivalent exactly when the one difference is inside
            inside = abs(d[0]) < margin
            return Equivalence(margin, 0.0 if inside else 1.0, float(d[0]), float(d[0]), PAIRED)
        lower = stats.ttest_1samp(d, -margin, alternative="greater")
        upper = stats.ttest_1samp(d, margin, alternative="less")
        ci = stats.ttest_1samp(d, 0.0).confidence_interval(confidence)
        return Equivalence(margin, float(max(lower.pvalue, upper.pvalue)), float(ci.low), float(ci.high), PAIRED)
    if len(a) >= 2 and len(b) >= 2 and not (a.std(ddof=1) == 0 and b.std(ddof=1) == 0):
        x, y = a.to_numpy(), b.to_numpy()
        lower = stats.ttest_ind(x + margin, y, equal_var=False, alternative="greater")
        upper = stats.ttest_ind(x - margin, y, equal_var=False, alternative="less")
        ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(confidence)
        return Equivalence(margin, float(max(lower.pvalue, upper.pvalue)), float(ci.low), float(ci.high), WELCH)
    return Equivalence(margin, nan, nan, nan, SHOWN)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN stays NaN and does not count as a test): the i-th
    smallest of m p-values is multiplied by (m - i), kept monotone, capped at 1.

    >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03, float("nan")])]
    [0.03, 0.06, 0.06, nan]
    """
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(order)
    adjusted = [math.nan] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def outside_noise(p_adjusted: float, alpha: float = ALPHA) -> bool:
    return not math.isnan(p_adjusted) and p_adjusted < alpha
