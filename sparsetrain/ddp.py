"""DDP communication hooks: sparsetrain's schemes inside any torch DistributedDataParallel model.

    from sparsetrain.compress import BlockRandomK
    from sparsetrain.ddp import SparseHookState, sparse_hook
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
- error feedback, compression and the one collective are those of
  ``sparsetrain.comm.SparseReducer`` (one reducer per bucket: its memory, compressor, message
  and collective): AllReduce sums the k values and the whole tensors in one buffer; AllGather
  sends values, whole tensors and positions in one packed message. The collective is started
  asynchronously; the returned future gives the averaged bucket (divided by world size);
- all of it on the bucket in place: the error-feedback add reads the compressed tensors where
  they lie in the bucket, the whole tensors go straight into the message and back, the averaged
  values are added at their bucket positions, and the hook returns the bucket itself (no copy of
  the bucket into the reducer's ``[compressed | whole]`` order and back). Build DDP with
  ``gradient_as_bucket_view=True`` (the trainer does): the ``.grad`` tensors are then views of
  the buckets, and DDP copies no gradient into a bucket or back either;
- positions come from ``bucket_seed(seed, step, bucket)``: shared by all ranks for AllReduce,
  per rank for AllGather (each bucket's reducer is seeded with the bucket's seed, as the
  trainer's reducer is with the run's);
- the first ``warmup_steps`` iterations use DDP's plain AllReduce; compression then starts with
  empty memory. ``state.step`` counts iterations (it advances on the bucket DDP reduces last).

Each bucket issues exactly one collective, from the hook itself (never from a future
callback), so ranks issue collectives in the same order with any number of buckets, on gloo too.

Bucket rebuilds. DDP rebuilds its buckets once, before the second iteration, in the order the
gradients arrived (and a fresh DDP after a resume starts again from its initial buckets). The
memory is kept per bucket index, and each bucket records which parameters it covers (their
positions in ``module.parameters()``). When a bucket index arrives with other parameters than
before, every bucket's memory is split back into per-parameter pieces, and each new bucket takes
its parameters' pieces when it first runs: no memory is lost or misplaced, whatever the new
layout. (torch's PowerSGD hook instead refuses error feedback before iteration 2.) The same
re-homing loads a checkpoint into any bucket layout.

Over 400 lines on purpose: the hook works on DDP's bucket in place, so where each parameter's
entries lie in a bucket (the slot map), the memory re-homing and the hook read the same layout
and change together.
"""

# no `from __future__ import annotations`: DDP compares the hook's annotations to the real types
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from sparsetrain.comm import SparseReducer, build_reducer, check_combination
from sparsetrain.comm.flat import packed_runs
from sparsetrain.compress import (
    BlockRandomK,
    Layout,
    compressed_first,
    parse_uncompressed,
    step_seed,
    uncompressed_flags,
)


def bucket_seed(seed: int, step: int, bucket: int, rank: int | None = None) -> int:
    """Seed of one bucket's positions at one step: ``step_seed(step_seed(seed, bucket), step,
    rank)``. ``rank=None``: the same on every rank (AllReduce); a rank: its own (AllGather)."""
    return step_seed(step_seed(seed, bucket), step, rank)



