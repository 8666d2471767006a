"""sparsetrain's PowerSGD exchange (``scheme=powersgd``): the arithmetic of
``sparsetrain.compress.PowerSGD`` with error feedback and two AllReduces per step.

Per step, on a buffer whose tensors are compressed (each viewed as a matrix) or travel whole
(``scheme.uncompressed``, by default the 1-D ones), in any order:

1. compress: acc = gradient + memory (error feedback), per compressed tensor M; Q (kept from
   the step before; a Gaussian at the first step, the same on every rank) orthogonalised;
   P = M Q; the whole tensors copied after the P factors;
2. exchange: one AllReduce of [every P | the whole tensors] (sums);
3. compress: the whole tensors averaged back into the buffer; P orthogonalised; Q = M^T P;
4. exchange: one AllReduce of every Q, divided by the ranks;
5. decompress: the buffer's compressed tensors = P Q^T; memory = acc - P Q^T (per rank).

Every rank ends with the same update. Bytes per step are the P and Q factors and the whole
tensors, all counted as sent (one collective each: AllReduce; ``aggregation`` does not apply).

- ``PowerSGDReducer``: the trainer's reducer (the ``comm.Reducer`` protocol: ``reduce``,
  checkpoints of the memory and Q, ``warmup_steps`` dense steps first), over the flat buffer;
- ``comm.powersgd_ddp``: the same reducer one DDP bucket at a time (``dist.ddp=true``).

Differences from torch's hook (``scheme=torch_powersgd``; ``tests/test_powersgd.py`` checks the
two agree within rounding, float64, 2 ranks): every tensor the uncompressed rule does not keep
whole is compressed (torch sends whole those whose factors are not ``min_compression_rate``, 2,
times smaller); the whole tensors ride in P's AllReduce (torch: a third one) and never enter the
memory (torch keeps local - average for them too: zero on average over ranks); any number of
warm-up steps, also none (torch needs 2 with error feedback).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from sparsetrain.comm.dense import average_dense
from sparsetrain.comm.flat import packed_runs
from sparsetrain.comm.protocol import ExchangeStats
from sparsetrain.compress import (
    ErrorFeedback,
    Layout,
    PowerSGD,
    compressor_class,
)
from sparsetrain.timing import PhaseTimer


def is_powersgd(compressor) -> bool:
    """Whether a scheme's compressor factory (``scheme.compressor``) builds PowerSGD: its exchange
    is this module's, not ``SparseReducer``."""
    return compressor is not None and issubclass(compressor_class(compressor), PowerSGD)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1



