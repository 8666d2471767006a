"""sparsetrain's PowerSGD as a DDP communication hook (``scheme=powersgd`` with ``dist.ddp=true``):
``comm.powersgd.PowerSGDReducer``, the trainer's reducer, run one DDP bucket at a time on the
bucket in place. The hook waits for P's AllReduce itself and leaves Q's in flight when it
returns, so every collective is issued from the hook, in bucket order, on every rank: any number
of buckets, on gloo too (torch's hook issues its second AllReduce from a future callback and
needs one bucket there). The memory and Q are kept per bucket and re-homed per parameter when
DDP rebuilds its buckets or a checkpoint is loaded.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from sparsetrain.comm.powersgd import PowerSGDReducer, build_powersgd_reducer, is_powersgd
from sparsetrain.compress import (
    Layout,
    PowerSGD,
    parse_uncompressed,
    uncompressed_flags,
)


# ----------------------------------------------------------------------------- the DDP hook
@dataclass
class _Plan:
    keys: tuple[int, ...]  # the bucket's parameters (positions in module.parameters())
    compressed: list[int]  # those compressed, in bucket order
    reducer: PowerSGDReducer | None  # None: nothing to compress, DDP's AllReduce


class PowerSGDHookState:
    """State of ``powersgd_hook``: one ``PowerSGDReducer`` per DDP bucket, working on the bucket
    in place, and the options of the config.

    ``module``: the DDP model (its ``parameters()`` order names the parameters in checkpoints);
    ``ratio``: with ``rank=None`` in the factory, the rank is matched to the layer-wise sparse
    schemes' bytes at ``ratio`` over the whole model, so every bucket (and the trainer's exchange)
    uses the same one (``rank``); ``compressor``: ``PowerSGD`` or what ``scheme.compressor``
    instantiates to (a ``functools.partial`` with ``rank``); ``uncompressed``: ``"1d"``,
    ``"none"`` or N; the first ``warmup_steps`` iterations use DDP's AllReduce. Q's Gaussian
    start is drawn from one ``numpy.random.RandomState(seed)`` shared by the buckets in the order
    they first compress (torch's hook does the same).

    The memory and Q are kept per bucket and re-homed per parameter when DDP rebuilds its buckets
    (and when a checkpoint is loaded); the surface the trainer reads (``bytes_sent_per_step``,
    ``sizes``, ``memory_norm``, ``decompress_ms``, ``exchange_ms``, ``plan``, checkpoints) is
    ``sparsetrain.ddp.SparseHookState``'s.
    """

    collective = "allreduce"

    def __init__(self, module: torch.nn.Module, ratio: float = 0.01, *, compressor=PowerSGD,
                 error_feedback: bool = True, uncompressed="1d", warmup_steps: int = 0, seed: int = 0,
                 process_group=None):
        if not is_powersgd(compressor):
            raise ValueError(f"PowerSGDHookState needs a PowerSGD compressor, not {compressor!r}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"scheme.warmup_steps={warmup_steps} is not allowed; it must be >= 0")
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.uncompressed = parse_uncompressed(uncompressed)
        self.warmup_steps = int(warmup_steps)
        self.seed = int(seed)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        params = list(module.parameters())
        self._key = {id(p): i for i, p in enumerate(params)}
        shapes = [tuple(p.shape) for p in params if p.requires_grad]
        kept = [s for s, f in zip(shapes, uncompressed_flags(shapes, self.uncompressed)) if not f]
        self.matrix_rank = (compressor(self.ratio, Layout.from_sizes(math.prod(s) for s in kept), "layerwise",
                                       shapes=kept).rank if kept else 1)
        self.factory = functools.partial(compressor, rank=self.matrix_rank)
        self.rng = np.random.RandomState(self.seed)
        self.step = 0
        self._buckets: dict[int, _Plan] = {}
        self._pending: dict[int, tuple] = {}  # (memory, Q) of parameters waiting for their bucket
        self.bytes_sent: dict[int, int] = {}
        self.dense_bytes: dict[int, int] = {}
        self.decompress_ms: list[float] = []  # this iteration's decompressions (collective callbacks)
        self.exchange_ms: list[float] = []  # this iteration's waits for P's AllReduce, inside the hook

    @property
    def bytes_sent_per_step(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def dense_bytes_per_step(self) -> int:
        return sum(self.dense_bytes.values())

    # --- buckets ---------------------------------------------------------------------------------
    def _dissolve(self) -> None:
        for plan in self._buckets.values():
            if plan.reducer is not None:
                self._pending.update(zip(plan.compressed, plan.reducer.pieces()))
        self._buckets.clear()

    def _plan(self, bucket, buf: torch.Tensor) -> _Plan:
        index, params = bucket.index(), bucket.parameters()
        try:
            keys = tuple(self._key[id(p)] for p in params)
        except KeyError:
            raise ValueError("a DDP bucket holds a parameter that is not in the module given to "
                             "PowerSGDHookState; pass the DDP model the hook is registered on") from None
        plan = self._buckets.get(index)
        if plan is not None and plan.keys == keys:
            return plan
        if plan is not None:  # DDP rebuilt its buckets: re-home memory and Q by parameter
            self._dissolve()
        shapes = [tuple(p.shape) for p in params]
        flags = uncompressed_flags(shapes, self.uncompressed)
        red = build_powersgd_reducer(
            self.factory, self.ratio, "layerwise", shapes, flags, world_size=self.world_size,
            rank=self.rank, seed=self.seed, error_feedback=self.error_feedback, group=self.process_group,
            device=buf.device, dtype=buf.dtype, rng=self.rng)
        compressed = [k for k, f in zip(keys, flags) if not f]
        if red is not None:
            red.adopt([self._pending.pop(k, None) for k in compressed])
        plan = self._buckets[index] = _Plan(keys, compressed, red)
        return plan

    def plan(self, bucket) -> None:
        """Build ``bucket``'s reducer (handing it its parameters' memory and Q) without exchanging:
        the trainer calls it while DDP settles its buckets, so sizes are known before step 0."""
        self._plan(bucket, bucket.buffer())

    # --- the hook --------------------------------------------------------------------------------
    def run(self, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        index, step = bucket.index(), self.step
        if index == 0:  # DDP reduces buckets in index order: a new iteration's accounting
            self.bytes_sent.clear()
            self.dense_bytes.clear()
            self.decompress_ms.clear()
            self.exchange_ms.clear()
        if bucket.is_last():
            self.step += 1
        self.dense_bytes[index] = buf.numel() * buf.element_size()
        red = self._plan(bucket, buf).reducer if step >= self.warmup_steps else None
        if red is None:
            self.bytes_sent[index] = self.dense_bytes[index]
            return allreduce_hook(self.process_group, bucket)
        self.bytes_sent[index] = red.bytes_sent_per_step
        mats = red.compress_p(buf)
        t0 = time.perf_counter()
        red.exchange_p()  # waited for here: Q's AllReduce is then issued from the hook too
        self.exchange_ms.append((time.perf_counter() - t0) * 1e3)
        red.compress_q(buf, mats)
        work = red.exchange_q(async_op=True)

        def finish(fut=None) -> torch.Tensor:
            if fut is not None:
                fut.value()  # raises if the collective failed
            t1 = time.perf_counter()
            red.decompress(buf, mats)
            self.decompress_ms.append((time.perf_counter() - t1) * 1e3)
            return buf

        if work is None:  # one rank
            done = torch.futures.Future()
            done.set_result(finish())
            return done
        return work.get_future().then(finish)

    # --- what the trainer reads --------------------------------------------------------------------
    def sizes(self) -> dict:
        """Per step once compression runs, over the buckets planned so far: ``bytes_sent``,
        ``uncompressed_bytes`` and ``density`` (entries sent / entries)."""
        sent = whole = entries = numel = 0
        for plan in self._buckets.values():
            red = plan.reducer
            if red is not None:
                sent += red.bytes_sent_per_step
                whole += red.uncompressed_bytes_per_step
                entries += red.entries_sent
                numel += red.numel
        return {"bytes_sent": sent, "uncompressed_bytes": whole, "density": entries / numel if numel else 1.0}

    def memory_norm(self) -> float:
        """||error-feedback memory|| over every bucket (and memory waiting for its bucket)."""
        sq = sum(float(plan.reducer.memory.memory.double().pow(2).sum())
                 for plan in self._buckets.values() if plan.reducer is not None)
        sq += sum(float(piece[0].double().pow(2).sum()) for piece in self._pending.values())
        return math.sqrt(sq)

    def state_dict(self) -> dict:
        """``step`` and, per compressed parameter (its position in ``module.parameters()``), its
        memory and Q (None before Q's start): loadable into any bucket layout."""
        params = dict(self._pending)
        for plan in self._buckets.values():
            if plan.reducer is not None:
                params.update(zip(plan.compressed, plan.reducer.pieces()))
        return {"step": self.step, "params": {k: {"memory": m, "q": q} for k, (m, q) in params.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._buckets.clear()
        self._pending = {int(k): (v["memory"].clone(), None if v["q"] is None else v["q"].clone())
                         for k, v in state["params"].items()}
        self.step = int(state["step"])


def powersgd_hook(state, bucket):  # unannotated: DDP checks a hook's annotations against the real types
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, powersgd_hook)``."""
    return state.run(bucket)


__all__ = ["PowerSGDHookState", "PowerSGDReducer", "build_powersgd_reducer", "is_powersgd", "powersgd_hook"]
