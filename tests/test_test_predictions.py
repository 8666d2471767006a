"""Per-image test predictions (issue 64, item 4): the final evaluation saves each test image's
predicted class in the run folder, and an interval for A - B carries the test set's sampling error
beside the seeds' noise (``stats.with_test_error``), checked on generated data."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from conftest import TINY, read_json, run_cli
from scipy import stats

from sparsetrain.analysis.findings import difference_over_images
from sparsetrain.analysis.stats import with_test_error
from sparsetrain.results import TEST_PREDICTIONS, read_test_predictions, write_test_predictions


def test_the_interval_by_hand_from_the_mean_squares():
    rng = np.random.default_rng(3)
    hard = rng.random(40) < 0.3  # images B gets wrong more often: an images' term
    a = {s: rng.random(40) < 0.9 for s in range(4)}
    b = {s: rng.random(40) < np.where(hard, 0.1, 0.6 + 0.1 * s) for s in range(4)}  # and a seeds' term
    r = with_test_error(a, b)
    # the two-way (seeds x images) analysis of variance of d, by its sums of squares
    d = np.stack([a[s].astype(float) - b[s].astype(float) for s in range(4)])
    n, m = d.shape
    grand = d.mean()
    ss_seeds = m * ((d.mean(axis=1) - grand) ** 2).sum()
    ss_images = n * ((d.mean(axis=0) - grand) ** 2).sum()
    ss_residual = ((d - grand) ** 2).sum() - ss_seeds - ss_images
    ms = {"seeds": ss_seeds / (n - 1), "images": ss_images / (m - 1), "residual": ss_residual / ((n - 1) * (m - 1))}
    variance = (ms["seeds"] + ms["images"] - ms["residual"]) / (n * m)
    assert variance >= max(ms["seeds"], ms["images"]) / (n * m)  # no fallback in this draw
    parts = [(ms["seeds"], n - 1), (ms["images"], m - 1), (-ms["residual"], (n - 1) * (m - 1))]
    df = variance ** 2 / sum((v / (n * m)) ** 2 / k for v, k in parts)
    half = stats.t.ppf(0.975, df) * math.sqrt(variance)
    assert r.diff == pytest.approx(100 * grand)
    assert (r.low, r.high) == pytest.approx((100 * (grand - half), 100 * (grand + half)))
    assert r.df == pytest.approx(df) and (r.n_seeds, r.n_images) == (4, 40)
    assert r.p == pytest.approx(2 * stats.t.sf(abs(grand) / math.sqrt(variance), df))


def test_with_one_seed_it_is_mcnemars_paired_variance():
    a = {7: np.array([1, 1, 0, 1, 0, 1, 1, 1], bool)}
    b = {7: np.array([0, 1, 0, 1, 1, 0, 0, 1], bool)}
    r = with_test_error(a, b)
    d = a[7].astype(float) - b[7].astype(float)  # +1 where only A is right, -1 where only B is
    se = d.std(ddof=1) / math.sqrt(len(d))
    assert r.se_seeds == 0 and r.se_images == pytest.approx(100 * se) and r.df == pytest.approx(7)
    assert r.high - r.diff == pytest.approx(100 * stats.t.ppf(0.975, 7) * se)
    # the seeds both sides hold are paired; a seed on one side only is left out
    assert with_test_error({**a, 8: a[7]}, b).n_seeds == 1
    with pytest.raises(ValueError, match="no seed on both sides"):
        with_test_error({1: a[7]}, b)


def test_the_interval_covers_when_the_test_set_is_drawn_too():
    """Generated data: a population of images, a tenth of them hard for B; each draw takes 1,000
    test images and 5 seeds. The paired t over the seeds' accuracies ignores which images the test
    set drew and covers the population's A - B too rarely; the interval with the images' term
    covers it about 95% of the time."""
    rng = np.random.default_rng(0)
    hard = rng.random(100_000) < 0.1
    p_a, p_b = np.where(hard, 0.9, 0.98), np.where(hard, 0.4, 0.98)
    truth = 100 * (p_a - p_b).mean()
    covered, covered_seeds_only, draws = 0, 0, 200
    for _ in range(draws):
        images = rng.choice(len(hard), 1000, replace=False)
        a = {s: rng.random(1000) < p_a[images] for s in range(5)}
        b = {s: rng.random(1000) < p_b[images] for s in range(5)}
        r = with_test_error(a, b)
        covered += r.low <= truth <= r.high
        ci = stats.ttest_rel([100 * a[s].mean() for s in a], [100 * b[s].mean() for s in b]).confidence_interval()
        covered_seeds_only += ci.low <= truth <= ci.high
    assert 0.92 <= covered / draws <= 0.99
    assert covered_seeds_only / draws < 0.9


def _runs_with_predictions(folder, label, wrong_by_seed, name):
    runs = []
    for seed, wrong in wrong_by_seed.items():
        run = folder / f"{name}{seed}"
        run.mkdir()
        predicted = label.copy()
        predicted[wrong] = 0
        path = write_test_predictions(run, predicted, label, num_classes=10)
        assert path.name == TEST_PREDICTIONS and path.stat().st_size < 1000
        runs.append({"run_dir": str(run), "seed": seed, "status": "completed",
                     "test_accuracy": float((predicted == label).mean())})
    return runs


def test_the_predictions_file_and_the_interval_with_test_set_error(tmp_path):
    label = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    a = _runs_with_predictions(tmp_path, label, {0: [0], 1: [2, 5], 2: []}, "a")
    b = _runs_with_predictions(tmp_path, label, {0: [0, 1], 1: [2, 3, 5], 3: [1]}, "b")
    got, labels = read_test_predictions(tmp_path / "a1")
    assert got.dtype == np.uint8 and list(labels) == list(label) and list(got[[2, 5]]) == [0, 0]
    assert read_test_predictions(tmp_path) is None  # a run that wrote none
    # the seeds both sides hold (0, 1), the images paired: A - B = (1 + 1) / 16 = 12.5 points
    t = difference_over_images(pd.DataFrame(a), pd.DataFrame(b))
    assert t.n_seeds == 2 and t.n_images == 8 and t.diff == pytest.approx(12.5)
    expected = with_test_error({s: np.load(tmp_path / f"a{s}" / TEST_PREDICTIONS)["predicted"] == label for s in (0, 1)},
                               {s: np.load(tmp_path / f"b{s}" / TEST_PREDICTIONS)["predicted"] == label for s in (0, 1)})
    assert (t.low, t.high, t.p) == (expected.low, expected.high, expected.p)
    # a paired run that wrote none (it predates them): no interval, rather than one from fewer seeds
    no_file = [*b[:1], {**b[1], "run_dir": str(tmp_path)}]
    assert difference_over_images(pd.DataFrame(a), pd.DataFrame(no_file)) is None
    # another test set (other labels, or another length): its images cannot be paired
    other = tmp_path / "other"
    other.mkdir()
    write_test_predictions(other, label[::-1].copy(), label[::-1].copy(), num_classes=10)
    with pytest.raises(ValueError, match="another test set than .*the labels differ first at image 0"):
        difference_over_images(pd.DataFrame(a), pd.DataFrame([*b[:1], {**b[1], "run_dir": str(other)}]))
    with pytest.raises(ValueError, match="one of each per test image"):
        write_test_predictions(tmp_path, label[:3], label, num_classes=10)


@pytest.mark.slow  # a 2-rank run; the file's format and the interval stay in the fast tier
def test_a_run_saves_its_test_predictions_in_the_test_sets_order(tmp_path):
    # two ranks, each scoring every other image: rank 0 puts them back in order, so the file's
    # accuracy is the summary's exactly
    run = tmp_path / "run"
    proc = run_cli(*TINY, "world_size=2", "train.epochs=1", f"hydra.run.dir={run}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(run / "summary.json")
    predicted, label = read_test_predictions(run)
    assert predicted.dtype == np.uint8 and len(predicted) == len(label) > 1
    assert (predicted == label).sum() / len(label) == pytest.approx(s["test_accuracy"], abs=1e-12)
