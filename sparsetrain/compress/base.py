"""The compressor interface, per-step seeds, and how a scheme's class is found.

A compressor turns one flat accumulated vector ``acc`` into a message of fixed size (every rank's
message has the same size, known at construction) in two sections:

- ``values``: ``num_values`` floats in the exchange's dtype. A sparsifier sends the ``k`` chosen
  entries of ``acc`` themselves; a quantizer its per-tensor scales or norms
  (``sparsetrain.compress.quantize``). With ``shared_positions`` the values of all ranks can be
  summed (AllReduce); otherwise every rank gathers every message (AllGather).
- ``positions``, the wire section: ``num_positions`` integers of ``wire_dtype``. A sparsifier
  describes its chosen entries there (entry indices for top-k and random-k, run or block start
  offsets for block-random-k; ``indices(positions)`` expands them back to the ``k`` entry
  indices, in the order of ``values``); a quantizer puts its packed bits there (``uint8``).

``compress(acc, seed, out=values, wire=positions)`` fills both (into the exchange's message when
given), ``decompress_add(values, positions, out)`` adds one message, decoded, to ``out``
(``decompress_many`` several, in order: every rank's after an AllGather), and
``forget(memory, payload)`` makes the error-feedback memory ``acc - sent (as decoded)``: zeroing
the sent entries for a sparsifier, subtracting the decoded message for a quantizer, or
``payload.decoded`` where the compressor gives the update every rank decoded (its docstring says
when it runs: before the collective for one's own message, after the last ``receive`` for
``decoded``). A
one-message compressor needs nothing else: the exchange (``comm.sparse``) lays its message out as
``[values | whole tensors | positions]`` and runs one collective.

A compressor whose exchange is not one message declares its communication instead: ``rounds``
lists the collectives of one step (``Round``: ``sum``, ``max`` or ``gather`` of some floats
and integers), ``send`` fills this rank's part of each round and ``receive`` reads every rank's
(PowerSGD: P summed, then Q; an integer-sum quantizer: a shared scale by ``max``, then integer
codes by ``sum``). The defaults of these three are the one-message exchange above, so the
exchange runs every compressor through them alike. State a compressor keeps across steps
(PowerSGD's Q) is checkpointed through ``state_dict`` and moved per tensor (``pieces`` /
``adopt``) when DDP rebuilds its buckets.

There is one route from a scheme to its class: the ``compressor`` node of
``conf/scheme/<name>.yaml`` (``_target_``: the class, ``_partial_: true``, the scheme's options),
which ``hydra.utils.instantiate`` turns into a ``functools.partial`` of the class; the exchange
calls it as ``factory(ratio, layout, scope, device=...)``. ``compressor_class`` reads the class
back from such a factory (e.g. ``shared_positions`` for the allowed aggregations).

Adding a scheme = one ``Compressor`` subclass (here or anywhere importable) + one
``conf/scheme/<name>.yaml`` (in conf/ or a folder on Hydra's search path) whose ``compressor``
node names it and gives its options (``scheme.compressor.<option>`` on the command line);
docs/own_compressor.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sparsetrain.compress.layout import Layout, as_layout

SCOPES = ("layerwise", "global")


def unwrap_partial(factory: Any) -> Any:
    """What a (possibly nested) ``functools.partial`` calls: a yaml node's ``_partial_: true``
    instantiates to one."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory


def compressor_class(factory: Any) -> type[Compressor]:
    """The class a scheme's compressor factory builds: ``factory`` itself when it is the class, the
    class of a ``functools.partial`` (what ``scheme.compressor`` instantiates to), or the class of
    a built compressor. ``TypeError`` for anything else."""
    cls = unwrap_partial(factory)
    if isinstance(cls, Compressor):
        return type(cls)
    if isinstance(cls, type) and issubclass(cls, Compressor):
        return cls
    raise TypeError(f"{factory!r} is not a Compressor class, a functools.partial of one, or a Compressor")


def k_for(ratio: float, numel: int) -> int:
    """Entries kept out of ``numel``: max(1, round(ratio * numel)), at most numel."""
    return min(numel, max(1, round(ratio * numel)))


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(base_seed: int, step: int, rank: int | None = None) -> int:
    """Seed for one step's random positions.

    ``rank=None`` gives the shared seed (identical on every rank: AllReduce of values);
    a rank gives a seed that differs per rank (AllGather). Result fits torch's manual_seed.
    """
    x = _splitmix64(int(base_seed) & _MASK64)
    x = _splitmix64(x ^ (int(step) & _MASK64))
    if rank is not None:
        x = _splitmix64(x ^ _splitmix64(0x5EED0000 + int(rank)))
    return x & ((1 << 63) - 1)


