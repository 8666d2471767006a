"""Exchange: turn every rank's gradient into the averaged update, one collective per step.

The trainer keeps all gradients in one flat buffer (parameters' ``.grad`` are views into it).
A reducer overwrites that buffer, in place, with the update every rank applies identically.

- ``DenseReducer``: plain AllReduce (dense SGD, scheme ``none``).
- ``SparseReducer``: error feedback + a compressor from ``sparsetrain.compress``, then either
  ``allreduce`` (positions drawn from a seed shared by all ranks: only the k values are summed)
  or ``allgather`` (each rank its own positions; values and positions packed into one byte
  buffer, one ``all_gather_into_tensor``, every rank adds all contributions).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsetrain.compress import (
    SCOPES,
    ErrorFeedback,
    as_layout,
    available,
    get_compressor,
    step_seed,
)
from sparsetrain.timing import PhaseTimer

AGGREGATIONS = ("allreduce", "allgather")


@dataclass
class ExchangeStats:
    """What one step sent. Byte counts are per worker, as put on the wire."""

    bytes_sent: int
    dense_bytes: int
    density: float = 1.0
    compression_error: float | None = None  # ||acc - sent|| / ||acc||
    memory_norm: float | None = None  # ||error-feedback memory|| after the step


class DenseReducer:
    """Plain data-parallel SGD: one AllReduce of the flat gradient, divided by world size.

    ``attach(params)`` (optional) overlaps the AllReduce with backward, as DDP does: the flat
    buffer is cut into buckets of whole parameters in reverse order (the order backward produces
    them), and a bucket's asynchronous AllReduce starts from a post-accumulate-grad hook as soon as
    all its parameters have their gradient (buckets start in the same order on every rank).
    ``reduce`` then waits for what is still in flight. Same result as without ``attach``.
    """

    def __init__(self, numel: int, element_size: int = 4, group=None):
        self.group = group
        self.numel = numel
        self.dense_bytes_per_step = numel * element_size
        self.bytes_sent_per_step = self.dense_bytes_per_step
        self._buckets: list[tuple[int, int]] = []
        self._flat: torch.Tensor | None = None
        self._hooks: list = []

    # --- overlap with backward -------------------------------------------------------------
    def attach(self, params, flat_grad: torch.Tensor, bucket_mb: float = 4.0, first_bucket_mb: float = 1.0):
        """Start bucket AllReduces during backward. ``params``' ``.grad`` must be views of
        ``flat_grad`` in order (as the trainer sets them up)."""
        if not (dist.is_initialized() and dist.get_world_size(self.group) > 1):
            return self
        params = [p for p in params if p.requires_grad]
        esize = flat_grad.element_size()
        offs, off = [], 0
        for p in params:
            offs.append(off)
            off += p.numel()
        if off != flat_grad.numel():
            raise ValueError(f"params hold {off} entries, the flat gradient {flat_grad.numel()}")
        self._flat = flat_grad
        self._buckets, self._bucket_of, members = [], {}, []
        cap = first_bucket_mb * 2**20
        end, size, cur = off, 0, []
        for i in reversed(range(len(params))):
            cur.append(i)
            size += params[i].numel() * esize
            if size >= cap or i == 0:
                start = offs[i]
                self._buckets.append((start, end))
                members.append(list(cur))
                end, size, cur, cap = start, 0, [], bucket_mb * 2**20
        for b, mem in enumerate(members):
            for i in mem:
                self._bucket_of[id(params[i])] = b
        self._need = [len(m) for m in members]
        self._reset()
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return self

    def _reset(self):
        self._left = list(self._need)
        self._next = 0
        self._handles: list = []

    def _on_grad(self, p):
        b = self._bucket_of[id(p)]
        self._left[b] -= 1
        while self._next < len(self._buckets) and self._left[self._next] <= 0:
            self._launch(self._next)

    def _launch(self, b: int):
        a, e = self._buckets[b]
        self._handles.append(dist.all_reduce(self._flat[a:e], group=self.group, async_op=True))
        self._next = b + 1

    def detach(self):
        for h in self._hooks:
            h.remove()
        self._hooks, self._buckets, self._flat = [], [], None

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer) -> ExchangeStats:
        with timer.phase("exchange"):
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                if self._buckets and flat_grad is self._flat:
                    while self._next < len(self._buckets):  # buckets whose hooks did not fire
                        self._launch(self._next)
                    for h in self._handles:
                        h.wait()
                    self._reset()
                else:
                    dist.all_reduce(flat_grad, group=self.group)
                flat_grad.div_(dist.get_world_size(self.group))
        return ExchangeStats(self.bytes_sent_per_step, self.dense_bytes_per_step)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def check_combination(scheme: str, scope: str, aggregation: str, ratio: float) -> None:
    """Raise ``ValueError`` (one line: key, value, what is allowed) for an invalid combination.

    Pure: usable before any rank starts. ``scheme=none`` is dense SGD and accepts any scope and
    aggregation (they do not apply to it).
    """
    get_compressor(scheme)  # raises for an unknown scheme, listing the known ones
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed; allowed: {', '.join(SCOPES)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation={aggregation!r} is not allowed; allowed: {', '.join(AGGREGATIONS)}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio={ratio!r} is not allowed; allowed: a number in (0, 1]")
    if scheme != "none" and aggregation == "allreduce" and not get_compressor(scheme).shared_positions:
        raise ValueError(
            f"aggregation='allreduce' is not available for scheme={scheme!r} (top-k picks "
            f"different positions on every rank); use aggregation=allgather"
        )


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """One AllGather into one flat tensor (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class SparseReducer:
    """Error feedback + compression + one collective + decompression, on the flat buffer.

    Result on every rank: ``flat_grad = (1/W) * sum_r decompress(payload_r)``, identical on all
    ranks (the same additions in the same rank order). Values are divided by W before they are
    added, which is exact for W = 2 (and any power of two) so that ratio=1 matches dense there.
    """

    def __init__(
        self,
        compressor,
        *,
        aggregation: str,
        world_size: int,
        rank: int,
        seed: int,
        error_feedback: bool = True,
        group=None,
        device="cpu",
        dtype=torch.float32,
        stats_every: int = 1,
    ):
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation={aggregation!r} is not allowed; allowed: {', '.join(AGGREGATIONS)}"
            )
        if aggregation == "allreduce" and not compressor.shared_positions:
            raise ValueError(
                f"aggregation='allreduce' is not available for scheme={compressor.name!r} (top-k "
                f"picks different positions on every rank); use aggregation=allgather"
            )
        self.compressor = compressor
        self.aggregation = aggregation
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.group = group
        self.device = torch.device(device)
        self.dtype = dtype
        self.stats_every = int(stats_every)
        self.numel = compressor.numel
        self.memory = ErrorFeedback(self.numel, enabled=error_feedback, device=device, dtype=dtype)

        esize = torch.empty((), dtype=dtype).element_size()
        k, p = compressor.k, compressor.num_positions
        self.pos_dtype = torch.int32 if compressor.max_position < 2**31 else torch.int64
        psize = torch.empty((), dtype=self.pos_dtype).element_size()
        self.dense_bytes_per_step = self.numel * esize
        if aggregation == "allreduce":
            self._values = torch.empty(k, dtype=dtype, device=device)
            self.bytes_sent_per_step = k * esize
        else:
            self._val_bytes = k * esize
            self._pos_off = -(-self._val_bytes // psize) * psize  # aligned for the int view
            align = max(esize, psize)  # every rank's message starts aligned for both views
            self._msg_bytes = -(-(self._pos_off + p * psize) // align) * align
            self._send = torch.zeros(self._msg_bytes, dtype=torch.uint8, device=device)
            self._recv = torch.zeros(self.world_size * self._msg_bytes, dtype=torch.uint8, device=device)
            self._send_values = self._send[: self._val_bytes].view(dtype)
            self._pos_end = self._pos_off + p * psize
            self._send_pos = self._send[self._pos_off : self._pos_end].view(self.pos_dtype)
            self.bytes_sent_per_step = self._msg_bytes

    def _step_seed(self, step: int) -> int:
        rank = None if self.aggregation == "allreduce" else self.rank
        return step_seed(self.seed, step, rank)

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer) -> ExchangeStats:
        W = _world(self.group)
        if W != self.world_size:
            raise RuntimeError(
                f"world_size={self.world_size} but the process group has {W} ranks"
            )
        want_stats = self.stats_every > 0 and step % self.stats_every == 0
        grad_sq = (
            float(torch.dot(flat_grad, flat_grad))
            if want_stats and not self.memory.enabled
            else None
        )
        comp = self.compressor
        with timer.phase("compress"):
            acc = self.memory.accumulate(flat_grad)
            out = self._values if self.aggregation == "allreduce" else self._send_values
            payload = comp.compress(acc, self._step_seed(step), out=out)
            self.memory.forget(payload, comp)
            if self.aggregation == "allgather":
                self._send_pos.copy_(payload.positions)
        stats = self.memory.stats(payload, grad_sq) if want_stats else (None, None)

        with timer.phase("exchange"):
            if W > 1:
                if self.aggregation == "allreduce":
                    dist.all_reduce(self._values, group=self.group)
                else:
                    _all_gather_single(self._recv, self._send, group=self.group)
            elif self.aggregation == "allgather":
                self._recv[: self._msg_bytes].copy_(self._send)

        with timer.phase("decompress"):
            flat_grad.zero_()
            if self.aggregation == "allreduce":
                self._values.div_(W)
                comp.decompress_add(self._values, payload.positions, flat_grad, indices=payload.indices)
            else:
                mb = self._msg_bytes
                for r in range(W):
                    msg = self._recv[r * mb : (r + 1) * mb]
                    values = msg[: self._val_bytes].view(self.dtype) / W
                    if r == self.rank:  # own positions already expanded
                        comp.decompress_add(values, payload.positions, flat_grad, indices=payload.indices)
                    else:
                        positions = msg[self._pos_off : self._pos_end].view(self.pos_dtype)
                        comp.decompress_add(values, positions, flat_grad)
        return ExchangeStats(
            self.bytes_sent_per_step,
            self.dense_bytes_per_step,
            density=comp.k / self.numel,
            compression_error=stats[0],
            memory_norm=stats[1],
        )

    def state_dict(self) -> dict:
        return {"error_feedback": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["error_feedback"])


def build_reducer(
    scheme: str,
    scope: str,
    aggregation: str,
    ratio: float,
    layout,
    *,
    world_size: int,
    rank: int,
    seed: int,
    error_feedback: bool = True,
    block_size: int = 256,
    group=None,
    device="cpu",
    dtype=torch.float32,
    stats_every: int = 1,
):
    """The reducer for a scheme/scope/aggregation; ``DenseReducer`` for ``scheme='none'``.

    ``layout``: a ``Layout``, the parameters (one segment each), their sizes, or a total numel.
    Raises ``ValueError`` with a one-line message for invalid combinations.
    """
    check_combination(scheme, scope, aggregation, ratio)
    layout = as_layout(layout)
    if scheme == "none":
        return DenseReducer(layout.total, torch.empty((), dtype=dtype).element_size(), group=group)
    cls = get_compressor(scheme)
    # pass scheme options only to the schemes that declare them
    accepted = inspect.signature(cls.__init__).parameters
    options = {"block_size": block_size} if "block_size" in accepted else {}
    comp = cls(ratio, layout, scope, device=device, **options)
    return SparseReducer(
        comp,
        aggregation=aggregation,
        world_size=world_size,
        rank=rank,
        seed=seed,
        error_feedback=error_feedback,
        group=group,
        device=device,
        dtype=dtype,
        stats_every=stats_every,
    )


__all__ = [
    "AGGREGATIONS",
    "DenseReducer",
    "ExchangeStats",
    "SparseReducer",
    "available",
    "build_reducer",
    "check_combination",
]
