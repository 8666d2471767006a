"""The schemes: none, topk, randk, blockk.

All work on one flat buffer described by a Layout. ``scope="layerwise"`` gives every segment
(parameter tensor) its own k_i = max(1, round(ratio * numel_i)); ``scope="global"`` one
k = max(1, round(ratio * total)) over the whole buffer. Hot paths are vectorised over segments
with per-entry tables built once; scratch buffers are allocated once and reused.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparsetrain.compress.base import Compressor, Payload
from sparsetrain.compress.layout import Layout
from sparsetrain.compress.sampling import DistinctSampler


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


class NoCompression(Compressor):
    """Sends everything (dense SGD expressed as a compressor)."""

    shared_positions = True

    def __init__(self, ratio: float = 1.0, layout=None, scope: str = "layerwise", **kw):  # ratio: any, all sent
        super().__init__(ratio, layout, scope, **kw)

    def segment_ks(self, layout):
        return list(layout.sizes)  # every entry is sent

    @property
    def num_positions(self) -> int:
        return 0

    def select(self, acc, seed):
        return (
            torch.empty(0, dtype=torch.int64, device=acc.device),
            torch.arange(self.numel, device=acc.device),
        )

    def compress(self, acc, seed=0, out=None, wire=None) -> Payload:
        values = out.copy_(acc) if out is not None else acc.clone()
        return Payload(values, torch.empty(0, dtype=torch.int64, device=acc.device), None)

    def indices(self, positions):
        return torch.arange(self.numel, device=positions.device)

    def decompress_add(self, values, positions, out, *, indices=None):
        return out.add_(values.to(out.dtype))


class TopK(Compressor):
    """Exact top-k by magnitude: the same set as ``torch.topk(acc.abs(), k)`` (ties aside),
    per segment (layerwise) or over the whole vector (global).

    Fast path: a per-segment threshold is estimated from a fixed random sample of |acc| so that
    about 1.3-2x k entries pass it; one pass marks the candidates, and an exact ``torch.topk`` on
    the small candidate set picks the k. A segment with fewer than k candidates (threshold
    estimate too high: rare) falls back to an exact topk on the whole segment. Small segments
    skip the estimate and use all their entries as candidates. The CPU runs this in numpy, in
    cache-sized chunks (``_select_cpu``); other devices in batched torch ops (``_select_torch``).
    """

    shared_positions = False
    SMALL = 8192  # segments up to this size: every entry is a candidate
    # work buffers and tables built on first use (the fused kernels' too), and counters kept for
    # diagnostics that no step reads: the kept-state check leaves them out
    transient = ("_scratch", "_mask", "_sample_np", "_chunks", "_small", "_small_fast", "_tables", "_fused_plan",
                 "fallbacks", "small_ties")

    def __init__(self, ratio, layout, scope="layerwise", **kw):
        super().__init__(ratio, layout, scope, **kw)
        sizes, offsets = self.layout.sizes, self.layout.offsets
        self.large = [s for s, n in enumerate(sizes) if n > self.SMALL]
        self._large_set = set(self.large)
        self._scratch = None
        self._sample_np = None
        self._chunks = None
        self._small = None
        self._small_fast = None
        self.small_ties = 0  # how often a tie sent the small segments to the batched reference
        self._mask = None
        self._thr = [0.0] * len(sizes)
        if self.large:
            m = int(min(32768, max(4096, 65536 // len(self.large))))
            gen = _generator(torch.device("cpu"), 0x70F0)
            rows, js = [], []
            for s in self.large:
                n, k = sizes[s], self.ks[s]
                # sorted: the per-step gather then sweeps memory upwards (prefetch-friendly)
                rows.append(torch.sort(torch.randint(0, n, (m,), generator=gen)).values + offsets[s])
                p = k / n
                js.append(min(m, math.ceil(p * m + 4.0 * math.sqrt(p * m) + 4.0)))
            self.sample_idx = torch.stack(rows).reshape(-1).to(self.device)
            self.sample_m = m
            self.sample_kth = torch.tensor(js, dtype=torch.int64, device=self.device) - 1
            self.sample_kth_max = max(js)
            self.sample_full = torch.tensor([j >= m for j in js], device=self.device)
        self.kstarts = list(Layout.from_sizes(self.ks).offsets)  # where each segment's k entries start
        self.segment_bounds = torch.tensor(list(offsets) + [self.numel], dtype=torch.int64, device=self.device)
        self.fallbacks = 0  # how often the exact full-segment fallback ran (diagnostics)
        self._tables = None  # the torch path's per-entry and per-slot tables (``_torch_tables``)

    def _buffers(self, acc):
        if self._scratch is None or self._scratch.dtype != acc.dtype or self._scratch.device != acc.device:
            self._scratch = torch.empty(self.numel, dtype=acc.dtype, device=acc.device)
            self._mask = torch.empty(self.numel, dtype=torch.bool, device=acc.device)
        return self._scratch, self._mask

    def _sample_thresholds(self, samples) -> torch.Tensor:
        """Per large segment the threshold from ``samples`` = |acc| at ``sample_idx`` (0: the
        sample is too small to set one, every entry is a candidate), on the samples' device."""
        samples = samples.view(len(self.large), self.sample_m)
        top = torch.topk(samples, self.sample_kth_max, dim=1, sorted=True).values
        t = top.gather(1, self.sample_kth.to(samples.device).view(-1, 1)).view(-1)
        return torch.where(self.sample_full.to(samples.device), torch.zeros_like(t), t)

    def _thresholds(self, samples) -> list[float]:
        """Per segment the threshold from ``samples`` = |acc| at ``sample_idx`` (0.0: none)."""
        thr = [0.0] * len(self.layout)
        if not self.large:
            return thr
        for s, v in zip(self.large, self._sample_thresholds(samples).tolist(), strict=True):
            thr[s] = v
        return thr

    def _segment_thresholds(self, sc) -> torch.Tensor:
        """``_thresholds`` as a tensor on |acc|'s device, read by no host: one per segment."""
        thr = torch.zeros(len(self.layout), dtype=sc.dtype, device=sc.device)
        if self.large:
            thr[self._torch_tables(sc.device)["large"]] = self._sample_thresholds(sc[self.sample_idx.to(sc.device)])
        return thr

    def _torch_tables(self, dev) -> dict:
        """The torch path's tables on ``dev``, built on first use: each entry's segment (int32,
        layer-wise only: the size of the model in int32), each output slot's segment and its
        rank there, each segment's k."""
        if self._tables is None or self._tables["k"].device != dev:
            ks = torch.tensor(self.ks, dtype=torch.int64)
            segs = torch.arange(len(self.layout))
            slot_segment = torch.repeat_interleave(segs, ks)
            t = {"k": ks, "large": torch.tensor(self.large, dtype=torch.int64), "bounds": self.segment_bounds.cpu(),
                 "slot_segment": slot_segment,
                 "slot_rank": torch.arange(self.k) - torch.tensor(self.kstarts, dtype=torch.int64)[slot_segment]}
            if len(self.layout) > 1:
                t["entry_segment"] = torch.repeat_interleave(segs.to(torch.int32),
                                                             torch.tensor(self.layout.sizes, dtype=torch.int64))
            self._tables = {name: v.to(dev) for name, v in t.items()}
        return self._tables

    @staticmethod
    def _segment_then_magnitude(cvals, cseg) -> torch.Tensor:
        """The order of the candidates by segment, then |acc| from the largest: one int64 sort
        in float32 (a non-negative float orders as its bits: key = segment << 32 - bits), two
        stable sorts otherwise."""
        if cvals.dtype == torch.float32:
            return torch.sort((cseg.to(torch.int64) << 32) - cvals.view(torch.int32)).indices
        order = torch.sort(cvals, descending=True, stable=True).indices
        return order[torch.sort(cseg[order], stable=True).indices]

    def _small_table(self, dev):
        """Segments <= SMALL, batched: one padded [S, maxlen] gather table and one row-wise topk."""
        if getattr(self, "_small", None) is not None:
            return self._small
        sizes, offs = self.layout.sizes, self.layout.offsets
        small = [s for s, n in enumerate(sizes) if n <= self.SMALL]
        if not small:
            self._small = ()
            return self._small
        maxlen = max(sizes[s] for s in small)
        kmax = max(self.ks[s] for s in small)
        col = torch.arange(maxlen)
        lens = torch.tensor([sizes[s] for s in small])
        pad = col[None, :] >= lens[:, None]
        table = torch.tensor([offs[s] for s in small])[:, None] + col[None, :]
        table = table.masked_fill(pad, 0)
        keep = torch.arange(kmax)[None, :] < torch.tensor([self.ks[s] for s in small])[:, None]
        slots = torch.cat([torch.arange(self.kstarts[s], self.kstarts[s] + self.ks[s]) for s in small])
        self._small = (table.to(dev), pad.to(dev), kmax, keep.to(dev), slots.to(dev))
        return self._small

    CHUNK = 1 << 16  # entries per chunk of the CPU pass: the chunk, its |.| and mask stay in L2

    def _chunk_plan(self) -> list[tuple[int, int, int]]:
        """``(start, end, segment)`` chunks covering the buffer: a large segment in chunks of at
        most ``CHUNK`` entries, runs of small ones left out (nothing to compare there)."""
        if self._chunks is None:
            sizes, offs = self.layout.sizes, self.layout.offsets
            self._chunks = [(a, min(a + self.CHUNK, offs[s] + sizes[s]), s)
                            for s in self.large for a in range(offs[s], offs[s] + sizes[s], self.CHUNK)]
        return self._chunks

    def _small_groups(self, dev):
        """The small segments in a few tables of similar lengths (padding at most ~2x, vectors up
        to 512 entries in one), each with its row-wise k_s + 1 (for the tie check below)."""
        if self._small_fast is not None:
            return self._small_fast
        sizes, offs = self.layout.sizes, self.layout.offsets
        classes: dict[int, list[int]] = {}
        for s, n in enumerate(sizes):
            if n <= self.SMALL:
                classes.setdefault(max(512, 1 << (n - 1).bit_length()), []).append(s)
        groups = []
        for _, segs in sorted(classes.items()):
            lens = torch.tensor([sizes[s] for s in segs])
            ks = torch.tensor([self.ks[s] for s in segs])
            col = torch.arange(int(lens.max()))
            pad = col[None, :] >= lens[:, None]
            table = (torch.tensor([offs[s] for s in segs])[:, None] + col[None, :]).masked_fill(pad, 0)
            distinct = torch.minimum(ks + 1, lens)  # the leading values that must differ
            kq = int(distinct.max())
            check = torch.arange(kq - 1)[None, :] < (distinct - 1)[:, None]
            keep = torch.arange(kq)[None, :] < ks[:, None]
            slots = torch.cat([torch.arange(self.kstarts[s], self.kstarts[s] + self.ks[s]) for s in segs])
            groups.append(tuple(x.to(dev) if isinstance(x, torch.Tensor) else x
                                for x in (table, pad, kq, check, keep, slots)))
        self._small_fast = groups
        return groups

    def _small_grouped(self, acc, idx) -> bool:
        """Top k_s of every small segment, by a few tables of similar lengths instead of one
        table as wide as the largest small segment (the batched reference, up to ~15x the entries).
        The result equals the reference's wherever it is unique: when each row's k_s + 1 largest
        |values| are distinct (its k_s largest, in descending order, are then the only answer).
        Returns False, writing nothing, when some row has a tie there (or a NaN): the caller then
        runs the reference, whose tie order is its own."""
        out = []
        for table, pad, kq, check, keep, slots in self._small_groups(acc.device):
            rows = torch.index_select(acc, 0, table.view(-1)).view(table.shape).abs_().masked_fill_(pad, -1.0)
            vals, sel = torch.topk(rows, kq, dim=1, sorted=True)
            if not bool(((vals[:, :-1] > vals[:, 1:]) | ~check).all()):
                return False
            out.append((slots, table.gather(1, sel)[keep]))
        for slots, chosen in out:
            idx.index_copy_(0, slots, chosen)
        return True

    def _select_cpu(self, acc):
        """CPU path in numpy (its compare and nonzero are ~3x torch's on one thread), in one pass.

        Thresholds from the sampled |acc|; then each large segment in chunks that stay in cache:
        |chunk|, compare against the segment's threshold, nonzero, the candidates' |acc| kept:
        acc is read once and nothing the size of the model is written. Exact topk on each
        segment's candidates; the small segments (biases, batch norm) in a few batched topks.
        The candidates, their order and every topk call are those of the two-pass method it
        replaced (full |acc| scratch, one compare per segment): the result is identical.
        """
        a_np = acc.detach().numpy()
        offs, sizes = self.layout.offsets, self.layout.sizes
        thr = [0.0] * len(self.layout)
        if self.large:
            if self._sample_np is None:
                self._sample_np = self.sample_idx.numpy()
            thr = self._thresholds(torch.from_numpy(np.abs(a_np[self._sample_np])))
        scratch = np.empty(min(self.CHUNK, self.numel), dtype=a_np.dtype)
        mask = np.empty(scratch.size, dtype=bool)
        found = {s: ([], []) for s in self.large if thr[s] > 0.0}
        for a, b, s in self._chunk_plan():
            if s in found:
                x, m = scratch[: b - a], mask[: b - a]
                np.abs(a_np[a:b], out=x)
                np.greater_equal(x, thr[s], out=m)
                c = np.flatnonzero(m)
                found[s][0].append(c + (a - offs[s]))
                found[s][1].append(x[c])
        idx = torch.empty(self.k, dtype=torch.int64)
        if self._small_table(acc.device) and not self._small_grouped(acc.detach(), idx):
            self.small_ties += 1
            table, pad, kmax, keep, slots = self._small_table(acc.device)
            rows = torch.index_select(acc.detach(), 0, table.view(-1)).view(table.shape).abs_().masked_fill_(pad, -1.0)
            sel = torch.topk(rows, kmax, dim=1, sorted=True).indices
            idx.index_copy_(0, slots, table.gather(1, sel)[keep])
        for s in self.large:
            k = self.ks[s]
            a, b = offs[s], offs[s] + sizes[s]
            dst = idx[self.kstarts[s] : self.kstarts[s] + k]
            c = None
            if s in found:
                c = torch.from_numpy(np.concatenate(found[s][0]))
            if c is not None and c.numel() == k:
                torch.add(c, a, out=dst)
            elif c is not None and c.numel() > k:
                sel = torch.topk(torch.from_numpy(np.concatenate(found[s][1])), k, sorted=False).indices
                torch.add(c[sel], a, out=dst)
            else:  # threshold estimate too high (or none): exact on the whole segment
                if s in found:
                    self.fallbacks += 1
                sel = torch.topk(torch.from_numpy(np.abs(a_np[a:b])), k, sorted=False).indices
                torch.add(sel, a, out=dst)
        return idx, idx

    def select(self, acc, seed=0):
        if acc.device.type == "cpu" and acc.dtype in (torch.float32, torch.float64) and acc.is_contiguous():
            return self._select_cpu(acc)
        return self._select_torch(acc)

    def _select_torch(self, acc):
        """Any device (the CUDA path): the same method in batched torch ops, no loop over the
        segments and two reads by the host (the candidates' count, then whether a segment fell
        short). Callable on the CPU too, so that tests check it there against ``torch.topk``."""
        sc, mask = self._buffers(acc)
        torch.abs(acc, out=sc)
        tab = self._torch_tables(acc.device)
        thr = self._segment_thresholds(sc)
        layerwise = "entry_segment" in tab
        torch.ge(sc, thr[tab["entry_segment"]] if layerwise else thr, out=mask)
        cand = mask.nonzero().view(-1)  # ascending: each segment's candidates are one run
        bounds = torch.searchsorted(cand, tab["bounds"])  # segment s: cand[bounds[s]:bounds[s + 1]]
        short = (bounds[1:] - bounds[:-1]) < tab["k"]
        any_short = bool(short.any())
        cvals = sc[cand]
        if not layerwise and not any_short:  # one segment: the k largest candidates
            idx = cand[torch.topk(cvals, self.k, sorted=False).indices]
        elif layerwise and cand.numel() > 0:  # segment s's k largest lead its run, sorted by
            # segment, then |acc| descending (a short segment's slots are overwritten below)
            order = self._segment_then_magnitude(cvals, tab["entry_segment"][cand])
            src = (bounds[:-1][tab["slot_segment"]] + tab["slot_rank"]).clamp_(max=cand.numel() - 1)
            idx = cand[order[src]]
        else:
            idx = torch.empty(self.k, dtype=torch.int64, device=acc.device)
        if any_short:  # threshold estimate too high for this step: exact on the segment
            for s in short.nonzero().view(-1).tolist():
                self.fallbacks += 1
                a, n, k = self.layout.offsets[s], self.layout.sizes[s], self.ks[s]
                torch.add(torch.topk(sc[a : a + n], k, sorted=False).indices, a,
                          out=idx[self.kstarts[s] : self.kstarts[s] + k])
        return idx, idx


