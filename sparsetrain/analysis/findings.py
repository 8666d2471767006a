"""The paper's findings as comparisons between configurations, each judged by one stated test.

A comparison has two sides, each a set of runs chosen by axis values (a setting plus what the
finding varies), and what the paper reports: side A above side B (``>``) or no visible difference
(``=``). Each side is its runs' final test accuracy per seed; only completed runs that trained
count (a run that did not train, failed or is missing is counted beside the number, never in it;
a run that blew up early and recovered counts, and is counted beside it too).

The test (``analysis.stats``): the difference A - B in points with its 95 % interval and
two-sided p-value, paired over seeds when both sides ran the same seeds, Welch's t-test otherwise;
a side with one run is shown, never judged. The p-values of one finding's comparisons are
adjusted together (Holm). A difference is **outside the noise** when its adjusted p < 0.05.
A comparison then **agrees** with the paper, is **reversed** (``>`` expected, the other way
round outside the noise), **differs** (``=`` expected, a difference outside the noise), is
**within noise** (``>`` expected, not outside the noise), **not judged** (a side with one run)
or **pending** (a side has no completed run yet). For ``=`` "agrees" needs an equivalence test:
two one-sided t-tests at +-1 point (``stats.equivalence``, Holm-adjusted over the finding's
``=`` comparisons) whose p is below 0.05 (a gap inside the margin agrees even where the
difference test detects it); a ``=`` comparison that is neither shown equivalent nor told apart
is **not told apart**. A finding is reproduced when all its comparisons agree.

Two settings (``Comparison.setting`` on top of ``SECOND_PASS``): the headline protocol
(``HEADLINE``: 4 epochs, 5 seeds) for RQ1 and RQ2 at 1 %; the second pass's 2 epochs, 3 seeds
for the rest. ``SECOND_PASS_FINDINGS`` judges the second pass's own comparisons (all at 2
epochs) with the same test, so that what changed between the passes can be read side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from sparsetrain.results import BLEW_UP_RECOVERED, read_test_predictions

from .group import code_versions, one_configuration, without_copies
from .loader import completed, select
from .stats import (
    ALPHA,
    EQUIVALENCE_MARGIN,
    SHOWN,
    Difference,
    TestSetDifference,
    compare,
    equivalence,
    holm,
    method_label,
    outside_noise,
    per_seed,
    with_test_error,
)
from .table import SCHEME_NAMES, Table

# The second pass's setting (experiment=cpu_scale): every side starts from it. Dense SGD rows
# carry "-" for the sparse-only axes and pass them.
# Its sweeps only: a run of one's own at the same setting elsewhere in the results tree (a smoke
# run, another commit's rerun) is not one of its seeds.
SECOND_PASS_SWEEPS = ["baseline", "rq1_scope", "rq2_low", "rq2_scheme", "rq3_aggregation", "rq4_global",
                      "rq4_workers"]
SECOND_PASS = {"model": "resnet20", "data": "fashion_mnist", "train_size": "all", "epochs_planned": 2,
               "batch_size": 64, "lr": 0.05, "exchange": "trainer", "uncompressed": "1d",
               "warmup_steps": 0, "error_feedback": True, "bn_recalibrate": 0, "experiment": SECOND_PASS_SWEEPS}
# The headline protocol (experiment=headline*): the same, at 4 epochs (near the plateau), 5 seeds,
# from its own sweeps (and those run at its budget beside it) only: the second pass's `budget`
# study also ran some of its configurations for 4 epochs (seed 0, earlier code), and is not one.
HEADLINE_SWEEPS = ["headline", "headline_dense", "headline_bytes", "ddp_fair", "frontier"]
HEADLINE = {"epochs_planned": 4, "experiment": HEADLINE_SWEEPS}
# Block-k's ratio whose bytes per step match top-k's (and random-k's) at 1 % with AllGather
# (experiment=headline_bytes).
BLOCKK_AT_TOPK_BYTES = 0.01992


@dataclass(frozen=True)
class Comparison:
    label: str
    a: dict
    b: dict
    expect: str  # ">": A above B; "=": no visible difference; "?": no claim (beyond the paper)
    setting: dict = field(default_factory=dict)  # on top of the base setting (e.g. HEADLINE)


@dataclass(frozen=True)
class Finding:
    key: str
    claim: str  # what the paper found, in our words
    comparisons: tuple[Comparison, ...]


def _sparse(scheme, **axes) -> dict:
    return {"scheme": scheme, **axes}


SPARSE = ("topk", "randk", "blockk")
TWO_WORKERS = {"world_size": 2, "aggregation": "allgather"}


def _pair(a: str, b: str, where: str, expect: str, setting: dict | None = None, ratio_a: float = 0.01,
          ratio_b: float = 0.01, **axes) -> Comparison:
    return Comparison(f"{SCHEME_NAMES[a]} vs {SCHEME_NAMES[b]}, {where}",
                      _sparse(a, ratio=ratio_a, **axes), _sparse(b, ratio=ratio_b, **axes), expect,
                      setting or {})


def _scope(s: str, where: str, setting: dict) -> Comparison:
    return Comparison(f"{SCHEME_NAMES[s]}: layer-wise vs global, {where}",
                      _sparse(s, scope="layerwise", ratio=0.01, **TWO_WORKERS),
                      _sparse(s, scope="global", ratio=0.01, **TWO_WORKERS), ">", setting)


def _rq3() -> Finding:
    return Finding("rq3_aggregation", "AllReduce vs AllGather: no visible accuracy difference for "
                   "random-k; block-random-k with AllReduce loses accuracy as workers increase.", tuple(
        Comparison(f"{SCHEME_NAMES[s]}: AllGather vs AllReduce, layer-wise, 1%, {w} workers, 2 epochs",
                   _sparse(s, aggregation="allgather", scope="layerwise", ratio=0.01, world_size=w),
                   _sparse(s, aggregation="allreduce", scope="layerwise", ratio=0.01, world_size=w),
                   "=" if s == "randk" else ">")
        for s in ("randk", "blockk") for w in (2, 4)))


def _rq4() -> Finding:
    return Finding("rq4_workers", "More workers: test accuracy drops in all settings, more with "
                   "global scope.", (
        *(Comparison(f"dense SGD: {w} vs {2 * w} workers, 2 epochs", {"scheme": "dense", "world_size": w},
                     {"scheme": "dense", "world_size": 2 * w}, ">") for w in (2, 4)),
        *(Comparison(f"{SCHEME_NAMES[s]}: {w} vs {2 * w} workers, layer-wise, 1%, 2 epochs",
                     _sparse(s, scope="layerwise", ratio=0.01, world_size=w, aggregation="allgather"),
                     _sparse(s, scope="layerwise", ratio=0.01, world_size=2 * w, aggregation="allgather"), ">")
          for s in SPARSE for w in (2, 4)),
        *(Comparison(f"{SCHEME_NAMES[s]}: 2 vs 4 workers, global, 1%, 2 epochs",
                     _sparse(s, scope="global", ratio=0.01, world_size=2, aggregation="allgather"),
                     _sparse(s, scope="global", ratio=0.01, world_size=4, aggregation="allgather"), ">")
          for s in SPARSE),
    ))


RQ1_CLAIM = "Layer-wise beats global scope in test accuracy for every scheme."
RQ2_ORDER_CLAIM = "Accuracy order: top-k > block-random-k > random-k."
RQ2_RANDOM_CLAIM = ("Random-k is about as good as block-random-k layer-wise, but loses clearly more "
                    "accuracy with global scope.")
LAYERWISE = {"scope": "layerwise", **TWO_WORKERS}
GLOBAL = {"scope": "global", **TWO_WORKERS}

# The findings as judged now: RQ1 and RQ2 at 1 % from the headline protocol (4 epochs, 5 seeds),
# RQ2 also at equal bytes; the rest at the second pass's 2 epochs.
FINDINGS: tuple[Finding, ...] = (
    Finding("rq1_scope", RQ1_CLAIM, tuple(_scope(s, "1%, 2 workers, 4 epochs", HEADLINE) for s in SPARSE)),
    Finding("rq2_order", RQ2_ORDER_CLAIM, (
        _pair("topk", "blockk", "layer-wise, 1%, 2 workers, 4 epochs", ">", HEADLINE, **LAYERWISE),
        _pair("blockk", "randk", "layer-wise, 1%, 2 workers, 4 epochs", ">", HEADLINE, **LAYERWISE),
        _pair("topk", "blockk", f"equal bytes (block-k at {BLOCKK_AT_TOPK_BYTES:g}), layer-wise, 2 workers, "
              "4 epochs", ">", HEADLINE, ratio_b=BLOCKK_AT_TOPK_BYTES, **LAYERWISE),
        _pair("blockk", "randk", f"equal bytes (block-k at {BLOCKK_AT_TOPK_BYTES:g}), layer-wise, 2 workers, "
              "4 epochs", ">", HEADLINE, ratio_a=BLOCKK_AT_TOPK_BYTES, **LAYERWISE),
        *(_pair(a, b, f"layer-wise, {r * 100:g}%, 2 workers, 2 epochs", ">", ratio_a=r, ratio_b=r, **LAYERWISE)
          for r in (0.1, 0.001) for a, b in (("topk", "blockk"), ("blockk", "randk"))),
    )),
    Finding("rq2_random", RQ2_RANDOM_CLAIM, (
        _pair("randk", "blockk", "layer-wise, 1%, 2 workers, 4 epochs", "=", HEADLINE, **LAYERWISE),
        _pair("blockk", "randk", "global, 1%, 2 workers, 4 epochs", ">", HEADLINE, **GLOBAL),
    )),
    _rq3(),
    _rq4(),
)

# Beyond the paper: comparisons the paper did not make, measured with the same test and no expected
# outcome ("?"). DDP_FAIR (experiment=ddp_fair): the exchange inside DDP's backward, at the headline
# budget, with the 2 dense warm-up steps torch's PowerSGD hook needs; block-k at the ratio whose bytes
# match PowerSGD at rank 1 (31,132 B against 31,092 B per step), each also against dense SGD (the
# trainer's exchange, experiment=headline_dense).
DDP_FAIR = {**HEADLINE, "exchange": "ddp hook", "warmup_steps": 2}
BLOCKK_AT_POWERSGD_BYTES = 0.0238
_DDP_BLOCKK = {"scheme": "blockk", "ratio": BLOCKK_AT_POWERSGD_BYTES, "scope": "layerwise", **TWO_WORKERS}
# torch's hook (runs recorded as scheme=powersgd before issue 24 load as torch_powersgd)
_DDP_POWERSGD = {"scheme": "torch_powersgd", "ratio": BLOCKK_AT_POWERSGD_BYTES, "world_size": 2}
_DENSE_HEADLINE = {"scheme": "dense", "world_size": 2, "exchange": "trainer", "warmup_steps": 0}
BEYOND_FINDINGS: tuple[Finding, ...] = (
    Finding("ddp_fair", "Inside DDP at equal bytes: block-random-k (AllGather) against torch's PowerSGD "
            "hook at rank 1, and each against dense SGD.", (
        Comparison("block-random-k vs PowerSGD rank 1, DDP hook, equal bytes, 2 workers, 4 epochs",
                   _DDP_BLOCKK, _DDP_POWERSGD, "?", DDP_FAIR),
        Comparison("dense SGD vs block-random-k (DDP hook, 2.38%), 2 workers, 4 epochs",
                   _DENSE_HEADLINE, _DDP_BLOCKK, "?", DDP_FAIR),
        Comparison("dense SGD vs PowerSGD rank 1 (DDP hook), 2 workers, 4 epochs",
                   _DENSE_HEADLINE, _DDP_POWERSGD, "?", DDP_FAIR),
    )),
)

# The frontier (experiment=frontier): the compression families at the headline budget, seeds 0-2
# (the headline protocol's first three, so that comparisons with its reused runs are paired), at
# about 1.5% of dense bytes (block-k at 1%: the headline's runs) and at signSGD's 3.6%, PowerSGD
# rank 1 (2.9%) and QSGD at s = 1 at their own bytes, fp16 and bf16 (torch's hooks) beside dense SGD.
# The points that ran seeds 0-4: the two byte levels' (seeds 3-4 in results/frontier_s34, the same
# commit) and the headline protocol's dense SGD and block-k 1%; the others ran 0-2. A comparison
# pairs the seeds both of its sides ran.
FIVE_SEEDS = {"dense", "topk_low", "randk_low", "blockk_low", "topk_high", "randk_high", "blockk_high", "signsgd"}
_LOW, _HIGH = 0.00504, 0.01567  # top-k's and random-k's ratios at each level (block-k: 0.01, 0.03126)
_F = {
    "topk_low": {"scheme": "topk", "ratio": _LOW, **LAYERWISE},
    "randk_low": {"scheme": "randk", "ratio": _LOW, **LAYERWISE},
    "blockk_low": {"scheme": "blockk", "ratio": 0.01, **LAYERWISE},
    "topk_high": {"scheme": "topk", "ratio": _HIGH, **LAYERWISE},
    "randk_high": {"scheme": "randk", "ratio": _HIGH, **LAYERWISE},
    "blockk_high": {"scheme": "blockk", "ratio": 0.03126, **LAYERWISE},
    "signsgd": {"scheme": "signsgd", **LAYERWISE},
    "powersgd": {"scheme": "powersgd", "scope": "layerwise", "world_size": 2},
    "qsgd": {"scheme": "qsgd", "error_feedback": False, "levels": 1, **LAYERWISE},
    "fp16": {"scheme": "fp16", "world_size": 2, "exchange": "ddp hook"},
    "bf16": {"scheme": "bf16", "world_size": 2, "exchange": "ddp hook"},
}
_F_NAMES = {"topk_low": "top-k 0.5%", "randk_low": "random-k 0.5%", "blockk_low": "block-random-k 1%",
            "topk_high": "top-k 1.57%", "randk_high": "random-k 1.57%", "blockk_high": "block-random-k 3.13%",
            "signsgd": "signSGD", "powersgd": "PowerSGD rank 1", "qsgd": "QSGD s=1",
            "fp16": "fp16 (torch hook)", "bf16": "bf16 (torch hook)"}


def _frontier(a: str, b: str, where: str) -> Comparison:
    side_a = _DENSE_HEADLINE if a == "dense" else _F[a]
    name_a = "dense SGD" if a == "dense" else _F_NAMES[a]
    seeds = list(range(5 if {a, b} <= FIVE_SEEDS else 3))
    return Comparison(f"{name_a} vs {_F_NAMES[b]}, {where}, 2 workers, 4 epochs",
                      {**side_a, "seed": seeds}, {**_F[b], "seed": seeds}, "?", HEADLINE)


BEYOND_FINDINGS += (
    Finding("frontier_low", "At about 1.5% of dense SGD's bytes per step (16.4 kB): the three sparsifiers.",
            tuple(_frontier(a, b, "1.5% of dense bytes") for a, b in
                  (("topk_low", "blockk_low"), ("blockk_low", "randk_low"), ("topk_low", "randk_low")))),
    Finding("frontier_high", "At signSGD's bytes per step (3.6% of dense SGD's, 39.1 kB): signSGD and the "
            "three sparsifiers.", tuple(_frontier(a, b, "3.6% of dense bytes") for a, b in
                                        (("signsgd", "topk_high"), ("signsgd", "blockk_high"), ("signsgd", "randk_high"),
                                         ("topk_high", "blockk_high"), ("blockk_high", "randk_high")))),
    Finding("frontier_dense", "Each family against dense SGD at the same budget: what its bytes cost in accuracy.",
            tuple(_frontier("dense", b, "own bytes") for b in
                  ("topk_high", "blockk_high", "randk_high", "signsgd", "powersgd", "qsgd", "fp16", "bf16"))),
)

# The second pass's comparisons (every one at 2 epochs, 3 seeds), judged by the same test.
SECOND_PASS_FINDINGS: tuple[Finding, ...] = (
    Finding("rq1_scope", RQ1_CLAIM, tuple(_scope(s, "1%, 2 workers, 2 epochs", {}) for s in SPARSE)),
    Finding("rq2_order", RQ2_ORDER_CLAIM, tuple(
        _pair(a, b, f"layer-wise, {r * 100:g}%, 2 workers, 2 epochs", ">", ratio_a=r, ratio_b=r, **LAYERWISE)
        for r in (0.01, 0.1, 0.001) for a, b in (("topk", "blockk"), ("blockk", "randk")))),
    Finding("rq2_random", RQ2_RANDOM_CLAIM, (
        _pair("randk", "blockk", "layer-wise, 1%, 2 workers, 2 epochs", "=", **LAYERWISE),
        _pair("blockk", "randk", "global, 1%, 2 workers, 2 epochs", ">", **GLOBAL),
    )),
    _rq3(),
    _rq4(),
)


def _side(runs: pd.DataFrame, axes: dict, base: dict) -> pd.DataFrame:
    """The runs of one side: ``base`` with ``axes`` on top (dense SGD passes its ``-`` axes); an
    axis given a list keeps any of its values (``seed: [0, 1, 2]``)."""
    return select(runs, {axis: value if isinstance(value, list) else [value]
                         for axis, value in {**base, **axes}.items()})


def side_accuracy(side: pd.DataFrame) -> pd.Series:
    """Final test accuracy (%) per seed of a side's completed runs."""
    # dense SGD run once per scope by a grid: one computation, counted once; any other two runs
    # of one seed stop in per_seed
    done = without_copies(completed(side))
    one_configuration(done, "one side of a comparison")
    return per_seed(done["test_accuracy"] * 100, done["seed"], done["run_dir"] if "run_dir" in done else None)


