"""Training: ``step`` (the one train step, shared with every benchmark), ``trainer`` (the loop
over built components), ``schedule`` (learning rate), ``checkpoint``, ``signals`` (stop signals)."""

from sparsetrain.errors import Diverged, Preempted
from sparsetrain.train.schedule import lr_at
from sparsetrain.train.step import StepResult, TrainStep
from sparsetrain.train.trainer import Trainer, _to_cpu  # noqa: F401  (_to_cpu: tests)

__all__ = ["Diverged", "Preempted", "StepResult", "TrainStep", "Trainer", "lr_at", "worker_main"]


def __getattr__(name: str):
    if name == "worker_main":  # its old home; a rank's entry point lives in launch.worker now
        from sparsetrain.launch.worker import worker_main

        return worker_main
    raise AttributeError(f"module 'sparsetrain.train' has no attribute {name!r}")
