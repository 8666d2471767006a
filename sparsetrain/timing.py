"""Per-phase wall-clock timers for a training step.

Phases are timed at their boundaries: on CUDA the device is synchronised at each boundary so
that a phase's time is the work it launched, on CPU ``time.perf_counter`` suffices. The first
``warmup_steps`` steps (allocator, cudnn autotune, lazy inits) are left out of the means.
Timers only read clocks: they never change what a step computes.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from sparsetrain.results import PHASES  # noqa: F401  (the run-folder schema owns the names)


class PhaseTimer:
    """``with timer.phase("backward"): ...`` inside ``timer.step()`` blocks.

    >>> timer = PhaseTimer(torch.device("cpu"), warmup_steps=0)
    >>> with timer.step():
    ...     with timer.phase("forward"):
    ...         pass
    >>> sorted(timer.last)
    ['forward', 'step']
    """

    def __init__(self, device: torch.device | str = "cpu", warmup_steps: int = 2):
        self.device = torch.device(device)
        self.warmup_steps = warmup_steps
        self.steps_seen = 0  # since the run began (a resumed run's earlier processes included)
        # ... and in this process: the warm-up is each process's own (a resumed run's first steps
        # allocate, autotune and compile again), so it is skipped again after a resume
        self.steps_this_process = 0
        self._left_out = False  # the step under way stays out of the means (``leave_out``)
        self.last: dict[str, float] = {}
        self.last_untimed_ms = 0.0  # time spent in ``untimed`` blocks during the last step
        self._sum: dict[str, float] = defaultdict(float)
        self._count = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def _clock(self, add):
        """Milliseconds between two synchronised boundaries, handed to ``add``."""
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            add((time.perf_counter() - t0) * 1e3)

    def _add_phase(self, name: str, ms: float) -> None:
        self.last[name] = self.last.get(name, 0.0) + ms

    def _add_untimed(self, ms: float) -> None:
        self.last_untimed_ms += ms

    def phase(self, name: str):
        return self._clock(lambda ms: self._add_phase(name, ms))

    def move(self, source: str, target: str, ms: float) -> None:
        """Reassign ``ms`` of the current step from phase ``source`` to ``target`` (at most what
        ``source`` holds): the DDP path splits its backward phase into the compression and the
        exchange that ran inside it. The step's total is unchanged.

        >>> timer = PhaseTimer("cpu", warmup_steps=0)
        >>> with timer.step():
        ...     timer.last["backward"] = 10.0
        ...     timer.move("backward", "exchange", 4.0)
        >>> timer.last["backward"], timer.last["exchange"]
        (6.0, 4.0)
        """
        ms = max(0.0, min(ms, self.last.get(source, 0.0)))
        self.last[source] = self.last.get(source, 0.0) - ms
        self._add_phase(target, ms)

    def take_out(self, source: str, ms: float) -> None:
        """``ms`` of phase ``source`` were work that is not part of the step (``untimed``,
        measured where this timer could not be used: inside DDP's hook, within backward):
        out of the phase and of the step, as ``untimed`` would have left them.

        >>> timer = PhaseTimer("cpu", warmup_steps=0)
        >>> timer.last = {"backward": 10.0}
        >>> timer.take_out("backward", 4.0)
        >>> timer.last["backward"], timer.last_untimed_ms
        (6.0, 4.0)
        """
        ms = max(0.0, min(ms, self.last.get(source, 0.0)))
        self.last[source] = self.last.get(source, 0.0) - ms
        self._add_untimed(ms)

    def untimed(self):
        """Work inside a step that is not part of it (statistics for the log): timed apart and
        left out of the step's time; in no phase. On CUDA the device is synchronised at both
        ends, like a phase boundary.

        >>> import time
        >>> timer = PhaseTimer("cpu", warmup_steps=0)
        >>> with timer.step():
        ...     with timer.untimed():
        ...         time.sleep(0.05)
        >>> timer.last["step"] < 50 <= timer.last_untimed_ms
        True
        """
        return self._clock(self._add_untimed)

    @contextmanager
    def step(self):
        """Times one whole step; phases inside it accumulate into ``last``; ``untimed`` blocks
        are subtracted from the step."""
        self.last = {}
        self.last_untimed_ms = 0.0
        with self.phase("step"):
            yield
        self.last["step"] -= self.last_untimed_ms
        counted = self.counting and not self._left_out
        self._left_out = False
        self.steps_seen += 1
        self.steps_this_process += 1
        if counted:
            self._count += 1
            for name, ms in self.last.items():
                self._sum[name] += ms

    def leave_out(self) -> None:
        """The step under way ran another path than the run's other steps (a fast-path run's
        logged step measures its compression error on the torch path): its time stays in its
        record (``last``) and out of the means."""
        self._left_out = True

    @property
    def counting(self) -> bool:
        """Whether the step under way (or the next one) counts in the means: past this process's
        warm-up."""
        return self.steps_this_process >= self.warmup_steps

    @property
    def counted_steps(self) -> int:
        return self._count

    def means(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase, over the steps after warm-up.

        A phase that ran in only some counted steps is averaged over all counted steps, so the
        phases add up to the step time. Falls back to all steps when every step was warm-up.
        """
        if self._count == 0:
            return {name: ms for name, ms in self.last.items()}
        return {name: total / self._count for name, total in self._sum.items()}

    def state_dict(self) -> dict:
        return {"steps_seen": self.steps_seen, "sum": dict(self._sum), "count": self._count}

    def load_state_dict(self, state: dict) -> None:
        """The means so far; this process's warm-up is skipped afresh (``steps_this_process``)."""
        self.steps_seen = state["steps_seen"]
        self.steps_this_process = 0
        self._sum = defaultdict(float, state["sum"])
        self._count = state["count"]