def difference_over_images(side_a: pd.DataFrame, side_b: pd.DataFrame) -> TestSetDifference | None:
    """A - B over seeds and test images (``stats.with_test_error``: an interval that carries the
    test set's sampling error) from the runs' saved per-image predictions
    (``sparsetrain.results.TEST_PREDICTIONS``), on the runs the paired test reads (one per seed,
    the seeds both sides hold). None where fewer than two seeds pair, or where one of those runs
    wrote no predictions (it predates them). Runs scored on another test set, or in another
    order, stop in one line naming the run: their images cannot be paired."""
    import numpy as np

    correct: list[dict] = []
    labels, first = None, None
    for side in (side_a, side_b):
        done = without_copies(completed(side))
        done = done[done["test_accuracy"].notna()]
        seeds = per_seed(done["test_accuracy"], done["seed"], done["run_dir"] if "run_dir" in done else None)
        out = {}
        for _, run in done.iterrows():
            found = read_test_predictions(run["run_dir"])
            if found is None:
                return None
            predicted, label = found
            if labels is None:
                labels, first = label, run["run_dir"]
            elif label.shape != labels.shape or not np.array_equal(label, labels):
                where = (f"{len(label)} images against {len(labels)}" if label.shape != labels.shape else
                         f"the labels differ first at image {int(np.argmax(label != labels))}")
                raise ValueError(f"{run['run_dir']}: its test predictions are of another test set than {first}'s "
                                 f"({where}); allowed: the runs of one comparison scored on one test set, in one order")
            out[run["seed"]] = predicted == label
        correct.append({seed: out[seed] for seed in seeds.index})
    if len(set(correct[0]) & set(correct[1])) < 2:
        return None
    return with_test_error(*correct)


