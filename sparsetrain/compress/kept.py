"""The kept-state check: a compressor or memory must declare what it keeps across steps.

A resumed run (and, with ``dist.ddp=true``, a bucket DDP rebuilt) gets a fresh object with the
declared state loaded: a memory's ``state_dict`` (its ``BUFFERS``), a compressor's
``state_dict`` / ``load_state_dict`` or, under DDP, ``pieces`` / ``adopt``. A tensor the object
changed and did not declare would be lost there, and the run would go on from other numbers
without a word. So the exchange checks each compressor and memory over its first compressed
step, and again over the first one after every epoch's end (state first written later: a phase
of the method that starts mid-run); a sync (``comm.periodic``) likewise over its first
synchronisation and again after every epoch's end:

- at the step's start, ``snapshot`` copies the object's state: its own attributes' tensors,
  numpy arrays, numbers and strings (a step counter), a ``torch.Generator``'s state, a numpy
  ``Generator``'s (``bit_generator.state``), an ``itertools.count``'s next value, an iterator's
  index into its list, tuple, range or string, and the same inside lists, tuples, dicts and plain
  objects' attributes (a helper holding a running statistic); a Python generator cannot be
  copied, and one kept across steps is refused when the exchange first copies the object
  (``probe_copy``);
- after the step, ``undeclared`` loads the live object's declared state into that copy (what a
  resume does) and names every value on which the two differ (``calls``, ``rng``, ``ema.v``).

An attribute that is a cache or scratch space, rewritten before it is read (random-k's latest
draw, top-k's work buffers, a diagnostic counter no step reads), is listed in the class's
``transient`` (a subclass lists its own; its bases' count too; a helper object's class likewise);
it is not compared.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import os
import random
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sparsetrain.errors import CheckpointError
from sparsetrain.provenance import installed_roots

# Values compared as they are: numbers, strings, flags (a step counter, a phase's name)
_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic)


# What a closure's cell or a generator's local holds that is state (not an owner, not a trainer)
_DATA = (*_SCALARS, torch.Tensor, np.ndarray, list, tuple, dict, collections.deque, set, frozenset,
         itertools.count, torch.Generator, np.random.Generator, np.random.RandomState)


def _plain(value) -> bool:
    """An object of a Python class whose attributes are state (a helper holding a running
    statistic): not a class, module, function, torch's or numpy's own objects."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType,
                          types.BuiltinFunctionType, functools.partial, torch.nn.Module)):
        return False
    module = type(value).__module__ or ""
    if module.split(".")[0] in ("torch", "numpy", "builtins", "numba"):
        return False
    return hasattr(value, "__dict__")


# Iterators whose position reads through ``__reduce__`` (an index into their sequence: copied as
# they stand, sharing the sequence), and Python generators (a frame: where it stopped, and its
# locals), which cannot be copied: a snapshot holds their position instead (``_Position``).
_SEQUENCE_ITERATORS = tuple({type(iter(x)) for x in ([], (), range(0), "", "\u00e9", b"")}
                            | {type(reversed([])), type(reversed(()))})
_POSITIONED = (types.GeneratorType, *_SEQUENCE_ITERATORS)


class _Position:
    """A generator's position when it was copied (``_position``): compared, never run."""

    __slots__ = ("leaves",)

    def __init__(self, leaves: dict[str, object]):
        self.leaves = leaves


def _frozen(leaf):
    """A leaf of ``_leaves`` that later steps cannot change: tensors and arrays copied (numbers,
    strings and the generators' states it returns are immutable or fresh already)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().clone()
    return leaf.copy() if isinstance(leaf, np.ndarray) else leaf


def _position(it) -> dict[str, object]:
    """Where ``it`` stands, as leaves by path suffix: a generator's last instruction
    (``.<position>``) and the data among its locals (``.<local i>``), copied; an iterator's index
    into its sequence (``.<index>``). A resume builds the object afresh, so a generator or an
    iterator that moved in a step, unless ``load_state_dict`` rebuilds it where it stood, starts
    over from its first item."""
    if isinstance(it, types.GeneratorType):
        frame = it.gi_frame
        if frame is None:
            return {".<position>": "finished"}
        out: dict[str, object] = {".<position>": frame.f_lasti}
        for name, value in frame.f_locals.items():
            if isinstance(value, _DATA):
                out.update({path: _frozen(leaf) for path, leaf in _leaves(value, f".<local {name}>").items()})
        return out
    reduced = it.__reduce__()  # (iter, (sequence,), index), or (iter, ((),)) once exhausted
    return {".<index>": reduced[2] if len(reduced) > 2 else "finished"}


def _clone(value, memo: dict | None = None):
    """``value`` with every tensor, array, generator and plain object in it copied (containers
    rebuilt); numbers and strings as they are (immutable); other objects kept (shared)."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Generator):
        gen = torch.Generator(device=value.device)
        gen.set_state(value.get_state())
        return gen
    if isinstance(value, (np.random.Generator, np.random.RandomState)):
        return copy.deepcopy(value)
    if isinstance(value, (torch.optim.Optimizer, torch.nn.Module)):  # their state: compared, so copied
        return memo.setdefault(id(value), copy.deepcopy(value))
    if isinstance(value, collections.deque):
        return collections.deque((_clone(v, memo) for v in value), maxlen=value.maxlen)
    if isinstance(value, types.GeneratorType):
        return _Position(_position(value))
    if isinstance(value, _SEQUENCE_ITERATORS):
        return copy.copy(value)
    if isinstance(value, itertools.count):  # its next value, in its repr: count(5) or count(5, 2)
        return eval(repr(value), {"count": itertools.count})  # noqa: S307  (a repr of numbers)
    if isinstance(value, (set, frozenset)):
        return type(value)(value)  # hashable members: immutable
    if isinstance(value, (list, tuple)):
        items = [_clone(v, memo) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _clone(v, memo) for k, v in value.items()}
    if _plain(value):
        out = memo[id(value)] = copy.copy(value)
        for name, attr in vars(value).items():
            object.__setattr__(out, name, _clone(attr, memo))  # frozen dataclasses too
        return out
    return value


