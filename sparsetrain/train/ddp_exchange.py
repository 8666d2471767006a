"""Training through torch DDP (``dist.ddp=true``): the model wrapped in DistributedDataParallel,
the exchange done by a communication hook during backward. The hook by scheme:

  every scheme with a    ``comm.ddp_hook.sparse_hook`` with the configured scope (global: within a
  compressor node      bucket), aggregation, ratio, memory, ``scheme.uncompressed``, warm-up and
  (topk, randk, ...,   seed: the trainer's exchange per bucket, on the bucket in place (a
  powersgd)            compressor's earlier rounds, e.g. PowerSGD's P, are waited for inside the
                       hook: ``exchange``, not ``compress``)
  none                 DDP's own AllReduce (through the same hook, so it is timed the same way)
  torch_powersgd       torch's PowerSGD hook, error feedback and warm start, at ``scheme.rank`` or,
                       by default, the rank whose bytes come closest to the layer-wise sparse
                       hook's at ``ratio`` (``comm.ddp_hook.matched_powersgd_rank``)
  fp16, bf16           torch's fp16 / bf16 compression hooks (every entry cast to 16 bits, AllReduced,
                       cast back)
  localsgd, diloco     torch's post-local-SGD hook (a scheme's sync node): the gradients AllReduced
  (a sync node)        during ``scheme.warmup_steps``, left local after; the model is synchronised
                       after the optimizer by ``comm.periodic.PeriodicSync``, as in the trainer

Which schemes run one of torch's hooks is conf/schemes.yaml's ``torch_hook``, the one source;
which hook each runs is ``TORCH_HOOKS`` (scheme name -> the factory of its hook and state).

``DDPExchange`` stands where the trainer keeps its reducer (the ``comm.Reducer`` surface): the
exchange has already happened when the train step calls ``reduce``, which only accounts for it:

- phases: the host time spent inside the hook calls is ``compress`` (compression and launching
  the collectives; on CUDA, host time); what backward waited after the last bucket was handed to
  the hook is the exchange not hidden by backward: ``exchange`` (less ``decompress``, the
  unpacking measured in the collectives' callbacks, as far as it fell into that wait); both are
  moved out of ``backward``, so the phases still add up to the step;
- bytes and density per step as the hook sent them; the memory norm on logged steps.

Buckets are settled before the first step (``settle``): DDP runs its first iteration on one
initial bucket and rebuilds its buckets before the second, in the order gradients arrived. Two
untimed forward/backward passes with the hook bypassed (no collective, no step counted, the
batch-norm buffers restored) let that happen, so every step of every run, fresh or resumed,
sees the same buckets, and a resumed run draws the same positions per bucket: bit-identical.
torch's PowerSGD on gloo runs in one bucket: it starts its second AllReduce from a future
callback, and with several buckets gloo ranks can then issue collectives in different orders.
"""

# no `from __future__ import annotations`: DDP compares the hook's annotations to the real types
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from sparsetrain.comm import ExchangeStats, ReducerBase
from sparsetrain.comm.ddp_hook import (
    SparseHookState,
    matched_powersgd_rank,
    powersgd_numel,
    sparse_hook,
)
from sparsetrain.errors import ConfigError
from sparsetrain.results import TORCH_HOOK_SCHEMES
from sparsetrain.scheme_catalog import is_dense
from sparsetrain.timing import BucketClock, PhaseTimer

# DDP's bucket cap for PowerSGD on gloo: larger than any model, so every parameter is in one
# bucket (with several, torch's hook can issue collectives in different orders across ranks)
ONE_BUCKET_MB = float(1 << 20)


@dataclass(frozen=True)
class TorchHook:
    """One of torch's DDP hooks: ``build(exchange, scheme, cfg, shapes, esize)`` sets the
    exchange's sizes and returns ``(hook, state)``; ``one_bucket_on_gloo``: the whole model in one
    bucket on gloo (a hook that issues collectives from future callbacks)."""

    build: Callable[..., tuple[Callable, Any]]
    one_bucket_on_gloo: bool = False


