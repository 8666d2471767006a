"""The decode check: once, before a reducer's first compressed step, that the update its
compressor decodes is what error feedback takes out of the memory.

Error feedback assumes ``update == forgotten``: the update every rank applies (the ranks'
messages through the compressor's rounds, ``receive``) is, where every rank sends the same
message, the part of ``acc`` that the compressor's ``forget`` takes out of the memory (with
``scheme.error_feedback=false``: what one message decodes to, ``decompress``). A compressor of
one's own can break it without a word: a ``receive`` that does not divide the ranks' sum by
``step.world``, a sparsifier whose message repeats an index (decoded twice, forgotten once), a
quantizer that inherits a ``decode_many`` of other codes. ``check_decode`` runs the compressor's
declared rounds on a copy of it, locally, as if ``world`` ranks sent the same message (``sum``:
``world`` x the message; ``max``: the message; ``gather``: ``world`` copies), on a fixed random
vector, and raises ``ConfigError`` (one line) where the two differ beyond rounding.

It sends nothing and changes nothing: the compressor is copied, the random vector has its own
generator, the global random states (torch, numpy, ``random``) are restored, and the vector,
seed and rank are the same on every rank, so every rank reaches the same verdict at the same
place (none waits in a collective for one that stopped).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from sparsetrain.compress import step_seed
from sparsetrain.compress.base import Message, StepState
from sparsetrain.compress.kept import probe_copy
from sparsetrain.errors import ConfigError

_PROBE_SEED = 0x5EED_DEC0


def check_decode(reducer, step: int) -> None:
    """Raise ``ConfigError`` where ``reducer.compressor``'s update, for ``reducer.world_size``
    ranks sending the same message, differs from what its ``forget`` subtracts (the decoded
    message where the memory keeps nothing). Step ``step``'s shared seed, rank 0's part."""
    comp = probe_copy(reducer.compressor)
    world, dtype, device = reducer.world_size, reducer.dtype, reducer.device
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    acc = torch.randn(comp.numel, generator=gen, dtype=torch.float64).to(dtype).to(device)
    state = StepState(acc.clone(), step_seed(reducer.seed, step), reducer.seed, world, 0, reducer.aggregation)
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            got = _identical_ranks(comp, state, world)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    if got is None:  # no payload: the real step says so
        return
    update, memory, ops = got
    payload = state.payload
    if reducer.memory.enabled:
        want, what = acc.double() - memory.double(), "its forget takes out of error feedback's memory"
    else:
        single = payload.decoded if payload.decoded is not None else comp.decompress(
            payload.values, payload.positions, indices=payload.indices, dtype=dtype)
        want, what = single.double(), "one message decodes to (decompress)"
    update = update.double()
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    rtol = min(0.25, max(1e-3, 4 * world * eps))
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = (update - want).abs()
    bad = diff > rtol * want.abs() + rtol * scale
    if not bool(bad.any()):
        return
    i = int(torch.argmax(torch.where(bad, diff, 0)))
    dot = float(torch.dot(want, want))
    factor = float(torch.dot(update, want)) / dot if dot > 0 else float("nan")
    raise ConfigError(
        f"{type(reducer.compressor).__name__}'s update is {factor:.3g}x what {what} (the decode check: "
        f"{world} rank(s) sending the same message through its rounds {'/'.join(ops)}; entry {i}: "
        f"{float(update[i]):.4g} applied, {float(want[i]):.4g} expected): {_hint(payload, factor, world)}; "
        f"see docs/own_compressor.md ('The decode check')")


def _identical_ranks(comp, state: StepState, world: int):
    """``(update, memory after forget, the rounds' ops)`` for ``world`` ranks that all send what
    ``comp`` sends from ``state``: the exchange's order (``comm.sparse``), each collective
    simulated. None where no round sets ``state.payload``."""
    acc = state.acc
    rounds = comp.rounds(state.aggregation)
    out, memory = torch.zeros_like(acc), acc.clone()
    forgot, last = False, len(rounds) - 1
    for r, rnd in enumerate(rounds):
        mine = Message(torch.zeros(rnd.floats, dtype=acc.dtype, device=acc.device),
                       torch.zeros(rnd.ints, dtype=rnd.int_dtype, device=acc.device))
        comp.send(r, state, mine)
        if r == last and state.payload is not None and state.payload.decoded is None:
            comp.forget(memory, state.payload)  # the own message: forgotten before it travels
            forgot = True
        if rnd.op == "gather":
            got = [Message(mine.floats.clone(), mine.ints.clone()) for _ in range(world)]
        elif rnd.op == "sum":
            got = Message(mine.floats * world, mine.ints * world)
        else:
            got = Message(mine.floats.clone(), mine.ints.clone())
        comp.receive(r, state, got, out if r == last else None)
    if state.payload is None:
        return None
    if not forgot:
        comp.forget(memory, state.payload)
    return out, memory, [rnd.op for rnd in rounds]


def _hint(payload, factor: float, world: int) -> str:
    """What to look at, from what differed."""
    idx = payload.indices
    if idx is not None and idx.numel() and torch.unique(idx).numel() < idx.numel():
        repeats = idx.numel() - torch.unique(idx).numel()
        return (f"its message repeats {repeats} of its {idx.numel()} entry indices, which the decode adds "
                f"once per repeat but forget takes out once: send distinct indices (torch.randperm, not "
                f"torch.randint)")
    if world > 1 and abs(factor - world) < 0.01 * world:
        return "the ranks' sum is not divided by the number of ranks: receive must divide it by step.world"
    if world > 1 and abs(factor * world - 1) < 0.01:
        return "the update is divided by the number of ranks twice"
    return ("receive, decompress_many / decode_many, decompress_add / decode_add and forget must decode "
            "the same message alike")
