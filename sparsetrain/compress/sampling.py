"""Exactly-k distinct uniform positions per segment, fast and deterministic from a generator.

``torch.randperm(n)[:k]`` costs O(n) (317 ms for n = 11.2M); here the cost is O(k).

Per segment (n_s entries, k_s wanted) we draw ``m_s >= k_s`` positions with replacement and keep
the first ``k_s`` distinct ones in draw order. That is sequential rejection sampling, which yields
a uniformly random k-subset. Duplicates are found without sorting by a scatter of the draw
number into a preallocated mark buffer (min wins, so the result is deterministic on any device),
which is reset at the touched entries only. ``m_s`` leaves a margin of several standard deviations
over the expected number of duplicates; if a segment still falls short (rare) it is redrawn with
``randperm`` from the same generator, which keeps the distribution uniform. Segments with
``k_s > n_s / 2`` use ``randperm`` directly, ``k_s == n_s`` takes the whole segment.

On the CPU the duplicates are found by sorting instead (``DistinctSampler._distinct_cpu``): one
numpy sort of the draws, each packed with its draw number into one int64 (position high, draw
number low), so that equal positions sit together, first draw first. The draws, and so the
positions picked, are exactly those of the scatter method (which the other devices run); the sort
touches only the draws (no buffer the size of the model) and costs about a third as much.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparsetrain.compress.layout import Layout

_INT32_MAX = 2**31 - 1


def _draws_needed(n: int, k: int) -> int:
    """Draws with replacement that give >= k distinct out of n with overwhelming probability."""
    m = k
    for _ in range(50):
        distinct = n * (1.0 - math.exp(m * math.log1p(-1.0 / n))) if n > 1 else 1.0
        dups = m - distinct
        new_m = k + math.ceil(dups + 6.0 * math.sqrt(dups + 1.0) + 4.0)
        if new_m == m:
            break
        m = new_m
    return int(m)


class DistinctSampler:
    """Draws ``ks[s]`` distinct uniform positions in ``[0, sizes[s])`` for every segment ``s``.

    ``sample(gen)`` returns int64 *global* indices (``offsets[s] + local``), segment ``s``'s
    picks at ``[sum(ks[:s]), sum(ks[:s+1]))``, within a segment in draw order.
    """

    # the CPU path's tables (with their scratch keys) and the mark buffer, rewritten or reset by
    # every draw: left out by the kept-state check (compress.kept) of the compressor holding it
    transient = ("_np", "_mark")

    def __init__(self, sizes, ks, device="cpu"):
        self.sizes = [int(n) for n in sizes]
        self.ks = [int(k) for k in ks]
        self.device = torch.device(device)
        self.total = sum(self.sizes)
        self.k = sum(self.ks)
        offsets, pos = [], 0
        for n in self.sizes:
            offsets.append(pos)
            pos += n
        self.offsets = offsets
        kstarts = list(Layout.from_sizes(self.ks).offsets)  # where each segment's k entries start
        self.kstarts = kstarts

        self.draw_segs = [s for s, (n, k) in enumerate(zip(self.sizes, self.ks, strict=True)) if 2 * k <= n]
        self.other_segs = [s for s in range(len(self.sizes)) if s not in set(self.draw_segs)]
        ms = [min(_draws_needed(self.sizes[s], self.ks[s]), 64 * self.ks[s] + 64) for s in self.draw_segs]
        self.ms = ms
        dev = self.device
        self._np: dict | None = None  # the CPU path's tables
        if self.draw_segs:
            draw_segment = torch.repeat_interleave(torch.arange(len(ms)), torch.tensor(ms))
            n_t = torch.tensor([self.sizes[s] for s in self.draw_segs], dtype=torch.int64)
            off_t = torch.tensor([offsets[s] for s in self.draw_segs], dtype=torch.int64)
            k_t = torch.tensor([self.ks[s] for s in self.draw_segs], dtype=torch.int64)
            self.draw_size = n_t[draw_segment].to(torch.float64).to(dev)
            self.draw_max_index = (n_t[draw_segment] - 1).to(dev)
            self.draw_offset = off_t[draw_segment].to(dev)
            self.draw_k = k_t[draw_segment].to(dev)
            self.draw_segment = draw_segment.to(dev)
            draws = Layout.from_sizes(ms)  # segment i's draws: [offsets[i], offsets[i] + ms[i])
            self.draw_start = torch.tensor(draws.offsets, dtype=torch.int64, device=dev)
            self.draw_end = self.draw_start + torch.tensor(ms, dtype=torch.int64, device=dev)
            self.k_t = k_t.to(dev)
            self.draw_order = torch.arange(sum(ms), dtype=torch.int32, device=dev)
            self.num_draws = sum(ms)
            # output slots of the drawn segments (identity when every segment is drawn)
            if self.other_segs:
                self.draw_slots = torch.cat(
                    [torch.arange(kstarts[s], kstarts[s] + self.ks[s]) for s in self.draw_segs]
                ).to(dev)
            else:
                self.draw_slots = None
            self._np = self._numpy_tables(ms) if dev.type == "cpu" else None
        self._mark: torch.Tensor | None = None  # int32 [total], lazily allocated once

    def _numpy_tables(self, ms) -> dict | None:
        """Per-draw tables of the CPU path (None when a packed key would not fit in 63 bits)."""
        shift = max(1, (self.num_draws - 1).bit_length())
        if self.total.bit_length() + shift > 62:
            return None
        order = np.arange(self.num_draws, dtype=np.int64)
        return {
            "shift": shift,
            "size": self.draw_size.numpy(),
            "max_index": self.draw_max_index.numpy(),
            # (segment offset << shift) | draw number: added to (local position << shift)
            "offset_order": np.left_shift(self.draw_offset.numpy(), shift) | order,
            "start": self.draw_start.numpy(),
            "end": self.draw_end.numpy(),
            "k": self.k_t.numpy(),
            "key": np.empty(self.num_draws, dtype=np.int64),
        }

    def _mark_buffer(self) -> torch.Tensor:
        if self._mark is None:
            self._mark = torch.full((self.total,), _INT32_MAX, dtype=torch.int32, device=self.device)
        return self._mark

    def _segment_perm(self, s: int, gen: torch.Generator) -> torch.Tensor:
        n, k = self.sizes[s], self.ks[s]
        if k == n:
            local = torch.arange(n, device=self.device)
        else:
            local = torch.randperm(n, generator=gen, device=self.device)[:k]
        return local + self.offsets[s]

    def sample(self, gen: torch.Generator) -> torch.Tensor:
        picked = None
        if self.draw_segs:
            u = torch.rand(self.num_draws, generator=gen, dtype=torch.float64, device=self.device)
            if self._np is not None:
                picked = self._distinct_cpu(u, gen)
            else:
                picked = self._distinct_torch(u, gen)
        if not self.other_segs:
            return picked
        out = torch.empty(self.k, dtype=torch.int64, device=self.device)
        if picked is not None:
            out.index_copy_(0, self.draw_slots, picked)
        for s in self.other_segs:
            out[self.kstarts[s] : self.kstarts[s] + self.ks[s]] = self._segment_perm(s, gen)
        return out

    def _distinct_torch(self, u: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Positions of the uniforms ``u``; the first k_s distinct ones per segment, in draw
        order: duplicates found by a scatter of the draw number into the mark buffer."""
        d = torch.minimum(u.mul_(self.draw_size).long(), self.draw_max_index).add_(self.draw_offset)
        mark = self._mark_buffer()
        mark.scatter_reduce_(0, d, self.draw_order, reduce="amin")
        first = mark[d] == self.draw_order
        mark.index_fill_(0, d, _INT32_MAX)
        cs = torch.cumsum(first, 0)
        cs0 = torch.cat([cs.new_zeros(1), cs])
        before = cs0[self.draw_start]
        got = cs0[self.draw_end] - before
        rank = cs - before[self.draw_segment]  # 1-based rank among first occurrences
        keep = first & (rank <= self.draw_k)
        if bool((got < self.k_t).any()):
            return self._top_up(d, keep, got, gen)
        return d[keep]

    def _distinct_cpu(self, u: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """``_distinct_torch`` on the CPU, the same result: duplicates found by one sort.

        key = (position << shift) | draw number; sorted, a key whose position equals its
        predecessor's is a repeat (a later draw of a position already drawn). Per segment the
        first k_s non-repeats are kept: the kept draws end at start + k_s + (repeats among them).
        """
        t = self._np
        shift = t["shift"]
        un = u.numpy()
        np.multiply(un, t["size"], out=un)
        key = t["key"]
        np.copyto(key, un, casting="unsafe")  # truncation, as torch's .long()
        np.minimum(key, t["max_index"], out=key)
        np.left_shift(key, shift, out=key)
        key += t["offset_order"]  # (global position << shift) | draw number
        ordered = np.sort(key)
        pos = ordered >> shift
        repeats = np.sort(ordered[1:][pos[1:] == pos[:-1]] & ((1 << shift) - 1))  # their draw numbers
        start, end, k = t["start"], t["end"], t["k"]
        keep = np.ones(key.size, dtype=bool)
        if repeats.size:
            keep[repeats] = False
            seg = np.searchsorted(end, repeats, side="right")  # the draw segment of each repeat
            rank = np.arange(repeats.size) - np.searchsorted(repeats, start)[seg]  # among its segment's
            kept_before = repeats - start[seg] - rank  # non-repeats drawn before it
            early = np.bincount(seg[kept_before < k[seg]], minlength=start.size)
            got = (end - start) - np.bincount(seg, minlength=start.size)
            cut = start + k + early
        else:
            got = end - start
            cut = start + k
        tail = np.maximum(end - cut, 0)  # draws after a segment's k-th non-repeat: not kept
        if tail.any():
            first = np.cumsum(tail) - tail
            keep[np.repeat(cut - first, tail) + np.arange(int(tail.sum()))] = False
        if bool((got < k).any()):
            d = torch.from_numpy(key >> shift)
            return self._top_up(d, torch.from_numpy(keep), torch.from_numpy(got), gen)
        return torch.from_numpy(key[keep] >> shift)

    def _top_up(self, d, keep, got, gen) -> torch.Tensor:
        """Rare path: a segment got fewer than k distinct draws; redraw it with randperm."""
        parts = []
        short = (got < self.k_t).tolist()
        starts, ends = self.draw_start.tolist(), self.draw_end.tolist()
        for j, s in enumerate(self.draw_segs):
            if short[j]:
                parts.append(self._segment_perm(s, gen))
            else:
                a, b = starts[j], ends[j]
                parts.append(d[a:b][keep[a:b]])
        return torch.cat(parts)
