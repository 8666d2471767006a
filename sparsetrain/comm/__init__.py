"""Communication: every rank's gradient in, the averaged update out, one collective per step.

- ``flat``: the flat gradient buffer (each parameter's ``.grad`` a view into it);
- ``protocol``: the ``Reducer`` interface the train step talks to, and ``ExchangeStats``;
- ``dense``: ``DenseReducer``, one AllReduce, optionally overlapped with backward;
- ``sparse``: ``SparseReducer``, error feedback + a compressor + AllReduce or packed AllGather;
- ``powersgd``: ``PowerSGDReducer``, error feedback + PowerSGD's factors in two AllReduces (and
  its DDP hook, ``powersgd_hook``);
- ``rules``: which scheme / scope / aggregation combinations exist;
- ``build``: ``build_exchange`` (buffer + reducer, as the trainer and every benchmark build them).
"""

from sparsetrain.comm.build import build_exchange, build_reducer
from sparsetrain.comm.dense import DenseReducer
from sparsetrain.comm.flat import flat_gradients
from sparsetrain.comm.powersgd import PowerSGDReducer
from sparsetrain.comm.powersgd_ddp import PowerSGDHookState, powersgd_hook
from sparsetrain.comm.protocol import ExchangeStats, Reducer
from sparsetrain.comm.rules import AGGREGATIONS, check_combination
from sparsetrain.comm.sparse import SparseReducer

__all__ = [
    "AGGREGATIONS",
    "DenseReducer",
    "ExchangeStats",
    "PowerSGDHookState",
    "PowerSGDReducer",
    "Reducer",
    "SparseReducer",
    "build_exchange",
    "build_reducer",
    "check_combination",
    "flat_gradients",
    "powersgd_hook",
]
