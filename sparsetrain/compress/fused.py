"""The fast path (``train.fast_path=true``): error feedback and compression in fused Triton
kernels on CUDA, sending exactly what the torch path sends.

On a GPU one copy of the ResNet-18 gradient takes 0.03 ms, so a compressor that composes a few
dozen torch ops is bound by their launches (docs/performance.md, section 4). Here one step of
error feedback + compression is a handful of kernels (``compress._triton``):

- top-k (``TopK``, both scopes): (1) each large segment's threshold from its fixed sample, the
  torch path's exact value (the (j)-th largest sampled ``|memory + grad|``, found bit by bit);
  (2) ``memory += grad`` fused with the threshold pass (each block counts its candidates,
  ``|acc| >= threshold``); (3) one cumulative sum; one host read (the candidates per segment);
  (4) the candidates compacted in index order with a sort key; (5) one stable sort of the keys
  (segment, then ``|acc|`` from the largest); (6) one kernel that takes each segment's first k,
  writes values, indices and wire positions, and zeroes them in the memory. The set sent is the
  k largest ``|acc|`` of each segment (global: of the whole vector), exactly ``torch.topk``'s
  wherever that set is unique. Ties at the k-th value: the entries of lowest index are sent
  (``torch.topk`` picks among them as it likes). A segment whose threshold was set too high
  (fewer candidates than k, rare) is selected exactly on the whole segment by the same rule.
  The values go out segment by segment, from the largest ``|acc|`` (the torch path's layer-wise
  order; its global order is topk's own); every receiver adds each entry once per message, so
  the decoded update is the same bits whatever the order.
- random-k and block-k: their draws are the torch path's (the same generator calls), then one
  kernel gathers the values, writes the wire positions (random-k) and zeroes the sent entries in
  the memory (three torch ops before); block-k's kernel also expands its run starts (layer-wise)
  or drawn blocks (global) into the entries (``BlockRandomK.indices``' integer arithmetic: half a
  dozen torch ops before). The draws themselves stay torch ops: they define the schemes.

- signSGD (with error feedback): the scales by the torch path's device ops, then one kernel
  packs the signs and does the forget; one kernel decodes (``sign_step``, ``sign_decode_add``).
- QSGD (any width, 2 to 17 bits a code): its encode and decode swapped (``prepare``): the norms
  and the generator's uniforms by the torch path's ops, one kernel for the levels and codes, one
  to decode, without fused multiply-adds (``qsgd_encode``, ``qsgd_decode_add``). Codes of 2, 4 or 8
  bits are whole in each byte; wider or odd ones cross bytes: each byte is built from the codes
  that touch it, each code read from the bytes that hold it.
- PowerSGD: no kernel; its matmuls batched by shape (``PowerSGD.batched``, ``prepare``).

Nothing else changes: the other schemes, another memory than plain error feedback, a DDP
bucket's pieces, or a step whose compression error is measured take the torch path
(``reason`` says why). The CPU path is untouched: there the fast path runs only under
``TRITON_INTERPRET=1`` (Triton's interpreter; the tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from sparsetrain.compress.base import Compressor, Payload
from sparsetrain.compress.feedback import ErrorFeedback, Memory
from sparsetrain.compress.powersgd import PowerSGD
from sparsetrain.compress.quantize import QSGD, SignSGD
from sparsetrain.compress.schemes import BlockRandomK, RandomK, TopK

BLOCK = 1024  # entries per program of the full-buffer passes
TAKE_BLOCK = 1024  # slots per program of the gather
WHOLE_CODES = (2, 4, 8)  # QSGD code widths with whole codes in each byte; the others cross bytes
MAX_BLOCKS = 4096  # block-k global: drawn blocks up to which one kernel expands them (block_size 256: 438)


def installed() -> bool:
    """Whether Triton is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``, read when the
    kernels' module is imported): on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def kernels():
    """The kernels' module, imported on first use."""
    from sparsetrain.compress import _triton

    return _triton