def _closure_data(fn: types.FunctionType) -> dict[str, object]:
    """The cells of ``fn``'s closure that hold data (a counter kept by ``nonlocal``, a list it
    fills): ``{"<closure name>": value}``. Objects it closes over (an owner, a trainer) are not
    its state, and are left out."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        value = _cell(cell)
        if isinstance(value, _DATA):
            out[f"<closure {name}>"] = value
    return out


def _cell(cell):
    """A closure cell's value (None while the enclosing function has not set it)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _leaves(value, path: str = "", seen: frozenset = frozenset()) -> dict[str, object]:
    """The state in ``value`` by path (``[0]``, ``['name']``, ``.attr``): tensors, numpy arrays,
    a torch generator's state, a numpy generator's (``bit_generator.state``), numbers and
    strings, and the same inside lists, tuples, dicts and plain objects' attributes."""
    if isinstance(value, (torch.Tensor, np.ndarray)) or isinstance(value, _SCALARS):
        return {path: value}
    if isinstance(value, torch.Generator):
        return {path: value.get_state()}
    if isinstance(value, np.random.Generator):
        return {path: value.bit_generator.state}  # a dict of numbers and names
    if isinstance(value, np.random.RandomState):
        return {path: value.get_state(legacy=False)}  # ... and an array
    if isinstance(value, (set, frozenset)):
        return {path: repr(sorted(value, key=repr))}
    if isinstance(value, itertools.count):
        return {path: repr(value)}
    if isinstance(value, _POSITIONED):
        return {path + k: v for k, v in _position(value).items()}
    if isinstance(value, _Position):
        return {path + k: v for k, v in value.leaves.items()}
    if isinstance(value, torch.optim.Optimizer):  # its per-parameter state (momentum), in order
        return _leaves(value.state_dict()["state"], f"{path}.state", seen)
    if isinstance(value, torch.nn.Module):
        return _leaves(dict(value.state_dict()), path, seen)
    if id(value) in seen:  # a cycle (a helper pointing back at its owner)
        return {}
    seen = seen | {id(value)}
    out: dict[str, object] = {}
    if isinstance(value, (list, tuple, collections.deque)):
        for i, v in enumerate(value):
            out.update(_leaves(v, f"{path}[{i}]", seen))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(_leaves(v, f"{path}[{k!r}]", seen))
    elif _plain(value):  # a helper's caches: its class's ``transient``, as for the owner
        skip = transient_names(type(value))
        for k, v in vars(value).items():
            if k not in skip:
                out.update(_leaves(v, f"{path}.{k}", seen))
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):  # a numpy generator's state
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() \
            and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, _SCALARS) or isinstance(b, _SCALARS):
        if type(a) is not type(b):
            return False
        return bool(a == b) or (isinstance(a, (float, complex, np.floating)) and a != a and b != b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape \
            and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and
                    torch.equal(a.isnan(), b.isnan()))
    return bool(torch.equal(a, b))