class _Bucket:
    """One DDP bucket as the hook sees it: its parameters, where its compressed and its whole
    tensors lie in the bucket, and the reducer.

    The reducer's memory and message hold the compressed tensors, then the whole ones, each group
    in bucket order (``[compressed | whole]``); the bucket interleaves them (a convolution, its
    batch-norm vectors, the next convolution, ...). The hook works on the bucket itself: the
    error-feedback add reads the compressed tensors where they lie, the whole ones are copied
    straight into the message and back, and the averaged values are added at their bucket
    positions (``place``): no copy of the bucket into that order and back.
    """

    def __init__(self, keys, shapes, flags, reducer):
        self.keys = keys
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.reducer: SparseReducer | None = reducer
        order = compressed_first(flags)
        self.compressed = [(keys[i], sizes[i]) for i in order if not flags[i]]  # memory layout
        self.grad_runs = packed_runs((offsets[i], sizes[i]) for i in order if not flags[i])
        self.whole_runs = packed_runs((offsets[i], sizes[i]) for i in order if flags[i])
        self._shift = None  # where a compressed entry's index lands in the bucket: see place()
        self._run_starts = self._run_shift = None
        if reducer is None:
            return
        from sparsetrain.compress.schemes import BlockRandomK, RandomK, TopK

        comp = reducer.compressor
        if len(self.grad_runs) == 1:
            self._shift = self.grad_runs[0][0]
        elif comp.scope == "layerwise" and type(comp) in (TopK, RandomK, BlockRandomK):
            # these put segment s's entries at slots [sum(ks[:s]), sum(ks[:s+1])): one shift a slot
            moved, pos = [], 0
            for i in order:  # per compressed tensor: its bucket offset - its memory offset
                if not flags[i]:
                    moved.append(offsets[i] - pos)
                    pos += sizes[i]
            ks = torch.tensor(comp.ks, dtype=torch.int64)
            self._shift = torch.repeat_interleave(torch.tensor(moved, dtype=torch.int64), ks).to(comp.device)
        else:
            self._run_starts = torch.tensor([f for _, f, _ in self.grad_runs], dtype=torch.int64, device=comp.device)
            self._run_shift = torch.tensor([a - f for a, f, _ in self.grad_runs], dtype=torch.int64, device=comp.device)

    def place(self, idx: torch.Tensor) -> torch.Tensor:
        """Bucket positions of the compressed part's entry indices ``idx`` (in the order of the
        compressor's values)."""
        if self._run_starts is not None:
            run = torch.searchsorted(self._run_starts, idx, right=True).sub_(1)
            return idx + self._run_shift[run]
        return idx + self._shift if not isinstance(self._shift, int) or self._shift else idx

    # The two halves of ``SparseReducer.pack`` / ``unpack`` on the bucket in place (the same
    # operations on the same numbers, so the same results; keep the two in step).
    def pack(self, buf: torch.Tensor, step: int):
        """Error feedback and compression of the bucket's compressed tensors into the reducer's
        message, the whole tensors after the values (and, for AllGather, the positions)."""
        red = self.reducer
        comp, k = red.compressor, red.compressor.num_values
        pieces = [(f, buf[a : a + n]) for a, f, n in self.grad_runs]
        wire = red._send_positions if red.aggregation == "allgather" else None
        payload = red.memory.step(pieces if len(pieces) > 1 else pieces[0][1], comp,
                                  red.positions_seed(step), out=red._values[:k], wire=wire)
        for a, w, n in self.whole_runs:
            red._values[k + w : k + w + n].copy_(buf[a : a + n])
        return payload

    def unpack(self, buf: torch.Tensor, payload) -> None:
        """Overwrite the bucket with the average over ranks (after the collective)."""
        red = self.reducer
        comp, k, world = red.compressor, red.compressor.num_values, red.world_size
        if not comp.sends_entries:  # a quantizer: every message decodes to the whole compressed part
            self._unpack_dense(buf)
            return
        own = payload.indices if payload.indices is not None else comp.indices(payload.positions)
        for a, _, n in self.grad_runs:
            buf[a : a + n].zero_()
        if red.aggregation == "allreduce":
            red._values.div_(world)
            self.place_add(buf, red._values[:k], own)
            for a, w, n in self.whole_runs:
                buf[a : a + n].copy_(red._values[k + w : k + w + n])
            return
        for a, _, n in self.whole_runs:
            buf[a : a + n].zero_()
        for r, values, wire in red.messages():
            idx = own if r == red.rank else comp.indices(wire)  # own positions already expanded
            self.place_add(buf, values[:k], idx)
            for a, w, n in self.whole_runs:
                buf[a : a + n].add_(values[k + w : k + w + n])

    def place_add(self, buf: torch.Tensor, values: torch.Tensor, idx: torch.Tensor) -> None:
        """``buf[place(idx)] += values``: a message's values added where its entries lie in the
        bucket (``idx`` index the compressed layout; the bucket orders tensors its own way)."""
        buf.index_add_(0, self.place(idx), values.to(buf.dtype))

    def _unpack_dense(self, buf: torch.Tensor) -> None:
        """``unpack`` for a compressor whose messages decode to every compressed entry (the
        quantizers, AllGather only): every rank's message decoded in rank order, as
        ``SparseReducer.unpack`` does, into the bucket's compressed tensors where they are one
        run, else into a buffer in memory order copied to them."""
        red = self.reducer
        comp, k = red.compressor, red.compressor.num_values
        if len(self.grad_runs) == 1:
            a, _, n = self.grad_runs[0]
            dense = buf[a : a + n]
        else:
            dense = self.__dict__.get("_dense")
            if dense is None:
                dense = self._dense = torch.empty(comp.numel, dtype=buf.dtype, device=buf.device)
        dense.zero_()
        for a, _, n in self.whole_runs:
            buf[a : a + n].zero_()
        for _, values, wire in red.messages():
            comp.decompress_add(values[:k], wire, dense)
            for a, w, n in self.whole_runs:
                buf[a : a + n].add_(values[k + w : k + w + n])
        if len(self.grad_runs) > 1:
            for a, f, n in self.grad_runs:
                buf[a : a + n].copy_(dense[f : f + n])