class RandomK(Compressor):
    """Exactly k distinct uniformly random positions per segment (layerwise) or overall (global),
    deterministic from the seed. See ``sampling.DistinctSampler`` for the method."""

    shared_positions = True
    draws_span_segments = True
    transient = ("_drawn",)  # the latest draw, a cache

    def __init__(self, ratio, layout, scope="layerwise", **kw):
        super().__init__(ratio, layout, scope, **kw)
        self.sampler = DistinctSampler(self.layout.sizes, self.ks, self.device)
        self._drawn = None  # (seed, indices): the latest draw, which the compressors sharing it read

    def draw(self, seed, device) -> torch.Tensor:
        """The k indices for ``seed`` (the latest kept: every DDP bucket of a step reads it)."""
        if self._drawn is None or self._drawn[0] != seed:
            self._drawn = (seed, self.sampler.sample(_generator(device, seed)))
        return self._drawn[1]

    def share_draws(self, source, segments):
        super().share_draws(source, segments)
        # per entry of this compressor: the slot of the source's draw it reads, and the shift
        # from the source's segment offset to this one's
        slots = torch.cat([torch.arange(source.sampler.kstarts[s], source.sampler.kstarts[s] + k)
                           for s, k in zip(segments, self.ks, strict=True)])
        shift = torch.repeat_interleave(
            torch.tensor([o - source.layout.offsets[s] for o, s in zip(self.layout.offsets, segments, strict=True)],
                         dtype=torch.int64), torch.tensor(self.ks, dtype=torch.int64))
        self._shared = (slots.to(self.device), shift.to(self.device))

    def select(self, acc, seed):
        if self._draw_source is None:
            idx = self.sampler.sample(_generator(acc.device, seed))
        else:
            slots, shift = self._shared
            idx = self._draw_source[0].draw(seed, acc.device)[slots] + shift
        return idx, idx


