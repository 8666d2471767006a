"""Which scheme / scope / aggregation / ratio combinations exist: the one place that says so.

Pure (no process group): ``config.validate`` calls it before any rank starts, the reducers when
they are built.
"""

from __future__ import annotations

from sparsetrain.compress import SCOPES, get_compressor
from sparsetrain.results import TORCH_HOOK_SCHEMES  # noqa: F401  (the analysis reads it without torch)

AGGREGATIONS = ("allreduce", "allgather")


def check_aggregation(scheme: str, aggregation: str) -> None:
    """``ValueError`` (one line) for an unknown aggregation or one the scheme cannot use."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation={aggregation!r} is not allowed; allowed: {', '.join(AGGREGATIONS)}"
        )
    if scheme != "none" and aggregation == "allreduce" and not get_compressor(scheme).shared_positions:
        raise ValueError(
            f"aggregation='allreduce' is not available for scheme={scheme!r} (top-k picks "
            f"different positions on every rank); use aggregation=allgather"
        )


def check_combination(scheme: str, scope: str, aggregation: str, ratio: float) -> None:
    """Raise ``ValueError`` (one line: key, value, what is allowed) for an invalid combination.

    ``scheme=none`` is dense SGD and accepts any scope and aggregation (they do not apply to it).
    """
    get_compressor(scheme)  # raises for an unknown scheme, listing the known ones
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed; allowed: {', '.join(SCOPES)}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio={ratio!r} is not allowed; allowed: a number in (0, 1]")
    check_aggregation(scheme, aggregation)
