"""What a reducer is: the one interface the trainer, its train step and its run record talk to
(``Reducer``), the defaults of its optional members (``ReducerBase``), and what it reports per
step (``ExchangeStats``).

A reducer owns the collectives of a step over the flat gradient buffer (``comm.flat``): it reads
every rank's gradient there and overwrites it, in place, with the update every rank applies
identically. ``DenseReducer`` (comm.dense), ``SparseReducer`` (comm.sparse), ``PeriodicSync``
(comm.periodic) and ``DDPExchange`` (train.ddp_exchange) implement it, each a ``ReducerBase``.
The trainer reads every member directly (no ``getattr`` probes): ``check_reducer`` refuses, when
the exchange is built, a reducer that lacks one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sparsetrain.errors import ConfigError
from sparsetrain.timing import PhaseTimer


@dataclass
class ExchangeStats:
    """What one step sent. Byte counts are per worker: the payload handed to the collective
    (``costmodel.wire_bytes(collective, bytes_sent, world)`` is what crosses the link; where
    ``bytes_by_collective`` is given, the sum of that over its collectives).
    ``compression_error`` and ``memory_norm`` are None on steps without statistics (the trainer
    asks for them on logged steps only: ``Reducer.reduce(..., want_stats=True)``)."""

    bytes_sent: int
    dense_bytes: int
    density: float = 1.0
    compression_error: float | None = None  # ||acc - sent|| / ||acc||
    memory_norm: float | None = None  # ||error-feedback memory|| after the step
    collective: str | None = "allreduce"  # what carried it: allreduce | allgather | None (nothing)
    #: ``bytes_sent`` split by the collective that carried each part (a compressor's rounds may
    #: gather some and sum others); None: all of it by ``collective``
    bytes_by_collective: dict[str, int] | None = None


@runtime_checkable
class Reducer(Protocol):
    """Turns the flat gradient into the averaged update, in place, once per step.

    Sizes are per step and per worker once compression runs (``warmup_steps`` dense steps come
    first): ``bytes_sent_per_step`` on the wire, ``dense_bytes_per_step`` for the same buffer
    sent whole, ``uncompressed_bytes_per_step`` of it for the tensors that travel whole;
    ``density`` = entries sent / entries; ``collective`` the one that carries them
    (``allreduce`` or ``allgather``; warm-up steps use ``allreduce``); ``bytes_by_collective``
    ``bytes_sent_per_step`` split by collective, where rounds of several carry it (None: all by
    ``collective``; the wire bytes are each part at its own ring factor).

    What the run record reads: ``compresses`` (whether anything is compressed once warm-up ends),
    ``ratio_applies`` / ``aggregation_applies`` / ``scope_applies`` (whether that axis of the run
    changes what is sent: summary.json's ``applies``), ``ranks_diverge`` (each rank's model and
    optimizer are its own between synchronisations: a checkpoint keeps every rank's),
    ``overlap_buckets`` (per bucket of an exchange inside backward: its share of the entries and
    its lead in ms; None when not overlapped) and ``sync_summary()``.
    """

    numel: int
    collective: str
    density: float
    warmup_steps: int
    bytes_sent_per_step: int
    bytes_by_collective: dict[str, int] | None
    dense_bytes_per_step: int
    uncompressed_bytes_per_step: int
    compresses: bool
    ratio_applies: bool
    aggregation_applies: bool
    scope_applies: bool
    ranks_diverge: bool
    overlap_buckets: list[tuple[float, float]] | None

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer,
               want_stats: bool = False) -> ExchangeStats:
        """Overwrite ``flat_grad`` with the averaged update; time the phases it runs.
        ``want_stats``: also report the compression error and memory norm (the caller asks on
        the steps it logs; a host sync on CUDA, left out of the step's time)."""
        ...

    def attach(self, params, flat_grad: torch.Tensor, **buckets) -> Reducer:
        """Start exchanging during backward where the reducer can (dense: bucketed AllReduces);
        a no-op otherwise. Same result either way. Returns the reducer."""
        ...

    def detach(self) -> None:
        """Undo ``attach``."""
        ...

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this rank's reducer (error-feedback memory)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def settle(self, inputs: torch.Tensor) -> None:
        """Under DDP, before step 0: let DDP settle its buckets on ``inputs`` (nothing sent)."""
        ...

    def after_optimizer(self, step: int, timer: PhaseTimer) -> None:
        """After the optimizer's step at 0-based ``step``: synchronise the model where the
        exchange does so (local SGD, DiLoCo)."""
        ...

    def synchronised(self) -> contextlib.AbstractContextManager[None]:
        """Within: the model every rank agrees on (evaluation, ``model.pt``)."""
        ...

    def sync_summary(self) -> dict | None:
        """summary.json's ``sync`` (a synchronisation's bytes and time); None: every step syncs."""
        ...

    def watch_kept_state(self) -> None:
        """Check once more, over the next compressed step (or synchronisation), that the state
        the exchange's parts keep across steps is declared (``compress.kept``): the trainer asks
        at every epoch's end, so state first written mid-run is caught before a resume loses it."""
        ...


def _members(protocol: type) -> tuple[str, ...]:
    """The names ``protocol`` declares: its annotated attributes and its methods."""
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return tuple(dict.fromkeys([*protocol.__annotations__, *methods]))


#: every member of ``Reducer``, in its order: what ``check_reducer`` asks of a reducer
REDUCER_MEMBERS = _members(Reducer)


class ReducerBase:
    """The defaults of ``Reducer``'s optional members, for an exchange that synchronises every
    step in ``reduce`` and keeps nothing else: every reducer subclasses it and overrides what
    differs. ``reduce``, ``state_dict``, ``load_state_dict`` and the sizes have no default."""

    compresses: bool = False
    ratio_applies: bool = True
    aggregation_applies: bool = True
    scope_applies: bool = True
    ranks_diverge: bool = False
    overlap_buckets: list[tuple[float, float]] | None = None
    bytes_by_collective: dict[str, int] | None = None  # all by ``collective``

    def attach(self, params, flat_grad, **buckets) -> ReducerBase:
        return self  # nothing to start during backward

    def detach(self) -> None:
        pass

    def settle(self, inputs: torch.Tensor) -> None:
        pass  # no DDP buckets

    def after_optimizer(self, step: int, timer: PhaseTimer) -> None:
        pass  # the model was synchronised through the gradient

    def synchronised(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # every rank holds the same model

    def sync_summary(self) -> dict | None:
        return None

    def watch_kept_state(self) -> None:
        pass  # nothing kept across steps


def split_by_collective(reducer) -> dict[str, int]:
    """``reducer.bytes_sent_per_step`` by the collective that carries each part: its
    ``bytes_by_collective``, or all of it by its ``collective`` (a fresh dict)."""
    return dict(reducer.bytes_by_collective or {reducer.collective: reducer.bytes_sent_per_step})


def check_reducer(reducer, where: str) -> Reducer:
    """``reducer``, or ``ConfigError`` (one line) naming the ``Reducer`` members it lacks;
    ``where``: what built it (the config key or function)."""
    missing = [name for name in REDUCER_MEMBERS if not hasattr(reducer, name)]
    if missing:
        raise ConfigError(f"{where} built a {type(reducer).__name__} without the Reducer members "
                          f"{', '.join(missing)}; a reducer must define every member of "
                          f"sparsetrain.comm.protocol.Reducer (subclass ReducerBase for the optional ones' defaults)")
    return reducer
