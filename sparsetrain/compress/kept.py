"""The kept-state check: a compressor or memory must declare what it keeps across steps.

A resumed run (and, with ``dist.ddp=true``, a bucket DDP rebuilt) gets a fresh object with the
declared state loaded: a memory's ``state_dict`` (its ``BUFFERS``), a compressor's
``state_dict`` / ``load_state_dict`` or, under DDP, ``pieces`` / ``adopt``. A tensor the object
changed and did not declare would be lost there, and the run would go on from other numbers
without a word. So the exchange checks each compressor and memory once, over its first
compressed step:

- at the step's start, ``snapshot`` copies the object's tensors (its own attributes, and the
  tensors in lists, tuples and dicts of them; a ``torch.Generator``'s state counts as a tensor);
- after the step, ``undeclared`` loads the live object's declared state into that copy (what a
  resume does) and names every tensor attribute on which the two differ.

An attribute that is a cache or scratch space, rewritten before it is read (random-k's latest
draw, top-k's work buffers), is listed in the class's ``transient`` (a subclass lists its own; its
bases' count too); it is not compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch

from sparsetrain.errors import CheckpointError


def _clone(value):
    """``value`` with every tensor, array and generator in it copied (containers rebuilt); other
    objects kept as they are (shared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Generator):
        gen = torch.Generator(device=value.device)
        gen.set_state(value.get_state())
        return gen
    if isinstance(value, (list, tuple)):
        items = [_clone(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _tensors(value, path: str = "") -> dict[str, object]:
    """The tensors in ``value`` by path (``[0]``, ``['name']``): tensors, numpy arrays and a
    generator's state."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return {path: value}
    if isinstance(value, torch.Generator):
        return {path: value.get_state()}
    if isinstance(value, (list, tuple)):
        out: dict[str, object] = {}
        for i, v in enumerate(value):
            out.update(_tensors(v, f"{path}[{i}]"))
        return out
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_tensors(v, f"{path}[{k!r}]"))
        return out
    return {}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape \
            and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and
                    torch.equal(a.isnan(), b.isnan()))
    return bool(torch.equal(a, b))


def snapshot(obj):
    """A copy of ``obj`` as it is now: a shallow copy whose tensors (and containers of them) are
    copies, so that loading state into it leaves ``obj`` untouched."""
    out = copy.copy(obj)
    for name, value in vars(obj).items():
        setattr(out, name, _clone(value))
    return out


def undeclared(live, restored, transient=()) -> list[str]:
    """The attributes (``name`` or ``name[i]``) whose tensors differ between ``live`` and
    ``restored`` (a ``snapshot`` with the live object's declared state loaded), ``transient``
    names left out."""
    skip = set(transient)
    names = [n for n in dict.fromkeys([*vars(live), *vars(restored)]) if n not in skip]
    out = []
    for name in names:
        a = _tensors(getattr(live, name, None), name)
        b = _tensors(getattr(restored, name, None), name)
        out.extend(p for p in dict.fromkeys([*a, *b]) if p not in a or p not in b or not _same(a[p], b[p]))
    return out


def transient_names(cls) -> set[str]:
    """The ``transient`` attributes of ``cls`` and of every class it derives from (a subclass
    names only its own)."""
    return {name for klass in cls.__mro__ for name in vars(klass).get("transient", ())}


def check_kept(live, snap, load: Callable[[object], None], route: str) -> None:
    """Refuse ``live`` (a compressor or memory after its first compressed step; ``snap``: its
    ``snapshot`` from before it) when it keeps a tensor its declared state does not carry.
    ``load(restored)`` loads the live object's declared state into a copy of ``snap``, as a
    resume does; ``route``: what declares it (said in the error)."""
    restored = snapshot(snap)
    load(restored)
    lost = undeclared(live, restored, transient_names(type(live)))
    if not lost:
        return
    cls = type(live).__name__
    shown = ", ".join(f"{cls}.{p}" for p in lost[:4]) + (f" (+{len(lost) - 4} more)" if len(lost) > 4 else "")
    raise CheckpointError(
        f"{shown} changed in the first compressed step but {cls}'s {route} does not carry it, so a "
        f"resumed run (or a DDP bucket rebuild) would lose it; declare it in {route}, or, for a cache "
        f"rewritten before it is read, name it in {cls}.transient (docs/own_compressor.md, 'Kept state')"
    )


__all__ = ["check_kept", "snapshot", "transient_names", "undeclared"]
