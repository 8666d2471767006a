"""Old import path of ``sparsetrain.comm`` (the exchange moved there); kept for existing scripts."""

from sparsetrain.comm import (  # noqa: F401
    AGGREGATIONS,
    DenseReducer,
    ExchangeStats,
    Reducer,
    SparseReducer,
    build_exchange,
    build_reducer,
    check_combination,
    flat_gradients,
)
from sparsetrain.compress import available  # noqa: F401

__all__ = [
    "AGGREGATIONS",
    "DenseReducer",
    "ExchangeStats",
    "Reducer",
    "SparseReducer",
    "available",
    "build_exchange",
    "build_reducer",
    "check_combination",
    "flat_gradients",
]
