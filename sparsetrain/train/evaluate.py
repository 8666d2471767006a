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
        self.test_predictions: torch.Tensor | None = None  # the last kept (rank 0's; CPU)

    def evaluate(self, epoch: int, predictions: bool = False) -> dict[str, float]:
        """With ``bn_recalibrate`` the model is scored twice: with the running batch-norm
        statistics from training (``test_accuracy_running_bn``, so every run measures what
        recalibration changes) and then with recalibrated ones (the result). ``predictions``:
        keep each test image's predicted class of the result (``test_predictions``)."""
        if self.bn_recalibrate <= 0:
            return self.test(predictions)
        before = self.test()
        self.recalibrate_batch_norm(epoch)
        return {**self.test(predictions), "test_accuracy_running_bn": before["test_accuracy"]}

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

    def test(self, predictions: bool = False) -> dict[str, float]:
        """Rank 0's model (its batch-norm statistics broadcast) on the validation split (when there
        is one: ``val_loss``, ``val_accuracy``) and the test set (``test_loss``, ``test_accuracy``),
        each sharded over the ranks. ``predictions``: rank 0 also keeps every test image's
        predicted class, in the test set's order, as ``test_predictions`` (None on other ranks)."""
        self._rank0_eval()
        splits = [("test", self.data.test_x, self.data.test_y)]
        if self.data.has_validation:
            splits.insert(0, ("val", self.data.val_x, self.data.val_y))
        out: dict[str, float] = {}
        for name, x, y in splits:
            out.update(self._score(name, x, y, keep=predictions and name == "test"))
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

    def _score(self, name: str, x: torch.Tensor, y: torch.Tensor, keep: bool = False) -> dict[str, float]:
        """``keep``: gather every image's predicted class on rank 0 (``test_predictions``)."""
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        total = len(y)
        x, y = x[self.rank :: self.world_size], y[self.rank :: self.world_size]
        predicted = []
        with torch.no_grad():
            for xb, yb in eval_batches(x, y, 512):
                xb, yb = xb.to(self.device), yb.to(self.device)
                logits = self.model(xb)
                sums[0] += F.cross_entropy(logits, yb, reduction="sum").double()
                sums[1] += (logits.argmax(1) == yb).sum()
                sums[2] += len(yb)
                if keep:
                    predicted.append(logits.argmax(1))
        if self.world_size > 1:
            dist.all_reduce(sums)
        if keep:
            self.test_predictions = self._gather(predicted, total)
        return {f"{name}_loss": (sums[0] / sums[2]).item(), f"{name}_accuracy": (sums[1] / sums[2]).item()}

    def _gather(self, predicted: list[torch.Tensor], total: int) -> torch.Tensor | None:
        """Each rank's predictions for its shard (images rank, rank + W, ...) put back in the test
        set's order on rank 0 (CPU, int64); None on other ranks. Shards differ by at most one
        image, so each is padded to the longest for the all-gather."""
        mine = torch.cat(predicted) if predicted else torch.zeros(0, dtype=torch.int64, device=self.device)
        if self.world_size == 1:
            return mine.cpu()
        longest = -(-total // self.world_size)
        padded = torch.zeros(longest, dtype=torch.int64, device=self.device)
        padded[: len(mine)] = mine
        shards = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(shards, padded)
        if self.rank != 0:
            return None
        out = torch.empty(total, dtype=torch.int64)
        for r, shard in enumerate(shards):
            n = len(range(r, total, self.world_size))
            out[r :: self.world_size] = shard[:n].cpu()
        return out
