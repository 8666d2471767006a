"""Quantizers: every entry sent, in a few bits, through the same exchange as the sparsifiers.

A quantizer's message (``compress.base``) is a values section of one float per tensor (its
scale; one for the whole buffer with ``scope="global"``) or per bucket (QSGD's norms) and a wire
section of packed bits (``uint8``, ``bits_per_entry`` bits per entry, packed tightly across
tensors). Every rank's
message is different, so they travel by AllGather (AllReduce is refused: nothing in them can be
summed), and every rank decodes every message. Error feedback subtracts the decoded message:
``memory = acc - decode(message)``.

- ``SignSGD``: the scaled sign of EF-SGD (Karimireddy et al. 2019, "Error Feedback Fixes
  SignSGD"): per tensor, ``mean(|acc|) * sign(acc)``. One bit per entry: 1 for a negative entry,
  0 otherwise, so **an exact zero decodes to +scale** (as do -0.0 and NaN). Bytes per rank:
  ceil(n / 8) + 4 per tensor (float32).
- ``QSGD``: stochastic quantization (Alistarh et al. 2017) to ``levels`` = s levels per bucket:
  each tensor (the whole buffer with ``scope="global"``) is cut into consecutive buckets of
  ``bucket_size`` entries, the last one shorter (512 by default, the paper's d; None: one bucket
  per tensor), each with its own 2-norm ||x||. ``r_i = |x_i| / ||x||_2 * s`` is rounded to
  ``floor(r_i)`` or ``floor(r_i) + 1`` at random, the latter with probability ``r_i -
  floor(r_i)`` (as ``floor(r_i + u_i)``, u_i uniform in [0, 1)), so ``E[decoded] = x``: decoded entry ``||x|| * sign(x_i) * level_i / s``. Randomness
  seeded with the step's seed (``step_seed``: per step and rank), so runs are reproducible:
  by default (``generator="counter"``) SplitMix64 at counter i, the same numbers on every device;
  ``generator="pcg64"``: numpy's PCG64 on the CPU, torch's generator on CUDA (the two differ). Each
  entry's code is its signed level ``sign(x_i) * level_i`` in two's complement, ``1 +
  ceil(log2(s + 1))`` bits (the sign and the level; s = 127: one byte), packed tightly (no byte
  alignment per entry). Bytes per rank: ceil(n * bits / 8) + 4 per bucket. A bucket whose norm
  is 0 sends level 0 everywhere.

Packed bit order (``pack_codes``): entry i's code occupies bits ``[i * bits, (i + 1) * bits)``
of the stream, least significant bit first; stream bit b is bit ``b % 8`` of byte ``b // 8``
(little-endian bit order, as ``numpy.packbits(..., bitorder="little")``); the last byte's unused
high bits are 0.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from sparsetrain.compress import kernels, splitmix
from sparsetrain.compress.base import Compressor, Payload


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that hold ``n`` codes of ``bits`` bits each, packed tightly."""
    return -(-int(n) * int(bits) // 8)


def _code_dtype(bits: int) -> torch.dtype:
    return torch.uint8 if bits <= 8 else torch.int32


def _numpy_ok(t: torch.Tensor) -> bool:
    """Whether the CPU's numpy path takes ``t`` (the CUDA path, and bfloat16, take torch's)."""
    return t.device.type == "cpu" and t.is_contiguous() and t.dtype != torch.bfloat16


def _batched(t: torch.Tensor) -> bool:
    """Whether the torch path batches its per-segment and per-bucket work (a device: one
    launch per segment costs more than the work) or keeps the CPU's loop (the same numbers as
    before, for the CPU's bfloat16). Tests turn it on for the CPU to check it against the loop."""
    return t.device.type != "cpu"


def _norms(pieces: list[torch.Tensor], ord: float) -> torch.Tensor:
    """Each piece's ``ord``-norm, as one vector, in one multi-tensor kernel (``torch._foreach_norm``,
    the one ``clip_grad_norm_`` uses) instead of a launch per piece."""
    return torch.stack(torch._foreach_norm(pieces, ord))


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels (``compress.kernels``) take these CPU tensors: numba in use,
    and every float among them float32 or float64 (float16 keeps the numpy path)."""
    return kernels.available() and all(
        _numpy_ok(t) and (not t.is_floating_point() or t.dtype in (torch.float32, torch.float64)) for t in tensors)


def _pack_bits(stream: torch.Tensor, out: torch.Tensor) -> None:
    """One bit per entry (``stream``: bool or 0/1 ``uint8``) into ``out``, 8 a byte, the lowest
    bit first (numpy's ``packbits(..., bitorder="little")``, which the CPU uses)."""
    if _numpy_ok(stream) and _numpy_ok(out):
        out.numpy()[:] = np.packbits(stream.numpy(), bitorder="little")
        return
    nbytes = out.numel()
    stream = stream.to(torch.uint8)
    if stream.numel() < nbytes * 8:
        stream = torch.cat([stream, stream.new_zeros(nbytes * 8 - stream.numel())])
    _combine(stream.view(nbytes, 8), 1, out)


def _unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of ``packed`` as 0/1 ``uint8`` (``_pack_bits`` undone)."""
    if _numpy_ok(packed):
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=count, bitorder="little"))
    return _split(packed, 1)[:count]


def _combine(columns: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """``out[b] = sum_j columns[b, j] << (j * bits)``: ``8 // bits`` codes into each byte."""
    out.copy_(columns[:, 0])
    for j in range(1, columns.shape[1]):
        out.bitwise_or_(columns[:, j].bitwise_left_shift(j * bits))


def _split(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``_combine`` undone: every byte's ``8 // bits`` codes, in order (``uint8``)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return packed.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and_((1 << bits) - 1).view(-1)


def _pack_whole_codes(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    """``pack_codes`` for 2 or 4 bits on the CPU: the ``8 // bits`` codes of a byte, read as one
    little-endian word (code j at bit 8 j), times a constant that moves code j to bit
    ``8 (per - 1) + bits j``; the word's top byte is then the packed byte. Every other product
    term lands below the top byte without overlapping another (codes < 2**bits), so no carry
    reaches it: the same bytes as ``_combine``."""
    per = 8 // bits
    word = {2: np.uint16, 4: np.uint32}[per]
    if codes.size != out.size * per:  # the last byte's missing codes are 0
        padded = np.zeros(out.size * per, dtype=np.uint8)
        padded[: codes.size] = codes
        codes = padded
    magic = word(sum(1 << (8 * (per - 1) - (8 - bits) * j) for j in range(per)))
    prod = np.multiply(codes.view(word), magic)  # wraps modulo the word size, as intended
    np.copyto(out, prod.view(np.uint8)[per - 1 :: per])


def _unpack_whole_codes(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """``_pack_whole_codes`` undone: ``n`` codes (``uint8``)."""
    per = 8 // bits
    codes = np.empty((packed.size, per), dtype=np.uint8)
    for j in range(per):  # code j of every byte: (byte >> bits j) & mask
        np.bitwise_and(np.right_shift(packed, bits * j, out=codes[:, j]), (1 << bits) - 1, out=codes[:, j])
    return codes.reshape(-1)[:n]


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``codes`` (n unsigned integers, each below ``2**bits``; bool for one bit) tightly
    into ``out`` (``uint8``, ``packed_nbytes(n, bits)`` bytes; allocated when None).

    Entry i's code occupies bits ``[i * bits, (i + 1) * bits)`` of the stream, lowest bit first;
    stream bit b is bit ``b % 8`` of byte ``b // 8``; the last byte's unused high bits are 0.
    With ``bits`` 1, 2, 4 or 8 that is ``8 // bits`` whole codes per byte."""
    codes = codes.reshape(-1)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    elif out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"{n} codes of {bits} bits need {nbytes} uint8 bytes, out has {out.numel()} {out.dtype}")
    if bits == 1:
        _pack_bits(codes, out)
    elif bits == 8:
        out.copy_(codes)
    elif 8 % bits == 0 and _numpy_ok(codes) and _numpy_ok(out):  # 2 or 4: one multiply per byte
        _pack_whole_codes(codes.to(torch.uint8).numpy(), bits, out.numpy())
    elif 8 % bits == 0:  # 2 or 4: whole codes in each byte
        per = 8 // bits
        c = codes.to(torch.uint8)
        if n < nbytes * per:
            c = torch.cat([c, c.new_zeros(nbytes * per - n)])
        _combine(c.view(nbytes, per), bits, out)
    else:  # codes across byte boundaries: through a stream of single bits
        if bits <= 8 and _numpy_ok(codes):
            c = codes.to(torch.uint8).numpy().reshape(n, 1)
            stream = torch.from_numpy(np.unpackbits(c, axis=1, count=bits, bitorder="little").reshape(-1))
        else:
            shifts = torch.arange(bits, dtype=torch.int32, device=codes.device)
            stream = codes.to(torch.int32).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1)
            stream = stream.to(torch.uint8).view(-1)
        _pack_bits(stream, out)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes ``pack_codes`` packed: ``uint8`` (0/1 for one bit) up to 8 bits, ``int32``
    above. With 8 bits the result is ``packed`` itself."""
    if packed.numel() != packed_nbytes(n, bits):
        raise ValueError(f"{n} codes of {bits} bits are {packed_nbytes(n, bits)} bytes, got {packed.numel()}")
    if bits == 1:
        return _unpack_bits(packed, n)
    if bits == 8:
        return packed
    if 8 % bits == 0:
        if _numpy_ok(packed):
            return torch.from_numpy(_unpack_whole_codes(packed.numpy(), bits, n))
        return _split(packed, bits)[:n]
    stream = _unpack_bits(packed, n * bits).view(n, bits)
    if bits <= 8 and _numpy_ok(stream):
        return torch.from_numpy(np.packbits(stream.numpy(), axis=1, bitorder="little").reshape(-1))
    weights = torch.tensor([1 << b for b in range(bits)], dtype=torch.int32, device=packed.device)
    return stream.to(torch.int32).mul_(weights).sum(dim=1, dtype=torch.int32).to(_code_dtype(bits))


_SIGNIFICAND = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _signed(x: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def counter_uniforms(seed: int, n: int, dtype: torch.dtype, device, out: np.ndarray | None = None):
    """QSGD's counter-based uniforms (``generator="counter"``) of entries 0 ... n - 1 for ``seed``:
    entry i's 64 bits are ``splitmix64(counter_key(seed) + (i + 1) GAMMA)``, the top 24 of them
    x 2**-24 for float32, the top 53 x 2**-53 for float64 (as many as the dtype's significand
    holds, so each is exact and below 1; ``compress.kernels`` draws the same
    inside its pass). ``out`` given (a numpy array): numpy's uint64 arithmetic into it; otherwise
    torch's int64 (wrapping, with the logical shifts masked), on ``device``."""
    key = splitmix.counter_key(seed)
    top = _SIGNIFICAND[dtype]
    if out is not None:
        x = np.arange(1, n + 1, dtype=np.uint64)
        x *= np.uint64(splitmix.GAMMA)
        x += np.uint64(key)
        for shift, mult in ((30, splitmix.MIX1), (27, splitmix.MIX2)):
            x ^= x >> np.uint64(shift)
            x *= np.uint64(mult)
        x ^= x >> np.uint64(31)
        np.multiply((x >> np.uint64(64 - top)).astype(out.dtype), out.dtype.type(2.0 ** -top), out=out)
        return out

    def shr(v, k):  # logical right shift of int64 bit patterns
        return v.bitwise_right_shift(k).bitwise_and_((1 << (64 - k)) - 1)

    x = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(_signed(splitmix.GAMMA)).add_(_signed(key))
    for shift, mult in ((30, splitmix.MIX1), (27, splitmix.MIX2)):
        x = x.bitwise_xor_(shr(x, shift)).mul_(_signed(mult))
    x = x.bitwise_xor_(shr(x, 31))
    return shr(x, 64 - top).to(dtype).mul_(2.0 ** -top)


class Quantizer(Compressor):
    """Base of the quantizers: every entry is sent (``k = numel``; ``ratio`` does not apply), in
    ``bits_per_entry`` bits, with one float per segment (per tensor, or one with
    ``scope="global"``). Subclasses implement ``encode`` (codes and per-segment floats) and
    ``decode_add`` (``out +=`` a message, decoded); ``decode_many`` (several messages in one
    pass) is optional: without it ``fused_decode`` is False and every message goes through
    ``decode_add`` (docs/own_compressor.md, "A quantizer")."""

    shared_positions = False
    ratio_applies = False
    allreduce_refusal = "sends every rank's own codes and scales, which cannot be summed"
    #: set by each subclass (or its constructor)
    bits_per_entry: ClassVar[int] = 1
    # work buffers and tables built on first use (the kept-state check leaves them out)
    transient: ClassVar[tuple[str, ...]] = ("_scratch", "_entry_tables", "_sizes", "_norm_places")

    def __init__(self, ratio: float = 1.0, layout=None, scope: str = "layerwise", *, device="cpu", **options):
        super().__init__(1.0, layout, scope, device=device, **options)  # ratio does not apply
        self._segment_bounds = self._bounds(self.spans())  # the kernels' segments (signSGD's scales)
        bits = self.bits_per_entry
        if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1:
            raise ValueError(f"{type(self).__name__}.bits_per_entry={bits!r} is not allowed; it must be an "
                             "integer >= 1 (the bits of one entry's code)")
        if self.fused_decode is None:  # the fused pass where the class has one
            self.fused_decode = _implements(type(self), "decode_many")
        if self.fused_decode and _stale_decode_many(type(self)):
            self.fused_decode = False  # decode_many decodes a base's codes, not this class's
        problem = type(self).unimplemented(self.fused_decode)
        if problem:
            raise TypeError(problem)
        if self.fused_decode and kernels.available() and self.device.type == "cpu":
            self.warm_kernels()

    # --- the message's two sections ------------------------------------------------------------
    def segment_ks(self, layout):
        return list(layout.sizes)  # every entry is sent

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
    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each segment."""
        return [(o, o + n) for o, n in zip(self.layout.offsets, self.layout.sizes, strict=True)]

    def scratch(self, name: str, dtype) -> np.ndarray:
        """A reused CPU buffer of ``numel`` entries (the numpy paths' temporaries)."""
        buffers = self.__dict__.setdefault("_scratch", {})
        key = (name, np.dtype(dtype))
        if key not in buffers:
            buffers[key] = np.empty(self.numel, dtype=dtype)
        return buffers[key]

    def segments(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x``'s segments (views), in order."""
        if len(self.layout) == 1:
            return [x]
        return [x[o : o + n] for o, n in zip(self.layout.offsets, self.layout.sizes, strict=True)]

    def per_segment(self, x: torch.Tensor, fn) -> torch.Tensor:
        """``fn`` of each segment of ``x`` (a 0-d tensor each), as one vector."""
        return torch.stack([fn(seg) for seg in self.segments(x)]).reshape(-1)

    def segment_norms(self, x: torch.Tensor, ord: float) -> torch.Tensor:
        """Each segment's ``ord``-norm in one kernel (``_norms``): the device paths'."""
        return _norms(self.segments(x), ord)

    def entry_table(self, name: str, dev: torch.device) -> torch.Tensor:
        """Per entry the index of its segment (``"segment"``) or bucket (``"bucket"``, QSGD), int32
        on ``dev``, built on first use: a device path spreads per-segment numbers over the
        entries with one gather instead of a launch per segment (the size of the model in
        int32, on that device)."""
        tables = self.__dict__.setdefault("_entry_tables", {})
        if (name, dev) not in tables:
            spans = self.spans() if name == "segment" else self.bucket_spans()
            lengths = torch.tensor([j - i for i, j in spans], dtype=torch.int64)
            tables[(name, dev)] = torch.repeat_interleave(torch.arange(len(spans), dtype=torch.int32), lengths).to(dev)
        return tables[(name, dev)]

    # --- what subclasses provide ---------------------------------------------------------------
    def encode(self, acc: torch.Tensor, seed: int, values: torch.Tensor, wire: torch.Tensor) -> None:
        """Fill ``values`` (one float per segment) and ``wire`` (the packed codes) from ``acc``."""
        raise NotImplementedError(_MUST["encode"].format(name=type(self).__name__))

    def decode_add(self, values: torch.Tensor, wire: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` the message, decoded (``values`` in ``out``'s dtype)."""
        raise NotImplementedError(_MUST["decode_add"].format(name=type(self).__name__))

    @classmethod
    def unimplemented(cls, fused_decode: bool | None = None) -> str | None:
        """The one line saying what the class must still implement (None: nothing): ``encode``
        and ``decode_add``, and ``decode_many`` where ``fused_decode`` (the class's, unless
        given) is True. ``config.validate`` asks before any rank starts; the constructor too."""
        fused = cls.fused_decode if fused_decode is None else fused_decode
        for method in ("encode", "decode_add"):
            if not _implements(cls, method):
                return _MUST[method].format(name=cls.__name__)
        if fused and not _implements(cls, "decode_many"):
            return _MUST["decode_many"].format(name=cls.__name__)
        return None

    def warm_kernels(self) -> None:
        """Compile what ``decode_many`` (and ``encode``) will run, at construction rather than in
        a timed step; called where ``fused_decode`` is True and the compiled kernels are in use
        on the CPU. Default: nothing (the built-in quantizers warm ``compress.kernels``)."""

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
        """``out +=`` the message (``values`` as received, e.g. divided by the number of ranks;
        ``positions`` its packed codes), decoded. ``indices`` does not apply."""
        self.decode_add(values.to(out.dtype), positions, out)
        return out

    def decompress_many(self, messages, out: torch.Tensor) -> torch.Tensor:
        """Every message added into ``out`` in one sweep on the CPU's compiled kernels (each
        entry receives ``+= m_0``, then ``+= m_1``, ...: the sequential loop's floats); the
        loop of ``decompress_add`` elsewhere."""
        wires = [positions for _, positions, _ in messages]
        if messages and self.fused_decode and _kernel_ok(out, *wires):
            values = torch.stack([v.to(out.dtype) for v, _, _ in messages])
            self.decode_many(values, torch.stack(wires), out)
            return out
        return super().decompress_many(messages, out)

    #: whether ``decode_many`` decodes the gathered messages in one pass (on the CPU, float32 or
    #: float64, where the compiled kernels are in use: ``_kernel_ok``); False: ``decode_add``
    #: of each in turn. None (the default): True exactly where the class implements
    #: ``decode_many``. A class or constructor may set it (QSGD: for 2, 4 or 8 bits only). False,
    #: whatever is set, where ``encode`` or ``decode_add`` is defined below the class that defines
    #: ``decode_many`` (``_stale_decode_many``).
    fused_decode: ClassVar[bool | None] = None

    def decode_many(self, values: torch.Tensor, wires: torch.Tensor, out: torch.Tensor) -> None:
        """``out +=`` W messages, decoded, in one pass (the built-in quantizers: the compiled
        kernel), each entry receiving ``+= m_0``, then ``+= m_1``, ...: the floats of
        ``decode_add`` of each in turn. ``values`` [W, num_values] in ``out``'s dtype, ``wires``
        [W, num_positions]. Optional (see ``fused_decode``)."""
        raise NotImplementedError(_MUST["decode_many"].format(name=type(self).__name__))

    def _bounds(self, spans) -> np.ndarray:
        """``spans``' starts, then the last one's end (int64): a kernel's segment or bucket bounds."""
        return np.array([i for i, _ in spans] + [spans[-1][1]], dtype=np.int64)

    def forget(self, memory: torch.Tensor, payload: Payload) -> None:
        """``memory = acc - decode(message)``: the decoded message of the negated scales added
        (the exact negation of the decoded message); ``payload.decoded`` where set, as the base's
        (see ``Compressor.forget``: when it runs)."""
        if payload.decoded is not None:
            super().forget(memory, payload)
            return
        self.decompress_add(payload.values.neg(), payload.positions, memory)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scope={self.scope!r}, bits={self.bits_per_entry}, n={self.numel})"


#: what each method a quantizer implements does, said where it is missing (``{name}``: the class)
_MUST = {
    "encode": "{name} must implement encode(acc, seed, values, wire): fill values (num_values floats) and "
              "wire (the packed codes, num_positions bytes) from acc; see docs/own_compressor.md",
    "decode_add": "{name} must implement decode_add(values, wire, out): out += the message, decoded; "
                  "see docs/own_compressor.md",
    "decode_many": "{name} must implement decode_many(values, wires, out) or set fused_decode = False: "
                   "fused_decode = True decodes every rank's message in one decode_many call; "
                   "see docs/own_compressor.md",
}


def _implements(cls: type, method: str) -> bool:
    """Whether ``cls`` (or a base below ``Quantizer``) defines ``method``."""
    return getattr(cls, method) is not getattr(Quantizer, method)


def _stale_decode_many(cls: type) -> bool:
    """Whether ``cls`` inherits its ``decode_many`` from a class above one that changes ``encode``
    or ``decode_add`` (a subclass of ``SignSGD`` or ``QSGD`` with codes of its own): that
    ``decode_many`` decodes the base's codes, while error feedback and the statistics decode
    through ``decode_add``. Such a class decodes through ``decode_add`` (``fused_decode`` False)
    unless it defines ``decode_many`` itself."""
    if not _implements(cls, "decode_many"):
        return False
    mro = cls.__mro__
    owner = next(i for i, klass in enumerate(mro) if "decode_many" in vars(klass))
    return any(m in vars(klass) for klass in mro[:owner] for m in ("encode", "decode_add"))


class SignSGD(Quantizer):
    """The scaled sign of EF-SGD: per segment ``mean(|acc|) * sign(acc)``, with an exact zero
    sent as + (bit 0). One bit per entry and one float per segment (tensor, or the whole buffer
    with ``scope="global"``). Use with error feedback (the scheme's default)."""

    bits_per_entry = 1
    #: ``train.fast_path``: the decode, one Triton kernel (``compress.fused.sign_decode_add``, set
    #: by ``fused.prepare``; a function here keeps this module from importing the kernels')
    fast_decode = None

    def warm_kernels(self):
        kernels.warm(1, signs=True)

    def encode(self, acc, seed, values, wire):
        if _kernel_ok(acc, wire):  # the CPU's compiled kernel: the numpy path's bytes, one pass each
            a = acc.numpy()
            scales = np.empty(len(self.layout), dtype=a.dtype)
            kernels.sign_encode(a, self._segment_bounds, scales, wire.numpy())
            values.copy_(torch.from_numpy(scales))
            return
        if _numpy_ok(acc) and _numpy_ok(wire):  # the CPU: numpy's kernels, reused buffers
            a = acc.numpy()
            mag = np.abs(a, out=self.scratch("mag", a.dtype))
            values.copy_(torch.tensor([mag[i:j].sum(dtype=a.dtype) / (j - i) for i, j in self.spans()]))
            pack_codes(torch.from_numpy(np.less(a, 0, out=self.scratch("neg", bool))), 1, wire)
            return
        if _batched(acc):  # all segments' norms in one kernel, divided by a tensor (see QSGD.decode_add)
            sizes = self.__dict__.setdefault("_sizes", {})
            if (acc.device, acc.dtype) not in sizes:
                sizes[(acc.device, acc.dtype)] = torch.tensor(self.layout.sizes, dtype=acc.dtype, device=acc.device)
            values.copy_(self.segment_norms(acc, 1).div_(sizes[(acc.device, acc.dtype)]))
        else:
            values.copy_(self.per_segment(acc, lambda v: torch.linalg.vector_norm(v, 1) / v.numel()))
        pack_codes(acc < 0, 1, wire)

    def decode_many(self, values, wires, out):  # +-1 x the segment's scale: exact
        kernels.decode_many(values.contiguous().numpy(), kernels.decode_table(1, signs=True), wires.numpy(),
                            self._segment_bounds, 1, out.numpy())

    def decode_add(self, values, wire, out):
        if self.fast_decode is not None:
            self.fast_decode(self, values, wire, out)
            return
        if _kernel_ok(wire, out):
            self.decode_many(values.reshape(1, -1), wire.reshape(1, -1), out)
            return
        if _numpy_ok(wire) and _numpy_ok(out):  # +-1 per entry, then += scale x +-1 per segment
            signs = self.scratch("signs", torch.empty((), dtype=out.dtype).numpy().dtype)
            pm = np.unpackbits(wire.numpy(), count=self.numel, bitorder="little").view(np.int8)  # 1: negative
            np.bitwise_or(np.negative(pm, out=pm), 1, out=pm)  # 0 -> +1, 1 -> -1 (-1 | 1 = -1)
            np.copyto(signs, pm)  # exact
            for (i, j), scale in zip(self.spans(), values.tolist(), strict=True):
                out[i:j].add_(torch.from_numpy(signs[i:j]), alpha=scale)  # +-1 x scale: exact
            return
        negative = unpack_codes(wire, 1, self.numel).view(torch.bool)
        if _batched(out):
            scale = values[self.entry_table("segment", out.device)]  # each entry's: the same sums
            out.add_(torch.where(negative, scale.neg(), scale))
            return
        for neg, o, scale in zip(self.segments(negative), self.segments(out), values, strict=True):
            o.add_(torch.where(neg, -scale, scale))


class QSGD(Quantizer):
    """Stochastic quantization to ``levels`` levels per bucket (Alistarh et al. 2017), unbiased,
    randomness from ``seed``; each entry's signed level ``sign(x_i) * l_i`` in
    ``1 + ceil(log2(levels + 1))`` bits (two's complement), one float (the bucket's 2-norm) per
    bucket. Each segment (a tensor; the whole buffer with ``scope="global"``) is cut into
    consecutive buckets of ``bucket_size`` entries, the last one shorter (the paper's d = 512, the
    default); ``bucket_size=None``: one bucket per segment (one norm per tensor)."""

    MAX_LEVELS = 65535
    #: ``counter`` (the default): SplitMix64, counter-based (entry i's number a function of the
    #: step's seed and i alone), the same numbers on the CPU and on CUDA, and cheaper to draw than
    #: PCG64 (see docs/performance.md). ``pcg64``: numpy's PCG64 on the CPU, torch's generator on
    #: CUDA (the two draw different numbers; every QSGD run before ``scheme.generator`` existed)
    GENERATORS = ("counter", "pcg64")
    draws_span_segments = True  # one stream of uniforms over every entry (see uniforms)
    transient = ("_drawn", "_drawn_key")  # the latest draw, a cache

    def __init__(self, ratio: float = 1.0, layout=None, scope: str = "layerwise", *, levels: int = 127,
                 bucket_size: int | None = 512, generator: str = "counter", **kw):
        self.check_options(levels=levels, bucket_size=bucket_size, generator=generator)
        self.generator = generator
        self.levels = int(levels)
        self.bucket_size = None if bucket_size is None else int(bucket_size)
        self.bits_per_entry = 1 + math.ceil(math.log2(self.levels + 1))
        self.fused_decode = self.bits_per_entry in (2, 4, 8)  # the kernels' whole codes per byte
        super().__init__(ratio, layout, scope, **kw)
        bits = self.bits_per_entry
        self._mask, self._top = (1 << bits) - 1, 1 << (bits - 1)  # the code's bits; its sign bit
        self._signed = np.int8 if bits <= 8 else np.int32  # a code as a signed integer
        # per segment: (start, full buckets, their size, the last short bucket's size or 0)
        self._cuts = []
        for o, n in zip(self.layout.offsets, self.layout.sizes, strict=True):
            size = n if self.bucket_size is None or self.bucket_size >= n else self.bucket_size
            self._cuts.append((o, n // size, size, n % size))
        self._num_buckets = sum(full + (tail > 0) for _, full, _, tail in self._cuts)
        self._bucket_bounds = self._bounds(self.bucket_spans())

    @classmethod
    def check_options(cls, *, levels: int = 127, bucket_size: int | None = 512, generator: str = "counter") -> None:
        if isinstance(levels, bool) or not isinstance(levels, (int, float)) or int(levels) != levels \
                or not 1 <= levels <= cls.MAX_LEVELS:
            raise ValueError(f"scheme.levels={levels!r} is not allowed; it must be an integer in "
                             f"[1, {cls.MAX_LEVELS}]")
        if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, (int, float))
                                        or int(bucket_size) != bucket_size or bucket_size < 1):
            raise ValueError(f"scheme.bucket_size={bucket_size!r} is not allowed; it must be an integer >= 1, "
                             "or null (one norm per tensor)")
        if generator not in cls.GENERATORS:
            raise ValueError(f"scheme.generator={generator!r} is not allowed; use one of "
                             f"{', '.join(cls.GENERATORS)}")

    def warm_kernels(self):
        kernels.warm(self.bits_per_entry)

    @property
    def num_values(self) -> int:
        """One float per bucket: its 2-norm."""
        return self._num_buckets

    def bucket_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each bucket, in the order of the norms."""
        out = []
        for o, full, size, tail in self._cuts:
            out += [(o + b * size, o + (b + 1) * size) for b in range(full)]
            if tail:
                out.append((o + full * size, o + full * size + tail))
        return out

    def _pieces(self, x):
        """``(view, first, count)`` per run of buckets of ``x`` (a tensor or numpy array): each
        segment's full buckets as a ``[count, size]`` view, then its short last bucket as a
        ``[1, tail]`` view; ``first`` the index of the run's first norm."""
        b = 0
        for o, full, size, tail in self._cuts:
            if full:
                yield x[o : o + full * size].reshape(full, size), b, full
                b += full
            if tail:
                yield x[o + full * size : o + full * size + tail].reshape(1, tail), b, 1
                b += 1

    def bucket_norms(self, x: torch.Tensor) -> torch.Tensor:
        """The 2-norm of each bucket of ``x``, in order. On a device in a few kernels whatever
        the number of segments: the full buckets of every segment (``_pieces``' runs) copied into
        one matrix (one ``cat``) and normed by rows, the other buckets (short ends, whole
        segments) in one multi-tensor norm."""
        if not _batched(x):
            return torch.cat([torch.linalg.vector_norm(v, dim=1) for v, _, _ in self._pieces(x)])
        pieces = list(self._pieces(x))
        rows = [p for p in pieces if p[0].shape[1] == self.bucket_size]
        others = [p for p in pieces if p[0].shape[1] != self.bucket_size]  # one bucket each
        places = self.__dict__.setdefault("_norm_places", {})
        if x.device not in places:  # where each group's norms go in the bucket order
            places[x.device] = [torch.tensor([i for _, first, count in group for i in range(first, first + count)],
                                             dtype=torch.int64, device=x.device) for group in (rows, others)]
        rows_at, others_at = places[x.device]
        out = torch.empty(self._num_buckets, dtype=x.dtype, device=x.device)
        if rows:
            matrix = torch.cat([v.reshape(-1) for v, _, _ in rows]).view(-1, self.bucket_size)
            out[rows_at] = torch.linalg.vector_norm(matrix, dim=1)
        if others:
            out[others_at] = _norms([v.reshape(-1) for v, _, _ in others], 2)
        return out

    def _scale_buckets(self, x, factors) -> None:
        """``x`` (a tensor or numpy array) times its bucket's factor, in place, entry by entry
        (on a device with the factors spread over the entries: the same products)."""
        if isinstance(x, torch.Tensor) and _batched(x):
            x.mul_(factors[self.entry_table("bucket", x.device)])
            return
        for v, b, count in self._pieces(x):
            v *= factors[b : b + count].reshape(count, 1)

    def uniforms(self, seed: int, acc: torch.Tensor, numpy: bool):
        """One uniform in [0, 1) per entry for ``seed``, in ``acc``'s dtype: numpy's PCG64 into
        a reused array (``numpy``: the CPU path), torch's generator otherwise. Shared draws
        (``share_draws``): the source's numbers at this compressor's entries (the source keeps
        its latest draw: every DDP bucket of a step reads it)."""
        if self._draw_source is not None:
            source, _ = self._draw_source
            full = source.uniforms(seed, acc, numpy)
            if numpy:
                return np.take(full, self._entries_np, out=self.scratch("u", full.dtype))
            return full[self._entries.to(full.device)]
        key = (int(seed), acc.dtype, acc.device, numpy)
        if self.__dict__.get("_drawn_key") == key:
            return self._drawn
        if self.generator == "counter":
            u = counter_uniforms(seed, self.numel, acc.dtype, acc.device,
                                 out=self.scratch("u", acc.numpy().dtype) if numpy else None)
        elif numpy:
            dtype = acc.numpy().dtype
            u = np.random.default_rng(int(seed)).random(self.numel, dtype=dtype, out=self.scratch("u", dtype))
        else:
            gen = torch.Generator(device=acc.device)
            gen.manual_seed(int(seed))
            u = torch.rand(self.numel, generator=gen, dtype=acc.dtype, device=acc.device)
        self._drawn_key, self._drawn = key, u
        return u

    def share_draws(self, source, segments):
        if (source.levels, source.bucket_size) != (self.levels, self.bucket_size):
            raise ValueError(f"{self!r} shares draws only with a QSGD of its own options, not {source!r}")
        super().share_draws(source, segments)
        self._entries = torch.cat([torch.arange(source.layout.offsets[s], source.layout.offsets[s] + n)
                                   for s, n in zip(segments, self.layout.sizes, strict=True)])
        self._entries_np = self._entries.numpy()

    #: ``train.fast_path``: encode and decode by Triton kernels (``compress.fused.qsgd_encode``,
    #: ``qsgd_decode_add``; set by ``fused.prepare``)
    fast_encode = None
    fast_decode = None

    def encode(self, acc, seed, values, wire):
        if self.fast_encode is not None:
            self.fast_encode(self, acc, seed, values, wire)
            return
        s = self.levels
        values.copy_(self.bucket_norms(acc))
        norms = values.to(acc.dtype)  # the norms as sent: decode multiplies by them
        # s / ||x|| per bucket (0 where the norm is 0), rounded once to acc's dtype
        factors = torch.where(norms > 0, s / norms.double(), norms.new_zeros((), dtype=torch.float64)).to(acc.dtype)
        if self.fused_decode and self._draw_source is None and _kernel_ok(acc, wire):
            # the compiled kernel: the numpy path's bytes, the uniforms (counter or PCG64) drawn in its one pass
            counter = self.generator == "counter"
            state = (np.uint64(0),) * 4 if counter else kernels.pcg64_state(seed)
            key = np.uint64(splitmix.counter_key(seed) if counter else 0)
            kernels.qsgd_encode(acc.numpy(), factors.numpy(), self._bucket_bounds, s, self.bits_per_entry,
                                *state, wire.numpy(), key, counter)
            return
        if _numpy_ok(acc) and _numpy_ok(wire):  # the CPU: numpy's kernels (uniforms: self.uniforms)
            a = acc.numpy()
            r = np.abs(a, out=self.scratch("r", a.dtype))
            self._scale_buckets(r, factors.numpy())  # |x| / ||x|| * s
            u = self.uniforms(seed, acc, numpy=True)
            np.add(r, u, out=r)
            if s == 1:  # 2 bits: see _encode_one_level
                pack_codes(torch.from_numpy(self._encode_one_level(r, a)), 2, wire)
                return
            np.floor(r, out=r)  # floor(r + u): floor(r) + 1 with probability r - floor(r)
            np.copysign(np.minimum(r, s, out=r), a, out=r)  # the signed level
            code = self.scratch("code", self._signed)
            np.copyto(code, r, casting="unsafe")
            if self.bits_per_entry != 8:
                np.bitwise_and(code, self._mask, out=code)  # two's complement in bits_per_entry bits
            pack_codes(torch.from_numpy(code.view(np.uint8) if code.dtype == np.int8 else code),
                       self.bits_per_entry, wire)
            return
        r = torch.abs(acc)
        self._scale_buckets(r, factors.to(acc.device))  # |x| / ||x|| * s
        u = self.uniforms(seed, acc, numpy=False)
        # floor(r + u), u uniform in [0, 1): floor(r) + 1 with probability r - floor(r)
        level = torch.copysign(r.add_(u).floor_().clamp_(max=s), acc)
        pack_codes(level.to(torch.int32).bitwise_and_(self._mask), self.bits_per_entry, wire)

    def _encode_one_level(self, t: np.ndarray, a: np.ndarray) -> np.ndarray:
        """s = 1's codes from ``t = r + u``: the level ``min(floor(t), 1)`` is ``t >= 1`` (t >= 0;
        +inf: 1; NaN: 0, as NaN's cast to an integer gives on the general path), and
        ``copysign(level, a)`` in two bits is 1 (+1), 3 (-1) or 0 (level 0, whatever the sign):
        ``level | (level & (a < 0)) << 1`` (where the level is 1, a is a nonzero number, so its
        sign bit is ``a < 0``). The same codes as the general path, without its float passes."""
        level = np.greater_equal(t, 1, out=self.scratch("level", bool)).view(np.uint8)
        neg = np.less(a, 0, out=self.scratch("neg", bool)).view(np.uint8)
        np.left_shift(np.bitwise_and(neg, level, out=neg), 1, out=neg)
        return np.bitwise_or(level, neg, out=neg)

    def decode_many(self, values, wires, out):  # the signed level x ||x|| / s of its bucket
        bits = self.bits_per_entry
        kernels.decode_many(values.div(self.levels).numpy(), kernels.decode_table(bits), wires.numpy(),
                            self._bucket_bounds, bits, out.numpy())

    def decode_add(self, values, wire, out):
        if self.fast_decode is not None:
            self.fast_decode(self, values, wire, out)
            return
        if self.fused_decode and _kernel_ok(wire, out):
            self.decode_many(values.reshape(1, -1), wire.reshape(1, -1), out)
            return
        codes = unpack_codes(wire, self.bits_per_entry, self.numel)
        # ||x|| / s per bucket, divided by a tensor on the values' device: CUDA divides by a
        # number from the host as a product with its reciprocal, which rounds otherwise
        units = values.div(values.new_tensor(self.levels))
        if _numpy_ok(codes) and _numpy_ok(out):
            c = codes.numpy()
            if self.bits_per_entry == 8:
                signed = c.view(np.int8)
            elif self.bits_per_entry < 8:  # sign-extend in int8: (c ^ top) - top, top <= 64
                signed = np.bitwise_xor(c, self._top, out=self.scratch("signed", np.uint8)[: c.size]).view(np.int8)
                np.subtract(signed, np.int8(self._top), out=signed)
            else:  # sign-extend: (c ^ top) - top
                signed = np.subtract(np.bitwise_xor(c, self._top), self._top, dtype=np.int32)
            dec = self.scratch("decoded", torch.empty((), dtype=out.dtype).numpy().dtype)
            np.copyto(dec, signed, casting="unsafe")
            self._scale_buckets(dec, units.cpu().numpy())  # sign(x_i) l_i x ||x|| / s
            out.add_(torch.from_numpy(dec))
            return
        signed = codes.to(torch.int32).bitwise_xor_(self._top).sub_(self._top).to(out.dtype)
        # the product rounded before the sum (no fused multiply-add), as on the CPU: error
        # feedback's memory is then exactly acc - decoded
        self._scale_buckets(signed, units)
        out.add_(signed)

    def __repr__(self) -> str:
        return (f"QSGD(levels={self.levels}, bucket_size={self.bucket_size}, scope={self.scope!r}, "
                f"bits={self.bits_per_entry}, n={self.numel}, generator={self.generator!r})")