def probe_copy(obj, memo: dict | None = None):
    """A copy of ``obj`` for a check that runs it (the decode check, the DDP buckets' draws
    check): ``copy.deepcopy``, or, where something in it cannot be deep-copied (a lock, an open
    file, a logger), a ``snapshot`` that shares those, so that the check still runs."""
    try:
        return copy.deepcopy(obj, dict(memo or {}))
    except Exception:  # noqa: BLE001  (whatever deepcopy raises: TypeError, pickling errors)
        out = snapshot(obj, memo=memo)
    generators = [path.removesuffix(".<position>") for name, value in vars(obj).items()
                  for path in _leaves(value, f"{type(obj).__name__}.{name}") if path.endswith(".<position>")]
    if generators:  # a snapshot holds only their positions: it could not run them
        raise CheckpointError(
            f"{generators[0]} is a generator kept across steps: neither a checkpoint nor the checks' "
            f"copies can hold one, so a resumed run would start it over; keep its position in a number "
            f"(a step counter, in state_dict) and compute each item from it (docs/own_compressor.md, "
            f"'Kept state')")
    return out


def snapshot(obj, share: tuple[str, ...] = (), memo: dict | None = None):
    """A copy of ``obj`` as it is now: a shallow copy whose state (tensors, generators, plain
    objects, and containers of them) is copied, so that loading state into it leaves ``obj``
    untouched. ``share``: attributes left as they are, not copied (the model's own tensors, which
    the trainer's checkpoint holds and no ``load_state_dict`` writes); ``memo``: objects already
    copied (``id`` to copy), as ``copy.deepcopy``'s."""
    out = copy.copy(obj)
    memo = {**(memo or {}), id(obj): out}
    for name, value in vars(obj).items():
        if name not in share:
            setattr(out, name, _clone(value, memo))
    return out


def undeclared(live, restored, transient=()) -> list[str]:
    """The attributes (``name``, ``name[i]`` or ``name.attr``) whose state differs between ``live`` and
    ``restored`` (a ``snapshot`` with the live object's declared state loaded), ``transient``
    names left out."""
    skip = set(transient)
    names = [n for n in dict.fromkeys([*vars(live), *vars(restored)]) if n not in skip]
    out = []
    for name in names:
        a = _leaves(getattr(live, name, None), name)
        b = _leaves(getattr(restored, name, None), name)
        out.extend(p for p in dict.fromkeys([*a, *b]) if p not in a or p not in b or not _same(a[p], b[p]))
    return out


_NOT_OWN = ("sparsetrain", "torch", "numpy", "builtins", "abc")


def own_classes(obj) -> list[type]:
    """The classes of ``obj`` written outside sparsetrain, torch and numpy (a method of one's own)."""
    return [c for c in type(obj).__mro__ if (c.__module__ or "").split(".")[0] not in _NOT_OWN]


def own_part(*objs):
    """The first of ``objs`` (a compressor, a memory) that is a method of one's own, else the
    first: what an error about their step names."""
    return next((o for o in objs if own_classes(o)), objs[0])


def _own_module(name: str | None) -> bool:
    """Whether module ``name`` is one's own: not sparsetrain, torch, numpy or the standard library,
    and not installed (a script, a notebook's ``__main__``, a helper module beside one's class)."""
    top = (name or "").split(".")[0]
    if not top or top in _NOT_OWN or top in sys.stdlib_module_names:
        return False
    path = getattr(sys.modules.get(name), "__file__", None)
    return path is None or not os.path.realpath(path).startswith(installed_roots())


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _functions(cls: type) -> list[types.FunctionType]:
    """The functions a class defines: methods, static and class methods, properties' accessors."""
    out = []
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            out.extend(f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType))
        elif isinstance(value, types.FunctionType):
            out.append(value)
    return out


def globals_used(classes) -> dict[str, object]:
    """The module globals that the code of ``classes`` uses by name (``global calls``, a
    module-level dict it fills), and in turn those of the functions and helper modules of one's
    own that it calls (``helpers.bump()``, ``helpers.counter``): ``{"module.name": value}``.

    Only what the code names: a script or notebook that defines a class beside its training loop
    holds the model, the reducer and the loop's step in its globals too, and those are not the
    method's state (the trainer's checkpoint holds the model; the loop's step is the loop's)."""
    queue = [f for cls in classes for f in _functions(cls)]
    seen: set[int] = set()
    out: dict[str, object] = {}

    def visit(module_name: str, names: set[str], space: dict, modules: set[str]) -> None:
        for name in names & space.keys():
            value = space[name]
            if name.startswith("__"):
                continue
            if isinstance(value, types.FunctionType):
                if _own_module(value.__module__):
                    queue.append(value)
                    for var, data in _closure_data(value).items():  # ``bump = make_counter()``
                        out[f"{module_name}.{name}.{var}"] = data
            elif isinstance(value, type):
                if _own_module(value.__module__):  # a helper class: its methods' globals
                    queue.extend(_functions(value))
                    out.update({f"{value.__module__}.{value.__name__}.{k}": v for k, v in vars(value).items()
                                if not k.startswith("__")})
            elif isinstance(value, types.ModuleType):
                if _own_module(value.__name__) and value.__name__ not in modules:  # ``helpers.counter``
                    visit(value.__name__, names, vars(value), modules | {value.__name__})
            else:
                out[f"{module_name}.{name}"] = value

    while queue:
        fn = queue.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        module_name = fn.__globals__.get("__name__", "?")
        visit(module_name, _code_names(fn.__code__), fn.__globals__, {module_name})
    return out


