"""The fast path's Triton kernels themselves: imported by ``compress.fused`` only when the fast
path runs (``train.fast_path=true`` on CUDA, or under ``TRITON_INTERPRET=1`` on CPU tensors), so
that no other run imports Triton. See ``compress.fused`` for what each kernel is for and why the
result is the torch path's.

Non-negative floats order as their bits (IEEE 754), so ``|x|`` is compared, ranked and sorted
through its bits as an integer: the thresholds found here are the exact float values, not
estimates of them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sample_threshold(mem, grad, sidx, kth, full, large, thr, M, MBLOCK: tl.constexpr, BITS: tl.constexpr):
    """Per large segment (one program each): the (kth + 1)-th largest of ``|mem + grad|`` at its
    ``M`` sampled entries (what ``TopK._sample_thresholds`` takes from ``|acc|``: the same floats,
    since ``acc = mem + grad``), found bit by bit from the top: the largest T with at least
    kth + 1 samples >= T is that sample's value. 0 where the sample is too small (``full``)."""
    r = tl.program_id(0)
    offs = tl.arange(0, MBLOCK)
    mask = offs < M
    where = tl.load(sidx + r * M + offs, mask=mask, other=0)
    a = tl.abs(tl.load(mem + where, mask=mask, other=0.0) + tl.load(grad + where, mask=mask, other=0.0))
    if BITS == 32:  # int32 keys: a large sample stays in registers
        x = tl.where(mask, a.to(tl.int32, bitcast=True), -1)
        t = tl.zeros((), dtype=tl.int32)
        one = tl.full((), 1, tl.int32)
    else:
        x = tl.where(mask, a.to(tl.int64, bitcast=True), -1)
        t = tl.zeros((), dtype=tl.int64)
        one = tl.full((), 1, tl.int64)
    need = tl.load(kth + r) + 1
    for b in range(BITS - 1):  # the sign bit of |x| is 0
        trial = t | (one << (BITS - 2 - b))
        if tl.sum((x >= trial).to(tl.int32), axis=0) >= need:
            t = trial
    if BITS == 32:
        value = t.to(tl.float32, bitcast=True)
    else:
        value = t.to(tl.float64, bitcast=True)
    value = tl.where(tl.load(full + r) != 0, 0.0, value)
    tl.store(thr + tl.load(large + r), value)


@triton.jit
def accumulate_count(mem, grad, thr, blk_seg, blk_start, blk_end, counts, BLOCK: tl.constexpr):
    """Error feedback and the threshold pass in one: ``mem = mem + grad`` (``acc``, the same add
    as ``memory.add_(grad)``) over one block of one segment, and how many of its entries have
    ``|acc| >= thr[segment]`` (the candidates)."""
    pid = tl.program_id(0)
    start = tl.load(blk_start + pid)
    end = tl.load(blk_end + pid)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    a = tl.load(mem + offs, mask=mask, other=0.0) + tl.load(grad + offs, mask=mask, other=0.0)
    tl.store(mem + offs, a, mask=mask)
    keep = (tl.abs(a) >= tl.load(thr + tl.load(blk_seg + pid))) & mask
    tl.store(counts + pid, tl.sum(keep.to(tl.int64), axis=0))


@triton.jit
def compact(mem, thr, blk_seg, blk_start, blk_end, counts, ends, cidx, ckey, cseg,
            BLOCK: tl.constexpr, BITS: tl.constexpr):
    """The candidates of one block, written in index order from the block's place in the running
    count (``ends``: inclusive cumulative ``counts``): their indices, their sort key and their
    segment. Key, ascending = segment, then |acc| from the largest: in float32 one int64
    ``segment << 32 - bits(|acc|)``; in float64 ``-bits(|acc|)`` (the segment sorted apart)."""
    pid = tl.program_id(0)
    start = tl.load(blk_start + pid)
    end = tl.load(blk_end + pid)
    seg = tl.load(blk_seg + pid)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    a = tl.abs(tl.load(mem + offs, mask=mask, other=0.0))
    keep = (a >= tl.load(thr + seg)) & mask
    base = tl.load(ends + pid) - tl.load(counts + pid)
    pos = base + tl.cumsum(keep.to(tl.int64), axis=0) - 1
    tl.store(cidx + pos, offs, mask=keep)
    if BITS == 32:
        key = (seg.to(tl.int64) << 32) - a.to(tl.int32, bitcast=True).to(tl.int64)
    else:
        key = -a.to(tl.int64, bitcast=True)
    tl.store(ckey + pos, key, mask=keep)
    tl.store(cseg + pos, tl.zeros_like(pos).to(tl.int32) + seg.to(tl.int32), mask=keep)