def images_interval_cell(m: dict) -> str:
    """A comparison's interval with the test set's sampling error (``difference_over_images``), for
    the comparisons table: the interval and the two sources' standard errors, or why not."""
    t = difference_over_images(m["side_a"], m["side_b"])
    if t is None:
        return "— (no test predictions)"
    return f"[{t.low:+.2f}, {t.high:+.2f}] (SE seeds {t.se_seeds:.2f}, images {t.se_images:.2f})"


def _show(values: pd.Series, side: pd.DataFrame) -> str:
    unscored = int(values.isna().sum())  # left out of the test too (compare drops them)
    values = values.dropna()
    n = len(values)
    text = "—" if n == 0 else f"{values.mean():.2f}" + (f" ± {values.std(ddof=1):.2f}" if n > 1 else "") + f" (n={n})"
    counts = side["status"].value_counts().drop("completed", errors="ignore")
    notes = [f"{count} {status}" for status, count in counts.items()]
    if unscored:
        notes.append(f"{unscored} completed with no test accuracy")
    if "stability" in side:
        blew = int((completed(side)["stability"] == BLEW_UP_RECOVERED).sum())
        if blew:
            notes.append(f"{blew} {BLEW_UP_RECOVERED}")
    versions = code_versions(completed(side))
    if len(versions) > 1:  # a study runs on one commit: a side that did not says so in its cell
        notes.append(f"{len(versions)} code versions: {', '.join(v[:12] for v in versions)}")
    return text + (" [" + ", ".join(notes) + "]" if notes else "")


