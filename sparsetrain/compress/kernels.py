"""Compiled CPU kernels of the quantizers (numba), bit-identical to their numpy paths.

The numpy paths of ``quantize.py`` make several full passes over the gradient per call (absolute
values, comparisons, a bit stream, packing), and numpy's PCG64 hands out one float per call
through a function pointer. These kernels do each operation in one or two passes, with the same
floating-point operations in the same order, so every packed byte, scale and decoded float is the
one the numpy path gives (``tests/test_quantize.py`` checks both paths against one reference):

- ``sign_encode``: per segment the sum of ``|a|`` in numpy's own order (pairwise: blocks of 128
  entries summed in 8 lanes, halves split at a multiple of 8; see ``_pairwise_abs_sum``), then
  the sign bits, packed.
- ``decode_many`` (both quantizers): W messages added into ``out`` in one sweep, each entry
  receiving ``+= m_0``, then ``+= m_1``, ... (the sequential loop's floats); each packed byte's
  values come from a 256-entry table (``decode_table``).
- ``qsgd_encode``: ``|a| x factor + u``, rounded, signed, packed, with u drawn block by block
  from PCG64 as numpy draws it (``random(dtype=...)`` of ``default_rng(seed)``): the 128-bit LCG
  step and XSL-RR output (``_pcg_next``), float32 from the top 24 bits of each 32-bit half (low
  half first), float64 from the top 53 bits; or, with QSGD's ``generator="counter"``, from
  SplitMix64 at counter i (``_draw_counter``), as ``quantize.counter_uniforms`` draws it.

Loops run over blocks of ``BLOCK`` entries and, inside them, over whole array views: LLVM
vectorizes those (a loop over a computed ``range(start, stop)`` of a larger array it did not).

Which path runs: ``SPARSETRAIN_KERNELS=numba`` (the default where numba imports) or ``numpy``;
``available()`` says whether these kernels are in use. numba is an optional dependency (the
``fast`` extra, which ``make`` installs): without it the numpy paths run, slower, with the same
results. Compiled code is cached beside this file (numba's ``cache=True``).
"""

from __future__ import annotations

import functools
import os

import numpy as np

try:  # optional: the numpy paths give the same bytes without it
    import numba
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None

CHOICES = ("numba", "numpy")

# QSGD's counter-based generator (``generator="counter"``): SplitMix64, whose i-th output is a
# function of (seed, i) alone: ``mix(key + (i + 1) * GAMMA)``. The same three constants in the
# compiled, numpy and torch paths, so all three draw the same numbers.
GAMMA = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function on a 64-bit integer (Python ints: exact)."""
    x = (x ^ (x >> 30)) * MIX1 & MASK64
    x = (x ^ (x >> 27)) * MIX2 & MASK64
    return x ^ (x >> 31)


def counter_key(seed: int) -> int:
    """The stream's key for ``seed`` (a step's seed, per step and rank): SplitMix64's first output
    for it, so that nearby seeds give unrelated streams."""
    return splitmix64((int(seed) + GAMMA) & MASK64)


def wanted() -> str:
    """The backend ``SPARSETRAIN_KERNELS`` asks for (default ``numba``); one clear error otherwise."""
    value = os.environ.get("SPARSETRAIN_KERNELS", "numba")
    if value not in CHOICES:
        raise ValueError(f"SPARSETRAIN_KERNELS={value!r} is not allowed; use one of {', '.join(CHOICES)}")
    return value


def available() -> bool:
    """Whether the quantizers' CPU paths use these kernels (numba imported and not turned off)."""
    return numba is not None and wanted() == "numba"


def backend() -> str:
    """``numba <version>`` or ``numpy``: what a run's provenance records."""
    return f"numba {numba.__version__}" if available() else "numpy"


