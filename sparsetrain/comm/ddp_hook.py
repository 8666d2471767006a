"""DDP communication hooks: sparsetrain's schemes inside any torch DistributedDataParallel model.

    from sparsetrain.compress import BlockRandomK
    from sparsetrain.comm.ddp_hook import SparseHookState, sparse_hook
    state = SparseHookState(ddp_model, "blockk", aggregation="allreduce", ratio=0.01,
                            compressor=BlockRandomK)
    ddp_model.register_comm_hook(state, sparse_hook)

DDP calls the hook once per gradient bucket as soon as backward has filled it, so compression
and exchange of early buckets overlap backward of later layers. Per bucket:

- the bucket's parameters are split by the rule of ``scheme.uncompressed`` (``"1d"``: vectors
  travel whole; ``"none"``; or N: tensors under N entries travel whole);
- ``scope="layerwise"``: k_i = max(1, round(ratio x numel_i)) per compressed parameter, exactly
  as the trainer does; ``scope="global"`` is **global within a bucket**: one k over the bucket's
  compressed entries (not over the model: DDP hands the hook one bucket at a time);
- the memory, compression, the compressor's rounds of collectives and the decoding are the
  trainer's own (``sparsetrain.comm.SparseReducer.start`` / ``finish``; one reducer per bucket:
  its memory, compressor, messages and collectives), run on the bucket in place through a
  ``Placement`` (where the bucket's compressed and whole tensors lie): the memory's add reads the
  compressed tensors where they lie, the whole tensors go straight into the message and back,
  and every message is decoded by the compressor's own ``receive``. The hook has no step of its
  own, so any compressor the trainer runs runs here alike (PowerSGD's two rounds included).
  Every round but the last is waited for inside the hook (``exchange_ms``); the last is left
  in flight, and the returned future gives the averaged bucket. Build DDP with
  ``gradient_as_bucket_view=True`` (the trainer does): the ``.grad`` tensors are then views of
  the buckets, and DDP copies no gradient into a bucket or back;
- positions (and every other random draw) follow tensors, not buckets: with layer-wise scope
  each bucket's reducer has the run's seed (shared by all ranks for AllReduce, per rank for
  AllGather), and a compressor whose draws span its tensors (``draws_span_segments``: random-k,
  block-k, QSGD, PowerSGD's start of Q) takes the trainer's draws for the bucket's tensors
  (``share_draws``) and the options the model's compressor chose (``bucket_options``:
  PowerSGD's rank). So the
  hook, layer-wise, exchanges exactly what the trainer does, whatever the buckets (bit for bit at
  two ranks; with more, gloo's AllReduce may sum a value's terms in another order depending on
  where it lies in the buffer; PowerSGD within rounding, as a matrix product's last bit depends
  on where its output lies in memory). Global scope draws per bucket from ``bucket_seed(seed, step,
  bucket)``;
- the first ``warmup_steps`` iterations use DDP's plain AllReduce; compression then starts with
  empty memory. ``state.step`` counts iterations (it advances on the bucket DDP reduces last).

Each bucket issues its collectives (one per round) from the hook itself, never from a future
callback, so ranks issue collectives in the same order with any number of buckets, on gloo too.

Bucket rebuilds. DDP rebuilds its buckets once, before the second iteration, in the order the
gradients arrived (and a fresh DDP after a resume starts again from its initial buckets). The
memory is kept per bucket index, and each bucket records which parameters it covers (their
positions in ``module.parameters()``). When a bucket index arrives with other parameters than
before, every bucket's memory (and the state its compressor keeps, e.g. PowerSGD's Q:
``Compressor.pieces``) is split back into per-parameter pieces, and each new bucket takes its
parameters' pieces when it first runs: no memory is lost or misplaced, whatever the new
layout. (torch's PowerSGD hook instead refuses error feedback before iteration 2.) The same
re-homing loads a checkpoint into any bucket layout.

"""

