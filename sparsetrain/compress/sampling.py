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
"""

from __future__ import annotations

import math

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
        self._mark: torch.Tensor | None = None  # int32 [total], lazily allocated once

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
                picked = self._top_up(d, keep, got, gen)
            else:
                picked = d[keep]
        if not self.other_segs:
            return picked
        out = torch.empty(self.k, dtype=torch.int64, device=self.device)
        if picked is not None:
            out.index_copy_(0, self.draw_slots, picked)
        for s in self.other_segs:
            out[self.kstarts[s] : self.kstarts[s] + self.ks[s]] = self._segment_perm(s, gen)
        return out

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