class NullTimer:
    """A timer that times nothing: for code that runs outside a timed step (the DDP hook, inside
    backward, is timed from outside by ``train.ddp_exchange``)."""

    def phase(self, name: str):
        return nullcontext()

    def untimed(self):
        return nullcontext()

    def leave_out(self) -> None:
        pass


NULL_TIMER = NullTimer()


class BucketClock:
    """When each bucket of an exchange overlapped with backward (DDP's hook, the dense reducer's
    bucketed AllReduce) was handed to its collective: what the cost model needs to tell how much
    of the exchange backward hides (``costmodel.exposed_ms``).

    ``mark(numel)`` at each handoff, in launch order; ``close()`` at the step's end turns the
    step's handoffs into leads: how long before the last handoff (the end of backward's compute,
    whose last gradients fill the last bucket) each bucket could start. The first ``skip`` steps
    (allocator, DDP's bucket rebuild) are left out. ``means()``: per bucket its share of the
    entries and its mean lead in ms, over the steps closed since the buckets last changed.
    Reads clocks only.

    >>> ticks = iter([0.0, 0.030, 0.040])
    >>> clock = BucketClock(skip=0, now=lambda: next(ticks))
    >>> for numel in (600, 300, 100):
    ...     clock.mark(numel)
    >>> clock.close()
    >>> [(round(share, 3), round(lead, 3)) for share, lead in clock.means()]
    [(0.6, 40.0), (0.3, 10.0), (0.1, 0.0)]
    """

    def __init__(self, skip: int = 2, now=time.perf_counter):
        self.skip, self.now = skip, now
        self._marks: list[tuple[float, int]] = []
        self._numels: tuple[int, ...] = ()
        self._lead_sum: list[float] = []
        self.steps = 0
        self._closed = 0

    def mark(self, numel: int) -> None:
        self._marks.append((self.now(), int(numel)))

    def close(self) -> None:
        marks, self._marks = self._marks, []
        if not marks:
            return
        self._closed += 1
        if self._closed <= self.skip:
            return
        numels = tuple(n for _, n in marks)
        if numels != self._numels:  # new buckets: what was averaged no longer applies
            self._numels, self._lead_sum, self.steps = numels, [0.0] * len(marks), 0
        last = marks[-1][0]
        for i, (t, _) in enumerate(marks):
            self._lead_sum[i] += (last - t) * 1e3
        self.steps += 1

    def means(self) -> list[tuple[float, float]] | None:
        """``[(share of the entries, mean lead ms), ...]`` in launch order; None before a step."""
        if not self.steps:
            return None
        total = sum(self._numels)
        return [(n / total, lead / self.steps) for n, lead in zip(self._numels, self._lead_sum)]


def process_age_s() -> float | None:
    """Seconds since this process started, as a user timing its launch would count them
    (interpreter start-up and imports included): Linux's ``/proc`` (10 ms resolution); None
    elsewhere.

    >>> 0 < process_age_s() < 3600 * 24
    True
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