def _torch_powersgd(ex: "DDPExchange", scheme, cfg, shapes, esize) -> tuple[Callable, Any]:
    """torch's PowerSGD, error feedback and warm start, at ``scheme.rank`` or the matched rank."""
    ex.powersgd_rank = scheme.get("rank") or matched_powersgd_rank(shapes, cfg.ratio)
    # torch needs >= 2 plain iterations with error feedback / warm start (bucket rebuild)
    ex.warmup_steps = max(2, int(scheme.warmup_steps))
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=ex.powersgd_rank,
        start_powerSGD_iter=ex.warmup_steps, use_error_feedback=bool(scheme.error_feedback),
        warm_start=True, random_seed=int(cfg.seed))
    sent = powersgd_numel(shapes, ex.powersgd_rank)
    ex.bytes_sent_per_step = sent * esize
    ex.uncompressed_bytes_per_step = powersgd_numel(shapes, ex.powersgd_rank, whole_only=True) * esize
    ex.density = sent / ex.numel
    return powerSGD_hook.powerSGD_hook, state


def _half_precision(hook: Callable) -> Callable[..., tuple[Callable, Any]]:
    """torch's fp16 / bf16 hook: every entry cast to 16 bits, AllReduced, cast back."""

    def build(ex: "DDPExchange", scheme, cfg, shapes, esize) -> tuple[Callable, Any]:
        ex.bytes_sent_per_step = ex.numel * 2
        ex.density = 1.0  # every entry, in half the bytes
        return hook, None

    return build


#: torch's hooks by scheme name; which schemes run one is conf/schemes.yaml's ``torch_hook``
#: (``results.TORCH_HOOK_SCHEMES``), and each of those must be registered here
TORCH_HOOKS: dict[str, TorchHook] = {
    "torch_powersgd": TorchHook(_torch_powersgd, one_bucket_on_gloo=True),
    "fp16": TorchHook(_half_precision(default_hooks.fp16_compress_hook)),
    "bf16": TorchHook(_half_precision(default_hooks.bf16_compress_hook)),
}


def torch_hook_for(scheme_name: str) -> TorchHook | None:
    """The torch hook of a scheme conf/schemes.yaml marks ``torch_hook`` (None for any other);
    ``ConfigError`` for one marked but not registered in ``TORCH_HOOKS``."""
    if scheme_name not in TORCH_HOOK_SCHEMES:
        return None
    if scheme_name not in TORCH_HOOKS:
        raise ConfigError(f"scheme={scheme_name!r} is marked torch_hook in conf/schemes.yaml but has no torch "
                          f"hook registered; registered: {', '.join(TORCH_HOOKS)} (train.ddp_exchange.TORCH_HOOKS)")
    return TORCH_HOOKS[scheme_name]


class _TimedHook:
    """Wraps a DDP hook and its state: the host time inside the hook calls and the moment the
    last bucket was handed over, per iteration; when each bucket was (``clock``, None: not
    recorded); ``bypass``: return the bucket untouched."""

    def __init__(self, hook, state, on_bypass=None, clock: BucketClock | None = None):
        self.hook, self.state, self.on_bypass, self.clock = hook, state, on_bypass, clock
        self.bypass = False
        self.hook_ms = 0.0
        self.handoff: float | None = None

    def take(self) -> tuple[float, float | None]:
        out = (self.hook_ms, self.handoff)
        self.hook_ms, self.handoff = 0.0, None
        return out


