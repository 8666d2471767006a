"""PowerSGD (Vogels, Karimireddy & Jaggi, 2019): rank-r power iteration per tensor, as plain
tensor code.

Each compressed tensor is viewed as a matrix M = [shape[0], rest] (a convolution's weight as
[out_channels, in_channels x kh x kw], as the paper and torch's hook do) and sent as two thin
factors of rank r = min(n, m, rank). One step, with Q kept from the step before (warm start):

    Q <- orthogonalise(Q)        the first step: a Gaussian Q (see ``start_q``)
    P <- M Q                     summed over ranks (the exchange's first AllReduce)
    P <- orthogonalise(P)
    Q <- M^T P                   averaged over ranks (the second AllReduce)
    update <- P Q^T              memory <- M - update (error feedback; M = gradient + memory)

It declares its communication as two rounds (``rounds``: P summed, then Q summed), which the
exchange (``sparsetrain.comm.SparseReducer``, the trainer's and the DDP hook's alike) runs with
the memory; this class knows the matrices, where each one's factors lie in the two factor
buffers, the arithmetic, and Q, kept from step to step (checkpointed: ``state_dict``; moved per
tensor when DDP rebuilds its buckets: ``pieces`` / ``adopt``). It matches torch's hook (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``)
in every choice that changes numbers: the matrix view, the orthogonalisation (Gram-Schmidt up to
rank 2, ``torch.linalg.qr`` above; a column of zeros stays zero here, where torch's epsilon-free
Gram-Schmidt divides by zero), the Gaussian start (``torch.manual_seed(numpy RandomState(seed)
.randint(1_000_000_000))``, one ``torch.randn`` per matrix in torch's order: matrices grouped by
shape, shapes in the order first seen), the factors summed (P) and averaged (Q).

Every tensor handed to it is compressed, also where its factors outnumber its entries (torch's
hook sends such a tensor whole: its ``min_compression_rate``, 2 by default); the exchange keeps
the tensors of ``scheme.uncompressed`` whole, as for the sparse schemes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from sparsetrain.compress.base import Compressor, Payload, Round, k_for

#: The ranks ``closest_rank`` chooses from.
MAX_RANK = 64


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a tensor is compressed as: ``[shape[0], rest]`` (a scalar: 1 x 1).

    >>> matrix_shape((16, 8, 3, 3)), matrix_shape((10,))
    ((16, 72), (10, 1))
    """
    n = int(shape[0]) if len(shape) else 1
    return n, math.prod(int(d) for d in shape) // n if n else 0