def judge(d: Difference, p_adjusted: float, expect: str, p_equivalent: float = math.nan,
          equivalence_alpha: float = ALPHA) -> str:
    """The outcome of one comparison from its difference, its Holm-adjusted p-value and, for an
    ``=`` claim, its equivalence test's Holm-adjusted p-value (NaN: not tested), which shows
    equivalence below ``equivalence_alpha``."""
    if d.n_a == 0 or d.n_b == 0:
        return "pending"
    if d.test == SHOWN:
        return "not judged"
    apart = outside_noise(p_adjusted)
    if expect == "?":
        return ("A higher" if d.diff > 0 else "B higher") if apart else "within noise"
    if expect == "=":  # equivalent within the margin agrees, even where a smaller gap is detected
        if outside_noise(p_equivalent, equivalence_alpha):
            return "agrees"
        return "differs" if apart else "not told apart"
    if not apart:
        return "within noise"
    return "agrees" if d.diff > 0 else "reversed"


def verdict(outcomes: list[str], claimed: bool = True) -> str:
    """One finding's verdict from its comparisons' outcomes; ``claimed=False`` for a finding
    beyond the paper (no expected outcome: the verdict counts what was measured)."""
    pending = outcomes.count("pending")
    if pending:
        return f"pending ({len(outcomes) - pending} of {len(outcomes)} comparisons measured)"
    unjudged = outcomes.count("not judged")
    if unjudged:  # a side with one run: no verdict from a finding not yet judged in full
        return f"not judged yet ({len(outcomes) - unjudged} of {len(outcomes)} comparisons judged)"
    counts = ", ".join(f"{count} {outcome}" for outcome, count in pd.Series(outcomes).value_counts().items())
    if not claimed:
        return "measured: " + counts
    if all(o == "agrees" for o in outcomes):
        return "reproduced"
    if all(o in ("reversed", "differs") for o in outcomes):  # each one against the claim, outside the noise
        return "not reproduced: " + counts
    return "partly: " + counts


