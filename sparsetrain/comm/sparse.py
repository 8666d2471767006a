"""The compressed exchange: a memory (error feedback by default) + a compressor from
``sparsetrain.compress`` + the rounds of collectives the compressor declares (``Round``).

A one-message compressor (the default ``rounds``) has two sections (``compress.base``):
``num_values`` floats (a sparsifier's k values, a quantizer's per-tensor scales) and
``num_positions`` integers of ``wire_dtype`` (a sparsifier's positions, a quantizer's packed
bits as uint8).

- ``allreduce``: positions drawn from a seed shared by all ranks, so only the k values are summed
  (compressors with ``shared_positions``): one ``sum`` round.
- ``allgather``: each rank its own message, values and positions packed into one byte message,
  one ``all_gather_into_tensor`` (a ``gather`` round), every rank decodes every message
  (``decompress_add``) in rank order, so every rank adds the same numbers in the same order.

A compressor with several rounds (PowerSGD: P summed, then Q; an integer-sum quantizer: a scale
by ``max``, then integer codes by ``sum``) runs through the same code: each round is sent,
carried by one collective and received in turn; the last one may stay in flight (the DDP hook
returns while it travels).

Tensors that bypass compression (``scheme.uncompressed``: by default the 1-D ones) sit at the end
of the flat buffer (``comm.flat.flat_gradients`` orders it so) and travel whole in the first
round that sums or gathers floats: appended to the AllReduce values, or to the packed AllGather
message.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsetrain.comm.dense import average_dense
from sparsetrain.comm.flat import packed_runs
from sparsetrain.comm.probe import check_decode
from sparsetrain.comm.protocol import ExchangeStats, ReducerBase
from sparsetrain.comm.rules import check_aggregation
from sparsetrain.compress import ErrorFeedback, compressed_first, compression_stats, step_seed
from sparsetrain.compress.base import Message, Round, StepState
from sparsetrain.compress.kept import (
    Window,
    changed_outside,
    check_kept,
    outside,
    own_part,
    refuse_outside,
    snapshot,
)
from sparsetrain.errors import ConfigError
from sparsetrain.timing import NULL_TIMER, PhaseTimer


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """One AllGather into one flat tensor (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# torch.distributed's collectives and point-to-point calls, as a compressor of one's own might call them
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
                "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object",
                "scatter_object_list")
_exchange_calls = threading.local()  # .own: the exchange's own collective is being called