# no `from __future__ import annotations`: DDP compares the hook's annotations to the real types
import contextlib
import functools
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from sparsetrain.comm.build import build_reducer
from sparsetrain.comm.protocol import split_by_collective
from sparsetrain.comm.rules import check_combination
from sparsetrain.comm.sparse import Placement, SparseReducer
from sparsetrain.compress import (
    BlockRandomK,
    Layout,
    compressed_first,
    compressor_class,
    parse_uncompressed,
    step_seed,
    uncompressed_flags,
)
from sparsetrain.compress.kept import probe_copy
from sparsetrain.errors import ConfigError
from sparsetrain.scheme_catalog import is_dense

#: the prefix of a compressor's per-parameter state among a parameter's memory pieces
KEPT = "compressor."


def bucket_seed(seed: int, step: int, bucket: int, rank: int | None = None) -> int:
    """Seed of one bucket's positions at one step: ``step_seed(step_seed(seed, bucket), step,
    rank)``. ``rank=None``: the same on every rank (AllReduce); a rank: its own (AllGather)."""
    return step_seed(step_seed(seed, bucket), step, rank)



class _Bucket:
    """One DDP bucket as the hook sees it: its parameters, where its compressed and its whole
    tensors lie in the bucket (``placement``), and the reducer.

    The reducer's memory and message hold the compressed tensors, then the whole ones, each group
    in bucket order (``[compressed | whole]``); the bucket interleaves them (a convolution, its
    batch-norm vectors, the next convolution, ...). The reducer's own step (``SparseReducer.start``
    / ``finish``, the trainer's) runs on the bucket through the placement: the error-feedback add
    reads the compressed tensors where they lie, the whole ones are copied straight into the
    message and back, and every message is decoded by the compressor's own ``decompress_add``.
    """

    def __init__(self, keys, shapes, flags, reducer):
        self.keys = keys
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        self.sizes = reducer  # what the bucket sends (of whole tensors only: a DenseReducer's count)
        self.reducer: SparseReducer | None = reducer if isinstance(reducer, SparseReducer) else None
        self.compressed = [(keys[i], sizes[i]) for i in compressed_first(flags) if not flags[i]]  # memory layout
        self.placement = Placement.of(sizes, flags)


