"""The memory: what a worker keeps of what it did not send, one component beside the compressor.

A memory turns the gradient into the vector the compressor sees (``accumulate``), once the
message is made keeps what was not sent (``forget``) and, after the exchange, may change the
update the optimizer applies (``update``; by default the ranks' averaged message is applied). Its state is a few buffers of one entry
per compressed entry (``buffers``): checkpoints save them, and the DDP hook moves them, entry by
entry, when DDP rebuilds its buckets, whatever the memory holds.

- ``ErrorFeedback`` (the scheme's default): ``acc = grad + memory; memory = acc - sent``.
  ``enabled=False`` (``scheme.error_feedback=false``) is the ablation: ``acc = grad``, nothing kept.
- Another memory is one class (subclass ``Memory``) named in the scheme's yaml::

      memory:
        _target_: mymodule.MomentumCorrection
        _partial_: true
        momentum: 0.9

  built as ``factory(numel, enabled=..., device=..., dtype=...)`` by the exchange.

``compression_stats`` gives the relative compression error from the decoded message (any
compressor, scaled values included) and the memory's norm.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from sparsetrain.compress.base import Compressor, Payload, unwrap_partial


class Memory:
    """Base of the memories. Subclasses set ``BUFFERS`` (the names of their per-entry buffers,
    the first one the one whose norm is logged) and implement ``accumulate`` and ``forget``.

    ``numel``: the compressed entries; ``enabled``: False keeps nothing (``acc = grad``)."""

    BUFFERS: ClassVar[tuple[str, ...]] = ()
    #: Attributes that are caches or scratch space, rewritten before they are read: not compared
    #: by the kept-state check (``compress.kept``). Any other tensor kept across steps is a buffer.
    transient: ClassVar[tuple[str, ...]] = ()

    def __init__(self, numel: int, *, enabled: bool = True, device="cpu", dtype=torch.float32):
        self.enabled = bool(enabled)
        self.numel = int(numel)
        for name in self.BUFFERS:
            setattr(self, name, torch.zeros(self.numel, device=device, dtype=dtype))

    # --- what a subclass provides ------------------------------------------------------------
    def accumulate(self, grad) -> torch.Tensor:
        """The vector to compress, from ``grad`` (a tensor, or its pieces ``[(offset, tensor)]``
        covering the compressed entries in order: a DDP bucket's tensors where they lie)."""
        raise NotImplementedError

    def forget(self, payload: Payload, compressor: Compressor) -> None:
        """After ``compressor.compress(acc)``: keep what was not sent."""
        raise NotImplementedError

    def update(self, average: torch.Tensor) -> None:
        """After the exchange (and ``forget``): ``average`` holds the update every rank decoded,
        the ranks' messages averaged, over the compressed entries in this memory's order. A
        memory that changes the update the optimizer applies overwrites it in place (EF21: its
        shared estimate ``g += average``, then ``g``); it must write the same on every rank.
        Default: nothing, the average is applied."""

    # --- shared behaviour ---------------------------------------------------------------------
    def buffers(self) -> dict[str, torch.Tensor]:
        """The per-entry state, by name (zeros, never changed, when disabled)."""
        return {name: getattr(self, name) for name in self.BUFFERS}

    def norm(self) -> float:
        """||first buffer||: what the logs call the memory norm (0 when disabled)."""
        if not self.enabled or not self.BUFFERS:
            return 0.0
        m = getattr(self, self.BUFFERS[0])
        return math.sqrt(float(torch.dot(m, m)))

    @staticmethod
    def _pieces(grad, numel: int) -> list:
        """``grad``'s pieces ``[(offset, tensor)]``, checked to cover ``numel`` entries."""
        pieces = list(grad)
        total = sum(g.numel() for _, g in pieces)
        if total != numel:
            raise ValueError(f"the gradient has {total} entries, the memory {numel}")
        return pieces

    @staticmethod
    def gradient(grad, numel: int) -> torch.Tensor:
        """``grad`` as one tensor (pieces concatenated: a copy)."""
        if isinstance(grad, torch.Tensor):
            return grad
        return torch.cat([g.reshape(-1) for _, g in Memory._pieces(grad, numel)])

    @staticmethod
    def add_into(buffer: torch.Tensor, grad) -> torch.Tensor:
        """``buffer += grad`` (a tensor or its pieces), in place; returns ``buffer``."""
        if isinstance(grad, torch.Tensor):
            return buffer.add_(grad)
        for off, g in Memory._pieces(grad, buffer.numel()):
            buffer[off : off + g.numel()].add_(g.reshape(-1))
        return buffer

    def step(self, grad, compressor: Compressor, seed: int = 0, out=None, wire=None) -> Payload:
        """accumulate + compress + forget, for a plain training loop."""
        acc = self.accumulate(grad)
        payload = compressor.compress(acc, seed, out=out, wire=wire)
        self.forget(payload, compressor)
        return payload

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, **{k: v.detach().clone() for k, v in self.buffers().items()}}

    def load_state_dict(self, state: dict) -> None:
        for name, buf in self.buffers().items():
            saved = state[name]
            if saved.numel() != buf.numel():
                raise ValueError(f"{name} of the {type(self).__name__} has {saved.numel()} entries, "
                                 f"this model {buf.numel()}")
            buf.copy_(saved)


