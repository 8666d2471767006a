"""Dense SGD's exchange: one AllReduce of the flat gradient, optionally overlapped with backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sparsetrain.comm.protocol import ExchangeStats, ReducerBase
from sparsetrain.compress import Layout
from sparsetrain.timing import BucketClock, PhaseTimer


def average_dense(flat: torch.Tensor, world: int, group=None) -> None:
    """Dense SGD's exchange, in place: AllReduce (sum) then divide by the number of ranks (also
    the sparse schemes' warm-up steps)."""
    if world > 1:
        dist.all_reduce(flat, group=group)
        flat.div_(world)


class DenseReducer(ReducerBase):
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
        self.uncompressed_bytes_per_step = self.dense_bytes_per_step  # everything goes whole
        self.density = 1.0
        self.collective = "allreduce"
        self.warmup_steps = 0
        self._buckets: list[tuple[int, int]] = []
        self._flat: torch.Tensor | None = None
        self._hooks: list = []
        self.clock: BucketClock | None = None  # when each bucket started (attach)

    # --- overlap with backward -------------------------------------------------------------
    def attach(self, params, flat_grad: torch.Tensor, bucket_mb: float = 4.0, first_bucket_mb: float = 1.0):
        """Start bucket AllReduces during backward. ``params``' ``.grad`` must be views of
        ``flat_grad`` in order (as the trainer sets them up)."""
        if not (dist.is_initialized() and dist.get_world_size(self.group) > 1):
            return self
        params = [p for p in params if p.requires_grad]
        esize = flat_grad.element_size()
        layout = Layout.from_tensors(params)
        if layout.total != flat_grad.numel():
            raise ValueError(f"params hold {layout.total} entries, the flat gradient {flat_grad.numel()}")
        self._flat = flat_grad
        self._buckets, self._bucket_of, members = [], {}, []
        cap = first_bucket_mb * 2**20
        end, size, cur = layout.total, 0, []
        for i in reversed(range(len(params))):
            cur.append(i)
            size += params[i].numel() * esize
            if size >= cap or i == 0:
                start = layout.offsets[i]
                self._buckets.append((start, end))
                members.append(list(cur))
                end, size, cur, cap = start, 0, [], bucket_mb * 2**20
        for b, mem in enumerate(members):
            for i in mem:
                self._bucket_of[id(params[i])] = b
        self._grads_per_bucket = [len(m) for m in members]
        self.clock = BucketClock()
        self._reset()
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return self

    def _reset(self):
        self._grads_missing = list(self._grads_per_bucket)
        self._next = 0
        self._handles: list = []

    def _on_grad(self, p):
        b = self._bucket_of[id(p)]
        self._grads_missing[b] -= 1
        while self._next < len(self._buckets) and self._grads_missing[self._next] <= 0:
            self._launch(self._next)

    def _launch(self, b: int):
        start, end = self._buckets[b]
        self.clock.mark(end - start)
        self._handles.append(dist.all_reduce(self._flat[start:end], group=self.group, async_op=True))
        self._next = b + 1

    def detach(self):
        for h in self._hooks:
            h.remove()
        self._hooks, self._buckets, self._flat = [], [], None
        self.clock = None

    @property
    def overlap_buckets(self) -> list[tuple[float, float]] | None:
        """Per bucket (launch order) its share of the entries and how long before backward's end
        it started (mean ms; ``timing.BucketClock``); None when the exchange is not overlapped."""
        return self.clock.means() if self.clock is not None else None

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer,
               want_stats: bool = False) -> ExchangeStats:
        with timer.phase("exchange"):
            world = dist.get_world_size(self.group) if dist.is_initialized() else 1
            if world > 1 and self._buckets and flat_grad is self._flat:
                while self._next < len(self._buckets):  # buckets whose hooks did not fire
                    self._launch(self._next)
                for h in self._handles:
                    h.wait()
                self.clock.close()
                self._reset()
                flat_grad.div_(world)
            else:
                average_dense(flat_grad, world, self.group)
        return ExchangeStats(self.bytes_sent_per_step, self.dense_bytes_per_step)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