class SparseHookState:
    """State of ``sparse_hook``: the options of the config and one reducer (with its
    error-feedback memory) per DDP bucket.

    ``module``: the DDP model (or the module it wraps): its ``parameters()`` order names the
    parameters in the memory and in checkpoints. ``scheme``: ``none``, or any scheme with a
    compressor (``topk``, ``randk``, ``blockk``, ``signsgd``, ``qsgd``, ``powersgd``, one's own);
    ``scope``: ``layerwise`` or ``global`` (global within a
    bucket); ``aggregation``: ``allgather`` or ``allreduce`` (not for top-k and the quantizers);
    ``ratio`` in (0, 1] (the quantizers send every entry: it does not apply to them);
    ``error_feedback``; ``uncompressed``: ``"1d"``, ``"none"`` or N; ``warmup_steps``: dense
    iterations first; ``seed``; ``compressor``: the scheme's class, or what ``scheme.compressor``
    in its conf/scheme/<scheme>.yaml instantiates to (a ``functools.partial`` of the class with
    its options, e.g. ``partial(BlockRandomK, block_size=64)``); required unless ``scheme='none'``;
    ``process_group``: default WORLD; ``fast_path``: each bucket's reducer takes the fused kernels
    (``train.fast_path``, ``compress.fused``) where they run: the same messages and memory.
    Invalid values raise ``ValueError`` with the config check's one-line message.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        scheme: str,
        scope: str = "layerwise",
        aggregation: str = "allgather",
        ratio: float = 0.01,
        *,
        error_feedback: bool = True,
        uncompressed="1d",
        warmup_steps: int = 0,
        seed: int = 0,
        compressor=None,
        memory=None,
        process_group=None,
        fast_path: bool = False,
    ):
        check_combination(scheme, scope, aggregation, ratio, compressor)
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"scheme.warmup_steps={warmup_steps} is not allowed; it must be >= 0")
        self.scheme, self.scope, self.aggregation, self.ratio = scheme, scope, aggregation, float(ratio)
        self.error_feedback = bool(error_feedback)
        self.uncompressed = parse_uncompressed(uncompressed)
        self.warmup_steps = int(warmup_steps)
        self.seed = int(seed)
        self.compressor = compressor
        self.memory = memory  # the memory's class (or partial): error feedback when None
        self.process_group = process_group
        self.fast_path = bool(fast_path)
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        params = list(module.parameters())
        self._key = {id(p): i for i, p in enumerate(params)}
        self._numel = [p.numel() for p in params]
        self._shape = [tuple(p.shape) for p in params]
        # each compressed parameter's segment in the trainer's layout (the module's parameters
        # that train, those that travel whole left out, in order)
        trained = [i for i, p in enumerate(params) if p.requires_grad]
        whole = uncompressed_flags([params[i].shape for i in trained], self.uncompressed)
        self._segment = {key: s for s, key in enumerate(key for key, w in zip(trained, whole, strict=True) if not w)}
        self._whole = None  # the trainer's compressor, built when a bucket first needs its draws
        self._probe = None  # ((device, dtype), probe gradient, the trainer's update of it): _check_draws
        self.step = 0
        self._buckets: dict[int, _Bucket] = {}
        self._pending: dict[int, torch.Tensor] = {}  # memory of parameters waiting for their bucket
        self.bytes_sent: dict[int, int] = {}  # per bucket, as sent at its latest call
        self.bytes_split: dict[int, dict[str, int]] = {}  # the same, by collective
        self.dense_bytes: dict[int, int] = {}
        self.decompress_ms: list[float] = []  # this iteration's unpack times (collective callbacks)
        self.exchange_ms: list[float] = []  # this iteration's waits for earlier rounds, inside the hook
        # ... and its checks inside the hook (the decode check, the kept-state snapshot): no phase's
        self.untimed_ms: list[float] = []

    # --- accounting ----------------------------------------------------------------------------
    def _planned(self) -> SparseReducer | None:
        """The first planned bucket's reducer (None until one is planned)."""
        return next((plan.reducer for plan in self._buckets.values() if plan.reducer is not None), None)

    @property
    def ratio_applies(self) -> bool:
        red = self._planned()
        return red.ratio_applies if red is not None else True

    @property
    def aggregation_applies(self) -> bool:
        red = self._planned()
        return red.aggregation_applies if red is not None else True

    @property
    def collective(self) -> str:
        """What carries the exchange once it compresses, as the planned buckets' reducers say
        (AllGather where a round gathers; PowerSGD's rounds are AllReduces whatever
        ``aggregation``); ``aggregation`` until a bucket is planned."""
        red = self._planned()
        return red.collective if red is not None else self.aggregation

    @property
    def bytes_sent_per_step(self) -> int:
        """Bytes one rank sent in the latest iteration (values, whole tensors, positions)."""
        return sum(self.bytes_sent.values())

    @property
    def bytes_by_collective(self) -> dict[str, int]:
        """``bytes_sent_per_step`` split by the collective that carried each part."""
        return _by_collective(self.bytes_split.values())

    @property
    def dense_bytes_per_step(self) -> int:
        return sum(self.dense_bytes.values())

    # --- buckets and their memory ------------------------------------------------------------------
    def _keys(self, params) -> tuple[int, ...]:
        try:
            return tuple(self._key[id(p)] for p in params)
        except KeyError:
            raise ValueError("a DDP bucket holds a parameter that is not in the module given to "
                             "SparseHookState; pass the DDP model the hook is registered on") from None

    def _model_compressor(self, device):
        """The trainer's compressor: over the module's compressed parameters in their order (whose
        draws the buckets' compressors share, and whose bucket options they take)."""
        if self._whole is None or self._whole.device != torch.device(device):
            keys = sorted(self._segment, key=self._segment.get)
            options = {"shapes": [self._shape[k] for k in keys]} if compressor_class(self.compressor).needs_shapes else {}
            self._whole = self.compressor(self.ratio, Layout.from_sizes(self._numel[k] for k in keys), "layerwise",
                                          device=device, **options)
        return self._whole

    def _dissolve(self) -> None:
        """Split every bucket's memory (and its compressor's kept state) into per-parameter
        pieces (after a rebuild or a load)."""
        for plan in self._buckets.values():
            if plan.reducer is not None:
                self._park([key for key, _ in plan.compressed], plan.reducer.memory.buffers(),
                           plan.reducer.compressor.pieces())
        self._buckets.clear()

    def _park(self, keys, buffers: dict, kept=None) -> int:
        """Cut a bucket's memory buffers (``{name: tensor}``, whatever the memory holds, over its
        compressed parameters ``keys`` in memory order) into per-parameter pieces that wait for
        the bucket that next holds them, with each parameter's compressor state (``kept``: one
        ``{name: tensor}`` per parameter, stored as ``compressor.<name>``). Returns the entries
        used."""
        pos = 0
        for i, key in enumerate(keys):
            n = self._numel[key]
            piece = {name: buf[pos : pos + n].clone() for name, buf in buffers.items()}
            if kept is not None:
                piece.update({KEPT + name: t.clone() for name, t in kept[i].items()})
            self._pending[key] = piece
            pos += n
        return pos

    def _plan(self, bucket, buf: torch.Tensor) -> _Bucket:
        index = bucket.index()
        params = bucket.parameters()
        keys = self._keys(params)
        plan = self._buckets.get(index)
        if plan is not None and plan.keys == keys:
            return plan
        if plan is not None:  # DDP rebuilt its buckets: re-home all memory by parameter
            self._dissolve()
        shapes = [p.shape for p in params]
        flags = uncompressed_flags(shapes, self.uncompressed)
        order = compressed_first(flags)
        # Layer-wise, a tensor's positions do not depend on the bucket it is in: every bucket's
        # reducer has the run's seed, and a compressor whose draws span its tensors takes the
        # trainer's draws for them (``share_draws``) and the model's choices (``bucket_options``),
        # so the hook exchanges what the trainer does. Global scope is global within a bucket:
        # each bucket draws from its own seed, bucket_seed(seed, step, index) (shared with
        # AllReduce, per rank with AllGather).
        layerwise = self.scope == "layerwise"
        compressor = self.compressor
        if layerwise and not is_dense(self.scheme):  # (check_combination: a compressor)
            options = self._model_compressor(buf.device).bucket_options()
            compressor = functools.partial(compressor, **options) if options else compressor
        reducer = build_reducer(
            self.scheme, self.scope, self.aggregation, self.ratio,
            Layout.from_sizes(shapes[i].numel() for i in order),
            world_size=self.world_size, rank=self.rank, seed=self.seed if layerwise else step_seed(self.seed, index),
            error_feedback=self.error_feedback, memory=self.memory,
            uncompressed=[flags[i] for i in order], group=self.process_group,
            device=buf.device, dtype=buf.dtype, compressor=compressor, shapes=[tuple(shapes[i]) for i in order],
            fast_path=self.fast_path,
        )
        plan = _Bucket(keys, shapes, flags, reducer)
        if plan.reducer is not None:
            plan.reducer.kept_route = "pieces"  # the state this hook moves and saves
        if plan.reducer is not None and layerwise:
            segments = [self._segment[key] for key, _ in plan.compressed]
            plan.reducer.compressor.set_segment_ids(segments)  # what ``tensor_seed`` keys on
            if plan.reducer.compressor.draws_span_segments:
                plan.reducer.compressor.share_draws(self._model_compressor(buf.device), segments)
            self._check_draws(plan.reducer, segments, buf)
        if plan.reducer is not None:  # the bucket takes its parameters' memory, every buffer of it
            buffers, pos, kept = plan.reducer.memory.buffers(), 0, []
            for key, n in plan.compressed:
                pieces = self._pending.pop(key, None) or {}
                kept.append({name[len(KEPT):]: t for name, t in pieces.items() if name.startswith(KEPT)})
                for name, piece in pieces.items():
                    if name.startswith(KEPT):
                        continue
                    if name not in buffers or piece.numel() != n:
                        raise ValueError(f"the memory of parameter {key} has a {name!r} of {piece.numel()} "
                                         f"entries; this memory holds {sorted(buffers)} of {n}")
                    buffers[name][pos : pos + n].copy_(piece)
                pos += n
            plan.reducer.compressor.adopt(kept)
        self._buckets[index] = plan
        return plan

    def _check_draws(self, red: SparseReducer, segments, buf: torch.Tensor) -> None:
        """Layer-wise, a bucket's compressor must send for its tensors what the trainer's sends
        for them. Checked once per bucket layout on a probe gradient, both run on copies as one
        rank alone (nothing sent; no state changes): a compressor that draws from the bucket's
        own segment numbers, or one stream over its segments, without ``tensor_seed`` or
        ``share_draws`` is refused here in one line, rather than training otherwise than the
        trainer without a word."""
        if list(segments) == list(range(len(self._segment))):
            return  # the bucket is the model, in its order: nothing to compare
        whole = self._model_compressor(buf.device)
        model_copy = probe_copy(whole)
        bucket_copy = probe_copy(red.compressor, {id(whole): model_copy})
        key = (buf.device, buf.dtype)
        if self._probe is None or self._probe[0] != key:
            gen = torch.Generator().manual_seed(0x5EED)
            acc = torch.randn(whole.numel, generator=gen, dtype=torch.float64).to(buf.dtype).to(buf.device)
            self._probe = (key, acc, _alone(model_copy, acc, self, red))
        _, acc, want = self._probe
        offsets, sizes = whole.layout.offsets, whole.layout.sizes
        mine = torch.cat([acc[offsets[s] : offsets[s] + sizes[s]] for s in segments])
        got = _alone(bucket_copy, mine, self, red)
        want = torch.cat([want[offsets[s] : offsets[s] + sizes[s]] for s in segments])
        scale = float(want.abs().max()) if want.numel() else 0.0
        if float((got - want).abs().max()) > 1e-4 * scale:
            cls = type(red.compressor).__name__
            raise ConfigError(
                f"{cls} sends other numbers for a DDP bucket's tensors than for the same tensors in "
                f"the trainer (dist.ddp=true, scope=layerwise): what it draws or computes depends on "
                f"the bucket; draw segment j's numbers from self.tensor_seed(seed, j) (keyed by the "
                f"model's tensor), or, for one stream over all tensors, set draws_span_segments and "
                f"implement share_draws (docs/own_compressor.md, 'Random draws')")

    # --- the hook ---------------------------------------------------------------------------
    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        index, step = bucket.index(), self.step
        if index == 0:  # DDP reduces buckets in index order: a new iteration's accounting
            self.check_kept_state()
            self.bytes_sent.clear()
            self.bytes_split.clear()
            self.dense_bytes.clear()
            self.decompress_ms.clear()
            self.exchange_ms.clear()
            self.untimed_ms.clear()
        if bucket.is_last():  # one iteration = one pass over the buckets (as torch's PowerSGD)
            self.step += 1
        self.dense_bytes[index] = buf.numel() * buf.element_size()
        plan = None
        if not is_dense(self.scheme) and step >= self.warmup_steps:
            plan = self._plan(bucket, buf)
        if plan is None or plan.reducer is None:  # dense: DDP's own AllReduce
            self.bytes_sent[index] = self.dense_bytes[index]
            self.bytes_split[index] = {"allreduce": self.dense_bytes[index]}
            return allreduce_hook(self.process_group, bucket)
        red = plan.reducer
        self.bytes_sent[index] = red.bytes_sent_per_step
        self.bytes_split[index] = red.bytes_by_collective
        clock = _ExchangeClock()
        pending = red.start(buf, step, placement=plan.placement, timer=clock)  # the last round in flight
        self.exchange_ms.append(clock.ms)
        self.untimed_ms.append(clock.untimed_ms)
        work, pending.work = pending.work, None

        def finish(fut=None) -> torch.Tensor:
            if fut is not None:
                fut.value()  # raises if the collective failed
            t0 = time.perf_counter()
            red.finish(pending)
            self.decompress_ms.append((time.perf_counter() - t0) * 1e3)  # list.append: thread-safe
            return buf

        if work is None:  # one rank: nothing to wait for
            done = torch.futures.Future()
            done.set_result(finish())
            return done
        return work.get_future().then(finish)

    def check_kept_state(self) -> None:
        """Each bucket's compressor and memory, after its first compressed step (and the first
        after each ``watch_kept_state``): refused (``CheckpointError``) where it keeps a tensor
        that ``pieces`` / ``BUFFERS`` do not carry (``SparseReducer.check_kept_state``). The hook
        checks at each iteration's start; the trainer right after each step."""
        for plan in list(self._buckets.values()):
            if plan.reducer is not None:
                plan.reducer.check_kept_state()

    def watch_kept_state(self) -> None:
        """Every bucket's check once more, over the next iteration (``Reducer.watch_kept_state``)."""
        for plan in list(self._buckets.values()):
            if plan.reducer is not None:
                plan.reducer.watch_kept_state()

    # --- what the trainer reads --------------------------------------------------------------
    def plan(self, bucket: dist.GradBucket) -> None:
        """Build ``bucket``'s reducer (and hand it its parameters' memory) without exchanging:
        the trainer calls it while DDP settles its buckets, so sizes are known before step 0."""
        if not is_dense(self.scheme):
            self._plan(bucket, bucket.buffer())

    def sizes(self) -> dict:
        """Per step once compression runs, over the buckets planned so far: ``bytes_sent``
        (and ``bytes_by_collective``, split by collective), ``uncompressed_bytes`` (tensors that
        travel whole) and ``density`` (entries sent / entries)."""
        out = {"bytes_sent": 0, "uncompressed_bytes": 0, "sent_entries": 0.0, "numel": 0}
        out["bytes_by_collective"] = _by_collective(split_by_collective(plan.sizes) for plan in self._buckets.values())
        for plan in self._buckets.values():
            red = plan.sizes  # the bucket's reducer, sparse or (whole tensors only) dense
            out["bytes_sent"] += red.bytes_sent_per_step
            out["uncompressed_bytes"] += red.uncompressed_bytes_per_step
            out["sent_entries"] += red.density * red.numel
            out["numel"] += red.numel
        numel = out.pop("numel")
        out["density"] = out.pop("sent_entries") / numel if numel else 1.0
        return out

    def memory_norm(self) -> float:
        """||memory|| over every bucket (and memory waiting for its bucket): the norm of each
        memory's first buffer (error feedback's ``memory``)."""
        sq = sum(plan.reducer.memory.norm() ** 2 for plan in self._buckets.values() if plan.reducer is not None)
        for pieces in self._pending.values():
            first = next((t for name, t in pieces.items() if not name.startswith(KEPT)), None)
            sq += 0.0 if first is None else float(first.double().pow(2).sum())
        return math.sqrt(sq)

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``step`` and the memory per bucket (``params``: positions in ``module.parameters()``
        of the compressed parameters it covers, in memory order; ``layout``: all the bucket's
        parameters; then the memory's buffers by name, error feedback's ``memory``), plus memory
        not yet re-homed (per parameter, its buffers by name).

        Restored, the memory and the step are exact. The trainer lets DDP settle its buckets
        (two bypassed iterations, ``train.ddp_exchange``) before every run's first step, fresh or
        resumed (global scope draws per bucket), and resumes bit for bit."""
        buckets = {}
        for index, plan in self._buckets.items():
            if plan.reducer is not None:
                buckets[index] = {"params": [k for k, _ in plan.compressed],
                                  "layout": list(plan.keys),  # every parameter of the bucket, in order
                                  **{name: buf.detach().clone() for name, buf in plan.reducer.memory.buffers().items()}}
                kept = plan.reducer.compressor.pieces()
                if any(kept):  # the compressor's state, per parameter (PowerSGD's Q)
                    buckets[index]["compressor"] = [{n: t.clone() for n, t in p.items()} for p in kept]
        return {"step": self.step, "buckets": buckets,
                "pending": {k: {name: t.clone() for name, t in v.items()} for k, v in self._pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore step and memory; each bucket takes its parameters' memory when it next runs,
        whatever DDP's bucket layout is now. (Checkpoints written before memories had several
        buffers hold error feedback's ``memory`` alone, as a tensor per parameter: read alike.)"""
        self._buckets.clear()
        self._pending = {int(k): ({"memory": v.clone()} if isinstance(v, torch.Tensor)
                                  else {name: t.clone() for name, t in v.items()})
                         for k, v in state.get("pending", {}).items()}
        for entry in state["buckets"].values():
            buffers = {name: t for name, t in entry.items() if name not in ("params", "layout", "compressor")}
            used = self._park([int(key) for key in entry["params"]], buffers, entry.get("compressor"))
            for name, t in buffers.items():
                if used != t.numel():
                    raise ValueError(f"a saved bucket's {name} has {t.numel()} entries, its parameters {used}")
        self.step = int(state["step"])


