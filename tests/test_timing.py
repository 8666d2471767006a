"""The phase timer across a resume, the checks inside DDP's hook, and the time to a target of a
resumed run (audit 3: each came out wrong without a word)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from sparsetrain.timing import PhaseTimer
from sparsetrain.train.trainer import Trainer


def _steps(timer: PhaseTimer, seconds: list[float]) -> None:
    for s in seconds:
        with timer.step(), timer.phase("forward"):
            time.sleep(s)


def test_a_resumed_timer_skips_its_new_processs_warm_up_again():
    """A resumed process allocates, autotunes and compiles again: its first steps are warm-up
    as a fresh run's are. Restoring the count of steps seen counted them (2 -> 7 ms a step in
    the audit's run)."""
    first = PhaseTimer("cpu", warmup_steps=2)
    _steps(first, [0.05, 0.05, 0.001, 0.001, 0.001])
    before, counted = first.means()["forward"], first.counted_steps
    assert counted == 3

    resumed = PhaseTimer("cpu", warmup_steps=2)
    resumed.load_state_dict(first.state_dict())
    _steps(resumed, [0.05, 0.05])  # the new process's cold steps
    assert resumed.counted_steps == counted and resumed.means()["forward"] == before
    assert resumed.counting  # past its warm-up now: the next step counts
    _steps(resumed, [0.001])
    assert resumed.counted_steps == counted + 1 and resumed.steps_seen == 8


def _reaching(resumed: bool) -> SimpleNamespace:
    return SimpleNamespace(target=0.5, reached=None, last_curve_accuracy=0.6, step=10,
                           loader=[0] * 5, curve_s=1.0, resumed=resumed)


def test_the_wall_time_to_a_target_is_none_for_a_resumed_run():
    """``wall_s`` is the process's age: for a resumed run that is the last process's alone (its
    earlier ones and the work they redid are not in it), so it is left out; ``train_s`` holds."""
    fresh, resumed = _reaching(False), _reaching(True)
    Trainer._reached_target(fresh, 3.0)
    Trainer._reached_target(resumed, 3.0)
    assert fresh.reached["wall_s"] > 0 and fresh.reached["train_s"] == 3.0
    assert resumed.reached["wall_s"] is None and resumed.reached["train_s"] == 3.0
    assert resumed.reached["step"] == 10 and resumed.reached["epoch"] == 2


def test_the_checks_inside_ddps_hook_are_out_of_the_step():
    """Inside DDP's hook the reducer's once-only checks (the decode check before the first
    compressed step, the kept-state snapshot) were timed as compression: the hook's clock now
    keeps them apart, and the trainer takes them out of backward and of the step."""
    from sparsetrain.comm.ddp_hook import _ExchangeClock
    from sparsetrain.comm.sparse import SparseReducer
    from sparsetrain.compress import TopK
    from sparsetrain.train.ddp_exchange import DDPExchange

    sizes = [300, 40]
    red = SparseReducer(TopK(0.1, sizes), aggregation="allgather", world_size=1, rank=0, seed=3,
                        uncompressed_numel=5)
    clock = _ExchangeClock()
    red.finish(red.start(torch.randn(sum(sizes) + 5), 0, timer=clock))
    assert clock.untimed_ms > 0  # the decode check and the first snapshot ran under it
    later = _ExchangeClock()
    red.finish(red.start(torch.randn(sum(sizes) + 5), 1, timer=later))
    assert later.untimed_ms == 0.0

    # the trainer's side: a hook that took 30 ms, 12 of them checks, 5 waiting for a round
    sparse = SimpleNamespace(decompress_ms=[], exchange_ms=[5.0], untimed_ms=[12.0], bytes_sent_per_step=10,
                             bytes_by_collective={"allgather": 10}, check_kept_state=lambda: None)
    ddp = SimpleNamespace(timed=SimpleNamespace(take=lambda: (30.0, None), clock=None), sparse=sparse,
                          compresses=True, warmup_steps=0, dense_bytes_per_step=100, density=0.1,
                          collective="allgather")
    timer = PhaseTimer("cpu", warmup_steps=0)
    with timer.step():
        timer.last["backward"] = 50.0
        DDPExchange.reduce(ddp, None, 3, timer)
        assert timer.last["backward"] == 20.0 and timer.last["compress"] == 13.0
        assert timer.last["exchange"] == 5.0 and timer.last_untimed_ms >= 12.0