@triton.jit
def take_ranked(mem, cidx, order, ends, counts, first_blk, slot_seg, slot_rank, values, idx, wire, K,
                BLOCK: tl.constexpr, WIRE: tl.constexpr):
    """The k sent entries from the ranked candidates, gather and forget in one: slot j of segment
    s takes the candidate ranked ``slot_rank[j]`` in s (``order``: the candidates by key), writes
    its value and index (and its wire position) and zeroes it in the memory."""
    pid = tl.program_id(0)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    mask = j < K
    fb = tl.load(first_blk + tl.load(slot_seg + j, mask=mask, other=0), mask=mask, other=0)
    cstart = tl.load(ends + fb, mask=mask, other=0) - tl.load(counts + fb, mask=mask, other=0)
    c = tl.load(order + cstart + tl.load(slot_rank + j, mask=mask, other=0), mask=mask, other=0)
    i = tl.load(cidx + c, mask=mask, other=0)
    v = tl.load(mem + i, mask=mask, other=0.0)
    tl.store(values + j, v, mask=mask)
    tl.store(idx + j, i, mask=mask)
    if WIRE:
        tl.store(wire + j, i.to(wire.dtype.element_ty), mask=mask)
    tl.store(mem + i, tl.zeros_like(v), mask=mask)


@triton.jit
def take(mem, idx, values, wire, K, BLOCK: tl.constexpr, WIRE: tl.constexpr):
    """Gather and forget in one: ``values[j] = mem[idx[j]]`` (and the wire position), then
    ``mem[idx[j]] = 0``. The indices are distinct (every scheme's message), so no slot reads an
    entry another zeroes."""
    pid = tl.program_id(0)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    mask = j < K
    i = tl.load(idx + j, mask=mask, other=0)
    v = tl.load(mem + i, mask=mask, other=0.0)
    tl.store(values + j, v, mask=mask)
    if WIRE:
        tl.store(wire + j, i.to(wire.dtype.element_ty), mask=mask)
    tl.store(mem + i, tl.zeros_like(v), mask=mask)


@triton.jit
def take_runs(mem, starts, seg, in_run, size, offset, values, idx, K, BLOCK: tl.constexpr):
    """Block-k layer-wise, gather and forget in one from the run starts: slot j of tensor s
    takes entry ``offset + (starts[s] + in_run[j]) % size`` (``BlockRandomK.indices``'s integer
    arithmetic), writes its value and index and zeroes it in the memory."""
    pid = tl.program_id(0)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    mask = j < K
    start = tl.load(starts + tl.load(seg + j, mask=mask, other=0), mask=mask, other=0)
    n = tl.load(size + j, mask=mask, other=1)
    i = (start + tl.load(in_run + j, mask=mask, other=0)) % n + tl.load(offset + j, mask=mask, other=0)
    v = tl.load(mem + i, mask=mask, other=0.0)
    tl.store(values + j, v, mask=mask)
    tl.store(idx + j, i, mask=mask)
    tl.store(mem + i, tl.zeros_like(v), mask=mask)