@functools.cache
def decode_table(bits: int, signs: bool = False) -> np.ndarray:
    """``decode_many``'s table: for each byte, its ``8 // bits`` values as int8 in one word
    (uint8, 16, 32 or 64 for 8, 4, 2 or 1 bits): the code's two's complement value, or with
    ``signs`` (signSGD's one bit) +1 for bit 0 and -1 for bit 1."""
    per = 8 // bits
    codes = (np.arange(256)[:, None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
    values = 1 - 2 * codes if signs else np.where(codes >= 1 << (bits - 1), codes - (1 << bits), codes)
    word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[per]
    return np.ascontiguousarray(values.astype(np.int8)).view(word).reshape(256)


@functools.cache
def warm(bits: int, signs: bool = False) -> None:
    """Compile every kernel a quantizer of ``bits`` bits uses (signSGD: ``signs``), for float32,
    once per process, on a few entries: the first compilation on a machine takes seconds, and it
    belongs to the quantizer's construction, not to a timed step (later processes load it from
    numba's cache)."""
    a, bounds = np.zeros(9, np.float32), np.array([0, 9], dtype=np.int64)
    wire = np.zeros((9 * bits + 7) // 8, dtype=np.uint8)
    if signs:
        sign_encode(a, bounds, np.zeros(1, np.float32), wire)
    else:
        qsgd_encode(a, np.zeros(1, np.float32), bounds, 1, bits, *pcg64_state(0), wire, np.uint64(0), False)
    decode_many(np.zeros((1, 1), np.float32), decode_table(bits, signs), wire.reshape(1, -1), bounds, bits, a)


def pcg64_state(seed: int) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """``default_rng(seed)``'s PCG64 state and increment as four 64-bit halves (hi, lo, hi, lo)."""
    st = np.random.PCG64(int(seed)).state["state"]
    low = (1 << 64) - 1
    return (np.uint64(st["state"] >> 64), np.uint64(st["state"] & low),
            np.uint64(st["inc"] >> 64), np.uint64(st["inc"] & low))


if numba is not None:
    _MUL_HI = np.uint64(0x2360ED051FC65DA4)  # PCG's default 128-bit multiplier, as numpy's PCG64
    _MUL_LO = np.uint64(0x4385DF649FCCF645)
    _F32_UNIT = np.float32(1.0 / 16777216.0)  # 2**-24
    _F64_UNIT = 1.0 / 9007199254740992.0  # 2**-53

    @intrinsic
    def _mul_add_128(typingctx, hi, lo, mhi, mlo, ihi, ilo):
        """``(hi:lo) * (mhi:mlo) + (ihi:ilo)`` modulo 2**128, as ``(hi, lo)``: LLVM's 128-bit
        integers, which numba's own types lack."""
        u64 = types.uint64
        sig = types.UniTuple(u64, 2)(u64, u64, u64, u64, u64, u64)

        def codegen(context, builder, signature, args):
            i128, i64 = ir.IntType(128), ir.IntType(64)

            def join(h, lw):
                return builder.or_(builder.shl(builder.zext(h, i128), ir.Constant(i128, 64)), builder.zext(lw, i128))

            s = builder.add(builder.mul(join(args[0], args[1]), join(args[2], args[3])), join(args[4], args[5]))
            high = builder.trunc(builder.lshr(s, ir.Constant(i128, 64)), i64)
            return context.make_tuple(builder, signature.return_type, (high, builder.trunc(s, i64)))

        return sig, codegen

    @njit(inline="always")
    def _pcg_next(hi, lo, ihi, ilo):
        """One PCG64 step, then its XSL-RR output: ``(hi, lo, 64 random bits)``."""
        hi, lo = _mul_add_128(hi, lo, _MUL_HI, _MUL_LO, ihi, ilo)
        x = hi ^ lo
        rot = hi >> np.uint64(58)
        return hi, lo, (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))

    @njit(cache=True)
    def _pairwise_abs_sum(a, lo, n):
        """``np.abs(a[lo:lo + n]).sum()`` in numpy's order (its ``pairwise_sum``): under 8 entries
        one by one; up to 128 in 8 lanes, combined as ((0+1)+(2+3))+((4+5)+(6+7)), the rest one
        by one; above, two halves split at a multiple of 8."""
        if n < 8:
            res = a.dtype.type(0)
            for i in range(n):
                res += abs(a[lo + i])
            return res
        if n <= 128:
            r0, r1, r2, r3 = abs(a[lo]), abs(a[lo + 1]), abs(a[lo + 2]), abs(a[lo + 3])
            r4, r5, r6, r7 = abs(a[lo + 4]), abs(a[lo + 5]), abs(a[lo + 6]), abs(a[lo + 7])
            whole = n - n % 8
            i = 8
            while i < whole:
                r0 += abs(a[lo + i])
                r1 += abs(a[lo + i + 1])
                r2 += abs(a[lo + i + 2])
                r3 += abs(a[lo + i + 3])
                r4 += abs(a[lo + i + 4])
                r5 += abs(a[lo + i + 5])
                r6 += abs(a[lo + i + 6])
                r7 += abs(a[lo + i + 7])
                i += 8
            res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
            while i < n:
                res += abs(a[lo + i])
                i += 1
            return res
        half = n // 2
        half -= half % 8
        return _pairwise_abs_sum(a, lo, half) + _pairwise_abs_sum(a, lo + half, n - half)

    #: entries per block: the blocked loops keep a block's temporaries in the L1 cache, and each
    #: inner loop runs over whole views (what lets LLVM vectorize it)
    BLOCK = 4096

    @njit(inline="always")
    def _pack(codes, m, bits, out):
        """``codes[:m]`` (each below ``2**bits``; ``codes`` zero up to a whole byte) packed into
        ``out`` as ``quantize.pack_codes`` packs them: the ``8 // bits`` codes of a byte read as
        one little-endian word, times a constant that moves code j to bit
        ``8 (8 // bits - 1) + bits j``; the word's top byte is then the packed byte (every other
        product term lands below it without overlapping another: no carry reaches it)."""
        nbytes = (m * bits + 7) // 8
        if bits == 8:
            for q in range(nbytes):
                out[q] = codes[q]
        elif bits == 4:
            w16 = codes.view(np.uint16)
            for q in range(nbytes):
                out[q] = np.uint8((np.uint64(w16[q]) * np.uint64(0x110) >> np.uint64(8)) & np.uint64(0xFF))
        elif bits == 2:
            w32 = codes.view(np.uint32)
            for q in range(nbytes):
                out[q] = np.uint8((np.uint64(w32[q]) * np.uint64(0x1041040) >> np.uint64(24)) & np.uint64(0xFF))
        else:
            w64 = codes.view(np.uint64)
            for q in range(nbytes):
                out[q] = np.uint8(w64[q] * np.uint64(0x0102040810204080) >> np.uint64(56))

    @njit(cache=True)
    def sign_encode(a, bounds, scales, wire):
        """signSGD: ``scales[s]`` = mean ``|a|`` over segment s (``bounds[s]:bounds[s + 1]``, in
        a's dtype, the count rounded to it as numpy does), ``wire`` the bits ``a < 0``, packed
        eight to a byte, lowest first."""
        for s in range(bounds.size - 1):
            n = bounds[s + 1] - bounds[s]
            scales[s] = _pairwise_abs_sum(a, bounds[s], n) / a.dtype.type(n)
        flags = np.zeros(BLOCK, np.uint8)
        for start in range(0, a.size, BLOCK):
            m = min(BLOCK, a.size - start)
            block = a[start : start + m]
            for k in range(m):
                flags[k] = block[k] < 0
            for k in range(m, min(BLOCK, (m + 7) // 8 * 8)):  # the last byte's unused bits: 0
                flags[k] = 0
            _pack(flags, m, 1, wire[start // 8 :])

    @njit(cache=True)
    def decode_many(units, table, wires, bounds, bits, out):
        """``out +=`` W messages, decoded: entry i of message w is ``value(code) x units[w, g]``
        (g the group, segment or bucket, ``bounds[g]:bounds[g + 1]`` holding i; the product
        rounded to out's dtype, then added), messages in order for every entry. ``wires[w]``
        the packed codes (``bits`` 1, 2, 4 or 8); ``table[byte]`` a byte's ``8 // bits`` values
        as int8 (signSGD: +-1; QSGD: the signed level), packed in one word of ``table``'s dtype."""
        per = 8 // bits
        values = np.empty(BLOCK, np.int8)
        words = values.view(table.dtype)
        g = 0
        for start in range(0, out.size, BLOCK):
            m = min(BLOCK, out.size - start)
            first = g  # the group holding entry ``start``
            for w in range(wires.shape[0]):
                packed = wires[w, start // per : start // per + (m + per - 1) // per]
                for q in range(packed.size):
                    words[q] = table[packed[q]]
                i, g = start, first
                while i < start + m:
                    while bounds[g + 1] <= i:
                        g += 1
                    stop = min(start + m, bounds[g + 1])
                    unit = units[w, g]
                    dst = out[i:stop]
                    src = values[i - start : stop - start]
                    for k in range(dst.size):
                        dst[k] += out.dtype.type(src[k]) * unit
                    i = stop
            while g + 1 < bounds.size - 1 and bounds[g + 1] <= start + m:
                g += 1

    _GAMMA, _MIX1, _MIX2 = np.uint64(GAMMA), np.uint64(MIX1), np.uint64(MIX2)

    @njit(inline="always")
    def _draw_counter(key, first, u, m):
        """``u[:m]``: the counter-based uniforms of entries ``first ... first + m - 1`` (float32:
        the top 24 bits of each output; float64: the top 53), one 64-bit output per entry."""
        for k in range(m):
            x = key + np.uint64(first + k + 1) * _GAMMA
            x = (x ^ (x >> np.uint64(30))) * _MIX1
            x = (x ^ (x >> np.uint64(27))) * _MIX2
            x = x ^ (x >> np.uint64(31))
            if u.itemsize == 4:
                u[k] = u.dtype.type(np.int32(x >> np.uint64(40))) * _F32_UNIT
            else:
                u[k] = u.dtype.type(np.float64(x >> np.uint64(11)) * _F64_UNIT)

    @njit(inline="always")
    def _draw(hi, lo, ihi, ilo, u, m):
        """``u[:m]`` from PCG64 at ``(hi:lo)`` as numpy's ``random(dtype=u.dtype)`` draws them
        (float32: two per 64-bit output, low half first, the top 24 bits of each; float64: the
        top 53 bits); returns the new state. ``m`` even for float32."""
        if u.itemsize == 4:
            for k in range(0, m, 2):
                hi, lo, v = _pcg_next(hi, lo, ihi, ilo)
                u[k] = u.dtype.type(np.int32((v & np.uint64(0xFFFFFFFF)) >> np.uint64(8))) * _F32_UNIT
                u[k + 1] = u.dtype.type(np.int32(v >> np.uint64(40))) * _F32_UNIT
        else:
            for k in range(m):
                hi, lo, v = _pcg_next(hi, lo, ihi, ilo)
                u[k] = u.dtype.type(np.float64(v >> np.uint64(11)) * _F64_UNIT)
        return hi, lo

    @njit(cache=True)
    def qsgd_encode(a, factors, bounds, levels, bits, hi, lo, ihi, ilo, wire, key, counter):
        """QSGD's codes into ``wire`` (``bits`` 2, 4 or 8, whole codes per byte, lowest first):
        per bucket b (``bounds[b]:bounds[b + 1]``) ``t = |a| x factors[b] + u`` (each product
        and sum rounded to a's dtype), level ``min(floor(t), levels)`` signed as ``a``, in two's
        complement; a NaN level is code 0 (what numpy's cast of NaN gives on x86). ``u``: PCG64
        at state ``(hi:lo)``, increment ``(ihi:ilo)``, one uniform per entry as numpy draws them;
        with ``counter``, the counter-based stream of ``key`` (``_draw_counter``)."""
        mask = (1 << bits) - 1
        top = a.dtype.type(levels)
        one = a.dtype.type(1)
        t = np.empty(BLOCK + 1, a.dtype)  # the block's uniforms, then |a| x factor + u
        codes = np.zeros(BLOCK, np.uint8)
        g = 0
        for start in range(0, a.size, BLOCK):
            m = min(BLOCK, a.size - start)
            if counter:
                _draw_counter(key, start, t, m)
            else:
                hi, lo = _draw(hi, lo, ihi, ilo, t, m + (m & 1))
            i = start
            while i < start + m:
                while bounds[g + 1] <= i:
                    g += 1
                stop = min(start + m, bounds[g + 1])
                factor = factors[g]
                src = a[i:stop]
                dst = t[i - start : stop - start]
                for k in range(src.size):
                    dst[k] = abs(src[k]) * factor + dst[k]
                i = stop
            block = a[start : start + m]
            if levels == 1:  # the level is t >= 1 (NaN: 0); the sign bit only where it is 1
                for k in range(m):
                    on = np.uint8(t[k] >= one)
                    codes[k] = on | ((on & np.uint8(block[k] < 0)) << np.uint8(1))
            else:
                for k in range(m):
                    r = np.floor(t[k])
                    level = np.int32(0) if r != r else np.int32(min(r, top))
                    codes[k] = np.uint8((-level if np.signbit(block[k]) else level) & mask)
            for k in range(m, min(BLOCK, m + 8)):  # the last byte's missing codes: 0
                codes[k] = 0
            _pack(codes, m, bits, wire[start * bits // 8 :])