class SparseHookState:
    """State of ``sparse_hook``: the options of the config and one reducer (with its
    error-feedback memory) per DDP bucket.

    ``module``: the DDP model (or the module it wraps): its ``parameters()`` order names the
    parameters in the memory and in checkpoints. ``scheme``: ``none``, ``topk``, ``randk``,
    ``blockk``, ``signsgd``, ``qsgd``; ``scope``: ``layerwise`` or ``global`` (global within a
    bucket); ``aggregation``: ``allgather`` or ``allreduce`` (not for top-k and the quantizers);
    ``ratio`` in (0, 1] (the quantizers send every entry: it does not apply to them);
    ``error_feedback``; ``uncompressed``: ``"1d"``, ``"none"`` or N; ``warmup_steps``: dense
    iterations first; ``seed``; ``compressor``: the scheme's class, or what ``scheme.compressor``
    in its conf/scheme/<scheme>.yaml instantiates to (a ``functools.partial`` of the class with
    its options, e.g. ``partial(BlockRandomK, block_size=64)``); required unless ``scheme='none'``;
    ``process_group``: default WORLD.
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
        process_group=None,
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
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        params = list(module.parameters())
        self._key = {id(p): i for i, p in enumerate(params)}
        self._numel = [p.numel() for p in params]
        self.step = 0
        self._buckets: dict[int, _Bucket] = {}
        self._pending: dict[int, torch.Tensor] = {}  # memory of parameters waiting for their bucket
        self.bytes_sent: dict[int, int] = {}  # per bucket, as sent at its latest call
        self.dense_bytes: dict[int, int] = {}
        self.decompress_ms: list[float] = []  # this iteration's unpack times (collective callbacks)

    # --- accounting ----------------------------------------------------------------------------
    @property
    def bytes_sent_per_step(self) -> int:
        """Bytes one rank sent in the latest iteration (values, whole tensors, positions)."""
        return sum(self.bytes_sent.values())

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

    def _dissolve(self) -> None:
        """Split every bucket's memory into per-parameter pieces (after a rebuild or a load)."""
        for plan in self._buckets.values():
            if plan.reducer is not None:
                self._park([key for key, _ in plan.compressed], plan.reducer.memory.memory)
        self._buckets.clear()

    def _park(self, keys, memory: torch.Tensor) -> int:
        """Cut a bucket's memory (its compressed parameters ``keys``, in memory order) into
        per-parameter pieces that wait for the bucket that next holds them. Returns the entries
        used."""
        pos = 0
        for key in keys:
            n = self._numel[key]
            self._pending[key] = memory[pos : pos + n].clone()
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
        # Each bucket's reducer draws its positions from the bucket's own seed: its seed rule
        # (shared with AllReduce, per rank with AllGather) then gives bucket_seed(seed, step, index).
        reducer = build_reducer(
            self.scheme, self.scope, self.aggregation, self.ratio,
            Layout.from_sizes(shapes[i].numel() for i in order),
            world_size=self.world_size, rank=self.rank, seed=step_seed(self.seed, index),
            error_feedback=self.error_feedback,
            uncompressed=[flags[i] for i in order], group=self.process_group,
            device=buf.device, dtype=buf.dtype, compressor=self.compressor,
        )
        plan = _Bucket(keys, shapes, flags, reducer if isinstance(reducer, SparseReducer) else None)
        if plan.reducer is not None:
            mem, pos = plan.reducer.memory.memory, 0
            for key, n in plan.compressed:
                piece = self._pending.pop(key, None)
                if piece is not None:
                    if piece.numel() != n:
                        raise ValueError(f"error-feedback memory of parameter {key} has {piece.numel()} "
                                         f"entries, the parameter {n}")
                    mem[pos : pos + n].copy_(piece)
                pos += n
        self._buckets[index] = plan
        return plan

    # --- the hook ---------------------------------------------------------------------------
    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        index, step = bucket.index(), self.step
        if index == 0:  # DDP reduces buckets in index order: a new iteration's accounting
            self.bytes_sent.clear()
            self.dense_bytes.clear()
            self.decompress_ms.clear()
        if bucket.is_last():  # one iteration = one pass over the buckets (as torch's PowerSGD)
            self.step += 1
        self.dense_bytes[index] = buf.numel() * buf.element_size()
        plan = None
        if self.scheme != "none" and step >= self.warmup_steps:
            plan = self._plan(bucket, buf)
        if plan is None or plan.reducer is None:  # dense: DDP's own AllReduce
            self.bytes_sent[index] = self.dense_bytes[index]
            return allreduce_hook(self.process_group, bucket)
        red = plan.reducer
        self.bytes_sent[index] = red.bytes_sent_per_step
        payload = plan.pack(buf, step)
        work = red.communicate(async_op=True)  # in flight when the hook returns

        def finish(fut=None) -> torch.Tensor:
            if fut is not None:
                fut.value()  # raises if the collective failed
            t0 = time.perf_counter()
            plan.unpack(buf, payload)
            self.decompress_ms.append((time.perf_counter() - t0) * 1e3)  # list.append: thread-safe
            return buf

        if work is None:  # one rank: nothing to wait for
            done = torch.futures.Future()
            done.set_result(finish())
            return done
        return work.get_future().then(finish)

    # --- what the trainer reads --------------------------------------------------------------
    def plan(self, bucket: dist.GradBucket) -> None:
        """Build ``bucket``'s reducer (and hand it its parameters' memory) without exchanging:
        the trainer calls it while DDP settles its buckets, so sizes are known before step 0."""
        if self.scheme != "none":
            self._plan(bucket, bucket.buffer())

    def sizes(self) -> dict:
        """Per step once compression runs, over the buckets planned so far: ``bytes_sent``,
        ``uncompressed_bytes`` (tensors that travel whole) and ``density`` (entries sent /
        entries)."""
        out = {"bytes_sent": 0, "uncompressed_bytes": 0, "sent_entries": 0.0, "numel": 0}
        for plan in self._buckets.values():
            red = plan.reducer
            if red is None:
                continue
            out["bytes_sent"] += red.bytes_sent_per_step
            out["uncompressed_bytes"] += red.uncompressed_bytes_per_step
            out["sent_entries"] += red.density * red.numel
            out["numel"] += red.numel
        numel = out.pop("numel")
        out["density"] = out.pop("sent_entries") / numel if numel else 1.0
        return out

    def memory_norm(self) -> float:
        """||error-feedback memory|| over every bucket (and memory waiting for its bucket)."""
        sq = sum(float(plan.reducer.memory.memory.double().pow(2).sum())
                 for plan in self._buckets.values() if plan.reducer is not None)
        sq += sum(float(piece.double().pow(2).sum()) for piece in self._pending.values())
        return math.sqrt(sq)

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``step`` and the memory per bucket (``params``: positions in ``module.parameters()``
        of the compressed parameters it covers, in memory order; ``layout``: all the bucket's
        parameters), plus memory not yet re-homed.

        Restored, the memory and the step are exact. Positions are drawn per bucket, so a resumed
        run draws those of an uninterrupted one only once DDP has its rebuilt buckets back: a
        fresh DDP runs its first iteration on one initial bucket. The trainer therefore lets DDP
        settle its buckets (two bypassed iterations, ``train.ddp_exchange``) before every run's
        first step, fresh or resumed, and resumes bit for bit."""
        buckets = {}
        for index, plan in self._buckets.items():
            if plan.reducer is not None:
                buckets[index] = {"params": [k for k, _ in plan.compressed],
                                  "memory": plan.reducer.memory.memory.detach().clone(),
                                  "layout": list(plan.keys)}  # every parameter of the bucket, in order
        return {"step": self.step, "buckets": buckets,
                "pending": {k: v.clone() for k, v in self._pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore step and memory; each bucket takes its parameters' memory when it next runs,
        whatever DDP's bucket layout is now."""
        self._buckets.clear()
        self._pending = {int(k): v.clone() for k, v in state.get("pending", {}).items()}
        for entry in state["buckets"].values():
            mem = entry["memory"]
            used = self._park([int(key) for key in entry["params"]], mem)
            if used != mem.numel():
                raise ValueError(f"a saved bucket's memory has {mem.numel()} entries, its parameters {used}")
        self.step = int(state["step"])


# ------------------------------------------------------------------------- bytes of other hooks
def powersgd_numel(shapes, rank: int, min_compression_rate: float = 2.0) -> int:
    """Entries torch's PowerSGD hook sends per step: rank x (n + m) for each tensor viewed as an
    n x m matrix (n = shape[0]) that it compresses, the others (1-D ones, small ones) whole; the
    same test as torch's ``_should_compress``."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        n = shape[0] if len(shape) else 1
        m = numel // n
        r = min(n, m, rank)
        total += r * (n + m) if (n + m) * r * min_compression_rate < numel else numel
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
