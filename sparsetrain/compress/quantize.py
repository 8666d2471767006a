"""Quantizers: every entry sent, in a few bits, through the same exchange as the sparsifiers.

A quantizer's message (``compress.base``) is a values section of one float per tensor (its
scale or norm; one for the whole buffer with ``scope="global"``) and a wire section of packed
bits (``uint8``, ``bits_per_entry`` bits per entry, packed tightly across tensors). Every rank's
message is different, so they travel by AllGather (AllReduce is refused: nothing in them can be
summed), and every rank decodes every message. Error feedback subtracts the decoded message:
``memory = acc - decode(message)``.

- ``SignSGD``: the scaled sign of EF-SGD (Karimireddy et al. 2019, "Error Feedback Fixes
  SignSGD"): per tensor, ``mean(|acc|) * sign(acc)``. One bit per entry: 1 for a negative entry,
  0 otherwise, so **an exact zero decodes to +scale** (as do -0.0 and NaN). Bytes per rank:
  ceil(n / 8) + 4 per tensor (float32).
- ``QSGD``: stochastic quantization (Alistarh et al. 2017) to ``levels`` = s levels per tensor:
  ``r_i = |x_i| / ||x||_2 * s`` is rounded to ``floor(r_i)`` or ``floor(r_i) + 1`` at random,
  the latter with probability ``r_i - floor(r_i)``, so ``E[decoded] = x``: decoded entry
  ``||x|| * sign(x_i) * level_i / s``. Randomness from a ``torch.Generator`` seeded with the
  step's seed (``step_seed``: per step and rank), so runs are reproducible. Each entry is a
  sign bit (the lowest, 1 for negative) and its level above it: ``1 + ceil(log2(s + 1))`` bits,
  packed tightly (no byte alignment per entry). Bytes per rank: ceil(n * bits / 8) + 4 per
  tensor. A tensor whose norm is 0 sends level 0 everywhere.

Packed bit order (``pack_codes``): entry i's code occupies bits ``[i * bits, (i + 1) * bits)``
of the stream, least significant bit first; stream bit b is bit ``b % 8`` of byte ``b // 8``
(little-endian bit order, as ``numpy.packbits(..., bitorder="little")``); the last byte's unused
high bits are 0.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sparsetrain.compress.base import Compressor, Payload

_BYTE_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that hold ``n`` codes of ``bits`` bits each, packed tightly."""
    return -(-int(n) * int(bits) // 8)


def _byte_weights(device: torch.device) -> torch.Tensor:
    w = _BYTE_WEIGHTS.get(device)
    if w is None:
        w = _BYTE_WEIGHTS[device] = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=device)
    return w


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``codes`` (n unsigned integers, each below ``2**bits``; bool for one bit) tightly
    into ``out`` (``uint8``, ``packed_nbytes(n, bits)`` bytes; allocated when None)."""
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    elif out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"{n} codes of {bits} bits need {nbytes} uint8 bytes, out has {out.numel()} {out.dtype}")
    codes = codes.reshape(-1)
    if bits == 1:
        stream = codes.to(torch.uint8)
    else:
        shifts = torch.arange(bits, dtype=torch.int64, device=codes.device)
        stream = codes.to(torch.int64).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1)
        stream = stream.to(torch.uint8).reshape(-1)
    pad = nbytes * 8 - stream.numel()
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    torch.sum(stream.view(nbytes, 8).mul(_byte_weights(codes.device)), dim=1, dtype=torch.uint8, out=out)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes ``pack_codes`` packed: ``uint8`` 0/1 for one bit, ``int64`` otherwise."""
    if packed.numel() != packed_nbytes(n, bits):
        raise ValueError(f"{n} codes of {bits} bits are {packed_nbytes(n, bits)} bytes, got {packed.numel()}")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = packed.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[: n * bits]
    if bits == 1:
        return stream
    weights = torch.tensor([1 << b for b in range(bits)], dtype=torch.int64, device=packed.device)
    return stream.view(n, bits).to(torch.int64).mul_(weights).sum(dim=1)