def factor_entries(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Entries of the factors of rank min(n, m, rank) of these tensors: sum of r (n + m).

    >>> factor_entries([(16, 8, 3, 3), (10, 64)], 1)
    162
    """
    total = 0
    for shape in shapes:
        n, m = matrix_shape(shape)
        total += min(n, m, rank) * (n + m)
    return total


def closest_rank(entries_at: Callable[[int], int], target: int) -> int:
    """The rank (1 to ``MAX_RANK``, the smallest on a tie) whose entries per step,
    ``entries_at(rank)``, come closest to ``target``: what ``scheme.rank=null`` picks, for
    sparsetrain's PowerSGD and torch's hook alike (``target``: the layer-wise sparse schemes'
    entries at ``ratio``)."""
    return min(range(1, MAX_RANK + 1), key=lambda r: abs(entries_at(r) - target))


def orthogonalise(matrices: torch.Tensor) -> None:
    """Orthonormalise the columns of each matrix of the batch ``[B, rows, r]`` in place, as
    torch's hook does: Gram-Schmidt for r <= 2 (and half precision), ``torch.linalg.qr``
    otherwise. A column of zeros stays zero (torch's epsilon-free Gram-Schmidt gives NaN)."""
    b, rows, r = matrices.shape
    if r > rows:
        raise ValueError(f"cannot orthogonalise {r} columns of {rows} entries")
    if r <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(r):
            col = matrices[:, :, i : i + 1]
            norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
            col /= torch.where(norm > 0, norm, torch.ones_like(norm))
            if i + 1 < r:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(matrices, out=(matrices, matrices.new_empty(b, r, r)))


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD over the tensors of ``layout`` with their ``shapes``.

    ``rank``: the rank of each matrix's factors (at most min(n, m)); None picks the rank whose
    entries per step come closest to the layer-wise sparse schemes' at ``ratio``
    (``closest_rank``; the tensors that travel whole count alike in both, so they do not
    change the choice). ``scope`` must be ``layerwise``: each tensor is a matrix of its own.
    ``shapes``: one per segment of ``layout`` (needed: a flat size says nothing of the matrix).

    ``k`` is the entries of both factors (``p_numel + q_numel``); P's factors lie in one buffer
    of ``p_numel`` entries, Q's in one of ``q_numel``, matrices grouped by shape (``groups``),
    so that each shape's factors are one ``[B, rows, r]`` block, orthogonalised at once.
    """

    shared_positions: ClassVar[bool] = True  # nothing to share: aggregation does not apply
    needs_shapes: ClassVar[bool] = True
    #: Q's Gaussian start is one stream over every matrix: a DDP bucket takes the model's
    draws_span_segments: ClassVar[bool] = True
    #: the scopes it allows (the constructor and comm.rules refuse the others in one line)
    scopes: ClassVar[tuple[str, ...]] = ("layerwise",)
    scope_reason: ClassVar[str] = "PowerSGD compresses each tensor as a matrix of its own"
    # the fast path's plan of same-shape matmuls (ShapeBatches), built from the layout on first use
    transient: ClassVar[tuple[str, ...]] = ("_batches",)
    #: ``train.fast_path``: the matmuls batched by shape (``ShapeBatches``), set by the exchange
    #: (``compress.fused.prepare``); the same factors and update bit for bit on the CPU
    batched: bool = False

    def __init__(self, ratio: float, layout, scope: str = "layerwise", *, device="cpu",
                 rank: int | None = None, shapes: Sequence[Sequence[int]] | None = None):
        self.check_options(rank=rank)
        if shapes is None:
            raise ValueError("PowerSGD needs the tensors' shapes (shapes=...): a flat size says nothing of the matrix")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        # the layer-wise sparse schemes' entries at ratio, k_i per tensor (rank=None matches them)
        sparse_k = sum(k_for(float(ratio), math.prod(s)) for s in self.shapes)
        self.rank = int(rank) if rank is not None else closest_rank(
            lambda r: factor_entries(self.shapes, r), sparse_k)
        self.matrices_shape = [matrix_shape(s) for s in self.shapes]
        self.ranks = [min(n, m, self.rank) for n, m in self.matrices_shape]
        super().__init__(ratio, layout, scope, device=device)  # ks: segment_ks, from the ranks
        # factors grouped by matrix shape, shapes in the order first seen (torch's order)
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, nm in enumerate(self.matrices_shape):
            by_shape.setdefault(nm, []).append(i)
        self.p_offsets = [0] * len(self.shapes)
        self.q_offsets = [0] * len(self.shapes)
        #: (matrix indices, n, m, r, P start, Q start) per shape
        self.groups: list[tuple[list[int], int, int, int, int, int]] = []
        p = q = 0
        for (n, m), members in by_shape.items():
            r = min(n, m, self.rank)
            self.groups.append((members, n, m, r, p, q))
            for i in members:
                self.p_offsets[i], self.q_offsets[i] = p, q
                p += n * r
                q += m * r
        self.p_numel, self.q_numel = p, q
        self.q: torch.Tensor | None = None  # kept from step to step (warm start); None before its start

    @classmethod
    def check_options(cls, *, rank: int | None = None) -> None:
        """``rank``: an integer >= 1, or None (torch's hook, scheme=torch_powersgd, takes the same)."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"scheme.rank={rank!r} is not allowed; it must be an integer >= 1 "
                             "(or null: the rank whose bytes come closest to the sparse schemes' at ratio)")

    def segment_ks(self, layout):
        """Both factors' entries, r (n + m), per matrix (``k = p_numel + q_numel``)."""
        sizes = tuple(math.prod(s) for s in self.shapes)
        if sizes != layout.sizes:
            raise ValueError(f"shapes of {sizes[:6]} entries for a layout of {layout.sizes[:6]}")
        return [r * (n + m) for r, (n, m) in zip(self.ranks, self.matrices_shape, strict=True)]

    @property
    def num_positions(self) -> int:
        return 0

    def select(self, acc, seed):
        raise TypeError("PowerSGD sends factors, not entries: its exchange is two rounds (rounds / send / "
                        "receive, run by sparsetrain.comm.SparseReducer), or the steps project / project_back / expand")

    def bucket_options(self) -> dict:
        """A bucket's PowerSGD takes the model's rank (``rank=None`` chooses it over the model)."""
        return {"rank": self.rank}

    # --- the exchange: P summed, then Q summed ---------------------------------------------------
    def rounds(self, aggregation: str) -> tuple[Round, ...]:
        """Two AllReduces, whatever ``aggregation``: the P factors, then the Q factors."""
        return (Round("sum", floats=self.p_numel), Round("sum", floats=self.q_numel))

    def matrices(self, acc: torch.Tensor) -> list[torch.Tensor]:
        """Each compressed tensor's matrix, a view of the flat ``acc``."""
        return [acc[o : o + n * m].view(n, m)
                for o, (n, m) in zip(self.layout.offsets, self.matrices_shape, strict=True)]

    def send(self, r, step, mine) -> None:
        """Round 0: Q orthogonalised (its Gaussian start the first time), P = M Q. Round 1:
        the summed P orthogonalised, Q = M^T P."""
        if r == 0:
            mats = step.scratch["mats"] = self.matrices(step.acc)
            if self.q is None:
                self._start(step.run_seed, step.acc)
            self.project(mats, self.q, mine.floats)
        else:
            self.project_back(step.scratch["mats"], step.scratch["p"], mine.floats)

    def receive(self, r, step, got, out) -> None:
        """Round 0: keep the summed P. Round 1: Q averaged (and kept for the next step), the
        update ``P Q^T`` into ``out``, given to the memory as the decoded update (the base's
        ``forget`` subtracts it: ``memory = acc - P Q^T``)."""
        if r == 0:
            step.scratch["p"] = got.floats
            return
        self.q.copy_(got.floats.div_(step.world))
        outs = self.matrices(out)
        self.expand(step.scratch["p"], self.q, outs)
        step.payload = Payload(got.floats, got.floats.new_empty(0, dtype=torch.int64), None, decoded=out)

    def _start(self, run_seed: int, like: torch.Tensor) -> None:
        """Q's Gaussian start, seeded as torch's hook does: ``numpy.random.RandomState(run_seed)
        .randint(1_000_000_000)``; a bucket's PowerSGD takes the model's start for its tensors
        (``share_draws``)."""
        seed = int(np.random.RandomState(run_seed).randint(1_000_000_000))
        self.q = torch.zeros(self.q_numel, dtype=like.dtype, device=like.device)
        if self._draw_source is None:
            self.start_q(self.q, seed)
            return
        source, segments = self._draw_source
        full = torch.zeros(source.q_numel, dtype=like.dtype, device=like.device)
        source.start_q(full, seed)
        theirs = source.q_views(full)
        for mine, s in zip(self.q_views(self.q), segments, strict=True):
            mine.copy_(theirs[s])

    # --- Q, kept ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"q": None if self.q is None else self.q.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        q = state.get("q")
        if q is not None and q.numel() != self.q_numel:
            raise ValueError(f"PowerSGD's Q has {q.numel()} entries, this model and rank {self.q_numel}")
        self.q = None if q is None else q.detach().clone().to(self.device)

    def pieces(self) -> list[dict]:
        if self.q is None:
            return [{} for _ in self.shapes]
        return [{"q": q.clone()} for q in self.q_views(self.q)]

    def adopt(self, pieces) -> None:
        """Q is taken only when every tensor brings one; otherwise it starts afresh."""
        pieces = list(pieces)
        if not pieces or not all("q" in p for p in pieces):
            return
        first = pieces[0]["q"]
        q = torch.zeros(self.q_numel, dtype=first.dtype, device=self.device)
        for view, piece in zip(self.q_views(q), pieces, strict=True):
            if piece["q"].numel() != view.numel():
                raise ValueError(f"a Q of {piece['q'].numel()} entries for a matrix whose Q has {view.numel()}")
            view.copy_(piece["q"].reshape(view.shape))
        self.q = q

    # --- the factors' places -------------------------------------------------------------------
    def p_views(self, p: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's P, ``[n, r]``, a view of the P buffer (``p_numel`` entries)."""
        return [p[o : o + n * r].view(n, r)
                for o, (n, _), r in zip(self.p_offsets, self.matrices_shape, self.ranks, strict=True)]

    def q_views(self, q: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's Q, ``[m, r]``, a view of the Q buffer (``q_numel`` entries)."""
        return [q[o : o + m * r].view(m, r)
                for o, (_, m), r in zip(self.q_offsets, self.matrices_shape, self.ranks, strict=True)]

    def _blocks(self, buf: torch.Tensor, which: str) -> list[torch.Tensor]:
        out = []
        for members, n, m, r, p0, q0 in self.groups:
            rows, start = (n, p0) if which == "p" else (m, q0)
            out.append(buf[start : start + len(members) * rows * r].view(len(members), rows, r))
        return out

    # --- the arithmetic ------------------------------------------------------------------------
    def start_q(self, q: torch.Tensor, seed: int) -> None:
        """A Gaussian Q, the same on every rank: ``torch.manual_seed(seed)`` on the CPU, then one
        ``torch.randn(m, r)`` per matrix in torch's order (by shape group). Torch's hook seeds
        with ``numpy.random.RandomState(random_seed).randint(1_000_000_000)`` (the exchange does
        the same). Not orthogonalised: ``project`` does that."""
        gen = torch.Generator().manual_seed(int(seed))
        for members, _, m, r, _, _ in self.groups:
            for i in members:
                o = self.q_offsets[i]
                q[o : o + m * r].copy_(torch.randn(m * r, generator=gen, dtype=q.dtype))

    def project(self, mats: Sequence[torch.Tensor], q: torch.Tensor, p: torch.Tensor) -> None:
        """Orthogonalise Q (in place), then P = M Q for each matrix ``mats[i]`` (``[n, m]``)."""
        for block in self._blocks(q, "q"):
            orthogonalise(block)
        if self.batched:
            self._shape_batches().project(mats, q, p)
            return
        for mat, qi, pi in zip(mats, self.q_views(q), self.p_views(p), strict=True):
            torch.mm(mat, qi, out=pi)

    def project_back(self, mats: Sequence[torch.Tensor], p: torch.Tensor, q: torch.Tensor) -> None:
        """Orthogonalise P (summed over ranks; in place), then Q = M^T P for each matrix."""
        for block in self._blocks(p, "p"):
            orthogonalise(block)
        if self.batched:
            self._shape_batches().project_back(mats, p, q)
            return
        for mat, pi, qi in zip(mats, self.p_views(p), self.q_views(q), strict=True):
            torch.mm(mat.t(), pi, out=qi)

    def expand(self, p: torch.Tensor, q: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """``outs[i] = P_i Q_i^T``: the decompressed matrices (Q averaged over ranks)."""
        if self.batched:
            self._shape_batches().expand(p, q, outs)
            return
        for pi, qi, out in zip(self.p_views(p), self.q_views(q), outs, strict=True):
            torch.mm(pi, qi.t(), out=out)

    def _shape_batches(self) -> ShapeBatches:
        batches = self.__dict__.get("_batches")
        if batches is None:
            batches = self.__dict__["_batches"] = ShapeBatches(self)
        return batches

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, matrices={len(self.shapes)}, k={self.k}, n={self.numel})"


class ShapeBatches:
    """PowerSGD's matmuls batched by shape (the fast path, ``PowerSGD.batched``): one
    ``torch.bmm`` per run of same-shape matrices instead of one ``torch.mm`` per matrix.

    A shape group's factors are already one ``[B, rows, r]`` block of the P and Q buffers
    (``PowerSGD.groups``; orthogonalised in one call either way). Its matrices lie in the flat
    buffer at the layout's offsets; where consecutive members lie at a constant stride (ResNet's
    stacked convolutions of one shape, the 1-D tensors travelling whole in between) they are one
    strided view ``[count, n, m]`` of the buffer, without a copy; each such run is one batched
    matmul. Each matrix's product is the one ``torch.mm`` computes (the same reduction per entry:
    equal bit for bit on the CPU, tested; cuBLAS's batched kernels may sum in another order).
    """

    def __init__(self, comp: PowerSGD):
        offsets = comp.layout.offsets
        #: (first matrix, count, stride between matrices, n, m, r, P start, Q start) per run
        self.runs: list[tuple[int, int, int, int, int, int, int, int]] = []
        for members, n, m, r, p0, q0 in comp.groups:
            j = 0
            while j < len(members):
                count, stride = 1, n * m
                if j + 1 < len(members):
                    stride = offsets[members[j + 1]] - offsets[members[j]]
                    count = 2
                    while (j + count < len(members)
                           and offsets[members[j + count]] - offsets[members[j + count - 1]] == stride):
                        count += 1
                self.runs.append((members[j], count, stride, n, m, r, p0 + j * n * r, q0 + j * m * r))
                j += count

    def _views(self, mats, p, q):
        """Per run: the matrices as one strided view of their buffer (``mats``: the views
        ``PowerSGD.matrices`` gives), and their P and Q blocks."""
        for first, count, stride, n, m, r, p0, q0 in self.runs:
            yield (mats[first].as_strided((count, n, m), (stride, m, 1)),
                   p[p0 : p0 + count * n * r].view(count, n, r), q[q0 : q0 + count * m * r].view(count, m, r))

    def project(self, mats, q, p) -> None:
        for mat, pb, qb in self._views(mats, p, q):
            torch.bmm(mat, qb, out=pb)

    def project_back(self, mats, p, q) -> None:
        for mat, pb, qb in self._views(mats, p, q):
            torch.bmm(mat.transpose(1, 2), pb, out=qb)

    def expand(self, p, q, outs) -> None:
        for out, pb, qb in self._views(outs, p, q):
            torch.bmm(pb, qb.transpose(1, 2), out=out)


__all__ = ["MAX_RANK", "PowerSGD", "ShapeBatches", "closest_rank", "factor_entries", "matrix_shape", "orthogonalise"]