def reason(compressor: Compressor, memory: Memory, device, dtype) -> str | None:
    """Why the fast path cannot run for this exchange (one phrase), or None when it runs."""
    device = torch.device(device)
    batched = type(compressor) is PowerSGD  # torch's batched matmuls: no Triton needed
    if not batched and not installed():
        return "triton is not installed"
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"it runs on CUDA (here {device.type})"
    if batched:
        return None
    if type(compressor) is QSGD:  # encode and decode in kernels, with or without error feedback
        return None if dtype in (torch.float32, torch.float64) else f"dtype {dtype} (float32 and float64 only)"
    if type(compressor) not in (TopK, RandomK, BlockRandomK, SignSGD):
        return f"no fused kernels for {type(compressor).__name__}"
    if type(memory) is not ErrorFeedback or not memory.enabled:
        return "it fuses plain error feedback only"
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype} (float32 and float64 only)"
    return None


def prepare(compressor: Compressor) -> bool:
    """Ready ``compressor`` for the fast path (where ``reason`` gives None): True where it then
    runs its own rounds, faster (PowerSGD: its matmuls batched by shape, ``PowerSGD.batched``),
    False where the exchange calls ``step`` instead of the compressor's compression."""
    if type(compressor) is PowerSGD:
        compressor.batched = True
        return True
    if type(compressor) is SignSGD:  # its decode (every received message) by one kernel too
        compressor.fast_decode = sign_decode_add
    if type(compressor) is QSGD:  # its own encode and decode, each one kernel after torch's norms
        compressor.fast_encode, compressor.fast_decode = qsgd_encode, qsgd_decode_add
        return True
    return False


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, -(-n // block)),)


class _TopKPlan:
    """A ``TopK``'s tables for the fused kernels on one device, built once."""

    def __init__(self, comp: TopK, dev: torch.device):
        sizes, offs = comp.layout.sizes, comp.layout.offsets
        seg, start, end, first, last = [], [], [], [], []
        for s, (o, n) in enumerate(zip(offs, sizes, strict=True)):
            first.append(len(seg))
            for a in range(o, o + n, BLOCK):
                seg.append(s)
                start.append(a)
                end.append(min(a + BLOCK, o + n))
            last.append(len(seg) - 1)
        i64 = dict(dtype=torch.int64, device=dev)
        self.blocks = len(seg)
        self.blk_seg, self.blk_start, self.blk_end = (torch.tensor(x, **i64) for x in (seg, start, end))
        self.first_blk, self.last_blk = torch.tensor(first, **i64), torch.tensor(last, **i64)
        ks = torch.tensor(comp.ks, dtype=torch.int64)
        self.slot_seg = torch.repeat_interleave(torch.arange(len(sizes)), ks).to(dev)
        self.slot_rank = (torch.arange(comp.k) - torch.tensor(comp.kstarts, dtype=torch.int64)[self.slot_seg.cpu()]).to(dev)
        self.counts = torch.empty(self.blocks, **i64)
        self.thr = None
        if comp.large:
            self.large = torch.tensor(comp.large, **i64)
            self.sidx = comp.sample_idx.to(dev)
            self.kth = comp.sample_kth.to(dev)
            self.full = comp.sample_full.to(device=dev, dtype=torch.int32)
            self.mblock = triton_next_pow2(comp.sample_m)
        self.cap = 0
        self.cidx = self.ckey = torch.empty(0, **i64)
        self.cseg = torch.empty(0, dtype=torch.int32, device=dev)

    def candidates(self, n: int, dev: torch.device):
        """The candidate buffers, grown to ``n`` (kept between steps)."""
        if n > self.cap:
            self.cap = max(n, self.cap + self.cap // 2)
            self.cidx = torch.empty(self.cap, dtype=torch.int64, device=dev)
            self.ckey = torch.empty(self.cap, dtype=torch.int64, device=dev)
            self.cseg = torch.empty(self.cap, dtype=torch.int32, device=dev)
        return self.cidx[:n], self.ckey[:n], self.cseg[:n]


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _exact_segment(mem: torch.Tensor, a: int, n: int, k: int) -> torch.Tensor:
    """A segment's k largest ``|mem|`` on the whole segment (the fallback), ties to the lowest
    index: one stable sort of ``-bits(|x|)``."""
    x = mem[a : a + n].abs()
    bits = x.view(torch.int32).to(torch.int64) if x.dtype == torch.float32 else x.view(torch.int64)
    return torch.sort(bits.neg_(), stable=True).indices[:k].add_(a)


def topk_step(comp: TopK, mem: torch.Tensor, grad: torch.Tensor, out=None, wire=None) -> Payload:
    """Error feedback + ``comp``'s top-k + the memory's forget, fused (see the module's doc):
    ``mem`` becomes ``mem + grad`` with the sent entries zeroed."""
    k_ = kernels()
    dev, dtype = mem.device, mem.dtype
    plan = getattr(comp, "_fused_plan", None)
    if plan is None or plan.counts.device != dev:
        plan = comp._fused_plan = _TopKPlan(comp, dev)
    bits = 32 if dtype == torch.float32 else 64
    if plan.thr is None or plan.thr.dtype != dtype:
        plan.thr = torch.zeros(len(comp.layout), dtype=dtype, device=dev)  # small segments: 0 (all)
    if comp.large:
        k_.sample_threshold[(len(comp.large),)](mem, grad, plan.sidx, plan.kth, plan.full, plan.large, plan.thr,
                                                comp.sample_m, MBLOCK=plan.mblock, BITS=bits,
                                                num_warps=16 if plan.mblock >= 16384 else 4)
    k_.accumulate_count[(plan.blocks,)](mem, grad, plan.thr, plan.blk_seg, plan.blk_start, plan.blk_end,
                                       plan.counts, BLOCK=BLOCK)
    ends = torch.cumsum(plan.counts, 0)
    seg_ends = ends[plan.last_blk].tolist()  # the one host read: candidates per segment
    total = seg_ends[-1]
    per_seg = [b - a for a, b in zip([0, *seg_ends[:-1]], seg_ends, strict=True)]
    short = [s for s, (c, k) in enumerate(zip(per_seg, comp.ks, strict=True)) if c < k]
    cidx, ckey, cseg = plan.candidates(total, dev)
    k_.compact[(plan.blocks,)](mem, plan.thr, plan.blk_seg, plan.blk_start, plan.blk_end, plan.counts, ends,
                               cidx, ckey, cseg, BLOCK=BLOCK, BITS=bits)
    order = torch.sort(ckey, stable=True).indices
    if bits == 64 and len(comp.layout) > 1:  # then by segment, |acc| order kept within each
        order = order[torch.sort(cseg[order], stable=True).indices]
    values = out if out is not None else torch.empty(comp.k, dtype=dtype, device=dev)
    idx = torch.empty(comp.k, dtype=torch.int64, device=dev)
    wire_ok = wire is not None
    if not short:
        k_.take_ranked[_grid(comp.k, TAKE_BLOCK)](mem, cidx, order, ends, plan.counts, plan.first_blk, plan.slot_seg,
                                                  plan.slot_rank, values, idx, wire if wire_ok else idx, comp.k,
                                                  BLOCK=TAKE_BLOCK, WIRE=wire_ok)
        return Payload(values, idx, idx)
    # some threshold too high this step: those segments exactly on the whole segment
    src = (cidx.new_tensor([e - c for e, c in zip(seg_ends, per_seg, strict=True)])[plan.slot_seg]
           + plan.slot_rank).clamp_(max=max(total - 1, 0))
    if total:
        idx.copy_(cidx[order[src]])
    for s in short:
        comp.fallbacks += 1
        a, n, k = comp.layout.offsets[s], comp.layout.sizes[s], comp.ks[s]
        idx[comp.kstarts[s] : comp.kstarts[s] + k] = _exact_segment(mem, a, n, k)
    k_.take[_grid(comp.k, TAKE_BLOCK)](mem, idx, values, wire if wire_ok else idx, comp.k,
                                       BLOCK=TAKE_BLOCK, WIRE=wire_ok)
    return Payload(values, idx, idx)


def drawn_step(comp: RandomK | BlockRandomK, mem: torch.Tensor, grad: torch.Tensor, seed: int,
               out=None, wire=None) -> Payload:
    """Error feedback + random-k's or block-k's draws (the torch path's own generator calls) +
    one kernel for the gather, the memory's forget and (random-k) the wire positions; block-k's
    kernels expand its run or block starts to the entries themselves (``indices``' arithmetic)."""
    mem.add_(grad)
    values = out if out is not None else torch.empty(comp.k, dtype=mem.dtype, device=mem.device)
    k_ = kernels()
    if type(comp) is RandomK:
        idx = comp.select(mem, seed)[1]
        k_.take[_grid(comp.k, TAKE_BLOCK)](mem, idx, values, wire if wire is not None else idx, comp.k,
                                           BLOCK=TAKE_BLOCK, WIRE=wire is not None)
        return Payload(values, idx, idx)
    starts = comp.draw(seed, mem.device)
    idx = torch.empty(comp.k, dtype=torch.int64, device=mem.device)
    if comp.scope == "layerwise":
        k_.take_runs[_grid(comp.k, TAKE_BLOCK)](mem, starts, comp.entry_segment, comp.entry_in_run,
                                                comp.entry_segment_size, comp.entry_offset, values, idx, comp.k,
                                                BLOCK=TAKE_BLOCK)
    elif comp.blocks_drawn > MAX_BLOCKS:  # each program reads every start: too many, torch expands them
        idx = comp.indices(starts)
        k_.take[_grid(comp.k, TAKE_BLOCK)](mem, idx, values, idx, comp.k, BLOCK=TAKE_BLOCK, WIRE=False)
    else:
        B = comp.block_size
        k_.take_blocks[(comp.blocks_drawn,)](mem, starts, values, idx, comp.blocks_drawn, comp.k, B,
                                             (comp.nb - 1) * B, comp.last_size,
                                             DRAWN_P2=triton_next_pow2(comp.blocks_drawn),
                                             CHUNK=min(1024, triton_next_pow2(B)))
    if wire is not None:
        wire.copy_(starts)
    return Payload(values, starts, idx)


def _sign_scales(comp: SignSGD, acc: torch.Tensor, values: torch.Tensor) -> None:
    """Each segment's ``mean(|acc|)``, by the torch path's device ops (one ``_foreach_norm`` and
    a division): a kernel of its own would sum in another order, other floats."""
    sizes = comp.__dict__.setdefault("_sizes", {})
    if (acc.device, acc.dtype) not in sizes:
        sizes[(acc.device, acc.dtype)] = torch.tensor(comp.layout.sizes, dtype=acc.dtype, device=acc.device)
    values.copy_(comp.segment_norms(acc, 1).div_(sizes[(acc.device, acc.dtype)]))


def sign_encode(comp: SignSGD, acc: torch.Tensor, values: torch.Tensor, wire: torch.Tensor,
                forget: bool = False) -> None:
    """signSGD's encode: the scales (``_sign_scales``), then one kernel for the packed signs;
    ``forget``: error feedback's ``acc -= decode(message)`` in the same kernel."""
    _sign_scales(comp, acc, values)
    n = comp.numel
    kernels().sign_pack[_grid(wire.numel(), TAKE_BLOCK // 8)](
        acc, comp.entry_table("segment", acc.device), values, wire, n, wire.numel(),
        BLOCK=TAKE_BLOCK // 8, FORGET=forget)


def sign_decode_add(comp: SignSGD, values: torch.Tensor, wire: torch.Tensor, out: torch.Tensor) -> None:
    """signSGD's decode in one kernel: ``out += +-scale`` per entry (the torch path's floats)."""
    kernels().sign_unpack_add[_grid(comp.numel, TAKE_BLOCK)](
        wire, comp.entry_table("segment", out.device), values.to(out.dtype), out, comp.numel, BLOCK=TAKE_BLOCK)


def sign_step(comp: SignSGD, mem: torch.Tensor, grad: torch.Tensor, out=None, wire=None) -> Payload:
    """Error feedback + signSGD: ``mem += grad``, the scales, then one kernel for the codes and
    the forget (``mem -= decode(message)``)."""
    mem.add_(grad)
    values = out if out is not None else torch.empty(comp.num_values, dtype=mem.dtype, device=mem.device)
    wire = wire if wire is not None else torch.empty(comp.num_positions, dtype=torch.uint8, device=mem.device)
    sign_encode(comp, mem, values, wire, forget=True)
    return Payload(values, wire, None)


def qsgd_encode(comp: QSGD, acc: torch.Tensor, seed: int, values: torch.Tensor, wire: torch.Tensor) -> None:
    """QSGD's encode: the bucket norms, factors and uniforms by the torch path's device ops (its
    generator's numbers, drawn as it draws them: the kernel takes them as a tensor), then one
    kernel for the levels and the packed codes."""
    s = comp.levels
    values.copy_(comp.bucket_norms(acc))
    norms = values.to(acc.dtype)
    factors = torch.where(norms > 0, s / norms.double(), norms.new_zeros((), dtype=torch.float64)).to(acc.dtype)
    u = comp.uniforms(seed, acc, numpy=False)
    bits, bucket = comp.bits_per_entry, comp.entry_table("bucket", acc.device)
    if bits in WHOLE_CODES:
        kernels().qsgd_pack[_grid(wire.numel(), TAKE_BLOCK // 8)](
            acc, bucket, factors, u, wire, comp.numel, wire.numel(), float(s),
            comp._mask, BITS=bits, PER=8 // bits, BLOCK=TAKE_BLOCK // 8, enable_fp_fusion=False)
    else:
        kernels().qsgd_pack_stream[_grid(wire.numel(), TAKE_BLOCK // 8)](
            acc, bucket, factors, u, wire, comp.numel, wire.numel(), float(s),
            comp._mask, BITS=bits, SPAN=_codes_per_byte(bits), BLOCK=TAKE_BLOCK // 8, enable_fp_fusion=False)


def qsgd_decode_add(comp: QSGD, values: torch.Tensor, wire: torch.Tensor, out: torch.Tensor) -> None:
    """QSGD's decode in one kernel: ``out += signed level x norm / levels`` (the torch path's
    floats: the units divided by a tensor, the product rounded before the sum)."""
    units = values.div(values.new_tensor(comp.levels)).to(out.dtype)
    bits, bucket = comp.bits_per_entry, comp.entry_table("bucket", out.device)
    if bits in WHOLE_CODES:
        kernels().qsgd_unpack_add[_grid(comp.numel, TAKE_BLOCK)](
            wire, bucket, units, out, comp.numel, comp._top, comp._mask,
            BITS=bits, PER=8 // bits, BLOCK=TAKE_BLOCK, enable_fp_fusion=False)
    else:
        kernels().qsgd_unpack_add_stream[_grid(comp.numel, TAKE_BLOCK)](
            wire, bucket, units, out, comp.numel, wire.numel(), comp._top, comp._mask,
            BITS=bits, BLOCK=TAKE_BLOCK, enable_fp_fusion=False)


def _codes_per_byte(bits: int) -> int:
    """How many codes of ``bits`` bits one byte of the stream can touch (at most ``7 // bits + 2``),
    rounded up to a power of two (Triton's ranges): 4 for 3 to 7 bits, 2 for 9 to 17."""
    return 1 << (7 // bits + 1).bit_length()


def step(comp: Compressor, mem: torch.Tensor, grad: torch.Tensor, seed: int = 0, out=None, wire=None) -> Payload:
    """One fused step of error feedback: ``mem`` (the memory's buffer) becomes ``mem + grad``
    less what was sent; returns the payload the torch path's ``accumulate``, ``compress`` and
    ``forget`` give (the same entries and values; top-k's from the largest per segment). ``out``,
    ``wire``: the message's sections, as ``Compressor.compress`` takes them."""
    comp._check_device(mem)
    if grad.shape != mem.shape or grad.dtype != mem.dtype or not (mem.is_contiguous() and grad.is_contiguous()):
        raise ValueError(f"the fused step needs a contiguous gradient of {mem.numel()} {mem.dtype} entries")
    if isinstance(comp, TopK):
        return topk_step(comp, mem, grad, out, wire)
    if type(comp) is SignSGD:
        return sign_step(comp, mem, grad, out, wire)
    return drawn_step(comp, mem, grad, seed, out, wire)
