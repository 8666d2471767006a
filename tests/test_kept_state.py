"""State a compressor or memory keeps across steps must be declared (issue 62, "nothing silently
wrong"): a tensor kept outside ``state_dict`` / ``pieces`` / ``BUFFERS`` would be lost on resume
(and, under DDP, when DDP rebuilds its buckets), so the exchange refuses it after its first
compressed step, in one line naming the class, the attribute and what to implement
(``compress.kept``). Declared state, and caches named in ``transient``, pass; so does every
built-in scheme."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import ROOT, SCHEME_TARGETS, TINY, compressor_for, read_json, run_cli
from test_ddp_hook import CAP_MB, _free_port, batch, net

from sparsetrain.comm import build_reducer
from sparsetrain.comm.periodic import PeriodicSync
from sparsetrain.compress import Layout, Memory, RandomK, TopK
from sparsetrain.errors import CheckpointError
from sparsetrain.timing import NULL_TIMER

SIZES = [300, 120, 40]


class Drifting(TopK):
    """Top-k of acc plus half the previous step's acc: ``prev`` is kept across steps."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.prev = torch.zeros(self.numel)

    def select(self, acc, seed):
        out = super().select(acc + 0.5 * self.prev, seed)
        self.prev = acc.clone()
        return out


class DeclaredDrifting(Drifting):
    """The same, ``prev`` declared for checkpoints (``state_dict``) and for DDP (``pieces``)."""

    def state_dict(self):
        return {"prev": self.prev.clone()}

    def load_state_dict(self, state):
        self.prev = state["prev"].clone()

    def pieces(self):
        return [{"prev": self.prev[o : o + n].clone()} for o, n in zip(self.layout.offsets, self.layout.sizes)]

    def adopt(self, pieces):
        if pieces and all("prev" in p for p in pieces):
            self.prev = torch.cat([p["prev"] for p in pieces])


class CachingDrifting(Drifting):
    """The same, ``prev`` said to be a cache (it is not: the opt-out is the class's word)."""

    transient = ("prev",)


class Momentum(Memory):
    """acc = grad + m u; keeps ``u`` in an attribute of its own, not among its ``BUFFERS``."""

    BUFFERS = ("memory",)

    def __init__(self, numel, **kw):
        super().__init__(numel, **kw)
        self.u = torch.zeros(numel, dtype=kw.get("dtype", torch.float32))

    def accumulate(self, grad):
        self.u.mul_(0.9).add_(grad)
        return self.memory.add_(self.u)

    def forget(self, payload, compressor):
        compressor.forget(self.memory, payload)


class DeclaredMomentum(Momentum):
    BUFFERS = ("memory", "u")

    def __init__(self, numel, **kw):
        Memory.__init__(self, numel, **kw)


def _steps(compressor, memory=None, steps=2, scope="layerwise"):
    red = build_reducer("mine", scope, "allgather", 0.1, Layout.from_sizes(SIZES), world_size=1, rank=0,
                        seed=0, compressor=compressor, memory=memory)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        red.reduce(torch.randn(sum(SIZES), generator=gen), step, NULL_TIMER)
    return red


def _refusal(compressor, memory=None) -> str:
    try:
        _steps(compressor, memory)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("state kept undeclared was not refused")


def test_a_compressor_keeping_a_tensor_undeclared_is_refused_after_its_first_step():
    msg = _refusal(Drifting)
    assert "\n" not in msg
    assert msg.startswith("Drifting.prev changed in the first compressed step but Drifting's state_dict / "
                          "load_state_dict does not carry it"), msg
    assert "name it in Drifting.transient" in msg and "'Kept state'" in msg


def test_declared_state_and_a_declared_cache_pass():
    red = _steps(DeclaredDrifting, steps=3)
    assert red._kept is True  # checked, once
    _steps(CachingDrifting, steps=3)
    _steps(compressor_for("randk"), DeclaredMomentum, steps=3)


def test_a_memory_keeping_a_tensor_outside_its_buffers_is_refused():
    msg = _refusal(compressor_for("randk"), Momentum)
    assert msg.startswith("Momentum.u changed in the first compressed step but Momentum's BUFFERS (or "
                          "state_dict / load_state_dict) does not carry it"), msg


