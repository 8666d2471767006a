"""The loop over built components: epochs, evaluation, checkpoints, stop signals, logging.

``Trainer`` builds its components from the config (``build``: data, the model and the compressor
through Hydra's ``instantiate`` of ``model`` and ``scheme.compressor``, the flat buffer and
reducer through ``comm.build_exchange``, the optimizer, the loader) and then runs ``fit``. Each step
is ``train.step.TrainStep``, the same step every benchmark times. As in the reference code, error
feedback acts on the raw gradient; weight decay and momentum come after the exchange.
"""

from __future__ import annotations

import gc
import math
import resource
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sparsetrain.costmodel import wire_bytes
from sparsetrain.data import ShardedLoader, eval_batches, load_dataset
from sparsetrain.errors import ConfigError, Diverged, Preempted, one_line_error
from sparsetrain.provenance import code_version, describe
from sparsetrain.rank import RankInfo
from sparsetrain.results import (
    PHASES,
    STABILITY_FROM_STEP,
    Heartbeat,
    NullWriter,
    RunWriter,
    echo,
    logged_step,
    relative_run_dir,
    stability_of,
)
from sparsetrain.timing import PhaseTimer
from sparsetrain.tracking import NullTracker, make_tracker
from sparsetrain.train import checkpoint as ckpt
from sparsetrain.train.components import exchange_from_config, optimizer_from_config
from sparsetrain.train.ddp_exchange import DDPExchange
from sparsetrain.train.schedule import lr_at
from sparsetrain.train.signals import StopSignals
from sparsetrain.train.step import TrainStep

CHECKPOINT = ckpt.CHECKPOINT
# What differs between ranks and is saved for each: error-feedback memory, local epoch sums.
PER_RANK_STATE = ("reducer", "epoch_stats")

__all__ = ["CHECKPOINT", "Diverged", "Preempted", "Trainer", "lr_at"]


