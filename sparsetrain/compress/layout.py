"""Where each tensor lives inside one flat buffer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Layout:
    """Segments of one flat buffer: tensor ``i`` occupies ``[offsets[i], offsets[i] + sizes[i])``.

    >>> Layout.from_sizes([3, 5]).offsets
    (0, 3)
    """

    sizes: tuple[int, ...]
    offsets: tuple[int, ...] = field(init=False)
    total: int = field(init=False)

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.sizes)
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"layout sizes must be positive and non-empty, got {sizes[:8]}")
        offsets, pos = [], 0
        for s in sizes:
            offsets.append(pos)
            pos += s
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "total", pos)

    @classmethod
    def from_sizes(cls, sizes: Iterable[int]) -> Layout:
        return cls(tuple(sizes))

    @classmethod
    def from_tensors(cls, tensors: Iterable[torch.Tensor]) -> Layout:
        """One segment per tensor (e.g. ``model.parameters()``), in iteration order."""
        return cls(tuple(t.numel() for t in tensors))

    @classmethod
    def single(cls, numel: int) -> Layout:
        return cls((int(numel),))

    def merged(self) -> Layout:
        """The whole buffer as one segment (global scope)."""
        return Layout.single(self.total)

    def __len__(self) -> int:
        return len(self.sizes)

    def views(self, flat: torch.Tensor, shapes: Sequence[torch.Size] | None = None):
        """Views of ``flat`` for each segment, optionally reshaped."""
        out = []
        for i, (o, s) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            v = flat[o : o + s]
            out.append(v.view(shapes[i]) if shapes is not None else v)
        return out


def as_layout(spec) -> Layout:
    """Accept a Layout, an int (one segment), a sequence of sizes or a sequence of tensors."""
    if isinstance(spec, Layout):
        return spec
    if isinstance(spec, int):
        return Layout.single(spec)
    items = list(spec)
    if items and isinstance(items[0], torch.Tensor):
        return Layout.from_tensors(items)
    return Layout.from_sizes(items)


#: Which tensors bypass compression and travel whole (``scheme.uncompressed``):
#: ``"none"``: every tensor is compressed; ``"1d"``: tensors with one dimension or none (biases,
#: batch-norm weights and biases) go whole, as in the reference code of the paper's lineage
#: (epfml/powersgd sends min(rank * (m + n), numel) entries of a tensor: every vector whole);
#: ``"N"`` (a positive integer): tensors with fewer than N entries go whole.
UNCOMPRESSED_RULES = ("none", "1d", "<positive integer N>")


def parse_uncompressed(rule) -> str | int:
    """``"none"``, ``"1d"`` or an int threshold; ``ValueError`` (one line) for anything else."""
    text = str(rule).strip().lower()
    if text in ("none", "1d"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"scheme.uncompressed={rule!r} is not allowed; allowed: none, 1d, or a positive "
            "integer N (tensors with fewer than N entries travel whole)"
        )
    return n


def uncompressed_flags(shapes: Sequence[Sequence[int]], rule) -> list[bool]:
    """One flag per tensor shape: True where the tensor bypasses compression under ``rule``.

    >>> uncompressed_flags([(16, 3, 3, 3), (16,), (10,)], "1d")
    [False, True, True]
    >>> uncompressed_flags([(16, 3, 3, 3), (16,), (10,)], 12)
    [False, False, True]
    """
    rule = parse_uncompressed(rule)
    flags = []
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        if rule == "none":
            flags.append(False)
        elif rule == "1d":
            flags.append(len(shape) <= 1)
        else:
            flags.append(numel < rule)
    return flags


def compressed_first(flags: Sequence[bool]) -> list[int]:
    """Indices that put the compressed tensors first and the whole ones last, each group in its
    own order: the layout of a flat buffer (or a DDP bucket) that the sparse reducer sends.

    >>> compressed_first([False, True, False, True])
    [0, 2, 1, 3]
    """
    return [i for i, f in enumerate(flags) if not f] + [i for i, f in enumerate(flags) if f]
