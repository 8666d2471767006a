"""Which scheme / scope / aggregation / ratio combinations exist: the one place that says so.

Pure (no process group): ``config.validate`` calls it before any rank starts, the reducers when
they are built. What a scheme allows comes from its compressor class (``shared_positions``),
found through the scheme's ``compressor`` node (``compress.compressor_class``), never by name.
"""

from __future__ import annotations

from typing import Any

from sparsetrain.compress import SCOPES, compressor_class
from sparsetrain.results import TORCH_HOOK_SCHEMES  # noqa: F401  (the analysis reads it without torch)
from sparsetrain.scheme_catalog import is_dense

AGGREGATIONS = ("allreduce", "allgather")


def check_aggregation(scheme: str, aggregation: str, compressor: Any = None) -> None:
    """``ValueError`` (one line) for an unknown aggregation or one the scheme's compressor cannot
    use (AllReduce needs positions every rank can draw alike: ``shared_positions``; the class's
    ``allreduce_refusal`` says why not)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation={aggregation!r} is not allowed; allowed: {', '.join(AGGREGATIONS)}"
        )
    cls = compressor_class(compressor) if compressor is not None else None
    if cls is not None and aggregation == "allreduce" and not cls.shared_positions:
        raise ValueError(
            f"aggregation='allreduce' is not available for scheme={scheme!r} ({cls.__name__} "
            f"{cls.allreduce_refusal}); use aggregation=allgather"
        )


def check_combination(scheme: str, scope: str, aggregation: str, ratio: float, compressor: Any = None) -> None:
    """Raise ``ValueError`` (one line: key, value, what is allowed) for an invalid combination.

    ``compressor``: the scheme's compressor, as its ``compressor`` node in conf/scheme/<scheme>.yaml
    instantiates it (a ``functools.partial`` of the class), or the class; None only for
    ``scheme='none'``, dense SGD, which accepts any scope and aggregation (they do not apply to it).
    """
    if not is_dense(scheme) and compressor is None:
        raise ValueError(f"scheme={scheme!r} has no compressor: its conf/scheme/{scheme}.yaml must name "
                         "the class in a compressor node (_target_, _partial_: true)")
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed; allowed: {', '.join(SCOPES)}")
    cls = None if is_dense(scheme) else compressor_class(compressor)
    if cls is not None and scope not in cls.scopes:  # a compressor with fewer scopes says which (PowerSGD)
        why = f" ({cls.scope_reason})" if cls.scope_reason else ""
        raise ValueError(f"scope={scope!r} is not allowed for scheme={scheme!r}{why}; "
                         f"allowed: {', '.join(cls.scopes)}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio={ratio!r} is not allowed; allowed: a number in (0, 1]")
    check_aggregation(scheme, aggregation, None if is_dense(scheme) else compressor)