class BlockRandomK(Compressor):
    """Block-random-k (the paper's "random-block").

    layerwise: one contiguous run of k_i entries per tensor, starting at a uniformly random
    offset in [0, n_i) and wrapping around the tensor's end. Wire: one start per tensor.

    global: the flat vector is cut into nb = ceil(n / block_size) blocks (the last one may be
    shorter). A uniformly random sequence of ``min(nb, ceil(k / block_size) + 1)`` distinct
    blocks is drawn; blocks are taken in that order, whole, until k entries are reached, and the
    block that crosses k is cut to its leading part (later blocks contribute nothing). So exactly
    k entries are sent, every block is equally likely to be picked, and the one extra block start
    on the wire covers the case where the short last block is among the picks. Wire: the block
    start offsets (one int per block).
    """

    shared_positions = True
    draws_span_segments = True

    def __init__(self, ratio, layout, scope="layerwise", *, block_size: int = 256, **kw):
        self.check_options(block_size=block_size)
        super().__init__(ratio, layout, scope, **kw)
        self.block_size = int(block_size)
        dev = self.device
        if scope == "layerwise":
            sizes, offs = self.layout.sizes, self.layout.offsets
            S = len(sizes)
            ks_t = torch.tensor(self.ks, dtype=torch.int64)
            entry_segment = torch.repeat_interleave(torch.arange(S), ks_t)
            self._kstarts = list(Layout.from_sizes(self.ks).offsets)  # where each tensor's run starts in the values
            kstarts = torch.tensor(self._kstarts, dtype=torch.int64)
            self.entry_segment = entry_segment.to(dev)
            self.entry_in_run = (torch.arange(self.k) - kstarts[entry_segment]).to(dev)
            self.entry_offset = torch.tensor(offs, dtype=torch.int64)[entry_segment].to(dev)
            self.entry_segment_size = torch.tensor(sizes, dtype=torch.int64)[entry_segment].to(dev)
            self.seg_n = torch.tensor(sizes, dtype=torch.float64, device=dev)
            self.segment_max_index = torch.tensor(sizes, dtype=torch.int64, device=dev) - 1
        else:
            B, n = self.block_size, self.numel
            self.nb = -(-n // B)
            self.blocks_drawn = min(self.nb, -(-self.k // B) + 1)
            self.last_size = n - (self.nb - 1) * B
            self.sampler = DistinctSampler([self.nb], [self.blocks_drawn], dev)
            self.entry_arange = torch.arange(self.k, device=dev)

    @classmethod
    def check_options(cls, *, block_size: int = 256) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, float)) \
                or int(block_size) != block_size or block_size < 1:
            raise ValueError(f"scheme.block_size={block_size!r} is not allowed; it must be an integer >= 1")

    @property
    def num_positions(self) -> int:
        return len(self.layout) if self.scope == "layerwise" else self.blocks_drawn

    @property
    def max_position(self) -> int:
        if self.scope == "layerwise":
            return max(self.layout.sizes) - 1
        return (self.nb - 1) * self.block_size

    def layerwise_starts(self, seed, device) -> torch.Tensor:
        """Layer-wise: each tensor's run start for ``seed``, one uniform per tensor."""
        u = torch.rand(len(self.layout), generator=_generator(device, seed), dtype=torch.float64, device=device)
        return torch.minimum(u.mul_(self.seg_n).long(), self.segment_max_index)

    def select(self, acc, seed):
        starts = self.draw(seed, acc.device)
        return starts, self.indices(starts)

    def draw(self, seed, device) -> torch.Tensor:
        """The wire positions for ``seed``: each tensor's run start (layer-wise), the drawn
        blocks' start offsets (global)."""
        if self._draw_source is not None:  # a DDP bucket's tensors: the model's draws for them
            return self._draw_source[0].layerwise_starts(seed, device)[self._segment_ids]
        if self.scope == "layerwise":
            return self.layerwise_starts(seed, device)
        gen = _generator(device, seed)
        return self.sampler.sample(gen).mul_(self.block_size)

    def share_draws(self, source, segments):
        super().share_draws(source, segments)
        self._segment_ids = torch.tensor(segments, dtype=torch.int64, device=self.device)

    def decompress_add(self, values, positions, out, *, indices=None):
        """``out[indices] += values``. Layer-wise on the CPU, as at most two slice adds per tensor
        (its run, and the part that wraps around its end) instead of an index_add over k expanded
        indices: the same additions in the same order (a message's positions are distinct), so
        the same bits, for a fraction of the memory traffic. Elsewhere the generic index_add."""
        if self.scope != "layerwise" or out.device.type != "cpu":
            return super().decompress_add(values, positions, out, indices=indices)
        values = values.to(out.dtype)
        for start, off, n, k, v0 in zip(positions.tolist(), self.layout.offsets, self.layout.sizes,
                                        self.ks, self._kstarts, strict=True):
            head = min(k, n - start)
            out[off + start: off + start + head].add_(values[v0: v0 + head])
            if head < k:
                out[off: off + k - head].add_(values[v0 + head: v0 + k])
        return out

    def indices(self, positions):
        positions = positions.long()
        if self.scope == "layerwise":
            return (positions[self.entry_segment] + self.entry_in_run).remainder_(self.entry_segment_size).add_(self.entry_offset)
        B = self.block_size
        sizes = torch.where(positions == (self.nb - 1) * B, self.last_size, B)
        before = torch.cumsum(sizes, 0) - sizes
        lengths = (self.k - before).clamp_(min=0)
        lengths = torch.minimum(lengths, sizes)
        run_start = torch.cumsum(lengths, 0) - lengths
        base = torch.repeat_interleave(positions - run_start, lengths, output_size=self.k)
        return base.add_(self.entry_arange)