def _normalise_device(device) -> torch.device:
    """``cuda`` means the current CUDA device: pin its index, so that it compares equal to the
    device of the tensors put there (``cuda:0``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class Payload:
    """What one rank sends in one step.

    values: the message's float section: the k sent entries (in the order of ``indices``), or a
        quantizer's scales.
    positions: the wire section: what describes the sent entries (int64 here; packed narrower by
        the exchange), or a quantizer's packed bits (uint8, the message's own bytes).
    indices: the k entry indices in the flat buffer, already expanded (sender-side cache); None
        when every entry is sent (``NoCompression``, the quantizers).
    """

    values: torch.Tensor
    positions: torch.Tensor
    indices: torch.Tensor | None
    #: the update as every rank decodes it, where the compressor's ``forget`` reads that
    #: instead of this rank's own message (PowerSGD: P Q^T); None otherwise
    decoded: torch.Tensor | None = None


#: What a round's collective does with the ranks' messages: ``sum`` and ``max`` (an AllReduce:
#: every rank receives one message), ``gather`` (an AllGather: every rank receives every rank's).
ROUND_OPS = ("sum", "max", "gather")


@dataclass(frozen=True)
class Round:
    """One collective of a compressor's step: ``floats`` entries of the exchange's dtype and
    ``ints`` integers of ``int_dtype``. A ``sum`` or ``max`` round carries floats or integers,
    not both (one AllReduce of one dtype); a ``gather`` round may carry both (one byte message
    per rank). The tensors that travel whole (``scheme.uncompressed``) ride after the floats of
    the first ``sum`` or ``gather`` round that has floats (or, where none has, in a ``sum``
    round of their own that the exchange runs first)."""

    op: str
    floats: int = 0
    ints: int = 0
    int_dtype: torch.dtype = torch.int32

    def __post_init__(self):
        if self.op not in ROUND_OPS:
            raise ValueError(f"Round op={self.op!r} is not allowed; allowed: {', '.join(ROUND_OPS)}")
        if self.floats < 0 or self.ints < 0:
            raise ValueError(f"a Round carries floats >= 0 and ints >= 0, not {self.floats} and {self.ints}")
        if self.op != "gather" and self.floats and self.ints:
            raise ValueError(f"a {self.op!r} round carries floats or integers, not both (one AllReduce, one dtype)")


@dataclass
class Message:
    """One rank's part of one round, or what a ``sum`` / ``max`` round returns (views of the
    exchange's buffers): ``floats`` (the round's floats, the whole tensors excluded) and
    ``ints``."""

    floats: torch.Tensor
    ints: torch.Tensor


@dataclass
class StepState:
    """One step of a compressor's exchange, from ``send`` of the first round to ``forget``.

    ``acc``: the vector to compress (the memory's); ``seed``: this step's draws (shared by all
    ranks with AllReduce, each rank its own with AllGather); ``run_seed``: the run's (draws made
    once, e.g. PowerSGD's start of Q); ``world``/``rank``; ``aggregation``; ``payload``: what
    this rank sent, for the memory's ``forget`` (set by ``send`` or ``receive``); ``scratch``:
    the compressor's, between rounds."""

    acc: torch.Tensor
    seed: int
    run_seed: int
    world: int
    rank: int
    aggregation: str
    payload: Payload | None = None
    scratch: dict = field(default_factory=dict)


_MUST_SELECT = ("{name} must implement select(acc, seed) -> (positions, indices) (a sparsifier), or subclass "
                "Quantizer (encode, decode_add), or send its own rounds (rounds, send, receive); "
                "see docs/own_compressor.md")


class Compressor:
    """Base class. Subclasses set ``shared_positions`` and implement ``select``/``indices``.

    Parameters: ``ratio`` in (0, 1]; ``layout`` of the flat buffer; ``scope`` ``"layerwise"``
    (each segment its own k) or ``"global"`` (one k over the whole buffer); ``device`` where the
    flat buffer lives; a subclass adds its own keyword options (``BlockRandomK``: ``block_size``),
    which conf/scheme/<name>.yaml passes in its ``compressor`` node.
    """

    #: True when every rank can draw the same positions from a shared seed, so only values need
    #: summing (AllReduce). False when positions depend on the data (top-k).
    shared_positions: ClassVar[bool] = True
    #: The scopes the class compresses at (PowerSGD: layerwise only); the constructor and
    #: ``comm.rules`` refuse the others, saying ``scope_reason`` (why, one clause) where set.
    scopes: ClassVar[tuple[str, ...]] = SCOPES
    scope_reason: ClassVar[str] = ""
    #: False when the message does not depend on ``ratio`` (the quantizers send every entry): the
    #: run's summary says so, and the analysis shows the ratio as 1.0
    ratio_applies: ClassVar[bool] = True
    #: Why ``aggregation=allreduce`` is refused when ``shared_positions`` is False (one line's end).
    allreduce_refusal: ClassVar[str] = "picks different positions on every rank"
    #: True when a layer-wise compressor draws its random numbers from one stream over all its
    #: segments (random-k, block-k, QSGD), so that the same class over some of the segments (a
    #: DDP bucket's tensors) would draw other numbers for them. Such a class implements
    #: ``share_draws``; the DDP hook then gives every tensor the numbers the trainer draws for it.
    draws_span_segments: ClassVar[bool] = False
    #: True when the class needs its tensors' shapes (``shapes=`` at construction), not sizes only
    needs_shapes: ClassVar[bool] = False
    #: Attributes that are caches or scratch space, rewritten before they are read, which a
    #: checkpoint need not carry: the kept-state check (``compress.kept``) does not compare them
    #: (a subclass names its own; its bases' count too). Any other tensor the class changes across
    #: steps goes in ``state_dict`` and ``pieces``.
    transient: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ratio: float, layout, scope: str = "layerwise", *, device="cpu", **options):
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"ratio={ratio!r} is outside (0, 1]")
        cls = type(self)
        if scope not in cls.scopes:  # one line: the scope, the class, why not, what is allowed
            why = f" ({cls.scope_reason})" if cls.scope_reason else ""
            raise ValueError(f"scope={scope!r} is not allowed for {cls.__name__}{why}; "
                             f"allowed: {', '.join(cls.scopes)}")
        self.ratio = float(ratio)
        self.full_layout = as_layout(layout)
        self.scope = scope
        self.layout: Layout = self.full_layout if scope == "layerwise" else self.full_layout.merged()
        self.numel = self.full_layout.total
        self.device = _normalise_device(device)
        #: each segment's entries in the message, and their sum: set here once, from ``segment_ks``
        self.ks: list[int] = [int(k) for k in self.segment_ks(self.layout)]
        if len(self.ks) != len(self.layout):
            raise ValueError(f"{cls.__name__}.segment_ks gave {len(self.ks)} counts for {len(self.layout)} segments")
        self.k: int = sum(self.ks)
        self._draw_source: tuple[Compressor, list[int]] | None = None  # see share_draws
        #: the model's tensor number of each segment (``tensor_seed``): 0, 1, ... in the trainer;
        #: in a DDP bucket, the numbers its tensors have in the trainer's layout (set by the hook)
        self.segment_ids: list[int] = list(range(len(self.layout)))
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(options)}")

    # --- what subclasses provide -------------------------------------------------------------
    @classmethod
    def check_options(cls, **options) -> None:
        """``ValueError`` (one line: the key, the value, what is allowed) for a bad value of one
        of the class's own keyword options (its yaml's ``compressor`` node gives them): the one
        place that says what each option takes. A subclass with options overrides it with them as
        keywords (their defaults the constructor's) and calls it from its constructor;
        ``config.validate`` calls it with the node's options before any rank starts. Default:
        nothing to check (an option the class does not take is refused by its constructor, and by
        ``config.validate``, which names the ones it takes)."""

    def segment_ks(self, layout: Layout) -> list[int]:
        """Each segment's entries in the message (``ks``; ``k`` is their sum), for the compressed
        ``layout`` (one segment with ``scope="global"``), called once by ``Compressor.__init__``:
        what it reads of a subclass is set before ``super().__init__`` (PowerSGD: each matrix's
        rank). Default: ``k_for(ratio, size)`` each (a sparsifier); every entry sent (the
        quantizers, dense): ``list(layout.sizes)``."""
        return [k_for(self.ratio, n) for n in layout.sizes]

    @property
    def num_values(self) -> int:
        """Floats in the message's values section (the k entries)."""
        return self.k

    @property
    def num_positions(self) -> int:
        """How many integers describe one payload on the wire."""
        return self.k

    def select(self, acc: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(positions, indices)`` for this step (both int64)."""
        raise NotImplementedError(_MUST_SELECT.format(name=type(self).__name__))

    @classmethod
    def unimplemented(cls) -> str | None:
        """The one line saying what the class must still implement, None when nothing:
        ``config.validate`` asks before any rank starts. Here: ``select``, unless the class
        sends otherwise (its own ``compress`` or ``send``). ``Quantizer`` checks its own."""
        sends = any(getattr(cls, m) is not getattr(Compressor, m) for m in ("select", "compress", "send"))
        return None if sends else _MUST_SELECT.format(name=cls.__name__)

    def indices(self, positions: torch.Tensor) -> torch.Tensor:
        """Expand wire positions to the k entry indices (int64), in the order of values."""
        return positions.long()

    def tensor_seed(self, seed: int, j: int, rank: int | None = None) -> int:
        """The seed of segment ``j``'s random numbers this step (``seed``: the step's, as given
        to ``select`` / ``send``; ``rank``: a seed of this rank's own, e.g. ``step.rank``).
        It is keyed by the tensor's number in the model (``segment_ids``), not by ``j``, so the
        trainer and every DDP bucket draw the same numbers for the same tensor."""
        return step_seed(seed, self.segment_ids[j], rank)

    def set_segment_ids(self, ids) -> None:
        """Say which of the model's tensors this compressor's segments are (the DDP hook, for a
        bucket's compressor; layer-wise)."""
        ids = [int(i) for i in ids]
        if len(ids) != len(self.layout):
            raise ValueError(f"{len(ids)} segment ids for the {len(self.layout)} segments of {self!r}")
        self.segment_ids = ids

    def share_draws(self, source: Compressor, segments) -> None:
        """Draw, from now on, the numbers that ``source`` draws for its ``segments`` (this class
        with the same options over a larger layout, e.g. the model's; ``segments``: which of its
        segments this compressor's are, in order): a DDP bucket's compressor then draws for each
        tensor what the trainer's draws, whatever the buckets. Needed only where
        ``draws_span_segments``; layer-wise scope only."""
        segments = [int(s) for s in segments]
        if type(source) is not type(self) or self.scope != "layerwise" or source.scope != "layerwise":
            raise ValueError(f"{type(self).__name__} shares draws only with a layer-wise compressor of its own class")
        if [source.layout.sizes[s] for s in segments] != list(self.layout.sizes) or \
                [source.ks[s] for s in segments] != list(self.ks):
            raise ValueError(f"segments {segments[:8]} of {source!r} are not the segments of {self!r}")
        self._draw_source = (source, segments)
        self.set_segment_ids(segments)

    def bucket_options(self) -> dict:
        """Options a compressor of this class over some of these tensors (a DDP bucket's) must be
        built with to compress them as this one does (PowerSGD: its rank, chosen over the whole
        model). Default: none."""
        return {}

    # --- the communication: one message unless a subclass says otherwise ---------------------
    def rounds(self, aggregation: str) -> tuple[Round, ...]:
        """The collectives of one step, in order. Default: one message; its values summed
        (``allreduce``, positions drawn alike on every rank) or every rank's values and wire
        positions gathered (``allgather``)."""
        if aggregation == "allreduce":
            return (Round("sum", floats=self.num_values),)
        return (Round("gather", floats=self.num_values, ints=self.num_positions, int_dtype=self.wire_dtype),)

    def send(self, r: int, step: StepState, mine: Message) -> None:
        """Fill this rank's part of round ``r`` (``mine``: views of the exchange's send buffer).
        Default: ``compress`` into the one message (``step.payload``)."""
        wire = mine.ints if mine.ints.numel() else None
        step.payload = self.compress(step.acc, step.seed, out=mine.floats, wire=wire)

    def receive(self, r: int, step: StepState, got, out: torch.Tensor) -> None:
        """Read round ``r``'s result: ``got`` a ``Message`` (the ranks' sum or max) or, for a
        ``gather`` round, every rank's ``Message`` in rank order. The last round adds the update
        every rank applies to ``out`` (zeros; the compressed layout). Default: the one
        message's values divided by the ranks, decoded by ``decompress_add`` (every rank's in
        rank order, so every rank adds the same numbers in the same order)."""
        k, world, payload = self.num_values, step.world, step.payload
        if not isinstance(got, list):  # summed values at the positions every rank drew
            values = got.floats.div_(world)
            self.decompress_add(values[:k], payload.positions, out, indices=payload.indices)
            return
        messages = []
        for rank, msg in enumerate(got):
            values = msg.floats / world
            if rank == step.rank and payload.indices is not None:  # own positions already expanded
                messages.append((values[:k], payload.positions, payload.indices))
            else:
                messages.append((values[:k], msg.ints, None))
        self.decompress_many(messages, out)

    # --- state kept across steps (none by default) ---------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps of the compressor (PowerSGD: Q). Default: nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def pieces(self) -> list[dict]:
        """The kept state of each compressed tensor (``{name: tensor}``; empty when none), so the
        DDP hook can move it when DDP rebuilds its buckets."""
        return [{} for _ in range(len(self.full_layout))]

    def adopt(self, pieces) -> None:
        """Take each compressed tensor's state (what ``pieces`` gave; an empty dict: none)."""

    # --- shared behaviour ----------------------------------------------------------------------
    @property
    def max_position(self) -> int:
        """Largest value a position can take (decides int32 vs int64 on the wire)."""
        return self.numel - 1

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of the wire section: int32 positions, int64 where they do not fit."""
        return torch.int32 if self.max_position < 2**31 else torch.int64

    def _check_device(self, acc: torch.Tensor) -> None:
        if acc.device != self.device:
            raise ValueError(
                f"{type(self).__name__} was built for device {self.device} but acc is on "
                f"{acc.device}; build it with device=acc.device"
            )

    def compress(self, acc: torch.Tensor, seed: int = 0, out: torch.Tensor | None = None,
                 wire: torch.Tensor | None = None) -> Payload:
        """Choose what to send from the flat vector ``acc``. Does not modify ``acc``.

        ``out``: optional preallocated (num_values,) buffer for the values (e.g. a slice of a
        send buffer); ``wire``: optional (num_positions,) buffer of ``wire_dtype`` that receives
        the positions as they travel.
        """
        self._check_device(acc)
        positions, idx = self.select(acc, seed)
        values = torch.index_select(acc, 0, idx, out=out) if out is not None else acc[idx]
        if wire is not None:
            wire.copy_(positions)
        return Payload(values, positions, idx)

    def forget(self, memory: torch.Tensor, payload: Payload) -> None:
        """Error feedback's ``memory = acc - sent`` (``memory`` holds ``acc``), once a step.

        When it runs (the exchange, ``comm.sparse``), and so what it subtracts:

        - ``step.payload`` set by ``send`` with ``decoded`` None (every one-message compressor):
          right after the last round's ``send``, before its collective, so before any
          ``receive`` / ``decompress_add`` of the step. It subtracts this rank's own message as
          a receiver decodes it, at full scale (not divided by the ranks; no other rank's):
          here, zero the sent entries (all of them when ``payload.indices`` is None); a
          quantizer adds its decoded message with negated values. ``memory`` may be ``acc``
          itself: ``compress`` / ``send`` have copied what they send out of it by then.
        - otherwise (``step.payload`` set in ``receive``, e.g. with ``decoded``: PowerSGD's
          ``P Q^T``): after the last ``receive``, before the memory's ``update``. Where
          ``payload.decoded`` is set it is what is subtracted, the update every rank applies
          (by this base and by ``Quantizer`` alike)."""
        if payload.decoded is not None:  # the update every rank decoded
            memory.sub_(payload.decoded)
        elif payload.indices is None:  # everything was sent
            memory.zero_()
        else:
            memory.index_fill_(0, payload.indices, 0)

    def decompress_add(
        self,
        values: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
        *,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add one message, decoded, to ``out`` (in the compressed layout): ``out[i] += value``
        for each of its entries, duplicates accumulating. ``indices``: ``self.indices(positions)``
        when the caller already has it (its own message); a subclass may decode without it.
        Returns ``out``."""
        idx = indices if indices is not None else self.indices(positions)
        return out.index_add_(0, idx, values.to(out.dtype))

    def decompress_many(self, messages, out: torch.Tensor) -> torch.Tensor:
        """Add several messages, decoded, to ``out``: ``messages`` a sequence of ``(values,
        positions, indices or None)``, e.g. every rank's after an AllGather, in rank order.
        Default: ``decompress_add`` of each in turn. A subclass may decode them in one fused pass
        only where every entry still receives ``+= m_0``, then ``+= m_1``, ... in that order (the
        same floats, bit for bit). Returns ``out``."""
        for values, positions, indices in messages:
            self.decompress_add(values, positions, out, indices=indices)
        return out

    def decompress(self, values, positions, *, indices=None, dtype=None) -> torch.Tensor:
        """The message as a dense vector of ``numel`` entries (zeros where nothing was sent)."""
        out = torch.zeros(self.numel, dtype=dtype or values.dtype, device=values.device)
        return self.decompress_add(values, positions, out, indices=indices)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio}, scope={self.scope!r}, k={self.k}, n={self.numel})"
