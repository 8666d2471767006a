"""The quantizers' compiled kernels themselves (numba): imported by ``compress.kernels`` only
when a quantizer runs on the CPU with them, so that other runs do not pay numba's import (about
0.2 s a process). See ``compress.kernels`` for what each kernel does and why it is exact."""

from __future__ import annotations

import numba  # noqa: F401  (kernels.numba: the module, for its version and tests)
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from sparsetrain.compress.splitmix import GAMMA, MIX1, MIX2

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


def _float_rows(a):
    """Whether the row intrinsics take ``a``: a C-contiguous 1-D float32 or float64 array."""
    return isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype in (types.float32, types.float64)


def _row_loader(context, builder, array_type, array):
    """The array's struct, the ``<8 x float>`` type, and ``row(i)``: the vector at ``a[i : i + 8]``
    (an unaligned load)."""
    ary = context.make_array(array_type)(context, builder, array)
    single = array_type.dtype == types.float32
    vec = ir.VectorType(ir.FloatType() if single else ir.DoubleType(), 8)

    def row(i):
        return builder.load(builder.bitcast(builder.gep(ary.data, [i]), vec.as_pointer()), align=4 if single else 8)

    return ary, vec, row


@intrinsic
def _lane_abs_sums(typingctx, a, lo, rows):
    """The 8 lanes of numpy's pairwise leaf over ``rows`` rows of 8 entries from ``a[lo]``:
    lane j = ``|a[lo + j]| + |a[lo + 8 + j]| + ...``, each lane added in order. Written as
    one ``<8 x float>`` add a row (LLVM IR): the lanes are independent, so this is the scalar
    loop's floats, but LLVM's vectorizers leave eight scalar chains of that loop scalar."""
    if not _float_rows(a):
        return None
    sig = types.UniTuple(a.dtype, 8)(a, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        _, vec, load = _row_loader(context, builder, signature.args[0], args[0])
        lo, rows = args[1], args[2]
        width = 32 if signature.args[0].dtype == types.float32 else 64
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec]), f"llvm.fabs.v8f{width}")

        def row(k):
            return builder.call(fabs, [load(builder.add(lo, builder.mul(k, ir.Constant(k.type, 8))))])

        one = ir.Constant(rows.type, 1)
        acc = cgutils.alloca_once_value(builder, row(ir.Constant(rows.type, 0)))
        with cgutils.for_range_slice(builder, one, rows, one, inc=True) as (k, _):
            builder.store(builder.fadd(builder.load(acc), row(k)), acc)
        lanes = builder.load(acc)
        return context.make_tuple(builder, signature.return_type,
                                  [builder.extract_element(lanes, ir.Constant(ir.IntType(32), j)) for j in range(8)])

    return sig, codegen


@intrinsic
def _negative_bytes(typingctx, a, wire):
    """``wire[q]`` = the bits ``a[8q + j] < 0`` (bit j), for every whole row of 8 entries: one
    vector compare a row, its 8 flags read as one byte (LLVM IR; x86's compare and movemask).
    ``wire`` must hold ``a.size // 8`` bytes (unchecked here: ``sign_encode`` checks it)."""
    if not (_float_rows(a) and isinstance(wire, types.Array) and wire.dtype == types.uint8 and wire.ndim == 1):
        return None
    sig = types.void(a, wire)

    def codegen(context, builder, signature, args):
        ary, vec, load = _row_loader(context, builder, signature.args[0], args[0])
        out = context.make_array(signature.args[1])(context, builder, args[1])
        rows = builder.udiv(builder.extract_value(ary.shape, 0), ir.Constant(ary.shape.type.element, 8))
        zero = ir.Constant(vec, None)
        with cgutils.for_range(builder, rows) as loop:
            q = loop.index
            flags = builder.fcmp_ordered("<", load(builder.mul(q, ir.Constant(q.type, 8))), zero)
            builder.store(builder.bitcast(flags, ir.IntType(8)), builder.gep(out.data, [q]))
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def _pairwise_abs_sum(a, lo, n):
    """``np.abs(a[lo:lo + n]).sum()`` in numpy's order (its ``pairwise_sum``): under 8 entries
    one by one; up to 128 in 8 lanes (``_lane_abs_sums``), combined as
    ((0+1)+(2+3))+((4+5)+(6+7)), the rest one by one; above, two halves split at a multiple
    of 8. ``a`` C-contiguous."""
    if n < 8:
        res = a.dtype.type(0)
        for i in range(n):
            res += abs(a[lo + i])
        return res
    if n <= 128:
        r0, r1, r2, r3, r4, r5, r6, r7 = _lane_abs_sums(a, lo, n // 8)
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for i in range(n - n % 8, n):
            res += abs(a[lo + i])
        return res
    half = n // 2
    half -= half % 8
    return _pairwise_abs_sum(a, lo, half) + _pairwise_abs_sum(a, lo + half, n - half)


#: entries per block: the blocked loops keep a block's temporaries in the L1 cache, and each
#: inner loop runs over whole views (what lets LLVM vectorize it)
BLOCK = 4096


@njit(inline="always")
def _pack(codes, m, bits, out):
    """``codes[:m]`` (each below ``2**bits``, ``bits`` 2, 4 or 8: QSGD's whole codes per byte;
    ``codes`` zero up to a whole byte) packed into ``out`` as ``quantize.pack_codes`` packs them
    (signSGD's single bits: ``_negative_bytes``): the ``8 // bits`` codes of a byte read as
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
    else:
        w32 = codes.view(np.uint32)
        for q in range(nbytes):
            out[q] = np.uint8((np.uint64(w32[q]) * np.uint64(0x1041040) >> np.uint64(24)) & np.uint64(0xFF))


@njit(cache=True)
def sign_encode(a, bounds, scales, wire):
    """signSGD: ``scales[s]`` = mean ``|a|`` over segment s (``bounds[s]:bounds[s + 1]``, in
    a's dtype, the count rounded to it as numpy does), ``wire`` the bits ``a < 0``, packed
    eight to a byte, lowest first."""
    for s in range(bounds.size - 1):
        n = bounds[s + 1] - bounds[s]
        scales[s] = _pairwise_abs_sum(a, bounds[s], n) / a.dtype.type(n)
    if wire.size < (a.size + 7) // 8:
        raise ValueError("sign_encode: wire holds fewer bytes than a's bits")
    _negative_bytes(a, wire)  # the whole bytes; then the last one's entries (its unused bits 0)
    whole = a.size - a.size % 8
    if whole < a.size:
        last = np.uint8(0)
        for j in range(a.size - whole):
            last |= np.uint8(a[whole + j] < 0) << np.uint8(j)
        wire[whole // 8] = last


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
