"""Compressed exchange: error feedback + a compressor from ``sparsetrain.compress``, then one
collective.

A compressor's message has two sections (``compress.base``): ``num_values`` floats (a
sparsifier's k values, a quantizer's per-tensor scales) and ``num_positions`` integers of
``wire_dtype`` (a sparsifier's positions, a quantizer's packed bits as uint8).

- ``allreduce``: positions drawn from a seed shared by all ranks, so only the k values are summed
  (compressors with ``shared_positions``).
- ``allgather``: each rank its own message, values and positions packed into one byte message,
  one ``all_gather_into_tensor``, every rank decodes every message (``decompress_add``) in rank
  order, so every rank adds the same numbers in the same order.

Tensors that bypass compression (``scheme.uncompressed``: by default the 1-D ones) sit at the end
of the flat buffer (``comm.flat.flat_gradients`` orders it so) and travel whole in the same
collective: appended to the AllReduce values, or to the packed AllGather message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsetrain.comm.dense import average_dense
from sparsetrain.comm.protocol import ExchangeStats
from sparsetrain.comm.rules import check_aggregation
from sparsetrain.compress import ErrorFeedback, compression_stats, step_seed
from sparsetrain.timing import NULL_TIMER, PhaseTimer


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """One AllGather into one flat tensor (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


@dataclass(frozen=True)
class Placement:
    """Where the exchange's two parts lie in the buffer it is handed, as runs ``(offset in the
    buffer, offset in the part, length)``: ``grad_runs`` cover the compressed tensors in the
    compressor's layout order, ``whole_runs`` the tensors that travel whole. The trainer's flat
    buffer is ``[compressed | whole]``, one run each (``Placement.flat``); a DDP bucket
    interleaves the two (``comm.flat.packed_runs``)."""

    grad_runs: tuple
    whole_runs: tuple

    @classmethod
    def flat(cls, compressed_numel: int, uncompressed_numel: int) -> Placement:
        whole = ((compressed_numel, 0, uncompressed_numel),) if uncompressed_numel else ()
        return cls(((0, 0, compressed_numel),), whole)


@dataclass
class SparseStep:
    """One sparse step in flight, between ``SparseReducer.start`` and ``finish``: the buffer and
    where its parts lie, what was packed, the collective's ``Work`` (None when it already ran, or
    on one rank) and the statistics (``(compression_error, memory_norm)``, None when not asked)."""

    buf: torch.Tensor
    placement: Placement
    payload: Any
    work: Any
    stats: tuple | None


class SparseReducer:
    """Error feedback + compression + one collective + decompression, on the flat buffer.

    Result on every rank: ``flat_grad = (1/W) * sum_r decompress(payload_r)`` (W ranks), identical on
    all ranks (the same additions in the same rank order). Values are divided by W before they are
    added, which is exact for W = 2 (and any power of two) so that ratio=1 matches dense there.

    The flat buffer is ``[compressed prefix | uncompressed tail]``: the compressor and the
    error-feedback memory cover the prefix (``compressor.numel`` entries); the last
    ``uncompressed_numel`` entries travel whole, after the sparse values in the same message,
    and never enter the memory. For the first ``warmup_steps`` steps the whole buffer is
    AllReduced densely and the memory stays empty; compression starts at step ``warmup_steps``.
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
        memory=None,
        uncompressed_numel: int = 0,
        warmup_steps: int = 0,
        group=None,
        device="cpu",
        dtype=torch.float32,
    ):
        check_aggregation(type(compressor).__name__, aggregation, compressor)
        self.compressor = compressor
        self.aggregation = aggregation
        self.collective = aggregation  # after warm-up; warm-up steps AllReduce densely
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.group = group
        self.device = torch.device(device)
        self.dtype = dtype
        self.warmup_steps = int(warmup_steps)
        self.compressed_numel = compressor.numel
        self.uncompressed_numel = int(uncompressed_numel)
        self.numel = self.compressed_numel + self.uncompressed_numel
        # the memory component (conf/scheme/<name>.yaml's ``memory`` node; error feedback by default)
        self.memory = (memory or ErrorFeedback)(self.compressed_numel, enabled=error_feedback, device=device,
                                                dtype=dtype)
        self.flat_placement = Placement.flat(self.compressed_numel, self.uncompressed_numel)
        self._decoded: torch.Tensor | None = None  # decoding buffer for a placement of several runs

        esize = torch.empty((), dtype=dtype).element_size()
        num_positions = compressor.num_positions
        num_values = compressor.num_values + self.uncompressed_numel  # compressor's values, then the whole tensors
        # per step once compression runs, whole tensors included (a quantizer sends every entry)
        self.entries_sent = compressor.k + self.uncompressed_numel
        self.density = self.entries_sent / self.numel
        self.pos_dtype = compressor.wire_dtype
        psize = torch.empty((), dtype=self.pos_dtype).element_size()
        self.dense_bytes_per_step = self.numel * esize
        self.uncompressed_bytes_per_step = self.uncompressed_numel * esize
        if aggregation == "allreduce":
            self._values = torch.empty(num_values, dtype=dtype, device=device)
            self.bytes_sent_per_step = num_values * esize
        else:
            self._values_nbytes = num_values * esize
            self._positions_start = -(-self._values_nbytes // psize) * psize  # aligned for the int view
            align = max(esize, psize)  # every rank's message starts aligned for both views
            self._message_nbytes = -(-(self._positions_start + num_positions * psize) // align) * align
            self._send = torch.zeros(self._message_nbytes, dtype=torch.uint8, device=device)
            self._recv = torch.zeros(self.world_size * self._message_nbytes, dtype=torch.uint8, device=device)
            self._values = self._send[: self._values_nbytes].view(dtype)
            self._positions_end = self._positions_start + num_positions * psize
            self._send_positions = self._send[self._positions_start : self._positions_end].view(self.pos_dtype)
            self.bytes_sent_per_step = self._message_nbytes

    def positions_seed(self, step: int) -> int:
        """The seed of ``step``'s positions: shared by every rank with AllReduce (they must send
        the same positions), each rank its own with AllGather."""
        rank = None if self.aggregation == "allreduce" else self.rank
        return step_seed(self.seed, step, rank)

    def _dense_step(self, flat_grad: torch.Tensor, world: int, timer: PhaseTimer) -> ExchangeStats:
        """Compression warm-up: plain AllReduce of everything; the memory stays untouched."""
        with timer.phase("exchange"):
            average_dense(flat_grad, world, self.group)
        return ExchangeStats(self.dense_bytes_per_step, self.dense_bytes_per_step, 1.0, 0.0, 0.0, "allreduce")

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer,
               want_stats: bool = False) -> ExchangeStats:
        world = _world(self.group)
        if world != self.world_size:
            raise RuntimeError(
                f"world_size={self.world_size} but the process group has {world} ranks"
            )
        if flat_grad.numel() != self.numel:
            raise ValueError(f"the flat gradient has {flat_grad.numel()} entries, the reducer {self.numel}")
        if step < self.warmup_steps:
            return self._dense_step(flat_grad, world, timer)
        pending = self.start(flat_grad, step, want_stats=want_stats, timer=timer, async_op=False)
        with timer.phase("decompress"):
            self.finish(pending)
        error, norm = pending.stats or (None, None)
        return ExchangeStats(
            self.bytes_sent_per_step,
            self.dense_bytes_per_step,
            density=self.density,
            compression_error=error,
            memory_norm=norm,
            collective=self.aggregation,
        )

    # --- the one sparse step: ``reduce`` and the DDP hook (sparsetrain.ddp) both drive it ---------
    def start(self, buf: torch.Tensor, step: int, *, placement: Placement | None = None,
              want_stats: bool = False, timer: PhaseTimer = NULL_TIMER, async_op: bool = True) -> SparseStep:
        """Error feedback and compression of ``buf``'s compressed tensors into the message, its
        whole tensors after them, then the one collective, started (``async_op``: not waited
        for). ``placement``: where the two parts lie in ``buf`` (default: the trainer's
        ``[compressed | whole]``). ``want_stats``: the compression error and memory norm (a host
        sync on CUDA, left out of the step's time)."""
        placement = placement or self.flat_placement
        with timer.phase("compress"):
            payload, acc = self.pack(buf, placement, self.positions_seed(step))
        stats = None
        if want_stats:  # the error before forget changes acc; the norm after
            with timer.untimed():
                error = compression_stats(acc, payload, self.compressor)
        with timer.phase("compress"):
            self.keep(buf, placement, payload)
        if want_stats:
            with timer.untimed():
                stats = (error, self.memory.norm())
        with timer.phase("exchange"):
            work = self.communicate(async_op=async_op)
        return SparseStep(buf, placement, payload, work, stats)

    def finish(self, pending: SparseStep) -> None:
        """Wait for the collective (if still in flight) and overwrite the buffer with the
        average over ranks."""
        if pending.work is not None:
            pending.work.wait()
        self.unpack(pending.buf, pending.placement, pending.payload)

    # --- the three phases of a step ------------------------------------------------------------
    def pack(self, buf: torch.Tensor, placement: Placement, seed: int):
        """The memory's accumulate and the compression of ``buf``'s compressed tensors (read
        where they lie) into the message. Returns ``(payload, acc)``: ``acc`` the vector that was
        compressed (until ``keep``)."""
        pieces = [(f, buf[a : a + n]) for a, f, n in placement.grad_runs]
        acc = self.memory.accumulate(pieces[0][1] if len(pieces) == 1 else pieces)
        wire = self._send_positions if self.aggregation == "allgather" else None
        payload = self.compressor.compress(acc, seed, out=self._values[: self.compressor.num_values], wire=wire)
        return payload, acc

    def keep(self, buf: torch.Tensor, placement: Placement, payload) -> None:
        """The memory's forget (what was not sent is kept), then ``buf``'s whole tensors into the
        message after the values."""
        self.memory.forget(payload, self.compressor)
        nv = self.compressor.num_values
        for a, w, n in placement.whole_runs:
            self._values[nv + w : nv + w + n].copy_(buf[a : a + n])

    def communicate(self, async_op: bool = False):
        """The one collective over the packed message; its ``Work`` when ``async_op`` (None on
        one rank, where AllGather's receive buffer is filled locally)."""
        if self.world_size > 1:
            if self.aggregation == "allreduce":
                return dist.all_reduce(self._values, group=self.group, async_op=async_op)
            return _all_gather_single(self._recv, self._send, group=self.group, async_op=async_op)
        if self.aggregation == "allgather":
            self._recv[: self._message_nbytes].copy_(self._send)
        return None

    def unpack(self, buf: torch.Tensor, placement: Placement, payload) -> None:
        """Overwrite ``buf``'s two parts with the average over ranks (after ``communicate``):
        every message decoded by the compressor's own ``decompress_add``, in rank order, into
        the compressed tensors (where they are one run, in place; else into a buffer in the
        compressor's layout, copied to them), the whole tensors summed beside."""
        comp, k, world = self.compressor, self.compressor.num_values, self.world_size
        runs = placement.grad_runs
        if len(runs) == 1:
            a, _, n = runs[0]
            grad = buf[a : a + n]
        else:
            if self._decoded is None or self._decoded.dtype != buf.dtype or self._decoded.device != buf.device:
                self._decoded = torch.empty(self.compressed_numel, dtype=buf.dtype, device=buf.device)
            grad = self._decoded
        grad.zero_()
        if self.aggregation == "allreduce":
            self._values.div_(world)
            comp.decompress_add(self._values[:k], payload.positions, grad, indices=payload.indices)
            for a, w, n in placement.whole_runs:
                buf[a : a + n].copy_(self._values[k + w : k + w + n])
        else:
            for a, _, n in placement.whole_runs:
                buf[a : a + n].zero_()
            for r, values, wire in self.messages():
                if r == self.rank and payload.indices is not None:  # own positions already expanded
                    comp.decompress_add(values[:k], payload.positions, grad, indices=payload.indices)
                else:
                    comp.decompress_add(values[:k], wire, grad)
                for a, w, n in placement.whole_runs:
                    buf[a : a + n].add_(values[k + w : k + w + n])
        if len(runs) > 1:
            for a, f, n in runs:
                buf[a : a + n].copy_(grad[f : f + n])

    def messages(self):
        """After an AllGather, every rank's message in rank order: ``(rank, its values section
        divided by the ranks, its wire section)`` (views of the receive buffer; the values a new
        tensor)."""
        size, world = self._message_nbytes, self.world_size
        for r in range(world):
            msg = self._recv[r * size : (r + 1) * size]
            yield (r, msg[: self._values_nbytes].view(self.dtype) / world,
                   msg[self._positions_start : self._positions_end].view(self.pos_dtype))

    def attach(self, params, flat_grad: torch.Tensor, **buckets) -> SparseReducer:
        """Nothing to start during backward: compression needs the whole gradient."""
        return self

    def detach(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"error_feedback": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["error_feedback"])