class Quantizer(Compressor):
    """Base of the quantizers: every entry is sent (``k = numel``; ``ratio`` does not apply), in
    ``bits_per_entry`` bits, with one float per segment (per tensor, or one with
    ``scope="global"``). Subclasses implement ``encode`` (codes and per-segment floats) and
    ``decode`` (the dense vector of a message)."""

    shared_positions = False
    sends_entries = False
    allreduce_refusal = "sends every rank's own codes and scales, which cannot be summed"
    #: set by each subclass (or its constructor)
    bits_per_entry: ClassVar[int] = 1

    def __init__(self, ratio: float = 1.0, layout=None, scope: str = "layerwise", *, device="cpu", **options):
        super().__init__(1.0, layout, scope, device=device, **options)  # ratio does not apply
        self.ks = list(self.layout.sizes)
        self.k = self.numel  # every entry is sent
        self._sizes = torch.tensor(self.layout.sizes, dtype=torch.int64, device=self.device)

    # --- the message's two sections ------------------------------------------------------------
    @property
    def num_values(self) -> int:
        """One float per segment: its scale (signSGD) or norm (QSGD)."""
        return len(self.layout)

    @property
    def num_positions(self) -> int:
        """The packed codes, in bytes."""
        return packed_nbytes(self.numel, self.bits_per_entry)

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def max_position(self) -> int:
        return 255

    # --- per-segment helpers -------------------------------------------------------------------
    def per_segment(self, x: torch.Tensor, fn) -> torch.Tensor:
        """``fn`` of each segment of ``x`` (a 0-d tensor each), as one vector."""
        if len(self.layout) == 1:
            return fn(x).reshape(1)
        return torch.stack([fn(x[o : o + n]) for o, n in zip(self.layout.offsets, self.layout.sizes, strict=True)])

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Each segment's value at each of its entries (n entries)."""
        if len(self.layout) == 1:
            return per_segment.expand(self.numel)
        return torch.repeat_interleave(per_segment, self._sizes, output_size=self.numel)

    # --- what subclasses provide ---------------------------------------------------------------
    def encode(self, acc: torch.Tensor, seed: int, values: torch.Tensor, wire: torch.Tensor) -> None:
        """Fill ``values`` (one float per segment) and ``wire`` (the packed codes) from ``acc``."""
        raise NotImplementedError

    def decode(self, values: torch.Tensor, wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The message as a dense vector of ``numel`` entries."""
        raise NotImplementedError

    # --- the Compressor interface --------------------------------------------------------------
    def select(self, acc, seed):
        raise TypeError(f"{type(self).__name__} sends every entry, quantized: it selects no positions")

    def indices(self, positions):
        raise TypeError(f"{type(self).__name__} sends every entry, quantized: it has no positions")

    def compress(self, acc: torch.Tensor, seed: int = 0, out: torch.Tensor | None = None,
                 wire: torch.Tensor | None = None) -> Payload:
        """Encode ``acc`` into ``out`` (scales) and ``wire`` (packed codes), allocated when None."""
        self._check_device(acc)
        if acc.numel() != self.numel:
            raise ValueError(f"acc has {acc.numel()} entries, {type(self).__name__} was built for {self.numel}")
        if out is None:
            out = torch.empty(self.num_values, dtype=acc.dtype, device=acc.device)
        if wire is None:
            wire = torch.empty(self.num_positions, dtype=torch.uint8, device=acc.device)
        self.encode(acc, seed, out, wire)
        return Payload(out, wire, None)

    def decompress_add(self, values, positions, out, *, indices=None):
        """``out += decode(values, positions)`` (``values`` as received, e.g. divided by the
        number of ranks). ``indices`` does not apply."""
        return out.add_(self.decode(values.to(out.dtype), positions, out.dtype))

    def forget(self, memory: torch.Tensor, payload: Payload) -> None:
        """``memory = acc - decode(message)``: the decoded message of the negated scales added
        (the exact negation of the decoded message)."""
        self.decompress_add(payload.values.neg(), payload.positions, memory)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scope={self.scope!r}, bits={self.bits_per_entry}, n={self.numel})"


class SignSGD(Quantizer):
    """The scaled sign of EF-SGD: per segment ``mean(|acc|) * sign(acc)``, with an exact zero
    sent as + (bit 0). One bit per entry and one float per segment (tensor, or the whole buffer
    with ``scope="global"``). Use with error feedback (the scheme's default)."""

    bits_per_entry = 1

    def encode(self, acc, seed, values, wire):
        scales = self.per_segment(acc, lambda v: v.abs().mean())
        values.copy_(scales)
        pack_codes(acc < 0, 1, wire)

    def decode(self, values, wire, dtype):
        negative = unpack_codes(wire, 1, self.numel)
        sign = negative.to(dtype).mul_(-2.0).add_(1.0)  # bit 1 -> -1, bit 0 -> +1
        return sign.mul_(self.expand(values.to(dtype)))


class QSGD(Quantizer):
    """Stochastic quantization to ``levels`` levels per segment (Alistarh et al. 2017),
    unbiased, randomness from ``seed``; each entry ``1 + ceil(log2(levels + 1))`` bits (sign
    lowest, then the level), one float (the segment's 2-norm) per segment."""

    MAX_LEVELS = 65535

    def __init__(self, ratio: float = 1.0, layout=None, scope: str = "layerwise", *, levels: int = 4, **kw):
        if isinstance(levels, bool) or not isinstance(levels, (int, float)) or int(levels) != levels \
                or not 1 <= levels <= self.MAX_LEVELS:
            raise ValueError(f"scheme.levels={levels!r} is not allowed; it must be an integer in "
                             f"[1, {self.MAX_LEVELS}]")
        self.levels = int(levels)
        self.bits_per_entry = 1 + math.ceil(math.log2(self.levels + 1))
        super().__init__(ratio, layout, scope, **kw)

    def encode(self, acc, seed, values, wire):
        s = self.levels
        norms = self.per_segment(acc, torch.linalg.vector_norm)
        values.copy_(norms)
        norm = self.expand(values.to(acc.dtype))
        r = acc.abs().div_(torch.where(norm > 0, norm, torch.ones_like(norm))).mul_(s)
        gen = torch.Generator(device=acc.device)
        gen.manual_seed(int(seed))
        u = torch.rand(self.numel, generator=gen, dtype=acc.dtype, device=acc.device)
        low = r.floor()
        frac = r.sub_(low)  # in place: r is not needed again
        level = low.add_((u < frac).to(acc.dtype)).clamp_(0, s).to(torch.int64)  # up with probability frac
        pack_codes(level.mul_(2).add_(acc < 0), self.bits_per_entry, wire)

    def decode(self, values, wire, dtype):
        codes = unpack_codes(wire, self.bits_per_entry, self.numel)
        signed = codes.bitwise_right_shift(1).to(dtype)
        signed.mul_((codes.bitwise_and(1) == 0).to(dtype).mul_(2.0).sub_(1.0))  # sign bit 1 -> -level
        return signed.mul_(self.expand(values.to(dtype))).div_(self.levels)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, scope={self.scope!r}, bits={self.bits_per_entry}, n={self.numel})"