def outside(objs, rngs: bool = True) -> dict[str, object]:
    """The state that a resume of ``objs`` (compressors, memories, a sync) does not rebuild and
    that they may change: numpy's and Python's global random states (``rngs``; torch's is in the
    trainer's checkpoints), the class attributes of their own classes, and the module globals
    their code uses (``globals_used``): numbers, strings, tensors, arrays, containers, helpers
    (``_leaves``), copied; names in ``transient`` left out."""
    out: dict[str, object] = {}
    if rngs:
        out["numpy's global random state (np.random)"] = np.random.get_state(legacy=False)
        out["Python's global random state (random)"] = random.getstate()
    for obj in objs:
        skip = transient_names(type(obj))
        classes = own_classes(obj)
        found = [(f"class attribute {cls.__name__}.{name}", value)
                 for cls in classes for name, value in vars(cls).items()]
        found += [(f"module global {path}", value) for path, value in globals_used(classes).items()]
        for where, value in found:
            name = where.rpartition(".")[2]
            if name.startswith("__") or name in skip:
                continue
            out.update({path: _frozen(leaf) for path, leaf in _leaves(value, where).items()})
    return out


def changed_outside(before: dict[str, object], objs, rngs: bool = True) -> list[str]:
    """What ``outside(objs, rngs)`` holds now that differs from ``before`` (new names included)."""
    now = outside(objs, rngs)
    return [p for p in dict.fromkeys([*before, *now])
            if p not in before or p not in now or not _same_outside(before[p], now[p])]


def _same_outside(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):  # Python's random state: numbers in tuples
        return a == b
    return _same(a, b)


def transient_names(cls) -> set[str]:
    """The ``transient`` attributes of ``cls`` and of every class it derives from (a subclass
    names only its own)."""
    return {name for klass in cls.__mro__ for name in vars(klass).get("transient", ())}


@dataclass
class Window:
    """One kept-state check under way: the copies taken when its window opened (``snapshot``, one
    per object watched), the step it opened at, what lay outside the objects then (``outside``),
    and, once the window closed, the step that closed it and what outside had changed by then
    (``changed_outside``; a check that reads it later leaves it None)."""
    snapshots: tuple
    start: int
    outside_before: dict
    end: int | None = None
    changed: list[str] | None = None


def check_kept(live, snap, load: Callable[[object], None], route: str,
               over: str = "the first compressed step", share: tuple[str, ...] = ()) -> None:
    """Refuse ``live`` (a compressor, memory or sync after the steps ``over`` names; ``snap``: its
    ``snapshot`` from before them) when it keeps a tensor its declared state does not carry.
    ``load(restored)`` loads the live object's declared state into a copy of ``snap``, as a
    resume does; ``route``: what declares it (said in the error); ``share``: as ``snapshot``'s."""
    restored = snapshot(snap, share)
    load(restored)
    lost = undeclared(live, restored, transient_names(type(live)))
    if not lost:
        return
    cls = type(live).__name__
    shown = ", ".join(f"{cls}.{p}" for p in lost[:4]) + (f" (+{len(lost) - 4} more)" if len(lost) > 4 else "")
    raise CheckpointError(
        f"{shown} changed in {over} but {cls}'s {route} does not carry it, so a "
        f"resumed run (or a DDP bucket rebuild) would lose it; declare it in {route}, or, for a cache "
        f"rewritten before it is read, name it in {cls}.transient (docs/own_compressor.md, 'Kept state')"
    )


def refuse_outside(changed: list[str], owner, over: str = "the first compressed step") -> None:
    """``CheckpointError`` naming what ``changed_outside`` found (nothing when empty)."""
    if not changed:
        return
    cls = type(owner).__name__
    shown = "; ".join(changed[:3]) + (f" (+{len(changed) - 3} more)" if len(changed) > 3 else "")
    raise CheckpointError(
        f"{cls} changed state outside itself in {over} ({shown}): a resume builds it afresh and "
        f"restores neither, so a resumed run would go on from other numbers; keep such state on the "
        f"instance and declare it (draws: a torch.Generator seeded by the step's seed), or, for a "
        f"cache, name it in {cls}.transient (docs/own_compressor.md, 'Kept state')"
    )


__all__ = ["Window", "changed_outside", "check_kept", "globals_used", "outside", "own_classes", "own_part", "refuse_outside", "probe_copy", "snapshot", "transient_names", "undeclared"]
