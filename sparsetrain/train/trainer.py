"""The loop over built parts: steps, epochs, evaluation and checkpoints at epoch ends, stop signals.

``Trainer`` puts together what the other modules of ``train`` do, one job each: ``build`` (the
parts from the config: data, model, exchange, optimizer, loader, the train step), ``tally`` (what
the steps add up to), ``stop`` (every rank stops at the same step), ``evaluate`` (test set,
batch-norm recalibration) and ``record`` (summary.json, metrics.jsonl, heartbeat, checkpoint.pt).
Each step is ``train.step.TrainStep``, the same step every benchmark times. The worker hands in
the device it set the process group up on (``launch.worker.pick_device``).
"""

from __future__ import annotations

import gc
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from sparsetrain.errors import Preempted
from sparsetrain.rank import RankInfo
from sparsetrain.results import echo, logged_step, relative_run_dir
from sparsetrain.timing import process_age_s
from sparsetrain.train.build import build
from sparsetrain.train.evaluate import Evaluator
from sparsetrain.train.record import RunRecord
from sparsetrain.train.replicas import check_replicas
from sparsetrain.train.signals import StopSignals
from sparsetrain.train.stop import StopAgreement
from sparsetrain.train.tally import Tally

__all__ = ["Trainer", "FINAL_WINDOW"]

FINAL_WINDOW = 0.1  # epochs: the end of training that summary.json's train_loss_final averages


