"""Every error a user reads, and how it is written: one line. Imports nothing from the project.

- ``ConfigError``: a bad key value or combination, refused before (or while) ranks start;
  ``RunFolderInUse``: the run folder is held by a run training there now.
- ``CheckpointError``: a checkpoint that cannot be written, read or resumed.
- ``Preempted``: a stop signal arrived; the loop saved a checkpoint and stopped.
- ``Diverged``: the training loss became inf or NaN on some rank; every rank stopped.
- ``ReplicasDiffer``: the ranks' models differ where every rank must hold the same one; every
  rank stopped.

``one_line_error`` turns any exception into the line that ``summary.json`` and the console show;
``print_error`` prints such a line on stderr.
"""

from __future__ import annotations

import re
import sys


class ConfigError(ValueError):
    """A bad key value or combination; its message is the single line the user sees."""


class RunFolderInUse(ConfigError):
    """Another process is training in the run folder now: a second one would interleave its
    metrics.jsonl, checkpoints and summary with the first's. Nothing in the folder is touched."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or resumed; the message says which and why."""


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGINT, SLURM's preemption signal) arrived: the loop saved a
    checkpoint and stops. ``signum`` is the signal, so the launcher can exit with 128 + it."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


class Diverged(RuntimeError):
    """The training loss became inf or NaN on some rank; every rank stops at the same check."""


class ReplicasDiffer(RuntimeError):
    """The ranks' models differ beyond rounding where every rank must hold the same one (an
    epoch's end): each rank applied another update, so an evaluation sharded over them would
    score a mixture of models. Every rank stops at the same check."""


# "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] " and the like: the
# source position of a C++ check, noise to a user.
_SOURCE_POSITION = re.compile(r"^\[[^\]\s]*\.(?:cc|cpp|h|hpp|c):\d+\]\s*")


def one_line_error(exc: BaseException) -> str:
    """``Type: first line of the message``: what summary.json and the console show."""
    text = str(exc).strip().splitlines()
    first = _SOURCE_POSITION.sub("", text[0]) if text else ""
    return f"{type(exc).__name__}: {first}"


def print_error(msg: str) -> None:
    """``error: <msg>`` on stderr, flushed: how the command line reports a failure."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