class Trainer:
    def __init__(self, cfg: Any, info: RankInfo, run_dir: str | Path, device: torch.device):
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(run_dir)
        self.device = device  # the rank's, as its process group was set up on it (launch.worker)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank

        data = load_dataset(
            cfg.data.name,
            cfg.data.root,
            download=cfg.data.download,
            train_size=cfg.data.train_size,
            test_size=cfg.data.test_size,
            seed=cfg.seed,
        )
        self.data = data
        # conf/model/<name>.yaml: the model's class or builder, given the data's shape here
        self.model = instantiate(cfg.model)(in_channels=data.in_channels, num_classes=data.num_classes)
        self.model = self.model.to(self.device)
        # One flat gradient buffer, each .grad a view into it; tensors that bypass compression
        # (scheme.uncompressed) sit at its end. conf/scheme/<name>.yaml's ``compressor`` node is
        # the scheme's class with its options, built once the buffer's layout is known.
        # dist.ddp: the model in torch DDP, the exchange in a communication hook during backward
        # (train.ddp_exchange); the step then runs the DDP model and keeps per-parameter .grad.
        exchange = exchange_from_config(cfg, self.model, world_size=info.world_size, rank=info.rank,
                                        device=self.device)
        net, self.flat_grad, self.params, self.reducer = (exchange.net, exchange.flat, exchange.params,
                                                          exchange.reducer)
        self.num_parameters = self.reducer.numel
        self.optimizer = optimizer_from_config(cfg, self.model)
        self.loader = ShardedLoader(
            data.train_x,
            data.train_y,
            cfg.train.batch_size,
            rank=info.rank,
            world_size=info.world_size,
            seed=cfg.seed,
            augment=cfg.data.augment,
            padding=data.augment_padding,
            flip=data.flip,
        )
        if len(self.loader) == 0:
            raise ConfigError(
                f"train.batch_size={cfg.train.batch_size} is not allowed: each of "
                f"{info.world_size} ranks holds {len(data.train_y) // info.world_size} examples; "
                "use a smaller batch"
            )
        self.timer = PhaseTimer(self.device, cfg.train.timing_warmup)
        schedule = partial(lr_at, steps_per_epoch=len(self.loader), cfg=cfg, world_size=info.world_size)
        # compression statistics on the steps the loop logs (0-based step i is logged after i + 1)
        self.run_step = TrainStep(net, self.optimizer, self.reducer, self.flat_grad,
                                  self.timer, self.device, lr=schedule,
                                  want_stats=lambda i: logged_step(i + 1, cfg.train.log_every))
        self.step = 0
        self.epoch = 0  # epochs completed
        self.batch_in_epoch = 0
        self.records_logged = 0
        self.last_eval: dict[str, float] = {}
        # loss sum, correct, count: kept on the device so a step never waits for the host
        self.epoch_stats = torch.zeros(3, dtype=torch.float64, device=self.device)
        # (step, loss) of this rank's first non-finite loss; step inf while there is none. Kept on
        # the device and read at the agreement points only, so no step waits for the host.
        self.nonfinite = torch.tensor([math.inf, 0.0], dtype=torch.float64, device=self.device)
        self.elapsed_s = 0.0
        self.bytes_sent_total = 0  # per rank, warm-up steps included
        self.wire_bytes_total = 0  # per rank, as the ring collectives move them (costmodel.wire_bytes)
        self.memory_norm_max: float | None = None  # rank 0's error-feedback memory norm, largest logged
        # Rank 0's largest batch loss (and its step) from step STABILITY_FROM_STEP on, and after
        # the lr warm-up: a run that blew up and recovered shows here, not in its final numbers.
        # On the device, updated without a host sync; -inf while there is none.
        self.lr_warmup_steps = math.ceil(cfg.optim.warmup_epochs * len(self.loader))
        self.loss_peaks = torch.tensor([-math.inf, 0.0, -math.inf, 0.0], dtype=torch.float64,
                                       device=self.device)
        # Which code this run runs, and every version a resumed run ran on (sparsetrain.provenance)
        self.code = code_version()
        self.code_commits = [describe(self.code, full=True)]
        self._stop_requested = 0  # the stop signal's number, once one arrived (signals.StopSignals)
        if info.world_size > 1:  # robust to seeding differences: start from rank 0's weights
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)

        self.writer = RunWriter(run_dir) if info.is_main else NullWriter()
        self.tracker = NullTracker()

    # ---- checkpoints -------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "reducer": self.reducer.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "records_logged": self.records_logged,
            "last_eval": dict(self.last_eval),
            "epoch_stats": self.epoch_stats.cpu(),
            "elapsed_s": self.elapsed_s,
            "bytes_sent_total": self.bytes_sent_total,
            "wire_bytes_total": self.wire_bytes_total,
            "memory_norm_max": self.memory_norm_max,
            "loss_peaks": self.loss_peaks.cpu(),
            "code": self.code,
            "code_commits": list(self.code_commits),
            "timer": self.timer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.reducer.load_state_dict(state["reducer"])
        self.step = state["step"]
        self.epoch = state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.records_logged = state["records_logged"]
        self.last_eval = dict(state["last_eval"])
        self.epoch_stats = state["epoch_stats"].to(self.device, copy=True)
        self.elapsed_s = state["elapsed_s"]
        self.bytes_sent_total = state.get("bytes_sent_total", 0)
        self.wire_bytes_total = state.get("wire_bytes_total", 0)
        self.memory_norm_max = state.get("memory_norm_max")
        if "loss_peaks" in state:
            self.loss_peaks = state["loss_peaks"].to(self.device, copy=True)
        # The versions it ran on, then this one (check_resume has refused a change unless allowed)
        here = describe(self.code, full=True)
        self.code_commits = [*state.get("code_commits", []), here]
        if len(self.code_commits) > 1 and self.code_commits[-2] == here:
            self.code_commits.pop()
        self.timer.load_state_dict(state["timer"])
        torch.set_rng_state(state["torch_rng"])

    def save_checkpoint(self) -> None:
        """Every rank contributes its own error-feedback memory; rank 0 writes one file."""
        state = self.state_dict()
        # On the CPU: all_gather_object pickles, and a CUDA tensor would be unpickled on rank 0
        # onto the sender's GPU (cuda:1 in rank 0's process), where it has no business being.
        own = {key: _to_cpu(state.pop(key)) for key in PER_RANK_STATE}
        gathered = [own]
        if self.info.world_size > 1:
            gathered = [None] * self.info.world_size
            dist.all_gather_object(gathered, own)
        state["per_rank"] = gathered
        state["config"] = OmegaConf.to_container(self.cfg, resolve=True)  # resume checks it
        if self.info.is_main:
            ckpt.save(state, self.checkpoint_path)  # atomic; a full disk keeps the old one

    def maybe_resume(self) -> bool:
        if not (self.cfg.train.checkpoint and self.checkpoint_path.exists()):
            return False
        state = ckpt.load(self.checkpoint_path, map_location=self.device)
        ckpt.check_same_run(state.pop("config", None), OmegaConf.to_container(self.cfg, resolve=True),
                            self.checkpoint_path)
        ckpt.check_same_code(state.pop("code", None), self.code, self.cfg.train.allow_code_change,
                             self.checkpoint_path)
        state.update(state.pop("per_rank")[self.info.rank])
        self.load_state_dict(state)
        return True

    # ---- loop ----------------------------------------------------------------------------
    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = self._stop_requested or int(signum)

    def _stop_agreed(self) -> int:
        """All ranks learn, at the same step, of a stop signal that reached any of them and of a
        non-finite loss on any of them (one tiny collective). Raises ``Diverged`` on every rank
        for the earliest non-finite loss; returns the stop signal's number (0: none)."""
        mine = torch.cat([torch.tensor([float(self._stop_requested)], dtype=torch.float64,
                                       device=self.device), self.nonfinite])
        rows = [mine]
        if self.info.world_size > 1:
            rows = [torch.empty_like(mine) for _ in range(self.info.world_size)]
            dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()
        first = int(torch.argmin(table[:, 1]))  # lowest step; ties: the lowest rank
        if math.isfinite(table[first, 1].item()):
            step, loss = int(table[first, 1].item()), table[first, 2].item()
            where = f" on rank {first}" if self.info.world_size > 1 else ""
            raise Diverged(f"diverged at step {step} (loss={loss:g}{where})")
        return int(table[:, 0].max().item())

    def _recalibrate_batch_norm(self) -> None:
        """Recompute batch-norm running statistics from ``train.bn_recalibrate`` training batches
        (the first ones of the current epoch's order, no augmentation draws beyond the loader's
        own seeded ones), averaged over ranks. Training updates move the weights in bursts under
        sparse schemes, so the running averages lag behind the weights they are used with."""
        norms = [m for m in self.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        n = self.cfg.train.bn_recalibrate
        if not norms or n <= 0:
            return
        saved = [m.momentum for m in norms]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the batches below
        self.model.train()
        with torch.no_grad():
            for i, (xb, _) in enumerate(self.loader.batches(self.epoch)):
                if i >= n:
                    break
                self.model(xb.to(self.device, non_blocking=True))
        for m, momentum in zip(norms, saved):
            m.momentum = momentum
            if self.info.world_size > 1:
                for buf in (m.running_mean, m.running_var):
                    dist.all_reduce(buf)
                    buf.div_(self.info.world_size)

    def evaluate(self) -> dict[str, float]:
        """Test loss and accuracy. With ``train.bn_recalibrate`` the model is scored twice: with
        the running batch-norm statistics from training (``test_accuracy_running_bn``, so every
        run measures what recalibration changes) and then with recalibrated ones (the result)."""
        if self.cfg.train.bn_recalibrate <= 0:
            return self._test()
        before = self._test()
        self._recalibrate_batch_norm()
        return {**self._test(), "test_accuracy_running_bn": before["test_accuracy"]}

    def _test(self) -> dict[str, float]:
        """Rank 0's model (its batch-norm statistics broadcast) on the test set, sharded."""
        if self.info.world_size > 1:
            for buf in self.model.buffers():
                dist.broadcast(buf, src=0)
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        x = self.data.test_x[self.info.rank :: self.info.world_size]
        y = self.data.test_y[self.info.rank :: self.info.world_size]
        with torch.no_grad():
            for xb, yb in eval_batches(x, y, 512):
                xb, yb = xb.to(self.device), yb.to(self.device)
                out = self.model(xb)
                sums[0] += F.cross_entropy(out, yb, reduction="sum").double()
                sums[1] += (out.argmax(1) == yb).sum()
                sums[2] += len(yb)
        if self.info.world_size > 1:
            dist.all_reduce(sums)
        self.model.train()
        return {"test_loss": (sums[0] / sums[2]).item(), "test_accuracy": (sums[1] / sums[2]).item()}

    def train_step(self, batches) -> tuple[torch.Tensor, Any, float]:
        result = self.run_step(batches, self.step)
        loss, out, yb, stats = result.loss, result.logits, result.targets, result.stats
        with torch.no_grad():
            batch = torch.stack(
                [loss.detach().double() * len(yb), (out.argmax(1) == yb).sum().double(),
                 torch.tensor(float(len(yb)), dtype=torch.float64, device=loss.device)]
            )
            first_bad = ~torch.isfinite(batch[0]) & torch.isinf(self.nonfinite[0])
            here = torch.stack([torch.full_like(batch[0], self.step + 1), loss.detach().double()])
            self.nonfinite = torch.where(first_bad, here, self.nonfinite)
        self.epoch_stats += batch
        done = self.step + 1
        if done >= STABILITY_FROM_STEP:
            self._track_peak(0, loss, done)
        if done > self.lr_warmup_steps:
            self._track_peak(2, loss, done)
        self.bytes_sent_total += stats.bytes_sent  # a Python int: no device sync
        self.wire_bytes_total += self._wire_bytes(stats.collective, stats.bytes_sent)
        self.step += 1
        return loss, stats, result.lr

    def _track_peak(self, at: int, loss: torch.Tensor, step: int) -> None:
        with torch.no_grad():
            value = loss.detach().double()
            higher = value > self.loss_peaks[at]
            self.loss_peaks[at] = torch.where(higher, value, self.loss_peaks[at])
            self.loss_peaks[at + 1] = torch.where(higher, float(step), self.loss_peaks[at + 1])

    def _loss_peaks(self) -> dict:
        peaks = self.loss_peaks.cpu().tolist()

        def one(value: float, step: float, first: int) -> dict:
            seen = math.isfinite(value)
            return {"from_step": first, "train_loss": value if seen else None,
                    "step": int(step) if seen else None}

        return {f"after_step_{STABILITY_FROM_STEP}": one(*peaks[:2], STABILITY_FROM_STEP),
                "after_lr_warmup": one(*peaks[2:], self.lr_warmup_steps + 1)}

    def _log_step(self, loss, stats, lr) -> None:
        if stats.memory_norm is not None:  # bounded memory is the sign of a stable scheme
            self.memory_norm_max = max(self.memory_norm_max or 0.0, stats.memory_norm)
        record = {
            "kind": "step",
            "step": self.step,
            "epoch": self.step / len(self.loader),
            "lr": lr,
            "train_loss": loss.item(),
            "time_ms": dict(self.timer.last),
            "bytes_sent": stats.bytes_sent,
            "wire_bytes": self._wire_bytes(stats.collective, stats.bytes_sent),
            "density": stats.density,
            "compression_error": stats.compression_error,
            "memory_norm": stats.memory_norm,
            "compressing": self.step > self.reducer.warmup_steps,
        }
        self._emit(record)

    def _emit(self, record: dict) -> None:
        self.writer.log(record)
        self.records_logged += 1
        # W&B merges what is logged at one step: epoch metrics get their own prefix.
        prefix = "" if record["kind"] == "step" else f"{record['kind']}/"
        self.tracker.log({f"{prefix}{k}": v for k, v in record.items() if k != "kind"}, step=self.step)

    def _hit_max_steps(self) -> bool:
        return self.cfg.train.max_steps is not None and self.step >= self.cfg.train.max_steps

    def _finished(self) -> bool:
        return self._hit_max_steps() or self.epoch >= self.cfg.train.epochs

    def _end_epoch(self) -> None:
        """Close an epoch (or the partial one a max_steps cap ended): log, maybe evaluate."""
        full = self.batch_in_epoch >= len(self.loader)
        if full:
            self.epoch += 1
            self.batch_in_epoch = 0
        stats = self.epoch_stats.clone()
        if self.info.world_size > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        self.epoch_stats.zero_()
        if self._finished() or (full and self.epoch % self.cfg.train.eval_every == 0):
            self.last_eval = self.evaluate()
        self.last_train_loss = (stats[0] / stats[2]).item() if stats[2] > 0 else None
        record = {
            "kind": "epoch",
            "epoch": self.epoch if full else self.step / len(self.loader),
            "step": self.step,
            "train_loss": self.last_train_loss,
            "train_accuracy": (stats[1] / stats[2]).item() if stats[2] > 0 else None,
            **self.last_eval,
            "lr": self.optimizer.param_groups[0]["lr"],
            "elapsed_s": self.elapsed_s,
        }
        self._emit(record)
        if self.info.is_main:
            acc = self.last_eval.get("test_accuracy", float("nan"))
            echo(  # through tqdm: never into the progress bar's line
                f"epoch {record['epoch']:.3g} | step {self.step} | train_loss "
                f"{self.last_train_loss:.4f} | test_acc {acc:.4f} | "
                f"{self.timer.means().get('step', float('nan')):.1f} ms/step",
            )

    def fit(self) -> dict:
        cfg = self.cfg
        resumed = self.maybe_resume()
        if resumed and self.info.is_main:
            echo(f"resumed from step {self.step} (epoch {self.step / len(self.loader):.3g}) of "
                 f"{relative_run_dir(self.checkpoint_path)}")
        if isinstance(self.reducer, DDPExchange):  # the same DDP buckets for every step, resumed or not
            inputs, _ = next(iter(self.loader.batches(self.epoch)))  # seeded order: no global RNG drawn
            self.reducer.settle(inputs.to(self.device))
        config = OmegaConf.to_container(cfg, resolve=True)
        self.writer.open_metrics(keep_records=self.records_logged if resumed else None)
        self.writer.start(
            config=config,
            run_dir=relative_run_dir(self.run_dir),
            world_size=self.info.world_size,
            launcher=self.info.launcher,
            device=str(self.device),
            num_parameters=self.num_parameters,
            num_classes=self.data.num_classes,
            bytes_sent_per_step=self.reducer.bytes_sent_per_step,
            wire_bytes_per_step=self._wire_bytes(self.reducer.collective, self.reducer.bytes_sent_per_step),
            dense_bytes_per_step=self.reducer.dense_bytes_per_step,
            **self._exchange_fields(),
            resumed_from_step=self.step if resumed else None,
            code=self.code,
            code_commits=self.code_commits,
            slurm_job_id=self.info.slurm_job_id,
        )
        if self.info.is_main:
            self.tracker = make_tracker(
                dict(config["wandb"]), config, str(self.run_dir), self.run_dir.name
            )
        signals = StopSignals(self._request_stop, self.info.preempt_signal) if _main_thread() else None
        heartbeat = Heartbeat(self.run_dir, lambda: self.step).start() if self.info.is_main else None
        self.last_train_loss = None
        gc.collect()
        gc.disable()  # no collector pauses inside timed steps; collected once per epoch
        try:
            self._loop()
        except BaseException as exc:
            self.writer.finish("failed", error=one_line_error(exc), **self._summary_fields())
            self.tracker.finish(self.writer.summary, failed=True)
            if signals is not None and isinstance(exc, Preempted):
                signals.pass_on()  # SLURM: submitit's handler requeues the job (rank 0) and exits
            raise
        finally:
            gc.enable()
            if signals is not None:
                signals.restore()
            if heartbeat is not None:
                heartbeat.stop()
        if self.cfg.train.save_model and self.info.is_main:
            torch.save(self.model.state_dict(), self.run_dir / "model.pt")
        self.writer.finish("completed", **self._summary_fields())
        self.tracker.finish(self.writer.summary)
        if self.info.is_main and self.checkpoint_path.exists():
            self.checkpoint_path.unlink()  # a finished run needs no resume point
        return self.writer.summary

    def _loop(self) -> None:
        cfg = self.cfg
        bar = _progress(self, cfg)
        while not self._finished():
            t0 = time.perf_counter()
            batches = iter(self.loader.batches(self.epoch, start_batch=self.batch_in_epoch))
            for _ in range(self.batch_in_epoch, len(self.loader)):
                loss, stats, lr = self.train_step(batches)
                self.batch_in_epoch += 1
                if bar is not None:
                    bar.update(1)
                if logged_step(self.step, cfg.train.log_every):  # the reducer's stats steps too
                    self._log_step(loss, stats, lr)
                    # Every rank checks at the same steps, so all stop together.
                    signum = self._stop_agreed()
                    if signum:
                        self.elapsed_s += time.perf_counter() - t0
                        self._preempt(signum)
                if self._hit_max_steps():
                    break
            self.elapsed_s += time.perf_counter() - t0
            # And at every epoch end (this also raises Diverged before a diverged state is
            # evaluated or saved): a signal after an epoch's last logged step is acted on here,
            # not lost, unless this epoch ends the run, which then completes.
            signum = self._stop_agreed()
            if signum and not self._ends_run():
                self._preempt(signum)
            self._end_epoch()
            gc.collect()
            if cfg.train.checkpoint and not self._finished():
                self.save_checkpoint()
        if bar is not None:
            bar.close()

    def _ends_run(self) -> bool:
        """Whether the epoch being closed is the run's last (checked before ``_end_epoch``)."""
        full = self.batch_in_epoch >= len(self.loader)
        return self._hit_max_steps() or (full and self.epoch + 1 >= self.cfg.train.epochs)

    def _preempt(self, signum: int) -> None:
        """Save the checkpoint at this step and stop every rank (the launcher says how to resume)."""
        self.save_checkpoint()
        name = signal.Signals(signum).name
        raise Preempted(f"{name} at step {self.step}: checkpoint saved; rerun into this folder to "
                        "resume", signum=signum)

    def _wire_bytes(self, collective: str | None, nbytes: int) -> int:
        """Bytes this rank puts on its link for ``nbytes`` through ``collective`` (ring model)."""
        return round(wire_bytes(collective, nbytes, self.info.world_size))

    def _exchange_fields(self) -> dict:
        """What the exchange sends once compression runs, and when it started."""
        red = self.reducer
        return {
            "density": red.density,  # entries sent / entries, uncompressed tensors included
            "uncompressed_bytes_per_step": red.uncompressed_bytes_per_step,
            "uncompressed_share": red.uncompressed_bytes_per_step / red.bytes_sent_per_step,
            "compression_start_step": red.warmup_steps if self.cfg.scheme.name != "none" else None,
        }

    def _summary_fields(self) -> dict:
        means = self.timer.means()
        on_cuda = self.device.type == "cuda"
        peak_mb = (
            torch.cuda.max_memory_allocated(self.device) / 2**20
            if on_cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        peaks = self._loss_peaks()
        return {
            "steps": self.step,
            "epochs": self.step / len(self.loader),
            "train_loss": self.last_train_loss,
            "test_accuracy": self.last_eval.get("test_accuracy"),
            "train_loss_peak": peaks,
            "stability": stability_of(self.last_train_loss, self.last_eval.get("test_accuracy"),
                                      peaks[f"after_step_{STABILITY_FROM_STEP}"]["train_loss"],
                                      num_classes=self.data.num_classes),
            "test_loss": self.last_eval.get("test_loss"),
            "time_ms": {phase: means.get(phase, 0.0) for phase in PHASES},
            "timed_steps": self.timer.counted_steps,
            "peak_memory_mb": peak_mb,
            "peak_memory_of": "cuda_max_allocated" if on_cuda else "process_max_rss",
            "bytes_sent_total": self.bytes_sent_total,
            "wire_bytes_total": self.wire_bytes_total,
            "memory_norm_max": self.memory_norm_max,  # None: never measured (dense, torch's hooks)
            "test_accuracy_running_bn": self.last_eval.get("test_accuracy_running_bn"),
            "duration_s": self.elapsed_s,
        }


def _to_cpu(obj):
    """``obj`` with every tensor in it (nested dicts, lists, tuples) copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _progress(trainer: Trainer, cfg: Any):
    if not (trainer.info.is_main and cfg.train.progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    total = len(trainer.loader) * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return tqdm(total=total, initial=trainer.step, unit="step", dynamic_ncols=True, leave=False)
