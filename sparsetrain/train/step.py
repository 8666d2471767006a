"""One training step: data, forward, backward, exchange, optimizer, each timed as a phase.

The trainer and every benchmark (sparsetrain/benchmarks/: step, ddp, step_device;
tests/test_bench.py) run this same step, so a benchmark times exactly what training does.

The gradients live in one flat buffer (``comm.flat``): backward writes into it, the reducer
overwrites it in place with the averaged update, the optimizer applies that update. Two variants
serve the benchmarks' baselines: ``reducer=None`` skips the exchange (the compute floor, or a
model wrapped in DDP that exchanges inside backward), and ``flat_grad=None`` means the
parameters keep their own ``.grad`` tensors (DDP), zeroed through the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sparsetrain.comm import ExchangeStats, Reducer
from sparsetrain.timing import PhaseTimer


@dataclass
class StepResult:
    loss: torch.Tensor  # the batch's mean loss (on the device; reading it waits for the step)
    logits: torch.Tensor
    targets: torch.Tensor
    stats: ExchangeStats | None  # None when the step had no exchange
    lr: float | None  # the learning rate the optimizer used (None: left as it was)


class TrainStep:
    """``step(batches, i)`` runs training step ``i`` on the next batch of ``batches``.

    ``lr``: ``i -> learning rate``, set on every parameter group before the optimizer steps
    (None: leave the optimizer's). ``before_exchange``: called between backward and exchange
    (benchmarks/step.py times the wait for the slowest rank there, as its own phase).
    ``want_stats``: ``i -> bool``, whether the exchange of step ``i`` reports its compression
    statistics (the trainer: on the steps it logs; None: never, as a benchmark step is not logged).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        reducer: Reducer | None,
        flat_grad: torch.Tensor | None,
        timer: PhaseTimer,
        device: torch.device | str,
        *,
        lr: Callable[[int], float] | None = None,
        loss_fn: Callable = F.cross_entropy,
        before_exchange: Callable[[PhaseTimer], Any] | None = None,
        want_stats: Callable[[int], bool] | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.reducer = reducer
        self.flat_grad = flat_grad
        self.timer = timer
        self.device = torch.device(device)
        self.lr = lr
        self.loss_fn = loss_fn
        self.before_exchange = before_exchange
        self.want_stats = want_stats

    def _zero_grad(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        elif self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)

    def __call__(self, batches: Iterator, step: int) -> StepResult:
        timer = self.timer
        lr = None
        stats = None
        with timer.step():
            with timer.phase("data"):  # batch assembly + augmentation + host-to-device
                inputs, targets = next(batches)
                inputs = inputs.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
            with timer.phase("forward"):
                logits = self.model(inputs)
                loss = self.loss_fn(logits, targets)
            with timer.phase("backward"):
                self._zero_grad()
                loss.backward()
            if self.reducer is not None:
                if self.before_exchange is not None:
                    self.before_exchange(timer)
                want = self.want_stats is not None and self.want_stats(step)
                stats = self.reducer.reduce(self.flat_grad, step, timer, want_stats=want)
            if self.optimizer is not None:
                with timer.phase("optimizer"):
                    if self.lr is not None:
                        lr = self.lr(step)
                        for group in self.optimizer.param_groups:
                            group["lr"] = lr
                    self.optimizer.step()
            # an exchange that synchronises the model after the optimizer (local SGD, DiLoCo)
            if self.reducer is not None:
                self.reducer.after_optimizer(step, timer)
        return StepResult(loss, logits, targets, stats, lr)