@triton.jit
def take_blocks(mem, starts, values, idx, DRAWN, K, B, LAST_START, LAST_SIZE,
                DRAWN_P2: tl.constexpr, CHUNK: tl.constexpr):
    """Block-k global, gather and forget in one from the drawn block starts (one program per
    drawn block): blocks taken whole in draw order until k entries, the one crossing k cut to
    its leading part (``BlockRandomK.indices``): block p's entries go to the slots from
    ``min(before_p, k)``, ``before_p`` the sizes of the blocks drawn before it."""
    p = tl.program_id(0)
    q = tl.arange(0, DRAWN_P2)
    all_starts = tl.load(starts + q, mask=q < DRAWN, other=0)
    sizes = tl.where(q < DRAWN, tl.where(all_starts == LAST_START, LAST_SIZE, B), 0).to(tl.int64)
    before = tl.sum(tl.where(q < p, sizes, 0), axis=0)
    start = tl.load(starts + p)
    mine = tl.where(start == LAST_START, LAST_SIZE, B).to(tl.int64)
    length = tl.minimum(tl.maximum(K - before, 0), mine)
    slot0 = tl.minimum(before, K)
    for e0 in range(0, length, CHUNK):
        e = e0 + tl.arange(0, CHUNK)
        mask = e < length
        i = start + e
        v = tl.load(mem + i, mask=mask, other=0.0)
        tl.store(values + slot0 + e, v, mask=mask)
        tl.store(idx + slot0 + e, i, mask=mask)
        tl.store(mem + i, tl.zeros_like(v), mask=mask)


@triton.jit
def sign_pack(acc, seg, scales, wire, N, NBYTES, BLOCK: tl.constexpr, FORGET: tl.constexpr):
    """signSGD's codes, one bit per entry (1: negative), 8 entries a byte from the lowest bit
    (``pack_codes(acc < 0, 1, wire)``), a block of bytes per program. ``FORGET``: error
    feedback's forget in the same pass, ``acc + (neg ? scale : -scale)``, the float of the torch
    path's ``acc += decode(-scales)`` (``seg``: each entry's segment, int32)."""
    pid = tl.program_id(0)
    b = pid * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    i = b[:, None] * 8 + j[None, :]
    mask = i < N
    a = tl.load(acc + i, mask=mask, other=0.0)
    neg = (a < 0) & mask
    code = tl.sum(neg.to(tl.int32) << j[None, :], axis=1)
    tl.store(wire + b, code.to(tl.uint8), mask=b < NBYTES)
    if FORGET:
        s = tl.load(scales + tl.load(seg + i, mask=mask, other=0), mask=mask, other=0.0)
        tl.store(acc + i, a + tl.where(neg, s, -s), mask=mask)


@triton.jit
def sign_unpack_add(wire, seg, scales, out, N, BLOCK: tl.constexpr):
    """signSGD's decode: ``out += (bit ? -scale : scale)`` per entry, its segment's scale (the
    torch path's ``out.add_(torch.where(negative, -scale, scale))``, the same floats)."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    byte = tl.load(wire + i // 8, mask=mask, other=0).to(tl.int32)
    neg = ((byte >> (i % 8)) & 1) != 0
    s = tl.load(scales + tl.load(seg + i, mask=mask, other=0), mask=mask, other=0.0)
    o = tl.load(out + i, mask=mask, other=0.0)
    tl.store(out + i, o + tl.where(neg, -s, s), mask=mask)


@triton.jit
def qsgd_pack(acc, bucket, factors, u, wire, N, NBYTES, S, MASK, BITS: tl.constexpr, PER: tl.constexpr,
              BLOCK: tl.constexpr):
    """QSGD's codes, ``PER = 8 // BITS`` a byte from the lowest bits: each entry's signed level
    ``copysign(min(floor(|acc| * factor + u), S), acc)`` (the torch path's ops, in its order;
    launched without fused multiply-adds) in two's complement, ``& MASK``."""
    pid = tl.program_id(0)
    b = pid * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, PER)
    i = b[:, None] * PER + j[None, :]
    mask = i < N
    a = tl.load(acc + i, mask=mask, other=0.0)
    f = tl.load(factors + tl.load(bucket + i, mask=mask, other=0), mask=mask, other=0.0)
    t = tl.abs(a) * f + tl.load(u + i, mask=mask, other=0.0)
    level = tl.minimum(tl.floor(t), S)
    code = tl.where(mask, tl.where(a < 0, -level, level).to(tl.int32) & MASK, 0)
    tl.store(wire + b, tl.sum(code << (j[None, :] * BITS), axis=1).to(tl.uint8), mask=b < NBYTES)


