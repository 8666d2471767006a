"""Training: ``step`` (the one train step, shared with every benchmark), ``trainer`` (the loop),
``build`` (the run's parts from the config; ``components``: the exchange and optimizer, shared with
every benchmark), ``tally`` (what the steps add up to), ``stop`` (stop agreement), ``evaluate``
(test set, batch-norm recalibration), ``record`` (the run folder's files), ``schedule`` (learning
rate), ``checkpoint`` (the file), ``signals`` (stop signals), ``ddp_exchange`` (``dist.ddp``)."""

from sparsetrain.errors import Diverged, Preempted
from sparsetrain.train.schedule import lr_at
from sparsetrain.train.step import StepResult, TrainStep
from sparsetrain.train.trainer import Trainer

__all__ = ["Diverged", "Preempted", "StepResult", "TrainStep", "Trainer", "lr_at"]
