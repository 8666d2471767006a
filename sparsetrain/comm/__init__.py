"""Communication: every rank's gradient in, the averaged update out, in place, every step.

- ``flat``: the flat gradient buffer (each parameter's ``.grad`` a view into it);
- ``protocol``: the ``Reducer`` interface the trainer talks to, ``ReducerBase`` (the defaults of
  its optional members, every reducer's base), ``check_reducer``, and ``ExchangeStats``;
- ``dense``: ``DenseReducer``, one AllReduce, optionally overlapped with backward;
- ``sparse``: ``SparseReducer``, the memory (error feedback) + a compressor + the rounds of
  collectives it declares (one AllReduce or packed AllGather for the sparsifiers and quantizers,
  two AllReduces for PowerSGD); the DDP hook (``sparsetrain.comm.ddp_hook``) runs it per bucket;
- ``rules``: which scheme / scope / aggregation combinations exist;
- ``build``: ``build_exchange`` (buffer + reducer, as the trainer and every benchmark build them).
"""

from sparsetrain.comm.build import build_exchange, build_reducer
from sparsetrain.comm.dense import DenseReducer
from sparsetrain.comm.flat import flat_gradients
from sparsetrain.comm.protocol import ExchangeStats, Reducer, ReducerBase, check_reducer
from sparsetrain.comm.rules import AGGREGATIONS, check_combination
from sparsetrain.comm.sparse import SparseReducer

__all__ = [
    "AGGREGATIONS",
    "DenseReducer",
    "ExchangeStats",
    "Reducer",
    "ReducerBase",
    "SparseReducer",
    "build_exchange",
    "build_reducer",
    "check_combination",
    "check_reducer",
    "flat_gradients",
]
