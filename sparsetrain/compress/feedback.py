"""Error feedback (memory): what a worker did not send is added to its next gradient."""

from __future__ import annotations

import math

import torch

from sparsetrain.compress.base import Compressor, Payload


class ErrorFeedback:
    """Per-worker memory over the flat buffer: ``acc = grad + memory; sent = C(acc);
    memory = acc - sent``.

    The accumulation happens in the memory buffer itself (``memory += grad`` is ``acc``), and
    ``memory = acc - sent`` is done by zeroing the sent entries: exact, no extra buffer.
    ``enabled=False`` is the ablation: ``acc = grad`` and the memory stays zero.

    >>> import torch
    >>> from sparsetrain.compress import TopK
    >>> comp = TopK(0.5, [4], "global")
    >>> ef = ErrorFeedback(4, dtype=torch.float64)
    >>> p = ef.step(torch.tensor([1.0, -3.0, 0.5, 2.0], dtype=torch.float64), comp)
    >>> sorted(p.indices.tolist()), ef.memory.tolist()
    ([1, 3], [1.0, 0.0, 0.5, 0.0])
    """

    def __init__(self, numel: int, *, enabled: bool = True, device="cpu", dtype=torch.float32):
        self.enabled = bool(enabled)
        self.memory = torch.zeros(int(numel), device=device, dtype=dtype)

    def accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        """Return ``acc``: the memory buffer (now holding grad + memory) or ``grad`` if disabled."""
        if not self.enabled:
            return grad
        return self.memory.add_(grad)

    def forget(self, payload: Payload, compressor: Compressor) -> None:
        """``memory = acc - sent (as decoded)`` (call after ``compress``): the compressor's
        ``forget`` zeroes the sent entries (sparsifiers) or subtracts the decoded message
        (quantizers)."""
        if not self.enabled:
            return
        compressor.forget(self.memory, payload)

    def step(self, grad, compressor: Compressor, seed: int = 0, out=None, wire=None) -> Payload:
        """accumulate + compress + forget, for a plain training loop and the reducers.

        ``grad``: the gradient, or its pieces ``[(offset, tensor)]`` covering the memory in order
        (the DDP hook passes a bucket's compressed tensors where they lie, without a copy).
        """
        if isinstance(grad, torch.Tensor):
            acc = self.accumulate(grad)
        else:
            pieces = list(grad)
            numel = sum(g.numel() for _, g in pieces)
            if numel != self.memory.numel():
                raise ValueError(f"the gradient has {numel} entries, the error-feedback memory "
                                 f"{self.memory.numel()}")
            if self.enabled:
                for off, g in pieces:
                    self.memory[off : off + g.numel()].add_(g.reshape(-1))
                acc = self.memory
            else:
                acc = torch.cat([g.reshape(-1) for _, g in pieces])
        payload = compressor.compress(acc, seed, out=out, wire=wire)
        self.forget(payload, compressor)
        return payload

    def stats(self, payload: Payload, grad_sq_norm: float | None = None, *,
              compressor: Compressor | None = None, acc: torch.Tensor | None = None) -> tuple[float, float]:
        """``(relative compression error ||acc - sent|| / ||acc||, memory norm)`` after a step.

        With memory on, ``acc - sent`` is the memory and ``||acc||^2 = ||memory||^2 +
        ||values||^2`` (sent values are acc's own entries): one pass. With memory off pass
        ``grad_sq_norm`` = ||grad||^2 measured before the buffer changed.

        A compressor that does not send entries (``sends_entries`` False: the quantizers) needs
        ``compressor``, and with memory off ``acc`` (the gradient, unchanged): the sent vector is
        then its decoded message.
        """
        if compressor is not None and not compressor.sends_entries:
            sent = compressor.decompress(payload.values, payload.positions, dtype=self.memory.dtype)
            if self.enabled:
                mem_sq = float(torch.dot(self.memory, self.memory))
                total = self.memory + sent
                acc_sq, err_sq, mem_norm = float(torch.dot(total, total)), mem_sq, math.sqrt(mem_sq)
            else:
                if acc is None:
                    raise ValueError("acc is needed when error feedback is disabled")
                err = acc - sent
                acc_sq, err_sq, mem_norm = float(torch.dot(acc, acc)), float(torch.dot(err, err)), 0.0
            return (math.sqrt(err_sq / acc_sq) if acc_sq > 0 else 0.0), mem_norm
        sent_sq = float(torch.dot(payload.values.view(-1), payload.values.view(-1)))
        if self.enabled:
            mem_sq = float(torch.dot(self.memory, self.memory))
            acc_sq = mem_sq + sent_sq
            err_sq = mem_sq
            mem_norm = math.sqrt(mem_sq)
        else:
            if grad_sq_norm is None:
                raise ValueError("grad_sq_norm is needed when error feedback is disabled")
            acc_sq = float(grad_sq_norm)
            err_sq = max(acc_sq - sent_sq, 0.0)
            mem_norm = 0.0
        rel = math.sqrt(err_sq / acc_sq) if acc_sq > 0 else 0.0
        return rel, mem_norm

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "memory": self.memory.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        mem = state["memory"]
        if mem.numel() != self.memory.numel():
            raise ValueError(
                f"error-feedback memory has {mem.numel()} entries, this model {self.memory.numel()}"
            )
        self.memory.copy_(mem)