def _num(value: float, digits: int = 2, signed: bool = False) -> str:
    if math.isnan(value):
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _p(value: float) -> str:
    if math.isnan(value):
        return "—"
    return "<0.001" if value < 0.001 else f"{value:.3f}"


RULE = ("A − B in points with its 95% interval (unadjusted); test: paired t on per-seed differences where both "
        "sides ran the same seeds, Welch's t otherwise (scipy.stats); p two-sided, Holm-adjusted "
        "over the finding's comparisons; outside the noise: adjusted p < 0.05; a claim of no difference "
        "(paper A = B) agrees only when two one-sided t-tests show equivalence within ±1 point (TOST p, "
        "Holm-adjusted over the finding's A = B claims, below 0.05; its 90% interval inside the margin), "
        "else it is 'not told apart'; the families were drawn after the runs (post hoc); a side with one run "
        "is shown, not judged. Setting: ResNet-20, all 60,000 Fashion-MNIST images, 64 images per "
        "worker, 1-D tensors whole, no warm-up, at the epochs each comparison names; runs that did "
        "not complete or did not train are counted in brackets, never in the numbers; runs that "
        "blew up early and recovered count, and are counted in brackets too.")


def _equivalence_cell(e, p_adjusted: float) -> str:
    if e is None:
        return "—"
    if not e.judged:
        return "not judged"
    return f"p={_p(p_adjusted)} (Holm), {100 * (1 - 2 * e.alpha):g}% [{e.low:+.2f}, {e.high:+.2f}] vs ±{e.margin:g}"


