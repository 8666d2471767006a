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
