"""Training: ``step`` (the one train step, shared with every benchmark), ``trainer`` (the loop
over built components), ``schedule`` (learning rate), ``checkpoint``, ``signals`` (stop signals)."""

from sparsetrain.errors import Diverged, Preempted
from sparsetrain.train.schedule import lr_at
from sparsetrain.train.step import StepResult, TrainStep
from sparsetrain.train.trainer import Trainer

__all__ = ["Diverged", "Preempted", "StepResult", "TrainStep", "Trainer", "lr_at"]