class Trainer:
    def __init__(self, cfg: Any, info: RankInfo, run_dir: str | Path, device: torch.device):
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(run_dir)
        self.device = device
        parts = build(cfg, info, device)
        self.data, self.model, self.reducer = parts.data, parts.model, parts.reducer
        self.optimizer, self.loader, self.timer = parts.optimizer, parts.loader, parts.timer
        self.run_step = parts.run_step
        self.step = 0
        self.epoch = 0  # epochs completed
        self.batch_in_epoch = 0
        self.elapsed_s = 0.0  # training time: curve points excluded
        self.curve_s = 0.0  # time spent scoring curve points (train.curve_points)
        self.target = cfg.train.get("stop_at_accuracy")  # stop at the curve point reaching it
        self.reached: dict | None = None  # when and after how long it was reached
        self.resumed = False  # from a checkpoint: this process's age is not the run's wall time
        self.last_curve_accuracy = -1.0
        points = cfg.train.get("curve_points", 1)
        # the steps within an epoch (1-based batch counts) that end with a curve point
        self.curve_at = ({round(j * len(self.loader) / points) for j in range(1, points + 1)} - {0}
                         if points > 1 else set())
        # "did not train" reads the loss of the run's last tenth of an epoch (FINAL_WINDOW)
        self.tally = Tally(info.world_size, device, math.ceil(cfg.optim.warmup_epochs * len(self.loader)),
                           window=math.ceil(FINAL_WINDOW * len(self.loader)))
        self.stop = StopAgreement(info.world_size, device)
        # the step count after the first compressed step (None: nothing is compressed), where the
        # ranks' models are compared once (``_check_replicas``)
        self.check_replicas_at = self.reducer.warmup_steps + 1 if self.reducer.compresses else None
        self.evaluator = Evaluator(self.model, self.data, self.loader, rank=info.rank,
                                   world_size=info.world_size, device=device,
                                   bn_recalibrate=cfg.train.bn_recalibrate)
        self.record = RunRecord(cfg, info, run_dir, device, parts, self.tally)

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "reducer": self.reducer.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "elapsed_s": self.elapsed_s,
            "curve_s": self.curve_s,
            "reached": self.reached,  # a run stopped between reaching its target and its end
            **self.tally.state_dict(),
            **self.record.state_dict(),
            "timer": self.timer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            # this rank's GPU's generator (each rank has its own: saved per rank, record.PER_RANK_STATE)
            **({"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.reducer.load_state_dict(state["reducer"])
        self.step = state["step"]
        self.epoch = state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.elapsed_s = state["elapsed_s"]
        self.curve_s = state.get("curve_s", 0.0)
        self.reached = state.get("reached")
        self.resumed = True
        self.tally.load_state_dict(state)
        self.record.load_state_dict(state)
        self.timer.load_state_dict(state["timer"])
        # on the CPU whatever map_location put them on: set_rng_state takes a CPU ByteTensor only
        torch.set_rng_state(state["torch_rng"].cpu())
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:  # absent: saved on the CPU or before it was
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)

    def save_checkpoint(self) -> None:
        self.record.save_checkpoint(self.state_dict())

    # ---- the run ---------------------------------------------------------------------------
    def fit(self) -> dict:
        state = self.record.load_checkpoint()
        resumed = state is not None
        if resumed:
            self.load_state_dict(state)
            if self.info.is_main:
                echo(f"resumed from step {self.step} (epoch {self.step / len(self.loader):.3g}) of "
                     f"{relative_run_dir(self.record.checkpoint_path)}")
        if self.cfg.dist.ddp:  # the same DDP buckets for every step, resumed or not
            inputs, _ = next(iter(self.loader.batches(self.epoch)))  # seeded order: no global RNG drawn
            self.reducer.settle(inputs.to(self.device))
        self.record.start(self.step, resumed, step_fn=lambda: self.step)
        main_thread = threading.current_thread() is threading.main_thread()
        signals = StopSignals(self.stop.request, self.info.preempt_signal) if main_thread else None
        gc.collect()
        gc.disable()  # no collector pauses inside timed steps; collected once per epoch
        try:
            self._loop()
        except BaseException as exc:
            self.record.fail(exc, self.step, self.elapsed_s)
            if signals is not None and isinstance(exc, Preempted):
                signals.pass_on()  # SLURM: submitit's handler requeues the job (rank 0) and exits
            raise
        finally:
            gc.enable()
            if signals is not None:
                signals.restore()
            self.record.stop_heartbeat()
        return self.record.complete(self.step, self.elapsed_s, self.curve_s, target=self._target_summary())

    def train_step(self, batches) -> Any:
        result = self.run_step(batches, self.step)
        self.step += 1
        self.stop.watch(result.loss, self.step)
        self.tally.add(result, self.step)
        return result

    def _loop(self) -> None:
        cfg = self.cfg
        bar = self._progress()
        while not self._finished():
            t0 = time.perf_counter()
            batches = iter(self.loader.batches(self.epoch, start_batch=self.batch_in_epoch))
            for _ in range(self.batch_in_epoch, len(self.loader)):
                result = self.train_step(batches)
                self.batch_in_epoch += 1
                if self.step == self.check_replicas_at:
                    t0 += self._check_replicas()  # its time is not training time
                if bar is not None:
                    bar.update(1)
                if self.batch_in_epoch in self.curve_at:
                    t0 += self._curve_point()  # its time is not training time
                    self._reached_target(self.elapsed_s + time.perf_counter() - t0)
                if logged_step(self.step, cfg.train.log_every):  # the reducer's stats steps too
                    self.tally.note_logged(result.stats)
                    self.record.log_step(self.step, result.loss, result.stats, result.lr)
                    # Every rank checks at the same steps, so all stop together; a signal at
                    # the run's last step lets it complete, as at the last epoch's end below.
                    signum = self.stop.agreed()
                    if signum and not self._ends_run():
                        self.elapsed_s += time.perf_counter() - t0
                        self._preempt(signum)
                if self._stops_here():
                    break
            self.elapsed_s += time.perf_counter() - t0
            # And at every epoch end (this also raises Diverged before a diverged state is
            # evaluated or saved): a signal after an epoch's last logged step is acted on here,
            # not lost, unless this epoch ends the run, which then completes.
            signum = self.stop.agreed()
            if signum and not self._ends_run():
                self._preempt(signum)
            self._end_epoch()
            gc.collect()
            if cfg.train.checkpoint and not self._finished():
                self.save_checkpoint()
        if bar is not None:
            bar.close()

    def _end_epoch(self) -> None:
        """Close an epoch (or the partial one a max_steps cap ended): log, maybe evaluate."""
        full = self.batch_in_epoch >= len(self.loader)
        if full:
            self.epoch += 1
            self.batch_in_epoch = 0
        train_loss, train_accuracy = self.tally.close_epoch()
        final = self._finished()
        self._check_replicas()  # before anything is scored or saved from the ranks' models
        self.reducer.watch_kept_state()  # state first written mid-run: checked over the next step
        if final or (full and self.epoch % self.cfg.train.eval_every == 0):
            with self._synchronised():
                # the final evaluation keeps each test image's prediction (after training: no
                # random number is drawn for it)
                self.record.last_eval = self.evaluator.evaluate(self.epoch, predictions=final)
                if final:
                    self.record.save_model(self.model)  # the model just scored
            if final:
                self.record.save_test_predictions(self.evaluator.test_predictions, self.data.test_y,
                                                  self.data.num_classes)
        self.record.log_epoch(self.epoch if full else self.step / len(self.loader), self.step,
                              train_loss, train_accuracy, self.elapsed_s)

    def _check_replicas(self) -> float:
        """``ReplicasDiffer`` on every rank where the ranks' models (as they agree on them) part:
        at every epoch's end, and once after the first compressed step (an exchange that parts
        them does so at once: no need to wait an epoch to stop it). Returns the seconds it took."""
        cfg = self.cfg
        start = time.perf_counter()
        with self._synchronised():
            check_replicas(self.model.named_parameters(), self.info.world_size,
                           f"step {self.step} (epoch {self.step / len(self.loader):.3g})",
                           f"Look at the exchange (scheme={cfg.scheme.name}, aggregation={cfg.aggregation.name}): "
                           f"with AllReduce a compressor must draw the same positions on every rank "
                           f"(shared_positions=True promises it; one that picks them from the rank's own "
                           f"gradient sets it to False), and a memory or sync must apply what every rank "
                           f"decoded (docs/own_compressor.md)")
        return time.perf_counter() - start

    def _curve_point(self) -> float:
        """Score the validation subset now (a ``curve`` record); returns the seconds it took."""
        start = time.perf_counter()
        with self._synchronised():
            point = self.evaluator.curve_point(self.cfg.train.get("curve_size"))
        took = time.perf_counter() - start
        self.curve_s += took
        self.last_curve_accuracy = point["accuracy"]
        self.record.log_curve(self.step, self.step / len(self.loader), point, took)
        return took

    def _reached_target(self, train_s: float) -> None:
        """Whether the curve point just taken reached ``train.stop_at_accuracy`` (every rank
        reads the same all-reduced accuracy, so all stop together): ``reached`` notes what a
        user timing the run would see: the step, the training time (curve points left out), the
        curve points' time, and the wall-clock time since this process started: None for a
        resumed run, whose earlier processes' start-ups and the work redone after their last
        checkpoint have no one wall time (its ``train_s`` holds)."""
        if self.target is not None and self.reached is None and self.last_curve_accuracy >= self.target:
            self.reached = {"step": self.step, "epoch": self.step / len(self.loader),
                            "val_accuracy": self.last_curve_accuracy, "train_s": train_s,
                            "curve_s": self.curve_s,
                            "wall_s": None if self.resumed else process_age_s()}

    def _target_summary(self) -> dict | None:
        if self.target is None:
            return None
        return {"accuracy": self.target, "reached": self.reached is not None, **(self.reached or {})}

    def _synchronised(self):
        """The model every rank agrees on, for evaluation and ``model.pt``: itself, except where
        the ranks' models part between synchronisations (local SGD, DiLoCo: the last synchronised
        one, ``comm.periodic.PeriodicSync.synchronised``)."""
        return self.reducer.synchronised()

    def _stops_here(self) -> bool:
        """The run stops at this step, mid-epoch or not: ``train.max_steps`` hit, or
        ``train.stop_at_accuracy`` reached."""
        return (self.cfg.train.max_steps is not None and self.step >= self.cfg.train.max_steps) \
            or self.reached is not None

    def _finished(self) -> bool:
        return self._stops_here() or self.epoch >= self.cfg.train.epochs

    def _ends_run(self) -> bool:
        """Whether the epoch being closed is the run's last (checked before ``_end_epoch``)."""
        full = self.batch_in_epoch >= len(self.loader)
        return self._stops_here() or (full and self.epoch + 1 >= self.cfg.train.epochs)

    def _preempt(self, signum: int) -> None:
        """Save the checkpoint at this step and stop every rank (the launcher says how to resume)."""
        self.save_checkpoint()
        name = signal.Signals(signum).name
        raise Preempted(f"{name} at step {self.step}: checkpoint saved; rerun into this folder to "
                        "resume", signum=signum)

    def _progress(self):
        cfg = self.cfg
        if not (self.info.is_main and cfg.train.progress and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        total = len(self.loader) * cfg.train.epochs
        if cfg.train.max_steps is not None:
            total = min(total, cfg.train.max_steps)
        return tqdm(total=total, initial=self.step, unit="step", dynamic_ncols=True, leave=False)
