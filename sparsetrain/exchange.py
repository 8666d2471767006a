"""Exchange: turn every rank's gradient into the averaged update, one collective per step.

The trainer keeps all gradients in one flat buffer (parameters' ``.grad`` are views into it).
A reducer overwrites that buffer, in place, with the update every rank applies identically.

- ``DenseReducer``: plain AllReduce (dense SGD, scheme ``none``).
- ``SparseReducer``: error feedback + a compressor from ``sparsetrain.compress``, then either
  ``allreduce`` (positions drawn from a seed shared by all ranks: only the k values are summed)
  or ``allgather`` (each rank its own positions; values and positions packed into one byte
  buffer, one ``all_gather_into_tensor``, every rank adds all contributions).

Tensors that bypass compression (``scheme.uncompressed``: by default the 1-D ones) sit at the end
of the flat buffer (``flat_gradients`` orders it so) and travel whole in the same collective:
appended to the AllReduce buffer, or to the packed AllGather message.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparsetrain.compress import (
    SCOPES,
    ErrorFeedback,
    Layout,
    as_layout,
    available,
    get_compressor,
    step_seed,
    uncompressed_flags,
)
from sparsetrain.timing import PhaseTimer

AGGREGATIONS = ("allreduce", "allgather")


@dataclass
class ExchangeStats:
    """What one step sent. Byte counts are per worker, as put on the wire."""

    bytes_sent: int
    dense_bytes: int
    density: float = 1.0
    compression_error: float | None = None  # ||acc - sent|| / ||acc||
    memory_norm: float | None = None  # ||error-feedback memory|| after the step


class DenseReducer:
    """Plain data-parallel SGD: one AllReduce of the flat gradient, divided by world size.

    ``attach(params)`` (optional) overlaps the AllReduce with backward, as DDP does: the flat
    buffer is cut into buckets of whole parameters in reverse order (the order backward produces
    them), and a bucket's asynchronous AllReduce starts from a post-accumulate-grad hook as soon as
    all its parameters have their gradient (buckets start in the same order on every rank).
    ``reduce`` then waits for what is still in flight. Same result as without ``attach``.
    """

    def __init__(self, numel: int, element_size: int = 4, group=None):
        self.group = group
        self.numel = numel
        self.dense_bytes_per_step = numel * element_size
        self.bytes_sent_per_step = self.dense_bytes_per_step
        self.uncompressed_bytes_per_step = self.dense_bytes_per_step  # everything goes whole
        self.density = 1.0
        self.warmup_steps = 0
        self._buckets: list[tuple[int, int]] = []
        self._flat: torch.Tensor | None = None
        self._hooks: list = []

    # --- overlap with backward -------------------------------------------------------------
    def attach(self, params, flat_grad: torch.Tensor, bucket_mb: float = 4.0, first_bucket_mb: float = 1.0):
        """Start bucket AllReduces during backward. ``params``' ``.grad`` must be views of
        ``flat_grad`` in order (as the trainer sets them up)."""
        if not (dist.is_initialized() and dist.get_world_size(self.group) > 1):
            return self
        params = [p for p in params if p.requires_grad]
        esize = flat_grad.element_size()
        offs, off = [], 0
        for p in params:
            offs.append(off)
            off += p.numel()
        if off != flat_grad.numel():
            raise ValueError(f"params hold {off} entries, the flat gradient {flat_grad.numel()}")
        self._flat = flat_grad
        self._buckets, self._bucket_of, members = [], {}, []
        cap = first_bucket_mb * 2**20
        end, size, cur = off, 0, []
        for i in reversed(range(len(params))):
            cur.append(i)
            size += params[i].numel() * esize
            if size >= cap or i == 0:
                start = offs[i]
                self._buckets.append((start, end))
                members.append(list(cur))
                end, size, cur, cap = start, 0, [], bucket_mb * 2**20
        for b, mem in enumerate(members):
            for i in mem:
                self._bucket_of[id(params[i])] = b
        self._need = [len(m) for m in members]
        self._reset()
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return self

    def _reset(self):
        self._left = list(self._need)
        self._next = 0
        self._handles: list = []

    def _on_grad(self, p):
        b = self._bucket_of[id(p)]
        self._left[b] -= 1
        while self._next < len(self._buckets) and self._left[self._next] <= 0:
            self._launch(self._next)

    def _launch(self, b: int):
        a, e = self._buckets[b]
        self._handles.append(dist.all_reduce(self._flat[a:e], group=self.group, async_op=True))
        self._next = b + 1

    def detach(self):
        for h in self._hooks:
            h.remove()
        self._hooks, self._buckets, self._flat = [], [], None

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer) -> ExchangeStats:
        with timer.phase("exchange"):
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                if self._buckets and flat_grad is self._flat:
                    while self._next < len(self._buckets):  # buckets whose hooks did not fire
                        self._launch(self._next)
                    for h in self._handles:
                        h.wait()
                    self._reset()
                else:
                    dist.all_reduce(flat_grad, group=self.group)
                flat_grad.div_(dist.get_world_size(self.group))
        return ExchangeStats(self.bytes_sent_per_step, self.dense_bytes_per_step)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def flat_gradients(params, uncompressed=None, *, device=None, dtype=torch.float32):
    """One flat gradient buffer whose slices are the parameters' ``.grad`` (backward accumulates
    in place, the reducer reads and overwrites the buffer, the optimizer reads ``.grad``).

    ``uncompressed``: one flag per parameter (``compress.uncompressed_flags``); flagged tensors
    are placed last, the others first, each group in parameter order, so that the compressed
    part is one contiguous prefix (global scope compresses it as one vector) and the whole
    tensors one contiguous tail. Returns ``(flat, params_in_buffer_order, flags_in_that_order)``.
    """
    params = [p for p in params if p.requires_grad]
    flags = [False] * len(params) if uncompressed is None else [bool(f) for f in uncompressed]
    if len(flags) != len(params):
        raise ValueError(f"{len(flags)} uncompressed flags for {len(params)} parameters")
    order = [i for i, f in enumerate(flags) if not f] + [i for i, f in enumerate(flags) if f]
    params = [params[i] for i in order]
    flags = [flags[i] for i in order]
    device = device if device is not None else (params[0].device if params else "cpu")
    flat = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
    for p, view in zip(params, as_layout(params).views(flat, [p.shape for p in params])):
        p.grad = view
    return flat, params, flags


def check_combination(scheme: str, scope: str, aggregation: str, ratio: float) -> None:
    """Raise ``ValueError`` (one line: key, value, what is allowed) for an invalid combination.

    Pure: usable before any rank starts. ``scheme=none`` is dense SGD and accepts any scope and
    aggregation (they do not apply to it).
    """
    get_compressor(scheme)  # raises for an unknown scheme, listing the known ones
    if scope not in SCOPES:
        raise ValueError(f"scope={scope!r} is not allowed; allowed: {', '.join(SCOPES)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"aggregation={aggregation!r} is not allowed; allowed: {', '.join(AGGREGATIONS)}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio={ratio!r} is not allowed; allowed: a number in (0, 1]")
    if scheme != "none" and aggregation == "allreduce" and not get_compressor(scheme).shared_positions:
        raise ValueError(
            f"aggregation='allreduce' is not available for scheme={scheme!r} (top-k picks "
            f"different positions on every rank); use aggregation=allgather"
        )


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """One AllGather into one flat tensor (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class SparseReducer:
    """Error feedback + compression + one collective + decompression, on the flat buffer.

    Result on every rank: ``flat_grad = (1/W) * sum_r decompress(payload_r)``, identical on all
    ranks (the same additions in the same rank order). Values are divided by W before they are
    added, which is exact for W = 2 (and any power of two) so that ratio=1 matches dense there.

    The flat buffer is ``[compressed prefix | uncompressed tail]``: the compressor and the
    error-feedback memory cover the prefix (``compressor.numel`` entries); the last
    ``uncompressed_numel`` entries travel whole, after the sparse values in the same message,
    and never enter the memory. For the first ``warmup_steps`` steps the whole buffer is
    AllReduced densely and the memory stays empty; compression starts at step ``warmup_steps``.
    """

    def __init__(
        self,
        compressor,
        *,
        aggregation: str,
        world_size: int,
        rank: int,
        seed: int,
        error_feedback: bool = True,
        uncompressed_numel: int = 0,
        warmup_steps: int = 0,
        group=None,
        device="cpu",
        dtype=torch.float32,
        stats_every: int = 1,
    ):
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation={aggregation!r} is not allowed; allowed: {', '.join(AGGREGATIONS)}"
            )
        if aggregation == "allreduce" and not compressor.shared_positions:
            raise ValueError(
                f"aggregation='allreduce' is not available for scheme={compressor.name!r} (top-k "
                f"picks different positions on every rank); use aggregation=allgather"
            )
        self.compressor = compressor
        self.aggregation = aggregation
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.group = group
        self.device = torch.device(device)
        self.dtype = dtype
        self.stats_every = int(stats_every)
        self.warmup_steps = int(warmup_steps)
        self.compressed_numel = compressor.numel
        self.uncompressed_numel = int(uncompressed_numel)
        self.numel = self.compressed_numel + self.uncompressed_numel
        self.memory = ErrorFeedback(self.compressed_numel, enabled=error_feedback, device=device, dtype=dtype)

        esize = torch.empty((), dtype=dtype).element_size()
        k, p = compressor.k, compressor.num_positions
        num_values = k + self.uncompressed_numel  # sparse values, then the whole tensors
        self.density = num_values / self.numel
        self.pos_dtype = torch.int32 if compressor.max_position < 2**31 else torch.int64
        psize = torch.empty((), dtype=self.pos_dtype).element_size()
        self.dense_bytes_per_step = self.numel * esize
        self.uncompressed_bytes_per_step = self.uncompressed_numel * esize
        if aggregation == "allreduce":
            self._values = torch.empty(num_values, dtype=dtype, device=device)
            self.bytes_sent_per_step = num_values * esize
        else:
            self._val_bytes = num_values * esize
            self._pos_off = -(-self._val_bytes // psize) * psize  # aligned for the int view
            align = max(esize, psize)  # every rank's message starts aligned for both views
            self._msg_bytes = -(-(self._pos_off + p * psize) // align) * align
            self._send = torch.zeros(self._msg_bytes, dtype=torch.uint8, device=device)
            self._recv = torch.zeros(self.world_size * self._msg_bytes, dtype=torch.uint8, device=device)
            self._values = self._send[: self._val_bytes].view(dtype)
            self._pos_end = self._pos_off + p * psize
            self._send_pos = self._send[self._pos_off : self._pos_end].view(self.pos_dtype)
            self.bytes_sent_per_step = self._msg_bytes

    def _step_seed(self, step: int) -> int:
        rank = None if self.aggregation == "allreduce" else self.rank
        return step_seed(self.seed, step, rank)

    def _dense_step(self, flat_grad: torch.Tensor, W: int, timer: PhaseTimer) -> ExchangeStats:
        """Compression warm-up: plain AllReduce of everything; the memory stays untouched."""
        with timer.phase("exchange"):
            if W > 1:
                dist.all_reduce(flat_grad, group=self.group)
                flat_grad.div_(W)
        return ExchangeStats(self.dense_bytes_per_step, self.dense_bytes_per_step, 1.0, 0.0, 0.0)

    def reduce(self, flat_grad: torch.Tensor, step: int, timer: PhaseTimer) -> ExchangeStats:
        W = _world(self.group)
        if W != self.world_size:
            raise RuntimeError(
                f"world_size={self.world_size} but the process group has {W} ranks"
            )
        if flat_grad.numel() != self.numel:
            raise ValueError(f"the flat gradient has {flat_grad.numel()} entries, the reducer {self.numel}")
        if step < self.warmup_steps:
            return self._dense_step(flat_grad, W, timer)
        nc, k = self.compressed_numel, self.compressor.k
        grad, whole = flat_grad[:nc], flat_grad[nc:]
        want_stats = self.stats_every > 0 and step % self.stats_every == 0
        grad_sq = float(torch.dot(grad, grad)) if want_stats and not self.memory.enabled else None
        comp = self.compressor
        with timer.phase("compress"):
            acc = self.memory.accumulate(grad)
            payload = comp.compress(acc, self._step_seed(step), out=self._values[:k])
            self.memory.forget(payload, comp)
            self._values[k:].copy_(whole)
            if self.aggregation == "allgather":
                self._send_pos.copy_(payload.positions)
        stats = self.memory.stats(payload, grad_sq) if want_stats else (None, None)

        with timer.phase("exchange"):
            if W > 1:
                if self.aggregation == "allreduce":
                    dist.all_reduce(self._values, group=self.group)
                else:
                    _all_gather_single(self._recv, self._send, group=self.group)
            elif self.aggregation == "allgather":
                self._recv[: self._msg_bytes].copy_(self._send)

        with timer.phase("decompress"):
            grad.zero_()
            if self.aggregation == "allreduce":
                self._values.div_(W)
                comp.decompress_add(self._values[:k], payload.positions, grad, indices=payload.indices)
                whole.copy_(self._values[k:])
            else:
                whole.zero_()
                size = self._msg_bytes
                for r in range(W):
                    msg = self._recv[r * size : (r + 1) * size]
                    values = msg[: self._val_bytes].view(self.dtype) / W
                    if r == self.rank:  # own positions already expanded
                        comp.decompress_add(values[:k], payload.positions, grad, indices=payload.indices)
                    else:
                        positions = msg[self._pos_off : self._pos_end].view(self.pos_dtype)
                        comp.decompress_add(values[:k], positions, grad)
                    whole.add_(values[k:])
        return ExchangeStats(
            self.bytes_sent_per_step,
            self.dense_bytes_per_step,
            density=self.density,
            compression_error=stats[0],
            memory_norm=stats[1],
        )

    def state_dict(self) -> dict:
        return {"error_feedback": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["error_feedback"])


def build_reducer(
    scheme: str,
    scope: str,
    aggregation: str,
    ratio: float,
    layout,
    *,
    world_size: int,
    rank: int,
    seed: int,
    error_feedback: bool = True,
    block_size: int = 256,
    uncompressed=None,
    warmup_steps: int = 0,
    group=None,
    device="cpu",
    dtype=torch.float32,
    stats_every: int = 1,
):
    """The reducer for a scheme/scope/aggregation; ``DenseReducer`` for ``scheme='none'``.

    ``layout``: a ``Layout``, the parameters (one segment each), their sizes, or a total numel.
    ``uncompressed``: one flag per segment, True for the tensors that travel whole; they must be
    the last segments (``flat_gradients`` orders the buffer so). ``warmup_steps``: dense steps
    before compression starts. Raises ``ValueError`` with a one-line message for invalid
    combinations.
    """
    check_combination(scheme, scope, aggregation, ratio)
    layout = as_layout(layout)
    esize = torch.empty((), dtype=dtype).element_size()
    flags = [False] * len(layout) if uncompressed is None else [bool(f) for f in uncompressed]
    if len(flags) != len(layout):
        raise ValueError(f"{len(flags)} uncompressed flags for a layout of {len(layout)} segments")
    n_compressed = flags.index(True) if True in flags else len(flags)
    if any(flags[:n_compressed]) or not all(flags[n_compressed:]):
        raise ValueError("uncompressed segments must come last in the flat buffer (see flat_gradients)")
    if scheme == "none" or n_compressed == 0:  # nothing to compress: dense SGD
        return DenseReducer(layout.total, esize, group=group)
    cls = get_compressor(scheme)
    # pass scheme options only to the schemes that declare them
    accepted = inspect.signature(cls.__init__).parameters
    options = {"block_size": block_size} if "block_size" in accepted else {}
    compressed = Layout(layout.sizes[:n_compressed])
    comp = cls(ratio, compressed, scope, device=device, **options)
    return SparseReducer(
        comp,
        aggregation=aggregation,
        world_size=world_size,
        rank=rank,
        seed=seed,
        error_feedback=error_feedback,
        uncompressed_numel=layout.total - compressed.total,
        warmup_steps=warmup_steps,
        group=group,
        device=device,
        dtype=dtype,
        stats_every=stats_every,
    )


def build_exchange(
    params,
    scheme: str,
    scope: str = "layerwise",
    aggregation: str = "allgather",
    ratio: float = 0.01,
    *,
    uncompressed="1d",
    device=None,
    dtype=torch.float32,
    **reducer_options,
):
    """The flat gradient buffer and its reducer for ``params``, as the trainer builds them, so
    that benchmarks time exactly what training runs.

    ``uncompressed`` is the rule of ``scheme.uncompressed`` (``"1d"``, ``"none"`` or N); it does
    not apply to dense SGD. ``reducer_options`` go to ``build_reducer`` (world_size, rank, seed,
    error_feedback, block_size, warmup_steps, group, stats_every). Returns ``(flat,
    params_in_buffer_order, reducer)``.
    """
    params = [p for p in params if p.requires_grad]
    rule = uncompressed if scheme != "none" else "none"
    flags = uncompressed_flags([p.shape for p in params], rule)
    flat, params, flags = flat_gradients(params, flags, device=device, dtype=dtype)
    reducer = build_reducer(scheme, scope, aggregation, ratio, Layout.from_tensors(params),
                            uncompressed=flags, device=flat.device, dtype=dtype, **reducer_options)
    return flat, params, reducer


__all__ = [
    "AGGREGATIONS",
    "DenseReducer",
    "ExchangeStats",
    "SparseReducer",
    "available",
    "build_exchange",
    "build_reducer",
    "check_combination",
    "flat_gradients",
]
