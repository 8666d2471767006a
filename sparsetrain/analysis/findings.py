"""The paper's findings as comparisons between configurations, each judged by one stated rule.

A comparison has two sides, each a set of runs chosen by axis values (the second pass's setting
plus what the finding varies), and what the paper reports: side A above side B (``>``) or no
visible difference (``=``). Each side is the mean ± std of its runs' final test accuracy over
seeds; only completed runs count (a run that did not train, failed or is missing is counted
beside the number, never in it).

The rule: a difference is **outside the noise** when the ranges mean ± std of the two sides do not
overlap (one run alone is a point). With 3 seeds a side this is about a two-sided t-test at
p < 0.07: a coarse rule, stated so that every verdict can be checked by hand. A comparison then
**agrees** with the paper, is **reversed** (``>`` expected, the other way round outside the
noise), **differs** (``=`` expected, a difference outside the noise), is **within noise** (``>``
expected, the ranges overlap) or is **pending** (a side has no completed run yet). A finding is
reproduced when all its comparisons agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from .loader import completed, select
from .tables import SCHEME_NAMES, Table

# The second pass's setting (experiment=cpu_scale): every side starts from it. Dense SGD rows
# carry "-" for the sparse-only axes and pass them.
SECOND_PASS = {"model": "resnet20", "data": "fashion_mnist", "train_size": "all", "epochs_planned": 2,
               "batch_size": 64, "lr": 0.05, "exchange": "trainer", "uncompressed": "1d",
               "warmup_steps": 0, "error_feedback": True, "bn_recalibrate": 0}


@dataclass(frozen=True)
class Comparison:
    label: str
    a: dict
    b: dict
    expect: str  # ">": A above B; "=": no visible difference


@dataclass(frozen=True)
class Finding:
    key: str
    claim: str  # what the paper found, in our words
    comparisons: tuple[Comparison, ...]


def _sparse(scheme, **axes) -> dict:
    return {"scheme": scheme, **axes}


def _scheme_pair(label_axes: str, scheme_a: str, scheme_b: str, expect: str, **axes) -> Comparison:
    return Comparison(f"{SCHEME_NAMES[scheme_a]} vs {SCHEME_NAMES[scheme_b]}, {label_axes}",
                      _sparse(scheme_a, **axes), _sparse(scheme_b, **axes), expect)


SPARSE = ("topk", "randk", "blockk")
RATIOS = (0.01, 0.1, 0.001)

FINDINGS: tuple[Finding, ...] = (
    Finding("rq1_scope", "Layer-wise beats global scope in test accuracy for every scheme.", tuple(
        Comparison(f"{SCHEME_NAMES[s]}: layer-wise vs global, 1%, 2 workers",
                   _sparse(s, scope="layerwise", ratio=0.01, world_size=2, aggregation="allgather"),
                   _sparse(s, scope="global", ratio=0.01, world_size=2, aggregation="allgather"), ">")
        for s in SPARSE)),
    Finding("rq2_order", "Accuracy order: top-k > block-random-k > random-k.", tuple(
        _scheme_pair(f"layer-wise, {r * 100:g}%, 2 workers", a, b, ">", scope="layerwise", ratio=r,
                     world_size=2, aggregation="allgather")
        for r in RATIOS for a, b in (("topk", "blockk"), ("blockk", "randk")))),
    Finding("rq2_random", "Random-k is about as good as block-random-k layer-wise, but loses clearly "
            "more accuracy with global scope.", (
        _scheme_pair("layer-wise, 1%, 2 workers", "randk", "blockk", "=", scope="layerwise", ratio=0.01,
                     world_size=2, aggregation="allgather"),
        _scheme_pair("global, 1%, 2 workers", "blockk", "randk", ">", scope="global", ratio=0.01,
                     world_size=2, aggregation="allgather"),
    )),
    Finding("rq3_aggregation", "AllReduce vs AllGather: no visible accuracy difference for random-k; "
            "block-random-k with AllReduce loses accuracy as workers increase.", tuple(
        Comparison(f"{SCHEME_NAMES[s]}: AllGather vs AllReduce, layer-wise, 1%, {w} workers",
                   _sparse(s, aggregation="allgather", scope="layerwise", ratio=0.01, world_size=w),
                   _sparse(s, aggregation="allreduce", scope="layerwise", ratio=0.01, world_size=w),
                   "=" if s == "randk" else ">")
        for s in ("randk", "blockk") for w in (2, 4))),
    Finding("rq4_workers", "More workers: test accuracy drops in all settings, more with global scope.", (
        *(Comparison(f"dense SGD: {w} vs {2 * w} workers", {"scheme": "dense", "world_size": w},
                     {"scheme": "dense", "world_size": 2 * w}, ">") for w in (2, 4)),
        *(Comparison(f"{SCHEME_NAMES[s]}: {w} vs {2 * w} workers, layer-wise, 1%",
                     _sparse(s, scope="layerwise", ratio=0.01, world_size=w, aggregation="allgather"),
                     _sparse(s, scope="layerwise", ratio=0.01, world_size=2 * w, aggregation="allgather"), ">")
          for s in SPARSE for w in (2, 4)),
        *(Comparison(f"{SCHEME_NAMES[s]}: 2 vs 4 workers, global, 1%",
                     _sparse(s, scope="global", ratio=0.01, world_size=2, aggregation="allgather"),
                     _sparse(s, scope="global", ratio=0.01, world_size=4, aggregation="allgather"), ">")
          for s in SPARSE),
    )),
)


def _side(runs: pd.DataFrame, axes: dict, base: dict) -> pd.DataFrame:
    """The runs of one side: ``base`` with ``axes`` on top (dense SGD passes its ``-`` axes)."""
    return select(runs, {axis: [value] for axis, value in {**base, **axes}.items()})


def _stats(side: pd.DataFrame) -> tuple[float, float, int]:
    per_seed = completed(side).groupby("seed")["test_accuracy"].mean() * 100
    n = len(per_seed)
    if n == 0:
        return math.nan, math.nan, 0
    return float(per_seed.mean()), float(per_seed.std(ddof=1)) if n > 1 else 0.0, n


def _show(mean: float, std: float, n: int, side: pd.DataFrame) -> str:
    text = "—" if n == 0 else f"{mean:.2f}" + (f" ± {std:.2f}" if n > 1 else "") + f" (n={n})"
    left_out = side["status"].value_counts().drop("completed", errors="ignore")
    if len(left_out):
        text += " [" + ", ".join(f"{count} {status}" for status, count in left_out.items()) + "]"
    return text


def judge(a: tuple[float, float, int], b: tuple[float, float, int], expect: str) -> str:
    """The outcome of one comparison from each side's (mean, std, n), by the module's rule."""
    (ma, sa, na), (mb, sb, nb) = a, b
    if na == 0 or nb == 0:
        return "pending"
    apart = ma - sa > mb + sb or mb - sb > ma + sa
    if expect == "=":
        return "differs" if apart else "agrees"
    if not apart:
        return "within noise"
    return "agrees" if ma > mb else "reversed"


def verdict(outcomes: list[str]) -> str:
    """One finding's verdict from its comparisons' outcomes."""
    pending = outcomes.count("pending")
    if pending:
        return f"pending ({len(outcomes) - pending} of {len(outcomes)} comparisons measured)"
    if all(o == "agrees" for o in outcomes):
        return "reproduced"
    if all(o in ("reversed", "differs") for o in outcomes):
        return "not reproduced: every comparison goes the other way"
    counts = pd.Series(outcomes).value_counts()
    return "partly: " + ", ".join(f"{count} {outcome}" for outcome, count in counts.items())


def findings_tables(runs: pd.DataFrame, findings: tuple[Finding, ...] = FINDINGS,
                    base: dict | None = None) -> tuple[Table, Table]:
    """``(verdicts, comparisons)``: one row per finding, and one row per comparison; every side
    starts from ``base`` (default: the second pass's setting)."""
    base = SECOND_PASS if base is None else base
    rows, verdict_rows = [], []
    for finding in findings:
        outcomes = []
        for comparison in finding.comparisons:
            side_a, side_b = _side(runs, comparison.a, base), _side(runs, comparison.b, base)
            stats_a, stats_b = _stats(side_a), _stats(side_b)
            outcome = judge(stats_a, stats_b, comparison.expect)
            outcomes.append(outcome)
            difference = stats_a[0] - stats_b[0]
            rows.append({
                "finding": finding.key, "comparison (A vs B)": comparison.label,
                "paper": "A > B" if comparison.expect == ">" else "A = B",
                "A: test accuracy (%)": _show(*stats_a, side_a), "B: test accuracy (%)": _show(*stats_b, side_b),
                "A − B (points)": "—" if math.isnan(difference) else f"{difference:+.2f}",
                "outcome": outcome,
            })
        verdict_rows.append({"finding": finding.key, "the paper": finding.claim, "verdict": verdict(outcomes)})
    rule = ("Outside the noise: the ranges mean ± std over seeds of A and B do not overlap (one run "
            "is a point). Second-pass setting: ResNet-20, all 60,000 Fashion-MNIST images, 2 epochs, "
            "64 images per worker, 1-D tensors whole, no warm-up; runs that did not complete or "
            "did not train are counted in brackets, never in the numbers.")
    comparisons = pd.DataFrame(rows)
    verdicts = pd.DataFrame(verdict_rows)
    return (Table("verdicts", "The paper's findings: verdicts", verdicts, verdicts, notes=[rule]),
            Table("findings", "The paper's findings: every comparison", comparisons, comparisons, notes=[rule]))
