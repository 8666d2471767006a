"""What the steps add up to: this epoch's loss / correct / count sums, the last ``window`` batch
losses (the end of training, which "did not train" reads: an epoch's mean carries an early blow-up
long after the run recovered), rank 0's largest batch loss
(from step ``STABILITY_FROM_STEP`` on and after the lr warm-up), the bytes sent and put on the wire,
the largest logged error-feedback memory norm. Kept on the device where a step produces it, so no
step waits for the host; read at epoch ends and for the summary."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from sparsetrain.comm import ExchangeStats
from sparsetrain.costmodel import wire_bytes
from sparsetrain.results import STABILITY_FROM_STEP
from sparsetrain.train.step import StepResult


class Tally:
    def __init__(self, world_size: int, device: torch.device, lr_warmup_steps: int, window: int = 1):
        self.world_size = world_size
        self.device = device
        self.lr_warmup_steps = lr_warmup_steps
        # loss sum, correct, count of this epoch's batches (this rank's)
        self.epoch_stats = torch.zeros(3, dtype=torch.float64, device=device)
        # this rank's last `window` batch losses, step i at slot i % window (NaN: not yet run)
        self.recent_losses = torch.full((max(1, window),), math.nan, dtype=torch.float64, device=device)
        # Rank 0's largest batch loss (and its step) from step STABILITY_FROM_STEP on, and after
        # the lr warm-up: a run that blew up and recovered shows here, not in its final numbers.
        # -inf while there is none.
        self.loss_peaks = torch.tensor([-math.inf, 0.0, -math.inf, 0.0], dtype=torch.float64, device=device)
        self.bytes_sent_total = 0  # per rank, warm-up steps included
        self.wire_bytes_total = 0  # per rank, as the ring collectives move them (costmodel.wire_bytes)
        self.memory_norm_max: float | None = None  # the error-feedback memory norm, largest logged

    def wire_bytes(self, collective: str | None, nbytes: int, by_collective: dict | None = None) -> int:
        """Bytes this rank puts on its link for ``nbytes`` through ``collective`` (ring model);
        ``by_collective``: ``nbytes`` split by collective where several carry it, each part at
        its own ring factor."""
        if by_collective:
            return round(sum(wire_bytes(c, n, self.world_size) for c, n in by_collective.items()))
        return round(wire_bytes(collective, nbytes, self.world_size))

    def add(self, result: StepResult, step: int) -> None:
        """Count ``result``, the outcome of 1-based ``step``."""
        loss, out, yb, stats = result.loss, result.logits, result.targets, result.stats
        with torch.no_grad():
            batch = torch.stack(
                [loss.detach().double() * len(yb), (out.argmax(1) == yb).sum().double(),
                 torch.tensor(float(len(yb)), dtype=torch.float64, device=loss.device)]
            )
        self.epoch_stats += batch
        self.recent_losses[step % len(self.recent_losses)] = loss.detach().double()
        if step >= STABILITY_FROM_STEP:
            self._track_peak(0, loss, step)
        if step > self.lr_warmup_steps:
            self._track_peak(2, loss, step)
        self.bytes_sent_total += stats.bytes_sent  # a Python int: no device sync
        self.wire_bytes_total += self.wire_bytes(stats.collective, stats.bytes_sent, stats.bytes_by_collective)

    def note_logged(self, stats: ExchangeStats) -> None:
        """A logged step's statistics: bounded memory is the sign of a stable scheme."""
        if stats.memory_norm is not None:
            self.memory_norm_max = max(self.memory_norm_max or 0.0, stats.memory_norm)

    def close_epoch(self) -> tuple[float | None, float | None]:
        """This epoch's train loss and accuracy over every rank (None without batches); the sums
        start over."""
        stats = self.epoch_stats.clone()
        if self.world_size > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        self.epoch_stats.zero_()
        if stats[2] <= 0:
            return None, None
        return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()

    def final_loss(self, reduce: bool = True) -> float | None:
        """The mean batch loss over the last ``window`` steps, over every rank (``reduce``; a
        collective: every rank calls it) or this rank's alone (a failing run, whose ranks may no
        longer meet). None before any step."""
        seen = ~torch.isnan(self.recent_losses)
        sums = torch.stack([torch.where(seen, self.recent_losses, 0.0).sum(), seen.sum().double()])
        if reduce and self.world_size > 1:
            dist.all_reduce(sums)
        total, count = sums.cpu().tolist()
        return total / count if count > 0 else None

    def _track_peak(self, at: int, loss: torch.Tensor, step: int) -> None:
        with torch.no_grad():
            value = loss.detach().double()
            higher = value > self.loss_peaks[at]
            self.loss_peaks[at] = torch.where(higher, value, self.loss_peaks[at])
            self.loss_peaks[at + 1] = torch.where(higher, float(step), self.loss_peaks[at + 1])

    def peaks(self) -> dict:
        """``train_loss_peak`` of summary.json: the largest batch loss and its step, after step
        ``STABILITY_FROM_STEP`` and after the lr warm-up (None where no step was counted)."""
        peaks = self.loss_peaks.cpu().tolist()

        def one(value: float, step: float, first: int) -> dict:
            seen = math.isfinite(value)
            return {"from_step": first, "train_loss": value if seen else None,
                    "step": int(step) if seen else None}

        return {f"after_step_{STABILITY_FROM_STEP}": one(*peaks[:2], STABILITY_FROM_STEP),
                "after_lr_warmup": one(*peaks[2:], self.lr_warmup_steps + 1)}

    def state_dict(self) -> dict:
        return {
            "epoch_stats": self.epoch_stats.cpu(),
            "bytes_sent_total": self.bytes_sent_total,
            "wire_bytes_total": self.wire_bytes_total,
            "memory_norm_max": self.memory_norm_max,
            "loss_peaks": self.loss_peaks.cpu(),
            "recent_losses": self.recent_losses.cpu(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch_stats = state["epoch_stats"].to(self.device, copy=True)
        self.bytes_sent_total = state.get("bytes_sent_total", 0)
        self.wire_bytes_total = state.get("wire_bytes_total", 0)
        self.memory_norm_max = state.get("memory_norm_max")
        recent = state.get("recent_losses")
        if recent is not None and len(recent) == len(self.recent_losses):
            self.recent_losses = recent.to(self.device, dtype=torch.float64, copy=True)
        if "loss_peaks" in state:
            self.loss_peaks = state["loss_peaks"].to(self.device, copy=True)