@contextlib.contextmanager
def _foreign_collectives():
    """Within: the names of the torch.distributed calls made other than by the exchange's rounds
    (``_own_collective``), in order: a compressor that communicates by itself sends bytes no
    round accounts for (the first compressed step is watched: ``SparseReducer.reduce``)."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def watched(name, fn):
        def call(*args, **kwargs):
            if not getattr(_exchange_calls, "own", False):
                calls.append(name)
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, watched(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _own_collective():
    _exchange_calls.own = True
    try:
        yield
    finally:
        _exchange_calls.own = False


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

    @classmethod
    def of(cls, sizes, whole) -> Placement:
        """The placement of a buffer of tensors of ``sizes``, in that order, ``whole`` saying
        which travel whole (a DDP bucket): each part takes its tensors in buffer order."""
        sizes, flags = [int(n) for n in sizes], [bool(f) for f in whole]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        order = compressed_first(flags)
        return cls(tuple(packed_runs((offsets[i], sizes[i]) for i in order if not flags[i])),
                   tuple(packed_runs((offsets[i], sizes[i]) for i in order if flags[i])))


@dataclass
class SparseStep:
    """One step in flight, between ``SparseReducer.start`` and ``finish``: the buffer and where
    its parts lie, the compressor's step (``StepState``: its payload and scratch), the last
    round's ``Work`` (None when it already ran, or on one rank) and the statistics
    (``(compression_error, memory_norm)``, None until known or when not asked)."""

    buf: torch.Tensor
    placement: Placement
    state: StepState
    work: Any
    stats: tuple | None
    want_stats: bool = False
    acc_copy: torch.Tensor | None = None  # acc for statistics taken after the last round
    forgotten: bool = False  # the memory's forget has run

    @property
    def payload(self):
        return self.state.payload


class _RoundBuffers:
    """One round's message buffers. ``sum`` / ``max``: one tensor, reduced in place (the floats,
    then the whole tensors where this round carries them; or the integers). ``gather``: one
    byte message per rank, ``[floats | whole tensors | integers]`` (the integers aligned for
    their view, every message aligned for both), gathered into ``world`` messages."""

    def __init__(self, rnd: Round, whole: int, world: int, device, dtype):
        self.round, self.world, self.dtype = rnd, int(world), dtype
        esize = torch.empty((), dtype=dtype).element_size()
        isize = torch.empty((), dtype=rnd.int_dtype).element_size()
        nf = rnd.floats + int(whole)
        if rnd.op != "gather":
            if rnd.ints:
                self.buffer = torch.empty(rnd.ints, dtype=rnd.int_dtype, device=device)
                self.mine = Message(torch.empty(0, dtype=dtype, device=device), self.buffer)
            else:
                self.buffer = torch.empty(nf, dtype=dtype, device=device)
                self.mine = Message(self.buffer[: rnd.floats], torch.empty(0, dtype=rnd.int_dtype, device=device))
            self.whole_view = self.buffer[rnd.floats :] if whole else None
            self.nbytes = self.buffer.numel() * self.buffer.element_size()
            return
        self._floats_nbytes = nf * esize
        self._ints_start = -(-self._floats_nbytes // isize) * isize  # aligned for the int view
        self._ints_end = self._ints_start + rnd.ints * isize
        align = max(esize, isize)  # every rank's message starts aligned for both views
        self.nbytes = -(-self._ints_end // align) * align
        self.send = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.recv = torch.zeros(self.world * self.nbytes, dtype=torch.uint8, device=device)
        self.mine = self._message(self.send)

    def _message(self, msg: torch.Tensor) -> Message:
        floats = msg[: self._floats_nbytes].view(self.dtype)
        return Message(floats[: self.round.floats], msg[self._ints_start : self._ints_end].view(self.round.int_dtype))

    def own_whole(self) -> torch.Tensor:
        """Where this rank's whole tensors go in its message."""
        if self.round.op != "gather":
            return self.whole_view
        return self.send[: self._floats_nbytes].view(self.dtype)[self.round.floats :]

    def communicate(self, group, async_op: bool):
        """The round's collective; its ``Work`` when ``async_op`` (None on one rank)."""
        op = self.round.op
        if self.world > 1:
            with _own_collective():
                if op == "gather":
                    return _all_gather_single(self.recv, self.send, group=group, async_op=async_op)
                red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
                return dist.all_reduce(self.buffer, op=red, group=group, async_op=async_op)
        if op == "gather":
            self.recv[: self.nbytes].copy_(self.send)
        return None

    def received(self):
        """The round's result: a ``Message`` (sum, max) or every rank's, in rank order (gather)."""
        if self.round.op != "gather":
            return self.mine
        return [self._message(self.recv[r * self.nbytes : (r + 1) * self.nbytes]) for r in range(self.world)]

    def whole_received(self):
        """The whole tensors as received: one tensor (summed) or every rank's (gathered)."""
        if self.round.op != "gather":
            return self.whole_view
        return [self.recv[r * self.nbytes : r * self.nbytes + self._floats_nbytes].view(self.dtype)[self.round.floats :]
                for r in range(self.world)]