@triton.jit
def qsgd_unpack_add(wire, bucket, units, out, N, TOP, MASK, BITS: tl.constexpr, PER: tl.constexpr,
                    BLOCK: tl.constexpr):
    """QSGD's decode: ``out += signed level x unit`` (``unit``: the bucket's norm / levels), the
    product rounded before the sum, as the torch path (launched without fused multiply-adds)."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    byte = tl.load(wire + i // PER, mask=mask, other=0).to(tl.int32)
    c = (byte >> ((i % PER) * BITS)) & MASK
    o = tl.load(out + i, mask=mask, other=0.0)
    signed = ((c ^ TOP) - TOP).to(o.dtype)
    unit = tl.load(units + tl.load(bucket + i, mask=mask, other=0), mask=mask, other=0.0)
    tl.store(out + i, o + signed * unit, mask=mask)


@triton.jit
def qsgd_pack_stream(acc, bucket, factors, u, wire, N, NBYTES, S, MASK, BITS: tl.constexpr, SPAN: tl.constexpr,
                     BLOCK: tl.constexpr):
    """``qsgd_pack`` for codes that cross byte boundaries (3, 5, 6, 7 or 9-17 bits): each byte
    of the stream (entry i's code at bits ``[i * BITS, (i + 1) * BITS)``, lowest bit first) from
    the ``SPAN`` codes that can touch it, each code's level computed as ``qsgd_pack`` does and
    shifted to its place (a code two bytes share is computed in both, the same ops each time)."""
    pid = tl.program_id(0)
    b = pid * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, SPAN)
    i = (b[:, None].to(tl.int64) * 8) // BITS + j[None, :]
    mask = (i < N) & (b[:, None] < NBYTES)
    a = tl.load(acc + i, mask=mask, other=0.0)
    f = tl.load(factors + tl.load(bucket + i, mask=mask, other=0), mask=mask, other=0.0)
    t = tl.abs(a) * f + tl.load(u + i, mask=mask, other=0.0)
    level = tl.minimum(tl.floor(t), S)
    code = tl.where(mask, tl.where(a < 0, -level, level).to(tl.int32) & MASK, 0)
    at = i * BITS - b[:, None] * 8  # the code's first bit, relative to the byte's: -(BITS-1) .. 7+
    piece = tl.where(at >= 0, code << tl.maximum(at, 0), code >> tl.maximum(-at, 0)) & 255
    piece = tl.where(at < 8, piece, 0)
    tl.store(wire + b, tl.sum(piece, axis=1).to(tl.uint8), mask=b < NBYTES)  # disjoint bits: sum = or


@triton.jit
def qsgd_unpack_add_stream(wire, bucket, units, out, N, NBYTES, TOP, MASK, BITS: tl.constexpr,
                           BLOCK: tl.constexpr):
    """``qsgd_unpack_add`` for codes that cross byte boundaries: entry i's code from the (up to
    three) bytes that hold its bits."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    first = i.to(tl.int64) * BITS  # 17-bit codes of 2**27 entries pass 2**31
    byte = first // 8
    word = tl.load(wire + byte, mask=mask, other=0).to(tl.int32)
    word |= tl.load(wire + byte + 1, mask=mask & (byte + 1 < NBYTES), other=0).to(tl.int32) << 8
    word |= tl.load(wire + byte + 2, mask=mask & (byte + 2 < NBYTES), other=0).to(tl.int32) << 16
    c = (word >> (first % 8)) & MASK
    o = tl.load(out + i, mask=mask, other=0.0)
    signed = ((c ^ TOP) - TOP).to(o.dtype)
    unit = tl.load(units + tl.load(bucket + i, mask=mask, other=0), mask=mask, other=0.0)
    tl.store(out + i, o + signed * unit, mask=mask)
