"""What a reducer is: the one interface the train step talks to (``Reducer``), and what it
reports per step (``ExchangeStats``).

A reducer owns the collectives of a step over the flat gradient buffer (``comm.flat``): it reads
every rank's gradient there and overwrites it, in place, with the update every rank applies
identically. ``DenseReducer`` (comm.dense) and ``SparseReducer`` (comm.sparse) implement it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sparsetrain.timing import PhaseTimer


@dataclass
class ExchangeStats:
    """What one step sent. Byte counts are per worker: the payload handed to the collective
    (``costmodel.wire_bytes(collective, bytes_sent, world)`` is what crosses the link).
    ``compression_error`` and ``memory_norm`` are None on steps without statistics (the trainer
    asks for them on logged steps only: ``Reducer.reduce(..., want_stats=True)``)."""

    bytes_sent: int
    dense_bytes: int
    density: float = 1.0
    compression_error: float | None = None  # ||acc - sent|| / ||acc||
    memory_norm: float | None = None  # ||error-feedback memory|| after the step
    collective: str | None = "allreduce"  # what carried it: allreduce | allgather | None (nothing)


@runtime_checkable
class Reducer(Protocol):
    """Turns the flat gradient into the averaged update, in place, once per step.

    Sizes are per step and per worker once compression runs (``warmup_steps`` dense steps come
    first): ``bytes_sent_per_step`` on the wire, ``dense_bytes_per_step`` for the same buffer
    sent whole, ``uncompressed_bytes_per_step`` of it for the tensors that travel whole;
    ``density`` = entries sent / entries; ``collective`` the one that carries them
    (``allreduce`` or ``allgather``; warm-up steps use ``allreduce``).
    """

    numel: int
    collective: str
    density: float
    warmup_steps: int
    bytes_sent_per_step: int
    dense_bytes_per_step: int
    uncompressed_bytes_per_step: int

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