def measure(runs: pd.DataFrame, finding: Finding, base: dict, margin: float = EQUIVALENCE_MARGIN,
            looks: int = 1, equivalence_unclaimed: bool = False,
            equivalence_alpha: float = ALPHA, pair_common: bool = False) -> list[dict]:
    """One finding's comparisons measured and judged: each a dict with the comparison, its sides'
    runs and per-seed accuracies, the ``Difference``, its Holm-adjusted p (times ``looks``, the
    analyses taken of the data so far, capped at 1), the equivalence test of a ``=`` claim with
    its Holm-adjusted p (over the finding's ``=`` claims, times ``looks``) and the outcome.
    ``equivalence_unclaimed``: a ``?`` comparison gets the equivalence test too, Holm-adjusted over
    the finding's ``?`` comparisons (shown beside its outcome, which it does not change).
    ``equivalence_alpha``: each one-sided test's level (a declaration's ``equivalence_alpha``).
    ``pair_common``: a declared study's sides, paired on the seeds both hold (``stats.compare``)."""
    measured = []
    for comparison in finding.comparisons:
        setting = {**base, **comparison.setting}
        side_a, side_b = _side(runs, comparison.a, setting), _side(runs, comparison.b, setting)
        acc_a, acc_b = side_accuracy(side_a), side_accuracy(side_b)
        tested = comparison.expect == "=" or (equivalence_unclaimed and comparison.expect == "?")
        eq = equivalence(acc_a, acc_b, margin, equivalence_alpha, pair_common) if tested else None
        measured.append({"comparison": comparison, "side_a": side_a, "side_b": side_b, "acc_a": acc_a,
                         "acc_b": acc_b, "d": compare(acc_a, acc_b, pair_common=pair_common), "equivalence": eq})

    def adjusted(ps: list[float]) -> list[float]:
        return [min(1.0, looks * p) if not math.isnan(p) else p for p in holm(ps)]

    for m, p_adj in zip(measured, adjusted([m["d"].p for m in measured]), strict=True):
        m["p_holm"] = p_adj
    for expect in ("=", "?"):  # each kind its own family: a claim is not diluted by what no one claimed
        equal = [m for m in measured if m["equivalence"] is not None and m["comparison"].expect == expect]
        for m, p_adj in zip(equal, adjusted([m["equivalence"].p for m in equal]), strict=True):
            m["p_equivalent"] = p_adj
    for m in measured:
        m.setdefault("p_equivalent", math.nan)
        expect = m["comparison"].expect
        m["outcome"] = judge(m["d"], m["p_holm"], expect, m["p_equivalent"] if expect == "=" else math.nan,
                             equivalence_alpha)
    return measured


