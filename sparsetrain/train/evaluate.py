"""Evaluation: rank 0's model on the validation split (when ``data.val_size`` holds one out) and
the test set, sharded over the ranks, with optional batch-norm recalibration
(``train.bn_recalibrate``) before it. Choices read ``val_accuracy``; ``test_accuracy`` is reported."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparsetrain.data import Dataset, ShardedLoader, eval_batches


class Evaluator:
    """``evaluate(epoch)``: validation (where there is a split) and test loss and accuracy of ``model``. ``bn_recalibrate`` > 0 recomputes
    the batch-norm statistics from that many training batches of ``epoch``'s order first."""

    def __init__(self, model: torch.nn.Module, data: Dataset, loader: ShardedLoader, *,
                 rank: int, world_size: int, device: torch.device, bn_recalibrate: int = 0):
        self.model = model
        self.data = data
        self.loader = loader
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.bn_recalibrate = bn_recalibrate

    def evaluate(self, epoch: int) -> dict[str, float]:
        """With ``bn_recalibrate`` the model is scored twice: with the running batch-norm
        statistics from training (``test_accuracy_running_bn``, so every run measures what
        recalibration changes) and then with recalibrated ones (the result)."""
        if self.bn_recalibrate <= 0:
            return self.test()
        before = self.test()
        self.recalibrate_batch_norm(epoch)
        return {**self.test(), "test_accuracy_running_bn": before["test_accuracy"]}

    def recalibrate_batch_norm(self, epoch: int) -> None:
        """Recompute batch-norm running statistics from ``bn_recalibrate`` training batches (the
        first ones of ``epoch``'s order, no augmentation draws beyond the loader's own seeded
        ones), averaged over ranks. Training updates move the weights in bursts under sparse
        schemes, so the running averages lag behind the weights they are used with."""
        norms = [m for m in self.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        n = self.bn_recalibrate
        if not norms or n <= 0:
            return
        saved = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the batches below
        self.model.train()
        with torch.no_grad():
            for i, (xb, _) in enumerate(self.loader.batches(epoch)):
                if i >= n:
                    break
                self.model(xb.to(self.device, non_blocking=True))
        for m, momentum in zip(norms, saved):
            m.momentum = momentum
            if self.world_size > 1:
                for buf in (m.running_mean, m.running_var):
                    dist.all_reduce(buf)
                    buf.div_(self.world_size)

    def test(self) -> dict[str, float]:
        """Rank 0's model (its batch-norm statistics broadcast) on the validation split (when there
        is one: ``val_loss``, ``val_accuracy``) and the test set (``test_loss``, ``test_accuracy``),
        each sharded over the ranks."""
        self._rank0_eval()
        splits = [("test", self.data.test_x, self.data.test_y)]
        if self.data.has_validation:
            splits.insert(0, ("val", self.data.val_x, self.data.val_y))
        out: dict[str, float] = {}
        for name, x, y in splits:
            out.update(self._score(name, x, y))
        self.model.train()
        return out

    def curve_point(self, size: int | None) -> dict[str, float]:
        """Rank 0's model on the first ``size`` validation images (all: None), sharded, running
        batch-norm statistics as they are: one point of the accuracy curve, cheap enough to take
        several times an epoch."""
        self._rank0_eval()
        n = len(self.data.val_y) if size is None else min(size, len(self.data.val_y))
        out = self._score("val", self.data.val_x[:n], self.data.val_y[:n])
        self.model.train()
        return {"accuracy": out["val_accuracy"], "loss": out["val_loss"], "size": n}

    def _rank0_eval(self) -> None:
        """Every rank scores rank 0's model: its batch-norm statistics broadcast, eval mode (the
        caller puts the model back in train mode)."""
        if self.world_size > 1:
            for buf in self.model.buffers():
                dist.broadcast(buf, src=0)
        self.model.eval()

    def _score(self, name: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        x, y = x[self.rank :: self.world_size], y[self.rank :: self.world_size]
        with torch.no_grad():
            for xb, yb in eval_batches(x, y, 512):
                xb, yb = xb.to(self.device), yb.to(self.device)
                logits = self.model(xb)
                sums[0] += F.cross_entropy(logits, yb, reduction="sum").double()
                sums[1] += (logits.argmax(1) == yb).sum()
                sums[2] += len(yb)
        if self.world_size > 1:
            dist.all_reduce(sums)
        return {f"{name}_loss": (sums[0] / sums[2]).item(), f"{name}_accuracy": (sums[1] / sums[2]).item()}