class ErrorFeedback(Memory):
    """Per-worker memory over the flat buffer: ``acc = grad + memory; sent = C(acc);
    memory = acc - sent``.

    The accumulation happens in the memory buffer itself (``memory += grad`` is ``acc``), and
    ``memory = acc - sent`` is the compressor's ``forget``: zeroing the sent entries for a
    sparsifier (exact, no extra buffer), subtracting the decoded message for a quantizer.
    ``enabled=False`` is the ablation: ``acc = grad`` and the memory stays zero.

    >>> import torch
    >>> from sparsetrain.compress import TopK
    >>> comp = TopK(0.5, [4], "global")
    >>> ef = ErrorFeedback(4, dtype=torch.float64)
    >>> p = ef.step(torch.tensor([1.0, -3.0, 0.5, 2.0], dtype=torch.float64), comp)
    >>> sorted(p.indices.tolist()), ef.memory.tolist()
    ([1, 3], [1.0, 0.0, 0.5, 0.0])
    """

    BUFFERS = ("memory",)

    def accumulate(self, grad) -> torch.Tensor:
        """``acc``: the memory buffer (now holding grad + memory), or the gradient itself if
        disabled (pieces concatenated)."""
        if not self.enabled:
            return self.gradient(grad, self.numel)
        return self.add_into(self.memory, grad)

    def forget(self, payload: Payload, compressor: Compressor) -> None:
        """``memory = acc - sent (as decoded)``: the compressor's ``forget``."""
        if self.enabled:
            compressor.forget(self.memory, payload)


def compression_stats(acc: torch.Tensor, payload: Payload, compressor: Compressor) -> float:
    """``||acc - decoded|| / ||acc||``: the relative compression error of one rank's message,
    from the message as the receivers decode it (so a compressor that scales or encodes its
    values is measured by what it sends; where the payload carries the update every rank decoded,
    ``Payload.decoded``, as PowerSGD's, that update). Call before the memory's ``forget`` (which
    may change ``acc`` in place). 0 for a zero ``acc``."""
    if payload.decoded is not None:
        decoded = payload.decoded.to(acc.dtype, copy=True)
    else:
        decoded = compressor.decompress(payload.values, payload.positions, indices=payload.indices, dtype=acc.dtype)
    err = decoded.sub_(acc)
    acc_sq = float(torch.dot(acc, acc))
    return math.sqrt(float(torch.dot(err, err)) / acc_sq) if acc_sq > 0 else 0.0


def memory_class(factory: Any) -> type[Memory]:
    """The class a scheme's memory factory builds: the class itself, or the class of a
    ``functools.partial`` of it (what ``scheme.memory`` instantiates to). ``TypeError`` else."""
    cls = unwrap_partial(factory)
    if isinstance(cls, type) and issubclass(cls, Memory):
        return cls
    raise TypeError(f"{factory!r} is not a Memory class or a functools.partial of one")