class PowerSGDReducer:
    """Error feedback + PowerSGD + two AllReduces on one buffer (the trainer's flat gradient or a
    DDP bucket), overwritten in place with the update every rank applies.

    ``shapes``: every tensor of the buffer, in buffer order; ``uncompressed``: one flag each,
    True for the tensors that travel whole (anywhere in the buffer). ``compressor``: a
    ``PowerSGD`` built on the compressed tensors (``build_powersgd_reducer`` builds both).
    The Gaussian start of Q is seeded from ``rng`` (default ``numpy.random.RandomState(seed)``,
    as torch's hook: one ``randint(1_000_000_000)`` when Q is first needed). For the first
    ``warmup_steps`` steps the buffer is AllReduced densely; memory and Q stay untouched.
    """

    def __init__(self, compressor: PowerSGD, shapes, uncompressed, *, world_size: int, rank: int,
                 seed: int, error_feedback: bool = True, warmup_steps: int = 0, group=None,
                 device="cpu", dtype=torch.float32, rng=None):
        flags = [bool(f) for f in uncompressed]
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(flags) != len(shapes):
            raise ValueError(f"{len(flags)} uncompressed flags for {len(shapes)} tensors")
        sizes = [math.prod(s) for s in shapes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if compressor.shapes != [s for s, f in zip(shapes, flags) if not f]:
            raise ValueError("the compressor was built for other tensors than the buffer's compressed ones")
        self.compressor = compressor
        self.collective = "allreduce"
        self.aggregation = "allreduce"
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.group = group
        self.device = torch.device(device)
        self.dtype = dtype
        self.warmup_steps = int(warmup_steps)
        self._rng = rng if rng is not None else np.random.RandomState(self.seed)
        self.numel = sum(sizes)
        #: (buffer offset, n, m) of each compressed tensor, in buffer order
        self._mats = [(o, *compressor.matrices_shape[j])
                      for j, o in enumerate(o for o, f in zip(offsets, flags) if not f)]
        self._grad_runs = packed_runs((o, n) for o, n, f in zip(offsets, sizes, flags) if not f)
        self._whole_runs = packed_runs((o, n) for o, n, f in zip(offsets, sizes, flags) if f)
        self.compressed_numel = sum(n for n, f in zip(sizes, flags) if not f)
        self.uncompressed_numel = self.numel - self.compressed_numel
        self.memory = ErrorFeedback(self.compressed_numel, enabled=error_feedback, device=device, dtype=dtype)
        p_numel = compressor.p_numel
        self._p = torch.zeros(p_numel + self.uncompressed_numel, device=device, dtype=dtype)  # [P | whole]
        self._p_factors = self._p[:p_numel]
        self._p_whole = self._p[p_numel:]
        self._q = torch.zeros(compressor.q_numel, device=device, dtype=dtype)
        self.q_ready = False  # False until Q's Gaussian start (at the first compressing step)

        esize = torch.empty((), dtype=dtype).element_size()
        self.entries_sent = compressor.k + self.uncompressed_numel  # P, Q and the whole tensors
        self.density = self.entries_sent / self.numel
        self.bytes_sent_per_step = self.entries_sent * esize
        self.dense_bytes_per_step = self.numel * esize
        self.uncompressed_bytes_per_step = self.uncompressed_numel * esize

    # --- the steps of one exchange: ``reduce`` and the DDP hook both drive them ----------------
    def _acc(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """acc = gradient + memory (in the memory); each compressed tensor's matrix in acc."""
        if not self.memory.enabled:
            return [buf[o : o + n * m].view(n, m) for o, n, m in self._mats]
        mem = self.memory.memory
        for b, f, n in self._grad_runs:
            mem[f : f + n].add_(buf[b : b + n])
        out, pos = [], 0
        for _, n, m in self._mats:
            out.append(mem[pos : pos + n * m].view(n, m))
            pos += n * m
        return out

    def compress_p(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Error feedback, Q orthogonalised (its Gaussian start the first time), P = M Q, the whole
        tensors after the P factors. Returns the matrices (``compress_q`` and ``decompress``
        take them)."""
        mats = self._acc(buf)
        if not self.q_ready:
            self.compressor.start_q(self._q, int(self._rng.randint(1_000_000_000)))
            self.q_ready = True
        self.compressor.project(mats, self._q, self._p_factors)
        for b, w, n in self._whole_runs:
            self._p_whole[w : w + n].copy_(buf[b : b + n])
        return mats

    def exchange_p(self, async_op: bool = False):
        """AllReduce (sum) of every P and the whole tensors; its ``Work`` when ``async_op``."""
        if self.world_size > 1:
            return dist.all_reduce(self._p, group=self.group, async_op=async_op)
        return None

    def compress_q(self, buf: torch.Tensor, mats: list[torch.Tensor]) -> None:
        """The whole tensors averaged into the buffer; P orthogonalised; Q = M^T P."""
        if self.uncompressed_numel:
            if self.world_size > 1:
                self._p_whole.div_(self.world_size)
            for b, w, n in self._whole_runs:
                buf[b : b + n].copy_(self._p_whole[w : w + n])
        self.compressor.project_back(mats, self._p_factors, self._q)

    def exchange_q(self, async_op: bool = False):
        """AllReduce (sum) of every Q; its ``Work`` when ``async_op``."""
        if self.world_size > 1:
            return dist.all_reduce(self._q, group=self.group, async_op=async_op)
        return None

    def decompress(self, buf: torch.Tensor, mats: list[torch.Tensor]) -> None:
        """Q averaged; the compressed tensors of the buffer = P Q^T; memory = acc - P Q^T."""
        if self.world_size > 1:
            self._q.div_(self.world_size)
        outs = [buf[o : o + n * m].view(n, m) for o, n, m in self._mats]
        self.compressor.expand(self._p_factors, self._q, outs)
        if self.memory.enabled:
            mem = self.memory.memory
            for b, f, n in self._grad_runs:
                mem[f : f + n].sub_(buf[b : b + n])

    # --- the Reducer protocol ------------------------------------------------------------------
    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer,
               want_stats: bool = False) -> ExchangeStats:
        world = _world(self.group)
        if world != self.world_size:
            raise RuntimeError(f"world_size={self.world_size} but the process group has {world} ranks")
        if flat_grad.numel() != self.numel:
            raise ValueError(f"the flat gradient has {flat_grad.numel()} entries, the reducer {self.numel}")
        if step < self.warmup_steps:  # dense warm-up: memory and Q untouched
            with timer.phase("exchange"):
                average_dense(flat_grad, world, self.group)
            return ExchangeStats(self.dense_bytes_per_step, self.dense_bytes_per_step, 1.0, 0.0, 0.0, "allreduce")
        with timer.phase("compress"):
            mats = self.compress_p(flat_grad)
        acc_sq = acc = None
        if want_stats:
            with timer.untimed():
                acc_sq = sum(float(torch.sum(m * m)) for m in mats)
                acc = None if self.memory.enabled else [m.clone() for m in mats]
        with timer.phase("exchange"):
            self.exchange_p()
        with timer.phase("compress"):
            self.compress_q(flat_grad, mats)
        with timer.phase("exchange"):
            self.exchange_q()
        with timer.phase("decompress"):
            self.decompress(flat_grad, mats)
        error = norm = None
        if want_stats:
            with timer.untimed():
                error, norm = self._stats(flat_grad, acc_sq, acc)
        return ExchangeStats(self.bytes_sent_per_step, self.dense_bytes_per_step, density=self.density,
                             compression_error=error, memory_norm=norm, collective="allreduce")

    def _stats(self, buf, acc_sq: float, acc) -> tuple[float, float]:
        """(||acc - update|| / ||acc|| over the compressed tensors, ||memory||)."""
        if self.memory.enabled:
            err_sq = float(torch.dot(self.memory.memory, self.memory.memory))
            norm = math.sqrt(err_sq)
        else:
            outs = [buf[o : o + n * m].view(n, m) for o, n, m in self._mats]
            err_sq = sum(float(torch.sum((a - u) ** 2)) for a, u in zip(acc, outs, strict=True))
            norm = 0.0
        return (math.sqrt(err_sq / acc_sq) if acc_sq > 0 else 0.0), norm

    def attach(self, params, flat_grad: torch.Tensor, **buckets) -> PowerSGDReducer:
        """Nothing to start during backward: compression needs the whole gradient."""
        return self

    def detach(self) -> None:
        pass

    def state_dict(self) -> dict:
        """The error-feedback memory and Q (None before its start): restored, a resumed run
        goes on bit for bit."""
        return {"error_feedback": self.memory.state_dict(),
                "q": self._q.detach().clone() if self.q_ready else None}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["error_feedback"])
        q = state.get("q")
        if q is not None and q.numel() != self._q.numel():
            raise ValueError(f"PowerSGD's Q has {q.numel()} entries, this model and rank {self._q.numel()}")
        if q is not None:
            self._q.copy_(q)
        self.q_ready = q is not None

    # --- per tensor, for DDP's bucket rebuilds ---------------------------------------------------
    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(memory, Q or None) of each compressed tensor, copied."""
        mem, pos, out = self.memory.memory, 0, []
        for (n, m), q in zip(self.compressor.matrices_shape, self.compressor.q_views(self._q), strict=True):
            out.append((mem[pos : pos + n * m].clone(), q.clone() if self.q_ready else None))
            pos += n * m
        return out

    def adopt(self, pieces) -> None:
        """Take each compressed tensor's ``(memory, Q or None)`` (None: none kept). Q is taken
        only when every tensor brings one; otherwise it starts afresh."""
        mem, pos = self.memory.memory, 0
        qs = self.compressor.q_views(self._q)
        for (n, m), piece in zip(self.compressor.matrices_shape, pieces, strict=True):
            if piece is not None:
                if piece[0].numel() != n * m:
                    raise ValueError(f"error-feedback memory of {piece[0].numel()} entries for a tensor of {n * m}")
                mem[pos : pos + n * m].copy_(piece[0])
            pos += n * m
        if pieces and all(p is not None and p[1] is not None for p in pieces):
            for q, piece in zip(qs, pieces, strict=True):
                q.copy_(piece[1])
            self.q_ready = True


def build_powersgd_reducer(compressor, ratio: float, scope: str, shapes, uncompressed, *,
                           device="cpu", **options) -> PowerSGDReducer | None:
    """The PowerSGD reducer for a buffer of tensors ``shapes`` with their ``uncompressed`` flags
    (``compressor``: the scheme's factory, ``scheme.compressor``; called with the compressed
    tensors' layout and ``shapes``); None when no tensor is compressed. ``options`` go to
    ``PowerSGDReducer`` (world_size, rank, seed, error_feedback, warmup_steps, group, dtype, rng)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    flags = [bool(f) for f in uncompressed]
    kept = [s for s, f in zip(shapes, flags, strict=True) if not f]
    if not kept:
        return None
    comp = compressor(ratio, Layout.from_sizes(math.prod(s) for s in kept), scope, device=device, shapes=kept)
    return PowerSGDReducer(comp, shapes, flags, device=device, **options)
