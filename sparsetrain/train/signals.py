"""Stop signals while training: save a checkpoint at the step, then let the launcher act.

- SIGTERM (preemption, ``scancel``, ``kill``) and SIGINT (Ctrl-C, which the terminal sends to the
  launcher and every rank) on every launcher;
- under SLURM also submitit's preemption signal (SIGUSR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` says
  otherwise; ``launch.env`` reads it into ``RankInfo.preempt_signal``), which SLURM sends
  ``signal_delay_s`` before a time limit or on preemption.

The handler only records the signal; the loop notices it at its next logged step or epoch end,
every rank agrees, the checkpoint is saved and the loop raises ``Preempted``. Then ``pass_on``
hands the signal to the handler that was installed before (submitit's: rank 0 requeues the job and
exits), so a requeued job resumes from the step where it stopped, not from the last epoch.
``received()`` tells a rank's process, after training, that a signal came (see launch.spawn).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

_received: signal.Signals | None = None  # the first stop signal this process got while training


def _signal(name: str) -> signal.Signals:
    name = name.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    return getattr(signal.Signals, name, signal.SIGUSR2)


def received() -> signal.Signals | None:
    """The first stop signal this process received while a ``StopSignals`` was installed."""
    return _received


class StopSignals:
    """Handle SIGTERM and SIGINT, plus ``preempt_signal`` (a name such as ``USR2``) when given."""

    def __init__(self, on_signal: Callable, preempt_signal: str | None = None):
        self._on_signal = on_signal
        self.signals = [signal.SIGTERM, signal.SIGINT]
        if preempt_signal:
            self.signals.append(_signal(preempt_signal))
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        global _received
        if self.received is None:
            self.received = signal.Signals(signum)
            _received = _received or self.received
        self._on_signal(signum, frame)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def pass_on(self) -> None:
        """After the checkpoint is safe: give the received signal to the previous handler, if it
        was a Python function (submitit's requeue on SLURM); not the default action, and not
        Python's SIGINT handler (a KeyboardInterrupt would hide the Preempted being raised)."""
        if self.received is None:
            return
        handler = self._previous.get(self.received)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(int(self.received), None)