class SparseReducer(ReducerBase):
    """The memory (error feedback by default) + a compressor's rounds of collectives, on the
    flat buffer or a DDP bucket: the one exchange of every compressor.

    Result on every rank: the update the compressor's ``receive`` decodes (one message:
    ``(1/W) * sum_r decompress(payload_r)``, W ranks), identical on all ranks (the same
    additions in the same rank order). Values are divided by W before they are added, which is
    exact for W = 2 (and any power of two) so that ratio=1 matches dense there.

    The flat buffer is ``[compressed prefix | uncompressed tail]``: the compressor and the memory
    cover the prefix (``compressor.numel`` entries); the last ``uncompressed_numel`` entries
    travel whole, after the floats of the first round that sums or gathers floats (``Round``),
    and never enter the memory. For the first ``warmup_steps`` steps the whole buffer is
    AllReduced densely and the memory stays empty; compression starts at step ``warmup_steps``.

    The memory forgets what was sent right after the last round's ``send`` when the payload is
    this rank's own message, or after the last ``receive`` when the compressor gives the update
    every rank decoded (``Payload.decoded``: PowerSGD's memory is ``acc - P Q^T``). Then the
    memory's ``update`` sees the decoded update and may overwrite it with the one applied (EF21's
    shared estimate); by default it leaves it as it is.

    Before the first compressed step, a copy of the compressor is run through its rounds as if
    every rank sent the same message, locally (``comm.probe.check_decode``): ``ConfigError`` where
    the update differs from what its ``forget`` takes out of the memory. Over the first
    compressed step the compressor and the memory are checked for state they keep
    but do not declare (``compress.kept``): ``reduce`` checks right after it, the DDP hook at the
    start of the next (``check_kept_state``). ``kept_route`` says what must carry that state:
    ``state_dict`` (the trainer's checkpoints) or ``pieces`` (the DDP hook's).
    """

    compresses = True  # (build_reducer gives a DenseReducer where nothing is compressed)

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
        fast_path: bool = False,
    ):
        check_aggregation(type(compressor).__name__, aggregation, compressor)
        self.compressor = compressor
        self.aggregation = aggregation
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
        self.kept_route = "state_dict"
        # the kept-state check: None (not started), a ``Window`` (its step under way, or done and
        # to be checked), or True (checked); ``_watched``: started again (``watch_kept_state``)
        self._kept: Window | bool | None = None
        self._watched = False
        self.decode_checked = False  # the decode check (comm.probe), before the first compressed step

        rounds = list(compressor.rounds(aggregation))
        if not rounds:
            raise ValueError(f"{type(compressor).__name__}.rounds({aggregation!r}) declares no collective")
        # the whole tensors ride after the floats of the first round that sums or gathers floats;
        # where none does, in a sum round of their own, first (the compressor's rounds follow)
        carrier = next((i for i, r in enumerate(rounds) if r.op in ("sum", "gather") and r.floats), None)
        self._own = 0  # rounds of the exchange's own before the compressor's
        if carrier is None and self.uncompressed_numel:
            rounds.insert(0, Round("sum"))
            carrier, self._own = 0, 1
        self.whole_round = carrier if self.uncompressed_numel else None
        self.rounds = tuple(rounds)
        self._buffers = [_RoundBuffers(r, self.uncompressed_numel if i == self.whole_round else 0,
                                       self.world_size, device, dtype) for i, r in enumerate(rounds)]
        # what carries the step: AllGather where any round gathers, else AllReduce
        self.collective = "allgather" if any(r.op == "gather" for r in rounds) else "allreduce"
        # which of the run's axes change what is sent (the summary records them for the analysis):
        # aggregation does not where the compressor's rounds are the same for both (PowerSGD)
        self.ratio_applies = bool(compressor.ratio_applies)
        if not self.ratio_applies and compressor.k != compressor.numel:
            cls = type(compressor).__name__
            raise ConfigError(
                f"{cls}.ratio_applies is False (its message does not depend on ratio: every entry is sent) "
                f"but it sends k={compressor.k:,} of {compressor.numel:,} entries at ratio={compressor.ratio}, so "
                f"the analysis would pool its runs at every ratio as one; allowed: ratio_applies = True, or "
                f"k = numel (docs/own_compressor.md, 'Class attributes')")
        # positions cast to a narrower wire dtype would wrap (int16: 40,000 becomes -25,536): a
        # receiver's index out of range, or another entry's, so refuse it before the first step
        wire = compressor.wire_dtype
        top = torch.iinfo(wire).max if not (wire.is_floating_point or wire.is_complex or wire == torch.bool) else None
        if top is None or compressor.max_position > top:
            cls = type(compressor).__name__
            raise ConfigError(
                f"{cls}.wire_dtype={wire} cannot carry its positions (max_position={compressor.max_position:,}"
                + (f", above {top:,}" if top is not None else ", not an integer type") + "): they would wrap "
                "on the wire and decode to other entries; allowed: an integer dtype that holds max_position "
                "(torch.int32 below 2**31, the default) (docs/own_compressor.md, 'Methods')")
        self.aggregation_applies = not (compressor.shared_positions
                                        and compressor.rounds("allreduce") == compressor.rounds("allgather"))

        esize = torch.empty((), dtype=dtype).element_size()
        # per step once compression runs, whole tensors included (a quantizer sends every entry)
        self.entries_sent = compressor.k + self.uncompressed_numel
        self.density = self.entries_sent / self.numel
        self.dense_bytes_per_step = self.numel * esize
        self.uncompressed_bytes_per_step = self.uncompressed_numel * esize
        self.bytes_sent_per_step = sum(b.nbytes for b in self._buffers)
        # the same split by the collective that carries each round: each crosses the link at its
        # own ring factor (a compressor may gather positions, then sum values)
        self.bytes_by_collective: dict[str, int] = {}
        for r, b in zip(rounds, self._buffers, strict=True):
            kind = "allgather" if r.op == "gather" else "allreduce"
            self.bytes_by_collective[kind] = self.bytes_by_collective.get(kind, 0) + b.nbytes
        # train.fast_path: error feedback + compression in fused kernels (compress.fused) where
        # they exist; the same message and memory as the torch path. Why not, where asked but not.
        self.fast_path_reason = None
        self._fused = None
        self._gathered = None  # the fast path's gradient where a bucket's tensors lie in several runs
        if fast_path:
            from sparsetrain.compress import fused

            self.fast_path_reason = fused.reason(compressor, self.memory, self.device, dtype)
            if self.fast_path_reason is None and not fused.prepare(compressor):
                self._fused = fused
            elif self.device.type == "cuda":  # asked for where it could run: say why it does not
                warnings.warn(f"the fast path (train.fast_path=true) is off here: {self.fast_path_reason}", stacklevel=2)

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
               want_stats: bool = False, placement: Placement | None = None) -> ExchangeStats:
        """The ``Reducer`` step: dense during warm-up, then ``start`` and ``finish`` (``placement``:
        where the parts lie in ``flat_grad``, default ``[compressed | whole]``)."""
        world = _world(self.group)
        if world != self.world_size:
            raise RuntimeError(
                f"world_size={self.world_size} but the process group has {world} ranks"
            )
        if flat_grad.numel() != self.numel:
            raise ValueError(f"the flat gradient has {flat_grad.numel()} entries, the reducer {self.numel}")
        if step < self.warmup_steps:
            return self._dense_step(flat_grad, world, timer)
        # the steps the kept-state check watches: any collective but the rounds' is refused after
        watching = _foreign_collectives() if self._kept is None else contextlib.nullcontext([])
        with watching as foreign:
            pending = self.start(flat_grad, step, placement=placement, want_stats=want_stats, timer=timer,
                                 async_op=False)
            self.finish(pending, timer)
        if foreign:
            cls = type(own_part(self.compressor, self.memory)).__name__
            raise ConfigError(
                f"{cls} called torch.distributed ({', '.join(dict.fromkeys(foreign))}) in "
                f"compressed step {step} outside the rounds it declares: the bytes the run reports are its rounds' "
                f"alone, so bytes per step (and time to accuracy) would leave them out; allowed: every message "
                f"through a round (docs/own_compressor.md, 'A communication of its own: rounds')")
        with timer.untimed():
            self.check_kept_state()
        error, norm = pending.stats or (None, None)
        return ExchangeStats(
            self.bytes_sent_per_step,
            self.dense_bytes_per_step,
            density=self.density,
            compression_error=error,
            memory_norm=norm,
            collective=self.collective,
            bytes_by_collective=self.bytes_by_collective,
        )

    # --- the one step: ``reduce`` and the DDP hook (sparsetrain.comm.ddp_hook) both drive it ------------------
    def start(self, buf: torch.Tensor, step: int, *, placement: Placement | None = None,
              want_stats: bool = False, timer: PhaseTimer = NULL_TIMER, async_op: bool = True) -> SparseStep:
        """The memory's accumulate over ``buf``'s compressed tensors, then every round but the
        last run to its end (send, collective, receive) and the last one sent and started
        (``async_op``: not waited for). ``placement``: where the two parts lie in ``buf``
        (default: the trainer's ``[compressed | whole]``). ``want_stats``: the compression error
        and memory norm (a host sync on CUDA, left out of the step's time)."""
        placement = placement or self.flat_placement
        if not self.decode_checked:  # the update is what the memory forgets (comm.probe): once, locally
            self.decode_checked = True
            with timer.untimed():
                check_decode(self, step)
        if self._kept is None:  # the first compressed step (or one watched again): what the two hold
            with timer.untimed():
                self._kept = Window((snapshot(self.compressor), snapshot(self.memory)), step,
                                    outside((self.compressor, self.memory)))
        pieces = [(f, buf[a : a + n]) for a, f, n in placement.grad_runs]
        # the fused kernels measure no compression error; they take the gradient as one tensor
        # (a DDP bucket's compressed tensors, where they lie in several runs, copied into one)
        fused = self._fused if not want_stats else None
        if self._fused is not None and want_stats:  # the torch path this once: not the run's time
            timer.leave_out()
        if fused is None:
            with timer.phase("compress"):
                acc = self.memory.accumulate(pieces[0][1] if len(pieces) == 1 else pieces)
        else:
            acc = self.memory.memory  # accumulated, compressed and forgotten in one go below
            grad = pieces[0][1]
            if len(pieces) > 1:
                with timer.phase("compress"):
                    if self._gathered is None:
                        self._gathered = torch.empty_like(acc)
                    grad = torch.cat([t for _, t in pieces], out=self._gathered)
        state = StepState(acc, self.positions_seed(step), self.seed, self.world_size, self.rank, self.aggregation)
        pending = SparseStep(buf, placement, state, None, None, want_stats)
        if want_stats and len(self.rounds) > 1:  # the update may overwrite acc before it is measured
            with timer.untimed():
                pending.acc_copy = acc.clone()
        last = len(self.rounds) - 1
        for i, rb in enumerate(self._buffers):
            with timer.phase("compress"):
                if fused is not None and i >= self._own:  # one message: accumulate + send + forget
                    wire = rb.mine.ints if rb.mine.ints.numel() else None
                    state.payload = fused.step(self.compressor, acc, grad, state.seed,
                                               out=rb.mine.floats, wire=wire)
                    pending.forgotten = True
                elif i >= self._own:
                    self.compressor.send(i - self._own, state, rb.mine)
                if i == self.whole_round:
                    whole = rb.own_whole()
                    for a, w, n in placement.whole_runs:
                        whole[w : w + n].copy_(buf[a : a + n])
            if i == last and not pending.forgotten and state.payload is not None and state.payload.decoded is None:
                self._forget(pending, acc, timer)  # the own message: forget before it travels
            with timer.phase("exchange"):
                work = rb.communicate(self.group, async_op=async_op and i == last)
                if i < last and work is not None:  # an earlier round: its result is needed now
                    work.wait()
            if i < last:
                with timer.phase("compress"):
                    self._receive(i, pending, None)
            else:
                pending.work = work
        return pending

    def finish(self, pending: SparseStep, timer: PhaseTimer = NULL_TIMER) -> None:
        """Wait for the last round (if still in flight) and receive it; where the compressor gives
        the decoded update, the memory's forget; then the memory's ``update`` (which may change
        what is applied) and the buffer overwritten with the update every rank applies (its
        compressed tensors, where they are one run, in place; else through a buffer in the
        compressor's layout)."""
        if pending.work is not None:
            with timer.phase("exchange"):
                pending.work.wait()
        buf, runs = pending.buf, pending.placement.grad_runs
        with timer.phase("decompress"):
            if len(runs) == 1:
                a, _, n = runs[0]
                out = buf[a : a + n]
            else:
                if self._decoded is None or self._decoded.dtype != buf.dtype or self._decoded.device != buf.device:
                    self._decoded = torch.empty(self.compressed_numel, dtype=buf.dtype, device=buf.device)
                out = self._decoded
            out.zero_()
            self._receive(len(self.rounds) - 1, pending, out)
        if not pending.forgotten:  # before the memory's update, which may overwrite the decoded update
            self._forget(pending, pending.state.acc if pending.acc_copy is None else pending.acc_copy, timer)
        with timer.phase("decompress"):
            self.memory.update(out)  # the update the optimizer applies, where the memory changes it
            if len(runs) > 1:
                for a, f, n in runs:
                    buf[a : a + n].copy_(out[f : f + n])
        if isinstance(self._kept, Window) and self._kept.end is None:
            # its one step is done: what changed outside the two is read now (no other code ran)
            self._kept.end = self._kept.start
            self._kept.changed = changed_outside(self._kept.outside_before, (self.compressor, self.memory))

    def check_kept_state(self) -> None:
        """Once the first compressed step is done (and each one ``watch_kept_state`` asks for):
        raise ``CheckpointError`` when the compressor or the memory changed a tensor that its
        declared state (``kept_route``) would not bring back on a resume (``compress.kept``)."""
        window = self._kept
        if not (isinstance(window, Window) and window.end is not None):
            return
        (comp, mem), changed = window.snapshots, window.changed
        over = "the first compressed step" if not self._watched else f"compressed step {window.start}"
        self._kept = True
        c, m = self.compressor, self.memory
        refuse_outside(changed, own_part(c, m), over)
        if self.kept_route == "pieces":  # the DDP hook moves and saves these
            check_kept(c, comp, lambda r: r.adopt(c.pieces()), "pieces / adopt", over)
            check_kept(m, mem, lambda r: [b.copy_(m.buffers()[n]) for n, b in r.buffers().items()],
                       "BUFFERS (per-entry tensors: all a DDP bucket keeps)", over)
        else:
            check_kept(c, comp, lambda r: r.load_state_dict(c.state_dict()), "state_dict / load_state_dict", over)
            check_kept(m, mem, lambda r: r.load_state_dict(m.state_dict()), "BUFFERS (or state_dict / load_state_dict)",
                       over)

    def watch_kept_state(self) -> None:
        """The kept-state check once more, over the next compressed step (``Reducer``)."""
        if self._kept is True:
            self._kept, self._watched = None, True

    def _receive(self, i: int, pending: SparseStep, out) -> None:
        """Round ``i``'s result to the compressor, and the whole tensors (averaged) back into the
        buffer where this round carried them."""
        rb = self._buffers[i]
        if i >= self._own:
            self.compressor.receive(i - self._own, pending.state, rb.received(), out)
        if i == self.whole_round:
            buf, world = pending.buf, self.world_size
            got = rb.whole_received()
            if isinstance(got, list):
                for a, _, n in pending.placement.whole_runs:
                    buf[a : a + n].zero_()
                for whole in got:
                    whole = whole / world
                    for a, w, n in pending.placement.whole_runs:
                        buf[a : a + n].add_(whole[w : w + n])
            else:
                got.div_(world)
                for a, w, n in pending.placement.whole_runs:
                    buf[a : a + n].copy_(got[w : w + n])

    def _forget(self, pending: SparseStep, acc, timer: PhaseTimer) -> None:
        """The memory's forget, with the statistics around it where asked: the compression error
        before (forget may change ``acc``), the memory's norm after."""
        payload = pending.payload
        if payload is None:  # a compressor of one's own that forgot to say what it sent
            raise RuntimeError(f"{type(self.compressor).__name__} set no step.payload in send or receive: the "
                               "memory's forget needs what this rank sent (a Payload)")
        error = None
        if pending.want_stats:
            with timer.untimed():
                error = compression_stats(acc, payload, self.compressor)
        with timer.phase("compress"):
            self.memory.forget(payload, self.compressor)
        pending.forgotten = True
        if pending.want_stats:
            with timer.untimed():
                pending.stats = (error, self.memory.norm())

    def state_dict(self) -> dict:
        out = {"error_feedback": self.memory.state_dict()}
        kept = self.compressor.state_dict()
        if kept:
            out["compressor"] = kept
        return out

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["error_feedback"])
        if "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])
        elif "q" in state:  # PowerSGD's checkpoints before the rounds protocol kept Q beside the memory
            self.compressor.load_state_dict({"q": state["q"]})