def _by_collective(splits) -> dict[str, int]:
    """Bytes by collective, summed over ``splits`` (one ``{collective: bytes}`` per bucket)."""
    out: dict[str, int] = {}
    for split in splits:
        for kind, n in split.items():
            out[kind] = out.get(kind, 0) + n
    return out


def _alone(compressor, acc: torch.Tensor, state: SparseHookState, red: SparseReducer) -> torch.Tensor:
    """The update ``compressor`` decodes from ``acc`` at the first compressed step, run as one rank
    alone with ``red``'s seed and rank (its draws are this rank's), without memory."""
    alone = SparseReducer(compressor, aggregation=state.aggregation, world_size=1, rank=state.rank,
                          seed=red.seed, error_feedback=False, device=acc.device, dtype=acc.dtype)
    alone._kept = True  # a probe: not a step of the run
    alone.decode_checked = True
    out = acc.clone()
    with torch.random.fork_rng(devices=[acc.device] if acc.device.type == "cuda" else []):
        alone.finish(alone.start(out, state.warmup_steps, async_op=False))
    return out


class _ExchangeClock:
    """The hook's timer for ``SparseReducer.start``: the time spent in ``exchange`` (earlier
    rounds waited for, the last one launched), so the trainer can tell it from compression."""

    def __init__(self):
        self.ms = 0.0
        self.untimed_ms = 0.0  # checks inside the hook: the trainer takes them out of the step

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if name == "exchange":
                self.ms += (time.perf_counter() - t0) * 1e3

    @contextlib.contextmanager
    def untimed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.untimed_ms += (time.perf_counter() - t0) * 1e3

    def leave_out(self) -> None:  # the hook's steps are left out, or not, by the trainer's timer
        pass


