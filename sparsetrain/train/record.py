"""The run record: what a run leaves in its folder (rank 0 writes; every rank calls the same
methods, other ranks' calls do nothing but take part in the collectives).

- ``summary.json``: ``running`` from ``start``, then ``completed`` or ``failed`` with the fields
  docs/results_files.md lists (``results.RunWriter`` writes it atomically);
- ``metrics.jsonl``: a record per logged step and per epoch (and the same to W&B);
- ``heartbeat.json`` while the loop runs (``results.Heartbeat``);
- ``checkpoint.pt``: every rank's own state (``PER_RANK_STATE``) gathered, one file written
  atomically by rank 0 (``train.checkpoint``); read back, checked, by ``load_checkpoint``;
- ``model.pt`` (``train.save_model``).
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from sparsetrain.compress import kernels
from sparsetrain.errors import one_line_error
from sparsetrain.provenance import code_version, compressor_code, describe, host, scheme_targets
from sparsetrain.rank import RankInfo
from sparsetrain.results import (
    METRICS,
    PHASES,
    STABILITY_FROM_STEP,
    Heartbeat,
    NullWriter,
    RunWriter,
    echo,
    logged_losses,
    relative_run_dir,
    stability_of,
    write_test_predictions,
)
from sparsetrain.scheme_catalog import is_dense
from sparsetrain.tracking import NullTracker, make_tracker
from sparsetrain.train import checkpoint as ckpt
from sparsetrain.train.build import Parts
from sparsetrain.train.tally import Tally

# What differs between ranks and is saved for each: error-feedback memory, local epoch sums, the
# rank's GPU generator (CUDA runs)
PER_RANK_STATE = ("reducer", "epoch_stats", "recent_losses", "cuda_rng")
# ... and, where the ranks' models part between synchronisations (local SGD, DiLoCo: the
# reducer's ``ranks_diverge``), each rank's model and optimizer too
DIVERGING_STATE = ("model", "optimizer")


class RunRecord:
    """The files of the run in ``run_dir``, written from the built ``parts`` (reducer, timer,
    loader, data, optimizer) and the steps' ``tally``."""

    def __init__(self, cfg: Any, info: RankInfo, run_dir: str | Path, device: torch.device,
                 parts: Parts, tally: Tally):
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(run_dir)
        self.device = device
        self.parts = parts
        self.tally = tally
        self.writer = RunWriter(run_dir) if info.is_main else NullWriter()
        self.tracker = NullTracker()
        self.wandb_id: str | None = None  # rank 0's W&B run: a resumed run goes on in it
        self.heartbeat: Heartbeat | None = None
        self.records_logged = 0
        self.last_eval: dict[str, float] = {}
        self.last_train_loss: float | None = None
        # Which code this run runs, and every version a resumed run ran on (sparsetrain.provenance)
        self.code = code_version()
        self.code_commits = [describe(self.code, full=True)]
        # ... the source of the scheme's own classes outside sparsetrain (compressor, memory, sync),
        # so that two versions of it are never averaged, and every version a resumed run ran on
        scheme = OmegaConf.to_container(cfg.scheme, resolve=True) if "scheme" in cfg else {}
        self.own_code = compressor_code(scheme_targets(scheme))
        self.own_code_versions = [self.own_code["digest"]] if self.own_code else []
        # ... and on which machine (rank 0's): every one a resumed run ran on, with what sets a
        # step's time there besides the configuration: torch's threads a rank (launch.worker; one
        # against two changed a step 5.5-6x) and the collectives' backend
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
        self.hosts = [{**host(), "torch": str(torch.__version__), "gpu": gpu,  # str: a checkpoint loads with weights_only
                       "threads": torch.get_num_threads(), "backend": backend and str(backend)}]

    # ---- checkpoints -------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / ckpt.CHECKPOINT

    def state_dict(self) -> dict:
        return {"records_logged": self.records_logged, "last_eval": dict(self.last_eval),
                "code": self.code, "code_commits": list(self.code_commits), "hosts": list(self.hosts),
                ckpt.OWN_CODE: self.own_code, "compressor_code_versions": list(self.own_code_versions),
                "wandb_id": self.wandb_id}

    def load_state_dict(self, state: dict) -> None:
        self.records_logged = state["records_logged"]
        self.last_eval = dict(state["last_eval"])
        self.wandb_id = state.get("wandb_id")
        # The versions it ran on, then this one (check_same_code has refused a change unless allowed)
        here = describe(self.code, full=True)
        self.code_commits = _then(state.get("code_commits", []), here)
        self.hosts = _then(state.get("hosts", []), self.hosts[-1])  # likewise the machines
        # ... and one's own classes' versions (check_same_own_code has refused a change unless allowed)
        saved = state.get("compressor_code_versions", [])
        self.own_code_versions = _then(saved, self.own_code["digest"]) if self.own_code else list(saved)

    def save_checkpoint(self, state: dict) -> None:
        """Every rank contributes its own ``PER_RANK_STATE`` of ``state``; rank 0 writes one file."""
        # On the CPU: all_gather_object pickles, and a CUDA tensor would be unpickled on rank 0
        # onto the sender's GPU (cuda:1 in rank 0's process), where it has no business being.
        keys = PER_RANK_STATE + (DIVERGING_STATE if self.parts.reducer.ranks_diverge else ())
        own = {key: _to_cpu(state.pop(key)) for key in keys if key in state}
        gathered = [own]
        if self.info.world_size > 1:
            gathered = [None] * self.info.world_size
            dist.all_gather_object(gathered, own)
        state["per_rank"] = gathered
        state["config"] = OmegaConf.to_container(self.cfg, resolve=True)  # resume checks it
        if self.info.is_main:
            ckpt.save(state, self.checkpoint_path)  # atomic; a full disk keeps the old one

    def load_checkpoint(self) -> dict | None:
        """This rank's state from the run folder's checkpoint, once it is known to be this run's
        on this code (or ``train.allow_code_change``); None where there is none to resume."""
        if not (self.cfg.train.checkpoint and self.checkpoint_path.exists()):
            return None
        state = ckpt.load(self.checkpoint_path, map_location=self.device)
        ckpt.check_same_run(state.pop("config", None), OmegaConf.to_container(self.cfg, resolve=True),
                            self.checkpoint_path)
        ckpt.check_same_code(state.pop("code", None), self.code, self.cfg.train.allow_code_change,
                             self.checkpoint_path)
        if ckpt.OWN_CODE in state:  # checkpoints written before it was kept: not checked
            ckpt.check_same_own_code(state.pop(ckpt.OWN_CODE), self.own_code,
                                     self.cfg.train.allow_code_change, self.checkpoint_path)
        state.update(state.pop("per_rank")[self.info.rank])
        return state

    # ---- the run's start and end -----------------------------------------------------------
    def start(self, step: int, resumed: bool, step_fn: Callable[[], int]) -> None:
        """``summary.json`` says running; ``metrics.jsonl`` keeps what the checkpoint had seen;
        W&B and the heartbeat (reading the step through ``step_fn``) start."""
        red = self.parts.reducer
        config = OmegaConf.to_container(self.cfg, resolve=True)
        self.writer.open_metrics(keep_records=self.records_logged if resumed else None)
        self.writer.start(
            config=config,
            run_dir=relative_run_dir(self.run_dir),
            world_size=self.info.world_size,
            launcher=self.info.launcher,
            link=self.info.link,  # launch.netcluster's emulated link (None off it)
            device=str(self.device),
            num_parameters=red.numel,
            num_classes=self.parts.data.num_classes,
            bytes_sent_per_step=red.bytes_sent_per_step,
            wire_bytes_per_step=self.tally.wire_bytes(red.collective, red.bytes_sent_per_step, red.bytes_by_collective),
            dense_bytes_per_step=red.dense_bytes_per_step,
            **self._exchange_fields(),
            resumed_from_step=step if resumed else None,
            code=self.code,
            code_commits=self.code_commits,
            # the scheme's out-of-tree classes' source, so that two versions of it are never averaged
            compressor_code=self.own_code,
            compressor_code_versions=list(self.own_code_versions) or None,
            hosts=self.hosts,
            kernels=kernels.backend(),  # the quantizers' CPU kernels: numba's, or the numpy paths
            slurm_job_id=self.info.slurm_job_id,
        )
        if self.info.is_main:
            self.tracker = make_tracker(dict(config["wandb"]), config, str(self.run_dir), self.run_dir.name,
                                        run_id=self.wandb_id)
            self.wandb_id = self.tracker.run_id
            self.heartbeat = Heartbeat(self.run_dir, step_fn).start()

    def stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def _load(self) -> dict:
        """The node's load while the run trained (rank 0's heartbeat): {} off rank 0."""
        if self.heartbeat is None:
            return {}
        return {"load": self.heartbeat.load(self.info.local_world_size)}

    def fail(self, exc: BaseException, step: int, elapsed_s: float) -> None:
        self.writer.finish("failed", error=one_line_error(exc), **self._summary_fields(step, elapsed_s),
                           **self._load())
        self.tracker.finish(self.writer.summary, failed=True)

    def save_model(self, model: torch.nn.Module) -> None:
        """``model.pt`` if asked for: the model the final evaluation scored, saved while it is
        (inside the same ``synchronised()``: local SGD restores each rank's own buffers on leaving
        it, and with ``train.bn_recalibrate`` those were not the scored ones)."""
        if self.cfg.train.save_model and self.info.is_main:
            torch.save(model.state_dict(), self.run_dir / "model.pt")

    def complete(self, step: int, elapsed_s: float, curve_s: float = 0.0, target: dict | None = None) -> dict:
        """``summary.json`` completed; the checkpoint goes (a finished run needs no resume point).
        ``target``: ``train.stop_at_accuracy`` and when it was reached. Returns the summary
        (rank 0's; empty on other ranks)."""
        self.writer.finish("completed", **self._summary_fields(step, elapsed_s, reduce=True),
                           curve_s=curve_s, curve_share=curve_s / (elapsed_s + curve_s) if elapsed_s + curve_s else None,
                           **({"target": target} if target is not None else {}), **self._load())
        self.tracker.finish(self.writer.summary)
        if self.info.is_main and self.checkpoint_path.exists():
            self.checkpoint_path.unlink()
        return self.writer.summary

    def save_test_predictions(self, predicted: torch.Tensor | None, label: torch.Tensor, num_classes: int) -> None:
        """``test_predictions.npz`` (``sparsetrain.results.TEST_PREDICTIONS``), rank 0 only."""
        if self.info.is_main and predicted is not None:
            write_test_predictions(self.run_dir, predicted.numpy(), label.cpu().numpy(), num_classes)

    # ---- metrics ---------------------------------------------------------------------------
    def log_step(self, step: int, loss: torch.Tensor, stats: Any, lr: float | None) -> None:
        self._emit({
            "kind": "step",
            "step": step,
            "epoch": step / len(self.parts.loader),
            "lr": lr,
            "train_loss": loss.item(),
            "time_ms": dict(self.parts.timer.last),
            "bytes_sent": stats.bytes_sent,
            "wire_bytes": self.tally.wire_bytes(stats.collective, stats.bytes_sent, stats.bytes_by_collective),
            "density": stats.density,
            "compression_error": stats.compression_error,
            "memory_norm": stats.memory_norm,
            "compressing": step > self.parts.reducer.warmup_steps,
        }, step)

    def log_epoch(self, epoch: float, step: int, train_loss: float | None,
                  train_accuracy: float | None, elapsed_s: float) -> None:
        """The epoch's record (with ``last_eval``) and rank 0's line on the console."""
        self.last_train_loss = train_loss
        record = {
            "kind": "epoch",
            "epoch": epoch,
            "step": step,
            "train_loss": train_loss,
            "train_accuracy": train_accuracy,
            **self.last_eval,
            "lr": self.parts.optimizer.param_groups[0]["lr"],
            "elapsed_s": elapsed_s,
        }
        self._emit(record, step)
        if self.info.is_main:
            acc = self.last_eval.get("test_accuracy", float("nan"))
            val = self.last_eval.get("val_accuracy")
            val = f"val_acc {val:.4f} | " if val is not None else ""
            echo(  # through tqdm: never into the progress bar's line
                f"epoch {epoch:.3g} | step {step} | train_loss {train_loss:.4f} | {val}test_acc {acc:.4f} | "
                f"{self.parts.timer.means().get('step', float('nan')):.1f} ms/step",
            )

    def log_curve(self, step: int, epoch: float, point: dict, seconds: float) -> None:
        """One accuracy-curve point (``train.curve_points``): the validation subset's accuracy and
        loss at ``step``, and how long scoring it took."""
        self._emit({"kind": "curve", "step": step, "epoch": epoch, "split": "val", "size": point["size"],
                    "accuracy": point["accuracy"], "loss": point["loss"], "eval_ms": 1e3 * seconds}, step)

    def _emit(self, record: dict, step: int) -> None:
        self.writer.log(record)
        self.records_logged += 1
        # W&B merges what is logged at one step: epoch metrics get their own prefix.
        prefix = "" if record["kind"] == "step" else f"{record['kind']}/"
        self.tracker.log({f"{prefix}{k}": v for k, v in record.items() if k != "kind"}, step=step)

    # ---- summary.json's fields -------------------------------------------------------------
    def _phase_means_of_ranks(self, means: dict) -> dict | None:
        """``{phase: [rank 0's mean ms, rank 1's, ...]}``; None for one rank. ``time_ms`` is rank
        0's alone, and the wait for the slowest rank shows only as other ranks' longer exchange.
        A collective (every rank calls it; only a completing run, whose ranks still meet)."""
        if self.info.world_size < 2 or not dist.is_initialized():
            return None
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor([float(means.get(p, 0.0)) for p in PHASES], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(self.info.world_size)]
        dist.all_gather(gathered, mine)
        rows = [t.cpu().tolist() for t in gathered]
        return {phase: [row[i] for row in rows] for i, phase in enumerate(PHASES)}

    def _exchange_fields(self) -> dict:
        """What the exchange sends once compression runs, and when it started."""
        red = self.parts.reducer
        return {
            "density": red.density,  # entries sent / entries, uncompressed tensors included
            "uncompressed_bytes_per_step": red.uncompressed_bytes_per_step,
            "uncompressed_share": red.uncompressed_bytes_per_step / red.bytes_sent_per_step,
            "compression_start_step": red.warmup_steps if not is_dense(self.cfg.scheme.name) else None,
            # what carries the exchange once it compresses, and which of the run's axes change
            # what is sent: the compressor's own word, so the analysis needs no list of schemes
            "collective": red.collective,
            "applies": {"ratio": bool(red.ratio_applies), "aggregation": bool(red.aggregation_applies),
                        "scope": bool(red.scope_applies)},
        }

    def _logged_losses(self) -> list[tuple[int, float]]:
        """The logged steps' losses in rank 0's metrics.jsonl (written line by line, so complete
        up to now), which the blow-up rule reads beside the peak; none on other ranks."""
        run_dir = getattr(self.writer, "run_dir", None)
        return logged_losses(Path(run_dir) / METRICS) if run_dir is not None else []

    def _summary_fields(self, step: int, elapsed_s: float, reduce: bool = False) -> dict:
        """``reduce``: the ranks still meet (a completing run), so the final loss is every rank's."""
        timer, tally = self.parts.timer, self.tally
        means = timer.means()
        on_cuda = self.device.type == "cuda"
        peak_mb = (
            torch.cuda.max_memory_allocated(self.device) / 2**20
            if on_cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        peaks = tally.peaks()
        final_loss = tally.final_loss(reduce=reduce)
        ranks_ms = self._phase_means_of_ranks(means) if reduce else None
        ev = self.last_eval
        # "did not train" reads the end of training and, where there is a split, validation
        chosen_on = ev.get("val_accuracy", ev.get("test_accuracy"))
        sync = self.parts.reducer.sync_summary()  # local SGD / DiLoCo
        buckets = self.parts.reducer.overlap_buckets  # an exchange inside backward
        red = self.parts.reducer
        # a sync on a schedule of its own: the sizes per step measured, not a period's
        measured = {"bytes_sent_per_step": red.bytes_sent_per_step,
                    "wire_bytes_per_step": tally.wire_bytes(red.collective, red.bytes_sent_per_step,
                                                            red.bytes_by_collective),
                    **self._exchange_fields()} if (sync or {}).get("schedule") == "own" else {}
        return {
            **measured,
            **({"sync": sync} if sync is not None else {}),  # a synchronisation's bytes and time
            "steps": step,
            "epochs": step / len(self.parts.loader),
            "train_loss": self.last_train_loss,  # the last epoch's mean
            "train_loss_final": final_loss,  # the mean over the last train_loss_final_steps steps
            "train_loss_final_steps": len(tally.recent_losses),
            "val_accuracy": ev.get("val_accuracy"),
            "val_loss": ev.get("val_loss"),
            "val_size": len(self.parts.data.val_y) if self.parts.data.has_validation else 0,
            "test_accuracy": ev.get("test_accuracy"),
            "train_loss_peak": peaks,
            "stability": stability_of(final_loss if final_loss is not None else self.last_train_loss,
                                      chosen_on, peaks[f"after_step_{STABILITY_FROM_STEP}"]["train_loss"],
                                      num_classes=self.parts.data.num_classes,
                                      peak_step=peaks[f"after_step_{STABILITY_FROM_STEP}"]["step"],
                                      logged=self._logged_losses()),
            "test_loss": ev.get("test_loss"),
            "time_ms": {phase: means.get(phase, 0.0) for phase in PHASES},
            # every rank's, where several ran: synchronous steps go at the slowest rank's pace
            "time_ms_ranks": ranks_ms,
            "timed_steps": timer.counted_steps,
            "peak_memory_mb": peak_mb,
            "peak_memory_of": "cuda_max_allocated" if on_cuda else "process_max_rss",
            "bytes_sent_total": tally.bytes_sent_total,
            "wire_bytes_total": tally.wire_bytes_total,
            "memory_norm_max": tally.memory_norm_max,  # None: never measured (dense, torch's hooks)
            # per bucket of an exchange inside backward: its share of the entries, and how long
            # before backward's end it started (None: the exchange runs after backward)
            "overlap_buckets": [{"share": share, "lead_ms": lead} for share, lead in buckets] if buckets else None,
            "test_accuracy_running_bn": self.last_eval.get("test_accuracy_running_bn"),
            "duration_s": elapsed_s,
        }


def _then(history: list, here) -> list:
    """``history`` (what a checkpoint recorded; empty from before it did), then ``here`` unless
    it is already the last."""
    return [*history] if history and history[-1] == here else [*history, here]


def _to_cpu(obj):
    """``obj`` with every tensor in it (nested dicts, lists, tuples) copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