class Counting(TopK):
    """A step counter (DGC's sparsity warm-up reads one): a Python int, not a tensor. (It does not
    scale what it sends: values scaled after top-k's forget took them whole would fail the decode
    check, comm.probe, before this one.)"""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = 0

    def compress(self, acc, seed=0, out=None, wire=None):
        self.calls += 1
        return super().compress(acc, seed, out=out, wire=wire)


class DeclaredCounting(Counting):
    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


class NumpyDrawn(RandomK):
    """Positions from a numpy Generator made once."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rng = np.random.default_rng(0)

    def select(self, acc, seed):
        idx = torch.from_numpy(np.sort(self.rng.choice(self.numel, self.k, replace=False)))
        return idx, idx


class _Ema:
    def __init__(self):
        self.v = torch.zeros(1)


class EmaScaled(TopK):
    """A running statistic inside a helper object (what sends is top-k's, as in ``Counting``)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ema = _Ema()

    def compress(self, acc, seed=0, out=None, wire=None):
        self.ema.v.mul_(0.9).add_(0.1 * acc.abs().mean())
        return super().compress(acc, seed, out=out, wire=wire)


class Ramp(Memory):
    """Error feedback phased in over 40 steps, counted in a Python int."""

    BUFFERS = ("memory",)

    def __init__(self, numel, **kw):
        super().__init__(numel, **kw)
        self.t = 0

    def accumulate(self, grad):
        self.t += 1
        self.memory.mul_(min(1.0, self.t / 40))
        return self.add_into(self.memory, grad)

    def forget(self, payload, compressor):
        compressor.forget(self.memory, payload)


def test_numbers_numpy_generators_and_helper_objects_kept_undeclared_are_refused():
    """Not only tensors: a Python number, a numpy Generator's state and the tensors of a plain
    helper object are lost on a resume as well; each is named (the helper's by its path)."""
    assert _refusal(Counting).startswith("Counting.calls changed in the first compressed step")
    assert _refusal(NumpyDrawn).startswith("NumpyDrawn.rng changed in the first compressed step")
    assert _refusal(EmaScaled).startswith("EmaScaled.ema.v changed in the first compressed step")
    assert _refusal(compressor_for("randk"), Ramp).startswith("Ramp.t changed in the first compressed step")
    assert _steps(DeclaredCounting, steps=3)._kept is True  # declared: it passes
    # top-k's diagnostic counters and the fused kernels' tables are no state of the exchange
    from sparsetrain.compress.kept import transient_names

    assert {"fallbacks", "small_ties", "_fused_plan"} <= transient_names(TopK)


def test_every_built_in_scheme_passes_the_check():
    shapes = [(30, 10), (12, 10), (4, 10)]
    checked = []
    for scheme, target in SCHEME_TARGETS.items():
        if target is None:  # no compressor: dense SGD, torch's hooks
            continue
        for scope in ("layerwise", "global"):
            for agg in ("allgather", "allreduce"):
                try:
                    red = build_reducer(scheme, scope, agg, 0.1, Layout.from_sizes(SIZES), world_size=1, rank=0,
                                        seed=0, compressor=compressor_for(scheme), shapes=shapes,
                                        uncompressed=[False] * 3)
                except ValueError:  # a combination the scheme refuses (top-k with AllReduce, ...)
                    continue
                gen = torch.Generator().manual_seed(0)
                for step in range(3):
                    red.reduce(torch.randn(sum(SIZES), generator=gen), step, NULL_TIMER)
                assert red._kept is True
                checked.append((scheme, scope, agg))
    assert {s for s, _, _ in checked} >= {"topk", "randk", "blockk", "signsgd", "qsgd", "powersgd"}, checked


# ---- under DDP: the hook moves and saves ``pieces``, not ``state_dict`` ---------------------------
class CheckpointOnly(DeclaredDrifting):
    """``prev`` declared for checkpoints only: DDP's bucket rebuild (and its checkpoints) lose it."""

    def pieces(self):
        return [{} for _ in self.layout.sizes]

    def adopt(self, pieces):
        pass


def _ddp_run(compressor) -> str | None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook

    model = DDP(net(), bucket_cap_mb=CAP_MB)
    state = SparseHookState(model, "mine", "layerwise", "allgather", 0.1, compressor=compressor)
    model.register_comm_hook(state, sparse_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(3):
            opt.zero_grad()
            F.cross_entropy(model(batch(0, step)[0]), batch(0, step)[1]).backward()
            opt.step()
            state.check_kept_state()  # as the trainer does after each step
    except CheckpointError as exc:
        return str(exc)
    return None


def _worker(rank, world, port, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save({"pieces": _ddp_run(DeclaredDrifting), "state_dict_only": _ddp_run(CheckpointOnly)},
                   f"{path}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_under_ddp_the_state_must_be_in_pieces(tmp_path):
    mp.spawn(_worker, args=(1, _free_port(), str(tmp_path)), nprocs=1, join=True)
    out = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert out["pieces"] is None
    assert out["state_dict_only"] is not None and out["state_dict_only"].startswith(
        "CheckpointOnly.prev changed in the first compressed step but CheckpointOnly's pieces / adopt does "
        "not carry it"), out["state_dict_only"]


# ---- from the command line: the run stops at its first step, one error line --------------------
DRIFT_MODULE = '''\
import torch

from sparsetrain.compress import TopK


class Drifting(TopK):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.prev = torch.zeros(self.numel, device=self.device)

    def select(self, acc, seed):
        out = super().select(acc + 0.5 * self.prev, seed)
        self.prev = acc.clone()
        return out
'''
DRIFT_YAML = """\
defaults:
  - base_scheme
  - _self_
name: drifting
compressor:
  _target_: drift.Drifting
  _partial_: true
"""


def _own_scheme_run(tmp_path, scheme: str, yaml: str, module: str, source: str, *overrides: str):
    """The command line on ``scheme`` (conf/scheme/<scheme>.yaml: ``yaml``) whose class lives in a
    module of one's own (``module``.py: ``source``), outside the checkout; the process."""
    (tmp_path / "conf" / "scheme").mkdir(parents=True)
    (tmp_path / "conf" / "scheme" / f"{scheme}.yaml").write_text(yaml)
    (tmp_path / f"{module}.py").write_text(source)
    return run_cli("--config-dir", str(tmp_path / "conf"), *TINY, f"scheme={scheme}", *overrides,
                   f"hydra.run.dir={tmp_path / 'run'}",
                   env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}, timeout=300)


def _assert_stopped(proc, tmp_path, want: str) -> None:
    """The run stopped with ``want`` in its one error line and in its failed summary."""
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert any(want in line for line in proc.stderr.splitlines() if line.startswith("error:")), proc.stderr[-3000:]
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["status"] == "failed" and want in summary["error"], summary


@pytest.mark.parametrize("path", ["trainer", pytest.param("ddp", marks=pytest.mark.slow)])  # ddp: full tier
def test_the_command_line_stops_an_undeclared_state_at_the_first_step(path, tmp_path):
    extra = ("dist.ddp=true", "dist.bucket_cap_mb=0.05") if path == "ddp" else ()
    proc = _own_scheme_run(tmp_path, "drifting", DRIFT_YAML, "drift", DRIFT_MODULE, "world_size=2",
                           "train.max_steps=3", *extra)
    route = "pieces / adopt" if path == "ddp" else "state_dict / load_state_dict"
    _assert_stopped(proc, tmp_path,
                    f"Drifting.prev changed in the first compressed step but Drifting's {route} does not carry it")


# ---- state first written mid-run: watched again after every epoch's end -----------------------
class LateDrifting(Drifting):
    """Drifting's ``prev``, kept only once ``keep`` is set: a phase of the method that starts
    mid-run, so the first compressed step changes nothing undeclared."""

    keep = False

    def select(self, acc, seed):
        return super().select(acc, seed) if self.keep else TopK.select(self, acc, seed)


class DeclaredLateDrifting(LateDrifting):
    state_dict = DeclaredDrifting.state_dict
    load_state_dict = DeclaredDrifting.load_state_dict


def _late(compressor):
    """Two steps, the phase started, a step unwatched, then one watched (``watch_kept_state``, as
    the trainer asks at every epoch's end); the reducer."""
    red = _steps(compressor, steps=2)
    assert red._kept is True  # the first step passed: nothing was kept yet
    red.compressor.keep = True
    gen = torch.Generator().manual_seed(1)
    red.reduce(torch.randn(sum(SIZES), generator=gen), 2, NULL_TIMER)  # the first-step check alone stops here
    red.watch_kept_state()
    red.reduce(torch.randn(sum(SIZES), generator=gen), 3, NULL_TIMER)
    return red


def test_state_first_written_mid_run_is_refused_on_the_step_watched_after_an_epoch_end():
    with pytest.raises(CheckpointError, match=r"^LateDrifting\.prev changed in compressed step 3 but "
                                              r"LateDrifting's state_dict / load_state_dict does not carry it"):
        _late(LateDrifting)
    assert _late(DeclaredLateDrifting)._kept is True  # declared: watched, and it passes


# ---- a sync of one's own (scheme.sync._target_: a PeriodicSync subclass) ----------------------
# Local SGD whose period doubles after each synchronisation, up to 8 (communication growing rarer
# as training settles). AdaptivePeriod keeps the period in an attribute its state_dict does not
# carry (a resumed run would synchronise every ``period`` steps again); DeclaredAdaptivePeriod
# declares it. One source: these tests build the classes from it, and the command line's run
# imports it as a module of one's own.
ADAPTIVE_MODULE = '''\
from sparsetrain.comm.periodic import PeriodicSync


class AdaptivePeriod(PeriodicSync):
    def after_optimizer(self, step, timer):
        synced = self.syncs
        super().after_optimizer(step, timer)
        if self.syncs > synced:
            self.period = min(2 * self.period, 8)


class DeclaredAdaptivePeriod(AdaptivePeriod):
    def state_dict(self):
        return {**super().state_dict(), "period": self.period}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.period = state["period"]
'''
_adaptive: dict = {"__name__": "adaptive"}
exec(ADAPTIVE_MODULE, _adaptive)
AdaptivePeriod, DeclaredAdaptivePeriod = _adaptive["AdaptivePeriod"], _adaptive["DeclaredAdaptivePeriod"]


class LateSync(PeriodicSync):
    """Counts its synchronisations in an undeclared attribute only once ``keep`` is set."""

    keep = False

    def after_optimizer(self, step, timer):
        super().after_optimizer(step, timer)
        if self.keep and self.syncs_at(step):
            self.counted = getattr(self, "counted", 0) + 1


class SyncsCounted(PeriodicSync):
    total = 0  # every instance's synchronisations, in the class

    def after_optimizer(self, step, timer):
        super().after_optimizer(step, timer)
        if self.syncs_at(step):
            type(self).total += 1


def _sync_steps(sync, steps, watch_after=None):
    """``steps`` train steps of test_periodic's small CNN, one rank, local SGD through ``sync``;
    ``watch_after``: the step after which the phase starts and the check is asked again."""
    from test_periodic import _batches, _net

    from sparsetrain.comm.build import build_exchange
    from sparsetrain.timing import PhaseTimer
    from sparsetrain.train.step import TrainStep

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    flat, params, red = build_exchange(list(model.parameters()), "none", "layerwise", "allreduce", 0.25,
                                       world_size=1, rank=0, seed=1, dtype=torch.float64)
    red = sync(params, list(model.buffers()), red)
    step = TrainStep(model, opt, red, flat, PhaseTimer("cpu", warmup_steps=0), "cpu")
    batches = _batches(0)
    for i in range(steps):
        step(batches, i)
        if i == watch_after:
            red.keep = True
            red.watch_kept_state()
    return red


def test_a_sync_keeping_state_undeclared_is_refused_after_its_first_synchronisation():
    from functools import partial

    with pytest.raises(CheckpointError, match=r"^AdaptivePeriod\.period changed in steps 0-1 \(its first "
                                              r"synchronisation\) but AdaptivePeriod's state_dict / "
                                              r"load_state_dict does not carry it"):
        _sync_steps(partial(AdaptivePeriod, period=2), steps=3)
    assert _sync_steps(partial(DeclaredAdaptivePeriod, period=2), steps=8)._kept is True
    # the built-in syncs pass: local SGD, DiLoCo (outer momentum), post-local SGD (warm-up)
    for sync in (partial(PeriodicSync, period=2), partial(PeriodicSync, period=2, outer_lr=0.7, outer_momentum=0.9),
                 partial(PeriodicSync, period=2, warmup_steps=2)):
        assert _sync_steps(sync, steps=6)._kept is True
    # a class attribute of its own
    with pytest.raises(CheckpointError, match=r"^SyncsCounted changed state outside itself in steps 0-1 \(its first "
                                              r"synchronisation\) \(class attribute SyncsCounted\.total\)"):
        _sync_steps(partial(SyncsCounted, period=2), steps=3)
    # watched again: state first written mid-run
    with pytest.raises(CheckpointError, match=r"^LateSync\.counted changed in steps 4-5 \(the synchronisation "
                                              r"after an epoch's end\)"):
        _sync_steps(partial(LateSync, period=2), steps=8, watch_after=3)


def test_a_sync_on_a_schedule_of_its_own_reports_the_bytes_it_sent():
    """A period that grows (2, 4, 8: synchronisations at steps 1, 3, 7, 15) sends 4 synchronisations
    in 16 steps, not one every 2 steps: the sizes per step were a period's as built (twice what it
    sent here) without a word. Now they are the measured means, and sync_summary says so; a sync
    on its period keeps its sizes to the bit, a last period cut short included."""
    from functools import partial

    red = _sync_steps(partial(DeclaredAdaptivePeriod, period=2), steps=16)
    assert red.syncs == 4 and red.own_schedule
    assert red.bytes_sent_per_step == red.bytes_per_sync * 4 / 16
    assert red.density == red.inner.density * 4 / 16
    assert red.sync_summary()["schedule"] == "own" and red.sync_summary()["mean_period"] == 4.0
    plain = _sync_steps(partial(PeriodicSync, period=2), steps=15)
    assert not plain.own_schedule and "schedule" not in plain.sync_summary()
    assert plain.bytes_sent_per_step == plain.bytes_per_sync / 2 and plain.density == plain.inner.density / 2


SYNC_MODULE = '''\
from sparsetrain.comm.periodic import PeriodicSync


class Counting(PeriodicSync):
    """From its third synchronisation on, counts them in an attribute of its own."""

    def after_optimizer(self, step, timer):
        super().after_optimizer(step, timer)
        if self.syncs >= 3 and self.syncs_at(step):
            self.counted = getattr(self, "counted", 0) + 1
'''
SYNC_YAML = """\
defaults:
  - base_scheme
  - _self_
name: counting
sync:
  _target_: counting.Counting
  _partial_: true
  period: 2
"""


def test_the_command_line_stops_a_sync_state_first_written_mid_run_after_the_epoch_end(tmp_path):
    """Through the trainer: an epoch of 16 steps (one rank: the check is each rank's own), a
    synchronisation every 2; the state starts at the third (step 5), after the first check (steps
    0-1); the trainer watches again at the epoch's end, and the run stops at the step after the
    next synchronisation."""
    proc = _own_scheme_run(tmp_path, "counting", SYNC_YAML, "counting", SYNC_MODULE, "world_size=1", "train.epochs=2")
    _assert_stopped(proc, tmp_path, "Counting.counted changed in steps 16-17 (the synchronisation after an epoch's "
                                    "end) but Counting's state_dict / load_state_dict does not carry it")


# ---- state outside the object: globals, class attributes, global random states; containers ------
_SEEN = {"calls": 0}  # a module global one of the classes below counts in


class GlobalCounting(TopK):
    def compress(self, acc, seed=0, out=None, wire=None):
        _SEEN["calls"] += 1
        return super().compress(acc, seed, out=out, wire=wire)


class ClassCounting(TopK):
    calls = 0

    def compress(self, acc, seed=0, out=None, wire=None):
        type(self).calls += 1
        return super().compress(acc, seed, out=out, wire=wire)


class NumpyGlobalDrawn(RandomK):
    """Positions from numpy's global random state (seeded once, as a script would)."""

    def select(self, acc, seed):
        idx = torch.from_numpy(np.sort(np.random.choice(self.numel, self.k, replace=False)))
        return idx, idx


class PythonGlobalDrawn(RandomK):
    def select(self, acc, seed):
        import random

        idx = torch.tensor(sorted(random.sample(range(self.numel), self.k)))
        return idx, idx


class DequeKept(TopK):
    """The last norms in a deque (no ``__dict__``: it was not looked into)."""

    def __init__(self, *args, **kw):
        import collections

        super().__init__(*args, **kw)
        self.norms = collections.deque(maxlen=3)

    def compress(self, acc, seed=0, out=None, wire=None):
        self.norms.append(float(acc.norm()))
        return super().compress(acc, seed, out=out, wire=wire)


class ModuleKept(TopK):
    """A running statistic in a torch module's buffer (torch's own objects were not looked into)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.stat = torch.nn.BatchNorm1d(1)

    def compress(self, acc, seed=0, out=None, wire=None):
        self.stat(acc[:8].reshape(-1, 1).float())
        return super().compress(acc, seed, out=out, wire=wire)


def test_state_outside_the_object_and_inside_torch_objects_and_deques_is_refused():
    """A resume builds the compressor afresh: a module global, a class attribute, numpy's or
    Python's global random state, a deque, a torch module's buffers are not brought back either."""
    assert _refusal(GlobalCounting).startswith(
        "GlobalCounting changed state outside itself in the first compressed step (module global "
        "test_kept_state._SEEN['calls']): a resume builds it afresh and restores neither"), _refusal(GlobalCounting)
    assert "(class attribute ClassCounting.calls)" in _refusal(ClassCounting)
    np.random.seed(0)
    assert "(numpy's global random state (np.random))" in _refusal(NumpyGlobalDrawn)
    assert "(Python's global random state (random))" in _refusal(PythonGlobalDrawn)
    assert _refusal(DequeKept).startswith("DequeKept.norms[0] changed in the first compressed step")
    msg = _refusal(ModuleKept)
    assert msg.startswith("ModuleKept.stat['running_mean'], ") and "changed in the first compressed step" in msg


def test_the_summary_of_a_sync_on_a_schedule_of_its_own_holds_the_bytes_it_sent(tmp_path):
    yaml = SYNC_YAML.replace("counting.Counting", "adaptive.DeclaredAdaptivePeriod").replace("name: counting",
                                                                                             "name: adaptive")
    proc = _own_scheme_run(tmp_path, "adaptive", yaml, "adaptive", ADAPTIVE_MODULE, "world_size=1", "train.epochs=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_json(tmp_path / "run" / "summary.json")
    assert s["steps"] == 16 and s["sync"]["syncs"] == 4 and s["sync"]["schedule"] == "own"
    assert s["bytes_sent_per_step"] == s["bytes_sent_total"] / 16 == s["sync"]["bytes_per_sync"] / 4


TALLY_MODULE = '''\
counts = {"calls": 0}


def bump():
    counts["calls"] += 1
'''

VIA_HELPERS_MODULE = '''\
import tally
from tally import bump

from sparsetrain.compress import TopK

steps = 0


def _count():
    global steps
    steps += 1


class ViaModule(TopK):
    def compress(self, acc, seed=0, out=None, wire=None):
        tally.counts["calls"] += 1
        return super().compress(acc, seed, out=out, wire=wire)


class ViaFunction(TopK):
    def compress(self, acc, seed=0, out=None, wire=None):
        bump()
        return super().compress(acc, seed, out=out, wire=wire)


class ViaLocalFunction(TopK):
    def compress(self, acc, seed=0, out=None, wire=None):
        _count()
        return super().compress(acc, seed, out=out, wire=wire)
'''


def test_state_a_helper_function_or_module_of_ones_own_changes_is_refused(tmp_path, monkeypatch):
    """The module globals the class's code uses are followed into the functions and helper
    modules of one's own that it calls: a counter there is state a resume does not rebuild."""
    (tmp_path / "tally.py").write_text(TALLY_MODULE)
    (tmp_path / "via_helpers.py").write_text(VIA_HELPERS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import via_helpers

    assert "(module global tally.counts['calls'])" in _refusal(via_helpers.ViaModule), _refusal(via_helpers.ViaModule)
    assert "(module global tally.counts['calls'])" in _refusal(via_helpers.ViaFunction)
    assert "(module global via_helpers.steps)" in _refusal(via_helpers.ViaLocalFunction)


SCRIPT = '''\
"""docs/library.md's loop across ranks (one here), with a compressor class of one's own beside it."""
import tempfile

import torch
import torch.distributed as dist

from sparsetrain.comm import build_reducer
from sparsetrain.compress import Layout, TopK
from sparsetrain.timing import NULL_TIMER


class HalfTopK(TopK):
    """Top-k of half the accumulator: keeps nothing."""

    def select(self, acc, seed):
        return super().select(acc * 0.5, seed)


dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
params = list(model.parameters())
reducer = build_reducer("half", "layerwise", "allgather", 0.1, Layout.from_tensors(params), world_size=1,
                        rank=0, seed=0, compressor=HalfTopK)
for step in range(4):
    x, y = torch.randn(32, 20), torch.randint(0, 2, (32,))
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    reducer.reduce(grad, step, NULL_TIMER)
    opt.step()
print(f"ok {step}")
'''


def test_a_scripts_own_loop_beside_its_class_is_not_state_of_the_class(tmp_path):
    """A class defined in a script (or a notebook) shares ``__main__`` with the loop's model,
    optimizer, reducer and step: those change every step and are not the class's state (they were
    refused, naming ``__main__.reducer``); only the globals the class's code uses are watched."""
    import subprocess
    import sys

    (tmp_path / "loop.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "loop.py")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok 3", proc.stderr[-3000:]


def _make_counter():
    calls = 0

    def bump():
        nonlocal calls
        calls += 1
        return calls

    return bump


class IteratorCounting(TopK):
    """Counts its steps in an ``itertools.count``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ticks = itertools.count()

    def compress(self, acc, seed=0, out=None, wire=None):
        next(self.ticks)
        return super().compress(acc, seed, out=out, wire=wire)


_BUMP = _make_counter()  # a module-level closure one of the classes below calls


class GlobalClosureCounting(TopK):
    def compress(self, acc, seed=0, out=None, wire=None):
        _BUMP()
        return super().compress(acc, seed, out=out, wire=wire)


def test_a_closures_cells_and_an_iterators_count_are_state():
    """A counter kept in a module-level closure the class calls, or in an ``itertools.count``,
    goes on from 0 after a resume: refused, naming it. (A function set on the object is not
    looked into: a method patched in to watch the run, as tests/test_wire_stats.py does, closes
    over the trainer and fills a list of its own.)"""
    assert _refusal(IteratorCounting).startswith("IteratorCounting.ticks changed in the first compressed step")
    assert "(module global test_kept_state._BUMP.<closure calls>)" in _refusal(GlobalClosureCounting)


def _density_warmup():
    """DGC's sparsity warm-up as a generator: 25%, 6.25%, ..., then the ratio for good."""
    density = 0.25
    while True:
        yield density
        density = max(density / 4, 0.01)


_WARMUP = [0.25, 0.0625, 0.015625] + [0.01] * 100  # the same warm-up, as a list


class GeneratorWarmup(TopK):
    """Reads its warm-up from a generator it keeps: a resume would start it over at 25%."""

    @staticmethod
    def make_schedule():
        return _density_warmup()

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.schedule = self.make_schedule()

    def compress(self, acc, seed=0, out=None, wire=None):
        next(self.schedule)
        return super().compress(acc, seed, out=out, wire=wire)


class ListWarmup(GeneratorWarmup):
    """The same warm-up from an iterator over a list."""

    @staticmethod
    def make_schedule():
        return iter(_WARMUP)


class DeclaredListWarmup(ListWarmup):
    """The same, its position declared: ``load_state_dict`` rebuilds the iterator where it stood."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.taken = 0

    def compress(self, acc, seed=0, out=None, wire=None):
        self.taken += 1
        return super().compress(acc, seed, out=out, wire=wire)

    def state_dict(self):
        return {"taken": self.taken}

    def load_state_dict(self, state):
        self.taken = state["taken"]
        self.schedule = self.make_schedule()
        for _ in range(self.taken):
            next(self.schedule)


_RATIOS = iter(_WARMUP)  # a module global one of the classes below reads


class GlobalIteratorWarmup(TopK):
    def compress(self, acc, seed=0, out=None, wire=None):
        next(_RATIOS)
        return super().compress(acc, seed, out=out, wire=wire)


def test_a_generators_and_an_iterators_position_are_state():
    """A schedule kept in a generator or in an iterator over a list restarts from its first item
    after a resume: refused, naming it (a generator when the exchange first copies the compressor:
    it cannot be copied; an iterator over a list by its index, which moved). One whose
    ``load_state_dict`` rebuilds it at its position passes, and the checks' copies did not move
    the live one (the third step read the list's fourth item)."""
    assert _refusal(GeneratorWarmup).startswith("GeneratorWarmup.schedule is a generator kept across steps: "
                                                "neither a checkpoint nor the checks' copies can hold one")
    assert _refusal(ListWarmup).startswith("ListWarmup.schedule.<index> changed in the first compressed step")
    red = _steps(DeclaredListWarmup, steps=3)
    assert red._kept is True and red.compressor.taken == red.compressor.schedule.__reduce__()[2] == 3
    assert "(module global test_kept_state._RATIOS.<index>)" in _refusal(GlobalIteratorWarmup)