def _timed_hook(timed: _TimedHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if timed.bypass:
        if timed.on_bypass is not None:
            timed.on_bypass(bucket)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    if timed.clock is not None:
        timed.clock.mark(bucket.buffer().numel())
    t0 = time.perf_counter()
    fut = timed.hook(timed.state, bucket)
    t1 = time.perf_counter()
    timed.hook_ms += (t1 - t0) * 1e3
    if bucket.is_last():  # DDP launches buckets in index order: the last one ends the handoff
        timed.handoff = t1
    return fut


class DDPExchange(ReducerBase):
    """The model in DDP with the configured hook, seen by the trainer as its reducer.

    ``net`` is the DDP model the train step runs; ``module`` the model inside it (evaluation,
    checkpoints). Sizes (``bytes_sent_per_step``, ``density``, ...) are exact once ``settle`` ran.
    """

    def __init__(self, cfg: Any, model: torch.nn.Module, *, device: torch.device):
        self.module = model
        scheme = cfg.scheme
        params = [p for p in model.parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in params]
        self.numel = sum(p.numel() for p in params)
        esize = params[0].element_size()
        self.dense_bytes_per_step = self.numel * esize
        # the bytes of tensors that travel whole, uncompressed: all of them for dense SGD (as the
        # trainer's DenseReducer counts), the hooks' own count otherwise
        self.uncompressed_bytes_per_step = self.dense_bytes_per_step if is_dense(scheme.name) else 0
        self.density = 1.0
        self.collective = "allreduce"
        self.warmup_steps = 0
        sync = bool(scheme.get("sync"))
        self.compresses = not is_dense(scheme.name) and not sync
        torch_hook = torch_hook_for(scheme.name)
        bucket_cap_mb = cfg.dist.bucket_cap_mb
        if torch_hook is not None and torch_hook.one_bucket_on_gloo and dist.get_backend() == "gloo":
            bucket_cap_mb = ONE_BUCKET_MB
        kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
        # No buffer broadcast before each forward: each rank keeps its own batch-norm statistics,
        # as the trainer's own path does (evaluation uses rank 0's); one collective less per step.
        # (torch >= 2.14 renamed the switch; it still syncs once at construction, as before.)
        no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")
        kwargs[no_sync] = False
        # sparsetrain's hook works on each bucket in place and returns it: with the gradients
        # views of the buckets, DDP copies none into a bucket or back (the results are the same;
        # the optimizer reads .grad, zeroed in place, and checkpoints hold no gradient). torch's
        # hooks keep DDP's default.
        if torch_hook is None:
            kwargs["gradient_as_bucket_view"] = True
        self.net = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **kwargs)
        self.state: Any = None  # the hook's state: SparseHookState, PowerSGDState or None (fp16)
        self.sparse: SparseHookState | None = None  # the state when it is sparsetrain's hook
        on_bypass = None
        if torch_hook is not None:
            hook, self.state = torch_hook.build(self, scheme, cfg, shapes, esize)
        elif sync:
            # the gradients averaged until local SGD starts, then kept local (no subgroup AllReduce)
            self.state = post_localSGD_hook.PostLocalSGDState(
                process_group=None, subgroup=None, start_localSGD_iter=int(scheme.warmup_steps),
                post_local_gradient_allreduce=False)
            hook = post_localSGD_hook.post_localSGD_hook
            self.bytes_sent_per_step = self.dense_bytes_per_step
        else:
            compressor = instantiate(scheme.compressor) if scheme.get("compressor") else None
            self.state = self.sparse = SparseHookState(
                self.net, scheme.name, cfg.scope.name, cfg.aggregation.name, cfg.ratio,
                error_feedback=scheme.error_feedback, uncompressed=scheme.uncompressed,
                warmup_steps=scheme.warmup_steps, seed=cfg.seed,
                compressor=compressor, memory=instantiate(scheme.memory) if scheme.get("memory") else None,
                fast_path=bool(cfg.train.get("fast_path", False)))
            hook = sparse_hook
            on_bypass = self.state.plan
            self.bytes_sent_per_step = self.dense_bytes_per_step  # until settle() plans the buckets
            if not is_dense(scheme.name):
                self.collective = self.sparse.collective  # until settle() plans the buckets
                self.warmup_steps = int(scheme.warmup_steps)
        # local SGD / DiLoCo synchronise after the optimizer, not inside backward: no overlap
        self.timed = _TimedHook(hook, self.state, on_bypass, clock=None if sync else BucketClock())
        self.net.register_comm_hook(self.timed, _timed_hook)

    # --- before the first step -------------------------------------------------------------------
    def settle(self, inputs: torch.Tensor) -> None:
        """Two bypassed forward/backward passes on ``inputs``: DDP rebuilds its buckets after
        the first, the sparse hook plans them in the second. Nothing is exchanged or counted;
        gradients are zeroed and batch-norm buffers restored, so training is untouched."""
        buffers = [b.detach().clone() for b in self.module.buffers()]
        self.timed.bypass = True
        try:
            for _ in range(2):
                out = self.net(inputs)
                out.float().sum().mul(0.0).backward()
        finally:
            self.timed.bypass = False
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers):
                b.copy_(saved)
        for p in self.module.parameters():
            p.grad = None
        if self.sparse is not None and self.compresses:
            sizes = self.sparse.sizes()
            self.bytes_sent_per_step = sizes["bytes_sent"]
            self.bytes_by_collective = sizes["bytes_by_collective"]
            self.uncompressed_bytes_per_step = sizes["uncompressed_bytes"]
            self.density = sizes["density"]
            self.collective = self.sparse.collective

    # --- the Reducer surface the trainer uses ----------------------------------------------------
    @property
    def ratio_applies(self) -> bool:
        """Whether ``ratio`` changes what is sent (the sparse hook's compressor says; True else)."""
        return self.sparse.ratio_applies if self.sparse is not None else True

    @property
    def aggregation_applies(self) -> bool:
        return self.sparse.aggregation_applies if self.sparse is not None else True

    def reduce(self, flat_grad: Any, step: int, timer: PhaseTimer, want_stats: bool = False) -> ExchangeStats:
        """Account for the exchange DDP ran inside backward at (0-based) ``step``."""
        now = time.perf_counter()
        hook_ms, handoff = self.timed.take()
        if self.timed.clock is not None:
            self.timed.clock.close()
        waited = (now - handoff) * 1e3 if handoff is not None else 0.0
        decompress = min(sum(self.sparse.decompress_ms), waited) if self.sparse is not None else 0.0
        # the hook waits for a compressor's earlier rounds (PowerSGD's P) inside itself: exchange
        inside = min(sum(self.sparse.exchange_ms), hook_ms) if self.sparse is not None else 0.0
        # the hook's checks (the decode check, the kept-state snapshot: once) belong to no phase
        untimed = min(sum(self.sparse.untimed_ms), hook_ms - inside) if self.sparse is not None else 0.0
        timer.take_out("backward", untimed)
        hook_ms -= untimed
        timer.move("backward", "compress", hook_ms - inside)
        timer.move("backward", "decompress", decompress)
        timer.move("backward", "exchange", waited - decompress + inside)
        compressing = self.compresses and step >= self.warmup_steps
        if self.sparse is not None and compressing:
            with timer.untimed():  # after the first compressed step (and those watched again): state kept undeclared
                self.sparse.check_kept_state()
        if self.sparse is not None:
            sent = self.sparse.bytes_sent_per_step  # as the hook sent it in this iteration
        else:
            sent = self.bytes_sent_per_step if compressing else self.dense_bytes_per_step
        memory_norm = None
        if self.sparse is not None and self.compresses and want_stats:
            with timer.untimed():
                memory_norm = self.sparse.memory_norm()
        return ExchangeStats(sent, self.dense_bytes_per_step,
                             density=self.density if compressing else 1.0,
                             memory_norm=memory_norm,
                             collective=self.collective if compressing else "allreduce",
                             bytes_by_collective=self.sparse.bytes_by_collective
                             if self.sparse is not None and compressing else None)

    @property
    def overlap_buckets(self) -> list[tuple[float, float]] | None:
        """Per DDP bucket (launch order) its share of the entries and how long before backward's
        end it was handed to the hook (mean ms; ``timing.BucketClock``); None: not overlapped."""
        return self.timed.clock.means() if self.timed.clock is not None else None

    def watch_kept_state(self) -> None:
        if self.sparse is not None:  # torch's own hooks' state is saved whole (state_dict below)
            self.sparse.watch_kept_state()

    def state_dict(self) -> dict:
        if self.sparse is not None:
            return {"hook": self.sparse.state_dict()}
        if isinstance(self.state, powerSGD_hook.PowerSGDState):
            st = self.state
            name, key, pos, has_gauss, gauss = st.rng.get_state()  # numpy: as tensors (weights_only)
            return {"hook": {"iter": st.iter, "error_dict": dict(st.error_dict),
                             "p_memory_dict": dict(st.p_memory_dict), "q_memory_dict": dict(st.q_memory_dict),
                             "rng": [name, torch.from_numpy(key.astype("int64")), pos, has_gauss, gauss]}}
        if isinstance(self.state, post_localSGD_hook.PostLocalSGDState):
            return {"hook": {"iter": self.state.iter}}
        return {}

    def load_state_dict(self, state: dict) -> None:
        if self.sparse is not None:
            self.sparse.load_state_dict(state["hook"])
        elif isinstance(self.state, powerSGD_hook.PowerSGDState):
            saved = dict(state["hook"])
            name, key, pos, has_gauss, gauss = saved.pop("rng")
            self.state.rng.set_state((name, key.numpy().astype("uint32"), int(pos), int(has_gauss), float(gauss)))
            for attr, value in saved.items():
                setattr(self.state, attr, value)
        elif isinstance(self.state, post_localSGD_hook.PostLocalSGDState):
            self.state.iter = int(state["hook"]["iter"])


__all__ = ["DDPExchange"]