def findings_tables(runs: pd.DataFrame, findings: tuple[Finding, ...] = FINDINGS,
                    base: dict | None = None, name: str = "") -> tuple[Table, Table]:
    """``(verdicts, comparisons)``: one row per finding, and one row per comparison; every side
    starts from ``base`` (default: the second pass's setting) with the comparison's ``setting``
    on top. ``name`` prefixes the tables' file names (``second_pass_``)."""
    base = SECOND_PASS if base is None else base
    rows, verdict_rows = [], []
    for finding in findings:
        outcomes = []
        for m in measure(runs, finding, base):
            comparison, d, outcome = m["comparison"], m["d"], m["outcome"]
            outcomes.append(outcome)
            rows.append({
                "finding": finding.key, "comparison (A vs B)": comparison.label,
                "paper": {">": "A > B", "=": "A = B"}.get(comparison.expect, "no claim"),
                "A: test accuracy (%)": _show(m["acc_a"], m["side_a"]),
                "B: test accuracy (%)": _show(m["acc_b"], m["side_b"]),
                "A − B (points)": _num(d.diff, signed=True),
                "95% interval": "—" if math.isnan(d.low) else f"[{d.low:+.2f}, {d.high:+.2f}]",
                "test": method_label(d),
                "p": _p(d.p), "p (Holm)": _p(m["p_holm"]),
                f"equivalence (TOST, ±{EQUIVALENCE_MARGIN:g} pt)": _equivalence_cell(m["equivalence"], m["p_equivalent"]),
                "outcome": outcome,
            })
        claimed = any(c.expect != "?" for c in finding.comparisons)
        verdict_rows.append({"finding": finding.key, "the paper": finding.claim,
                             "verdict": verdict(outcomes, claimed)})
    comparisons = pd.DataFrame(rows)
    verdicts = pd.DataFrame(verdict_rows)
    what = TITLES.get(name, "The paper's findings")
    notes = [RULE, *NOTES.get(name, ())]
    return (Table(f"{name}verdicts", f"{what}, verdicts", verdicts, verdicts, notes=notes),
            Table(f"{name}findings", f"{what}, every comparison", comparisons, comparisons, notes=notes))


# Table titles by file-name prefix (findings_tables' ``name``).
TITLES = {"second_pass_": "The paper's findings, second pass (2 epochs)",
          "beyond_": "Beyond the paper (no claim to reproduce: A higher, B higher or within noise)"}
NOTES = {"beyond_": ("DDP hook runs (experiment=ddp_fair): the exchange inside DDP's backward, 2 dense "
                     "warm-up steps (torch's PowerSGD hook needs 2); dense SGD: the trainer's exchange, no "
                     "warm-up (experiment=headline_dense).",
                     "Frontier (experiment=frontier): seeds 0-4 on both sides where both ran them (the points at "
                     "1.5% and 3.6%, and the headline protocol's block-k 1% and dense SGD runs, reused), "
                     "seeds 0-2 otherwise, paired; layer-wise, AllGather; QSGD without error "
                     "feedback; fp16 and bf16 through DDP.")}
