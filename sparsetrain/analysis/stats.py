"""The statistics behind every verdict: a difference in points with its 95 % interval and p-value.

- Both sides ran the same seeds (same initial weights, same data order): a **paired** t-test on
  the per-seed differences (``scipy.stats.ttest_rel``), the stronger test that the design allows.
  In a declared study (``pair_common``: every side runs the declared seeds), a seed that ended on
  one side only (it failed or scored nothing on the other) leaves the pairs: they are the seeds
  both hold, A - B is their mean difference, and the seeds left out are named
  (``Difference.unpaired``, ``method_label``), so a paired design is never read as two samples.
- Otherwise (sides that ran other seeds by design): **Welch's** t-test
  (``scipy.stats.ttest_ind(equal_var=False)``), which does not assume equal spreads.
- A side with one run (or a pairing with one seed) is **shown, never judged**: no interval, no p.
- A finding's comparisons are corrected together for multiplicity with **Holm**'s step-down
  method; a difference is **outside the noise** when its Holm-adjusted p is below 0.05.
- **Test-set sampling error** (``with_test_error``): from the runs' saved per-image predictions, an
  interval for A - B over seeds and test images whose variance adds the test images' term
  (McNemar's paired variance) to the seeds' (the paired t's).
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
    unpaired: tuple = ()  # seeds that ended on one side only, left out of a paired test

    @property
    def judged(self) -> bool:
        return not math.isnan(self.p)


def method_label(d: Difference) -> str:
    """A test as the tables name it: ``paired t (n=5)``, with the seeds a pairing left out
    (``paired t (n=4; seed 4 on one side only, left out)``) and a difference without spread."""
    label = d.test
    if d.n_pairs:
        left_out = ""
        if d.unpaired:
            left_out = (f"; seed{'s' if len(d.unpaired) > 1 else ''} {', '.join(map(str, d.unpaired))} "
                        "on one side only, left out")
        label += f" (n={d.n_pairs}{left_out})"
    if d.judged and d.low == d.high:  # every difference alike: t is undefined, p set to 0 or 1
        label += ", no spread: p is 0 or 1 by convention"
    return label


def _pairs(a: pd.Series, b: pd.Series, pair_common: bool) -> tuple[pd.Series, pd.Series, tuple] | None:
    """The two sides on the seeds both hold, in A's order, and the seeds only one holds; None
    where fewer than two are shared, or (without ``pair_common``) where the seeds differ at all
    (no pairing: Welch's test, or shown)."""
    common = a.index[a.index.isin(b.index)]  # in A's order, as the tests always read them
    if len(common) < 2 or (not pair_common and set(a.index) != set(b.index)):
        return None
    unpaired = tuple(sorted(set(a.index).symmetric_difference(b.index)))
    return a.loc[common], b.loc[common], unpaired


def per_seed(values: pd.Series, seeds: pd.Series, names: pd.Series | None = None) -> pd.Series:
    """One value per seed, indexed by seed, sorted. Two runs of one seed are never averaged: a
    mean of repeats would count as one seed and hide their spread, so they stop with one line
    naming them (``names``: the runs' folders)."""
    seeds = pd.Series(seeds.to_numpy())
    repeated = seeds[seeds.duplicated(keep=False)]
    if len(repeated):
        seed = repeated.iloc[0]
        which = "" if names is None else ": " + ", ".join(
            map(str, pd.Series(names.to_numpy())[seeds == seed]))
        raise ValueError(f"seed {seed} has {int((seeds == seed).sum())} runs on one side of a comparison{which}; "
                         f"a verdict pairs one run per seed: give each run its own seed, or narrow the side "
                         f"(--where) to one of them")
    return pd.Series(values.to_numpy(dtype=float), index=seeds.to_numpy()).sort_index()


def compare(a: pd.Series, b: pd.Series, confidence: float = 0.95, pair_common: bool = False) -> Difference:
    """A - B for two per-seed series (index: seed). Paired when both hold the same seeds (two or
    more), Welch otherwise (two or more on each side); else shown, not judged. ``pair_common``
    (a declared study: every side runs the same seeds, so one missing is a run that failed):
    paired on the seeds both hold wherever they share two or more (A - B: the mean of their
    differences; the others named in ``unpaired``)."""
    a, b = a.dropna(), b.dropna()
    n_a, n_b = len(a), len(b)
    nan = math.nan
    if n_a == 0 or n_b == 0:
        return Difference(nan, nan, nan, nan, SHOWN, n_a, n_b)
    diff = float(a.mean() - b.mean())
    pairs = _pairs(a, b, pair_common)
    if pairs is not None:
        pa, pb, unpaired = pairs
        n = len(pa)
        d = pa.to_numpy() - pb.to_numpy()
        if unpaired:  # A - B over the pairs only (over every seed, a seed's own level would count)
            diff = float(pa.mean() - pb.mean())
        if (d == d[0]).all():  # no spread in the differences: t is undefined
            return Difference(diff, diff, diff, 0.0 if d[0] != 0 else 1.0, PAIRED, n_a, n_b, n, unpaired)
        res = stats.ttest_rel(pa.to_numpy(), pb.to_numpy())
        ci = res.confidence_interval(confidence)
        return Difference(diff, float(ci.low), float(ci.high), float(res.pvalue), PAIRED, n_a, n_b, n, unpaired)
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
    alpha: float = ALPHA  # each one-sided test's level: the interval is 1 - 2 alpha

    @property
    def judged(self) -> bool:
        return not math.isnan(self.p)


def equivalence(a: pd.Series, b: pd.Series, margin: float = EQUIVALENCE_MARGIN,
                alpha: float = ALPHA, pair_common: bool = False) -> Equivalence:
    """Two one-sided t-tests of A - B against -``margin`` and +``margin`` for two per-seed series
    (index: seed), paired or Welch as ``compare`` chooses (``pair_common`` as there).
    Each one-sided test is scipy's (``ttest_1samp`` on the paired differences, ``ttest_ind`` on A
    shifted by the margin), so the p-values come from the same code as every other verdict."""
    a, b = a.dropna(), b.dropna()
    nan = math.nan
    confidence = 1 - 2 * alpha
    pairs = _pairs(a, b, pair_common)
    if pairs is not None:
        pa, pb, _ = pairs
        d = pa.to_numpy() - pb.to_numpy()
        if (d == d[0]).all():  # no spread: equivalent exactly when the one difference is inside
            inside = abs(d[0]) < margin
            return Equivalence(margin, 0.0 if inside else 1.0, float(d[0]), float(d[0]), PAIRED, alpha)
        lower = stats.ttest_1samp(d, -margin, alternative="greater")
        upper = stats.ttest_1samp(d, margin, alternative="less")
        ci = stats.ttest_1samp(d, 0.0).confidence_interval(confidence)
        return Equivalence(margin, float(max(lower.pvalue, upper.pvalue)), float(ci.low), float(ci.high), PAIRED, alpha)
    if len(a) >= 2 and len(b) >= 2 and not (a.std(ddof=1) == 0 and b.std(ddof=1) == 0):
        x, y = a.to_numpy(), b.to_numpy()
        lower = stats.ttest_ind(x + margin, y, equal_var=False, alternative="greater")
        upper = stats.ttest_ind(x - margin, y, equal_var=False, alternative="less")
        ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(confidence)
        return Equivalence(margin, float(max(lower.pvalue, upper.pvalue)), float(ci.low), float(ci.high), WELCH, alpha)
    return Equivalence(margin, nan, nan, nan, SHOWN)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values over a family of m planned comparisons: the i-th
    smallest p-value is multiplied by (m - i), kept monotone, capped at 1. A comparison that could
    not be tested (NaN: a side had too few runs) stays NaN but still counts in m: a family does not
    shrink, and its other comparisons grow stronger, because runs failed or are still missing.

    >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03, float("nan")])]
    [0.04, 0.09, 0.09, nan]
    """
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(pvalues)
    adjusted = [math.nan] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def outside_noise(p_adjusted: float, alpha: float = ALPHA) -> bool:
    return not math.isnan(p_adjusted) and p_adjusted < alpha


TEST_IMAGES = "paired t + test images"


@dataclass(frozen=True)
class TestSetDifference:
    """A minus B (points) over seeds and test images, with an interval that carries both the
    seeds' noise and the test set's sampling error (``with_test_error``): ``se_seeds`` and
    ``se_images`` are the two terms' standard errors (points), ``df`` Satterthwaite's degrees of
    freedom for their sum."""

    diff: float
    low: float
    high: float
    p: float
    se_seeds: float
    se_images: float
    df: float
    n_seeds: int
    n_images: int
    test: str = TEST_IMAGES


def with_test_error(correct_a: dict, correct_b: dict, confidence: float = 0.95) -> TestSetDifference:
    """A - B in points from each seed's per-image correctness (``{seed: bool array over the test
    images}``, the same images in the same order on both sides; paired by seed: the seeds both
    hold), with an interval that includes the test set's sampling error.

    Method: d[s, i] = correct_a[s][i] - correct_b[s][i], seeds s = 1..n crossed with images
    i = 1..N; the estimate is the mean of d. Its variance, with seeds and test images both drawn
    at random (two-way crossed random effects), is estimated from three mean squares: the seeds'
    term (the variance over seeds of each seed's mean of d, over n: what the paired t uses), the
    images' term (the variance over images of each image's mean of d over the seeds, over N:
    McNemar's paired variance where n = 1), less the seed-by-image residual mean square over
    n x N, which each of the two terms holds once (the sum alone would count it twice). The
    interval is t-based with Satterthwaite's degrees of freedom; p two-sided against 0. With one
    seed only the image term remains (df: N - 1). Where the estimate would fall below the larger
    of the two terms, that term is used (a variance no smaller than either source alone)."""
    import numpy as np

    seeds = sorted(set(correct_a) & set(correct_b))
    if not seeds:
        raise ValueError("no seed on both sides: nothing to pair")
    d = np.stack([np.asarray(correct_a[s], dtype=float) - np.asarray(correct_b[s], dtype=float) for s in seeds])
    n, images = d.shape
    if images < 2:
        raise ValueError(f"{images} test image(s): the image term needs two or more")
    diff = float(d.mean())
    by_seed, by_image = d.mean(axis=1), d.mean(axis=0)
    var_images = float(by_image.var(ddof=1)) / images
    terms = [(var_images, images - 1)]  # (a variance term, its degrees of freedom)
    var_seeds = 0.0
    if n > 1:
        var_seeds = float(by_seed.var(ddof=1)) / n
        residual = d - by_seed[:, None] - by_image[None, :] + diff
        var_residual = float((residual ** 2).sum()) / ((n - 1) * (images - 1)) / (n * images)
        terms += [(var_seeds, n - 1), (-var_residual, (n - 1) * (images - 1))]
    total = sum(v for v, _ in terms)
    if total < max(var_seeds, var_images):  # a sampling low of the residual's subtraction
        terms = [max((var_seeds, n - 1), (var_images, images - 1))]
        total = terms[0][0]
    if total == 0:  # every image and seed alike: no spread to test against
        p = 0.0 if diff != 0 else 1.0
        return TestSetDifference(100 * diff, 100 * diff, 100 * diff, p, 0.0, 0.0, math.inf, n, images)
    df = total ** 2 / sum(v ** 2 / k for v, k in terms if v != 0)
    se = math.sqrt(total)
    half = float(stats.t.ppf(0.5 + confidence / 2, df)) * se
    p = float(2 * stats.t.sf(abs(diff) / se, df))
    return TestSetDifference(100 * diff, 100 * (diff - half), 100 * (diff + half), p,
                             100 * math.sqrt(var_seeds), 100 * math.sqrt(var_images), df, n, images)
