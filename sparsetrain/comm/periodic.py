"""Synchronising less often: local SGD and DiLoCo as one exchange (``scheme=localsgd``,
``scheme=diloco``: a scheme's ``sync`` node).

Every rank takes ``period`` = H optimizer steps on its own gradients (no communication), then the
ranks synchronise once: each rank's pseudo-gradient ``delta_r = anchor - theta_r`` (how far it
moved since the last synchronisation, ``anchor``) is averaged by an inner exchange, and an outer
optimizer steps the anchor on it::

    delta = mean_r (anchor - theta_r)          the inner exchange: dense, or any compressor
    anchor <- OuterSGD(anchor, delta)          lr outer_lr, momentum outer_momentum (Nesterov)
    theta_r <- anchor                          every rank starts the next period from it

With ``outer_lr=1`` and no momentum the anchor becomes the ranks' mean model: local SGD (periodic
model averaging). DiLoCo (Douillard et al., 2023) uses Nesterov momentum outside (0.7 / 0.9 in
the paper). The inner exchange is the harness's own (``comm.build_reducer`` over the flat delta):
dense AllReduce without a compressor node, or the scheme's compressor with its memory (error
feedback carried from one synchronisation to the next), so "synchronise less often" and "send
less each time" combine.

Between synchronisations each rank's model and optimizer are its own (``ranks_diverge``): a
checkpoint keeps every rank's, so a run resumed in the middle of a period goes on bit for bit.
What is evaluated (and saved as ``model.pt``) is the synchronised model: the anchor, with the
batch-norm statistics of the last synchronisation (``synchronised``), the same on every rank.

What is averaged: the parameters (through the delta) and the batch-norm running statistics
(every floating-point buffer, averaged as they are, dense, in one AllReduce);
``num_batches_tracked`` stays each rank's own. The first ``warmup_steps`` steps are dense SGD
(gradients averaged every step), and the anchor follows the model until they end: post-local SGD.

Bytes: the inner exchange's per synchronisation plus the buffers, sent on the last step of each
period (``ExchangeStats`` of that step); ``bytes_sent_per_step`` is that divided by H, the mean
over a period, comparable with per-step schemes. ``sync_summary`` (summary.json's ``sync``) gives
a synchronisation's own bytes and time.

Under DDP (``dist.ddp=true``) torch's post-local-SGD hook averages the gradients during warm-up
inside backward and leaves them local after (``gradients``: that exchange, for its accounting);
the synchronisation is this class's, the same as the trainer's to the bit. torch's
``PeriodicModelAverager`` is not used: it averages parameters only, with no outer optimizer,
compressed delta or batch-norm statistics; tests/test_periodic.py checks that plain local SGD here
equals it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from sparsetrain.comm.dense import average_dense
from sparsetrain.comm.protocol import ExchangeStats, ReducerBase, split_by_collective
from sparsetrain.compress import Layout
from sparsetrain.compress.kept import (
    Window,
    changed_outside,
    check_kept,
    outside,
    refuse_outside,
    snapshot,
)
from sparsetrain.timing import PhaseTimer


def sync_class(factory: Any) -> type:
    """The class a scheme's ``sync`` node builds (a ``functools.partial`` of it): ``PeriodicSync``
    or a subclass; ``TypeError`` for anything else."""
    from sparsetrain.compress.base import unwrap_partial

    cls = unwrap_partial(factory)
    if isinstance(cls, type) and issubclass(cls, PeriodicSync):
        return cls
    raise TypeError(f"{factory!r} is not PeriodicSync or a functools.partial of it")


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class PeriodicSync(ReducerBase):
    """The ``Reducer`` of local SGD / DiLoCo over ``params`` (the model's, in the flat gradient
    buffer's order) and the model's floating-point ``buffers``.

    ``inner``: the reducer that averages the flat pseudo-gradient (``numel`` = the parameters'
    entries). ``period`` (H >= 1), ``outer_lr`` (> 0), ``outer_momentum`` (in [0, 1)),
    ``nesterov``. ``reduce`` leaves the gradient local (it averages it only during warm-up);
    ``after_optimizer`` synchronises on the last step of each period.

    A subclass (a sync of one's own: ``scheme.sync._target_``) keeps what it changes across steps
    in ``state_dict`` / ``load_state_dict`` (calling this class's), or names a cache in
    ``transient``: the kept-state check (``compress.kept``) compares, from the first step after
    warm-up to the step after the first synchronisation (and again after every epoch's end), the
    object with a copy of it into which its ``state_dict`` was loaded, as a resume does.
    """

    #: left out of the kept-state check: the model's tensors (the trainer's checkpoint holds
    #: them), views and scratch rebuilt or rewritten before they are read, the inner exchange and
    #: DDP's (checked or saved on their own), and the check's own record
    transient = ("params", "buffers", "_anchor_views", "_delta_views", "delta", "inner", "gradients",
                 "_kept", "_kept_again", "own_schedule", "bytes_sent_per_step", "density",
                 "uncompressed_bytes_per_step", "bytes_by_collective", "_done")  # the last six: from syncs
    # and the step (``_account``)
    _MODEL = ("params", "buffers")  # not copied by the check's snapshot: no load_state_dict writes them

    ranks_diverge = True  # each rank's model and optimizer are its own within a period

    def __init__(self, params, buffers, inner, *, period: int, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, nesterov: bool = True, warmup_steps: int = 0, group=None,
                 gradients=None):
        self.check_options(period=period, outer_lr=outer_lr, outer_momentum=outer_momentum)
        # under DDP: the exchange that averaged the gradients inside backward (torch's
        # post-local-SGD hook, AllReduce during warm-up, nothing after); it accounts for that
        self.gradients = gradients
        self.params = list(params)
        self.buffers = [b for b in buffers if b.is_floating_point()]
        self.inner = inner
        self.period = int(period)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.warmup_steps = int(warmup_steps)
        self.group = group
        ref = self.params[0]
        self.numel = sum(p.numel() for p in self.params)
        if inner.numel != self.numel:
            raise ValueError(f"the inner exchange covers {inner.numel} entries, the parameters {self.numel}")
        self.delta = torch.zeros(self.numel, dtype=ref.dtype, device=ref.device)
        # the anchor: the model at the last synchronisation, stepped by the outer optimizer
        self.anchor = torch.zeros(self.numel, dtype=ref.dtype, device=ref.device, requires_grad=True)
        # each parameter's slice of the anchor and of the delta, shaped like it
        layout, shapes = Layout.from_tensors(self.params), [p.shape for p in self.params]
        self._anchor_views = layout.views(self.anchor.detach(), shapes)
        self._delta_views = layout.views(self.delta, shapes)
        self.anchored = False
        self.anchor_buffers = [torch.zeros_like(b) for b in self.buffers]  # the buffers as last averaged
        by_dtype: dict = {}
        for i, b in enumerate(self.buffers):
            by_dtype.setdefault(b.dtype, []).append(i)
        self.buffer_groups = list(by_dtype.values())
        self.outer = torch.optim.SGD([self.anchor], lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.nesterov and self.outer_momentum > 0)
        esize = ref.element_size()
        buffer_bytes = sum(b.numel() * b.element_size() for b in self.buffers)
        self.bytes_per_sync = inner.bytes_sent_per_step + buffer_bytes
        self.bytes_sent_per_step = self.bytes_per_sync / self.period  # a period's mean
        self.dense_bytes_per_step = self.numel * esize
        self.uncompressed_bytes_per_step = (inner.uncompressed_bytes_per_step + buffer_bytes) / self.period
        self.density = inner.density / self.period
        self.collective = inner.collective
        self.syncs = 0  # synchronisations done
        self.sync_ms, self.syncs_timed = 0.0, 0  # their phases' time, over the timer's counted steps
        # which of the run's axes change what is sent: the inner exchange's (none when dense)
        self.compresses = bool(inner.compresses)
        self.ratio_applies = self.compresses and bool(inner.ratio_applies)
        self.aggregation_applies = self.compresses and bool(inner.aggregation_applies)
        self.scope_applies = self.compresses
        # a synchronisation's bytes by the collective that carries them: the inner exchange's (its
        # rounds may gather some and sum others), then the buffers' AllReduce; a step's, a period's mean
        split = split_by_collective(inner)
        split["allreduce"] = split.get("allreduce", 0) + buffer_bytes
        self.bytes_by_collective_per_sync = split
        self.bytes_by_collective = {c: n / self.period for c, n in split.items()}
        # a sync of one's own may synchronise on a schedule of its own (a period that grows, a
        # syncs_at of its own): then the sizes per step above are the measured means instead
        self._period0, self.own_schedule = self.period, False
        # the kept-state check: None (to start at the next step), a ``Window`` (closed by the step
        # of the next synchronisation), or True (checked); ``_kept_again``: started by
        # ``watch_kept_state``
        self._kept: Window | bool | None = None
        self._kept_again = False

    @staticmethod
    def check_options(*, period: int = 1, outer_lr: float = 1.0, outer_momentum: float = 0.0, **_) -> None:
        """``ValueError`` (one line: key, value, what is allowed) for a bad option (the config's
        check calls it before any rank starts)."""
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"scheme.sync.period={period!r} is not allowed; it must be an integer >= 1")
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or not outer_lr > 0:
            raise ValueError(f"scheme.sync.outer_lr={outer_lr!r} is not allowed; it must be a number > 0")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
                or not 0 <= outer_momentum < 1:
            raise ValueError(f"scheme.sync.outer_momentum={outer_momentum!r} is not allowed; it must be in [0, 1)")

    # --- the Reducer protocol ---------------------------------------------------------------------
    def syncs_at(self, step: int) -> bool:
        """Whether 0-based ``step`` ends a period (after warm-up)."""
        return step >= self.warmup_steps and (step - self.warmup_steps + 1) % self.period == 0

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer,
               want_stats: bool = False) -> ExchangeStats:
        """Warm-up: dense SGD's AllReduce of the gradient. After it: nothing (the gradient stays
        local); the step's bytes are the synchronisation's on the last step of a period."""
        if not self.anchored:
            self._anchor()
        self._check_kept(step, timer)
        if self.gradients is not None:  # DDP's hook ran in backward: its time out of backward
            stats = self.gradients.reduce(flat_grad, step, timer, want_stats)
            if step < self.warmup_steps:
                return stats
        elif step < self.warmup_steps:
            with timer.phase("exchange"):
                average_dense(flat_grad, _world(self.group), self.group)
            return ExchangeStats(self.dense_bytes_per_step, self.dense_bytes_per_step, 1.0, 0.0, 0.0, "allreduce")
        syncs = self.syncs_at(step)
        return ExchangeStats(self.bytes_per_sync if syncs else 0, self.dense_bytes_per_step, density=self.density,
                             collective=self.collective,
                             bytes_by_collective=self.bytes_by_collective_per_sync if syncs else None)

    def after_optimizer(self, step: int, timer: PhaseTimer) -> None:
        """After the optimizer's step: during warm-up the anchor follows the model; on the last
        step of a period, the synchronisation (the delta as ``compress``, the scheme's exchange
        with its own phases, the outer step as ``optimizer``, the buffers' AllReduce as
        ``exchange``). Then the sizes per step, where the synchronisations left the schedule
        of ``period``."""
        self._after_optimizer(step, timer)
        if step >= self.warmup_steps:
            self._account(step - self.warmup_steps + 1)

    def _account(self, done: int) -> None:
        """After ``done`` steps past warm-up: where ``syncs`` is not what one every ``period``
        (as built) gives, the sizes per step become the measured means (``syncs / done`` of a
        synchronisation's), and ``sync_summary`` says so: the bytes a run reports are what it sent."""
        if not self.own_schedule and self.syncs == done // self._period0:
            return
        self.own_schedule = True
        share = self.syncs / done
        inner_uncompressed = self.bytes_per_sync - self.inner.bytes_sent_per_step + self.inner.uncompressed_bytes_per_step
        self.bytes_sent_per_step = self.bytes_per_sync * share
        self.density = self.inner.density * share
        self.uncompressed_bytes_per_step = inner_uncompressed * share
        self.bytes_by_collective = {c: n * share for c, n in self.bytes_by_collective_per_sync.items()}
        self._done = done

    def _after_optimizer(self, step: int, timer: PhaseTimer) -> None:
        if step < self.warmup_steps:
            self._anchor()
            return
        if not self.syncs_at(step):
            return
        world = _world(self.group)
        before = self._phases_ms(timer)
        with torch.no_grad():
            with timer.phase("compress"):  # this rank's pseudo-gradient: delta_r = anchor - theta_r
                for a, p, d in zip(self._anchor_views, self.params, self._delta_views, strict=True):
                    torch.sub(a, p, out=d)
            # the scheme's exchange times its own phases (exchange; compress / decompress)
            self.inner.reduce(self.delta, (step - self.warmup_steps) // self.period, timer)
            with timer.phase("optimizer"):  # the outer step, every rank's model set to the anchor
                self.anchor.grad = self.delta
                self.outer.step()
                self._model_to_anchor()
            with timer.phase("exchange"):  # the buffers in one AllReduce (per dtype)
                for group in self.buffer_groups:
                    flat = torch.cat([self.buffers[i].reshape(-1) for i in group])
                    average_dense(flat, world, self.group)
                    pos = 0
                    for i in group:
                        b, n = self.buffers[i], self.buffers[i].numel()
                        b.copy_(flat[pos : pos + n].view_as(b))
                        self.anchor_buffers[i].copy_(b)
                        pos += n
        self.syncs += 1
        if isinstance(self._kept, Window) and self._kept.end is None:
            self._kept.end = step  # the check compares at the next step, after all of this one
        if getattr(timer, "counting", False):  # counted in its means
            self.sync_ms += self._phases_ms(timer) - before
            self.syncs_timed += 1

    def _check_kept(self, step: int, timer: PhaseTimer) -> None:
        """The kept-state check (``compress.kept``), at the start of a step: where a
        synchronisation ran since the snapshot, ``CheckpointError`` for a value this object
        changed that its ``state_dict`` / ``load_state_dict`` do not bring back; then, where one
        is due (the first step after warm-up, the first after ``watch_kept_state``), a snapshot."""
        kept = self._kept
        if isinstance(kept, Window) and kept.end is not None:
            self._kept = True
            over = (f"steps {kept.start}-{kept.end} (its first synchronisation)" if not self._kept_again else
                    f"steps {kept.start}-{kept.end} (the synchronisation after an epoch's end)")
            with timer.untimed():
                # its class attributes and module globals too (numpy's and Python's random states
                # are not read: the window holds whole steps, the data's and the model's)
                refuse_outside(changed_outside(kept.outside_before, (self,), rngs=False), self, over)
                check_kept(self, kept.snapshots[0], lambda r: r.load_state_dict(self.state_dict()),
                           "state_dict / load_state_dict", over, share=self._MODEL)
        if self._kept is None and step >= self.warmup_steps:
            with timer.untimed():
                self._kept = Window((snapshot(self, share=self._MODEL),), step, outside((self,), rngs=False))

    def watch_kept_state(self) -> None:
        """The kept-state check once more, from the next step to the one after the next
        synchronisation; the inner exchange's and DDP's over their next step."""
        if self._kept is True:
            self._kept, self._kept_again = None, True
        self.inner.watch_kept_state()
        if self.gradients is not None:
            self.gradients.watch_kept_state()

    @staticmethod
    def _phases_ms(timer: PhaseTimer) -> float:
        """The phases of the current step so far (a synchronisation's time: what it adds)."""
        return sum(ms for name, ms in getattr(timer, "last", {}).items() if name != "step")

    def sync_summary(self) -> dict:
        """For summary.json's ``sync``: the period, a synchronisation's bytes and its mean time
        (its phases: the delta, the scheme's exchange, the outer step, the buffers), next to the
        per-step means every scheme records."""
        own = {"schedule": "own", "mean_period": self._done / self.syncs if self.syncs else None} \
            if self.own_schedule else {}
        return {"period": self.period, "syncs": self.syncs, "bytes_per_sync": self.bytes_per_sync,
                "time_ms_per_sync": self.sync_ms / self.syncs_timed if self.syncs_timed else None, **own}

    def _model_to_anchor(self) -> None:
        """Every parameter takes its slice of the anchor (under ``no_grad``)."""
        for p, a in zip(self.params, self._anchor_views, strict=True):
            p.copy_(a)

    def _anchor(self) -> None:
        """The anchor takes the model as it is now (parameters and buffers)."""
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in self.params], out=self.anchor.data)
            for b, kept in zip(self.buffers, self.anchor_buffers, strict=True):
                kept.copy_(b)
        self.anchored = True

    @contextlib.contextmanager
    def synchronised(self):
        """Within: the model holds the synchronised model (the anchor and the buffers as last
        averaged), for evaluation and ``model.pt``; after: each rank's own again, bit for bit."""
        if not self.anchored:
            yield
            return
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            own_buffers = [b.clone() for b in self.buffers]
            self._model_to_anchor()
            for b, kept in zip(self.buffers, self.anchor_buffers, strict=True):
                b.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self.params, own, strict=True):
                    p.copy_(mine)
                for b, mine in zip(self.buffers, own_buffers, strict=True):
                    b.copy_(mine)

    def settle(self, inputs: torch.Tensor) -> None:
        """Under DDP: its buckets settled before step 0 (``DDPExchange.settle``)."""
        if self.gradients is not None:
            self.gradients.settle(inputs)

    def state_dict(self) -> dict:
        """The anchor, the outer optimizer's momentum and the inner exchange's memory: restored,
        a run resumed in the middle of a period goes on bit for bit."""
        return {"anchor": self.anchor.detach().clone(), "anchored": self.anchored,
                "anchor_buffers": [b.clone() for b in self.anchor_buffers],
                "outer": self.outer.state_dict(), "inner": self.inner.state_dict(),
                "syncs": self.syncs, "sync_ms": self.sync_ms, "syncs_timed": self.syncs_timed,
                **({"gradients": self.gradients.state_dict()} if self.gradients is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.anchor.copy_(state["anchor"])
        self.anchored = bool(state["anchored"])
        with torch.no_grad():
            for kept, saved in zip(self.anchor_buffers, state["anchor_buffers"], strict=True):
                kept.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.syncs, self.sync_ms, self.syncs_timed = state["syncs"], state["sync_ms"], state["syncs_timed"]
        self.inner.load_state_dict(state["inner"])
        if self.gradients is not None:
            self.gradients.load_state_dict(state["gradients"])