# ------------------------------------------------------------------------- bytes of other hooks
def powersgd_numel(shapes, rank: int, min_compression_rate: float = 2.0, *, whole_only: bool = False) -> int:
    """Entries torch's PowerSGD hook sends per step: rank x (n + m) for each tensor viewed as an
    n x m matrix (n = shape[0]) that it compresses, the others (1-D ones, small ones) whole; the
    same test as torch's ``_should_compress``. ``whole_only``: the entries of the whole ones."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) else 1
        m = numel // n
        r = min(n, m, rank)
        compressed = (n + m) * r * min_compression_rate < numel
        total += numel if not compressed else 0 if whole_only else r * (n + m)
    return total


def hook_numel(shapes, ratio: float, uncompressed="1d") -> int:
    """Entries the layer-wise hook sends per step at ``ratio`` (k_i per compressed tensor, the
    whole tensors of ``uncompressed``), as the reducer it builds counts them."""
    flags = uncompressed_flags(shapes, parse_uncompressed(uncompressed))
    order = compressed_first(flags)
    red = build_reducer("blockk", "layerwise", "allreduce", ratio,
                        Layout.from_sizes(math.prod(shapes[i]) for i in order),
                        world_size=1, rank=0, seed=0, uncompressed=[flags[i] for i in order],
                        compressor=BlockRandomK)
    return red.entries_sent


def matched_powersgd_rank(shapes, ratio: float) -> int:
    """The rank (1-64) at which torch's PowerSGD hook's bytes come closest to the layer-wise
    hook's at ``ratio`` (the rule of sparsetrain's PowerSGD too: ``compress.powersgd.closest_rank``)."""
    from sparsetrain.compress.powersgd import closest_rank

    return closest_rank(lambda r: powersgd_numel(shapes, r), hook_numel(shapes, ratio))


def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, sparse_hook)``."""
    return state.run(bucket)


__all__ = ["SparseHookState", "bucket_seed", "hook_numel", "matched_powersgd_rank", "powersgd_numel",
           "sparse_hook"]
