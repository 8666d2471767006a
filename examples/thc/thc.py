"""An integer-sum quantizer in the manner of THC (Li et al., 2024, "THC: Accelerating Distributed
Deep Learning Using Tensor Homomorphic Compression"): the ranks agree on one scale per tensor
first, then quantize to small integers on that shared grid, so that one AllReduce sums the codes
themselves (no decoding before the sum, no AllGather). Per step, per tensor::

    round 1 (max):  s = max over ranks of max|acc|             one float per tensor
    round 2 (sum):  c_r = floor(acc_r / s * L + u),  u ~ U[0, 1)   int8 codes in [-L, L]
                    update = (sum_r c_r) * s / (L * W)         W ranks; W * L <= 127 fits int8

Stochastic rounding makes each rank's codes unbiased (E[c_r] s / L = acc_r); error feedback keeps
``acc - c_r s / L``, this rank's own quantization error. The draws are per tensor and rank, from
``tensor_seed`` (keyed by the model's tensor), so a DDP bucket draws what the trainer draws for
its tensors. The tensors that travel whole ride in a round of their own, before these two
(neither sums floats).

This file is the whole method; conf/scheme/thc.yaml names it.
"""

import torch

from sparsetrain.compress import Compressor, Payload
from sparsetrain.compress.base import Round


class IntegerSum(Compressor):
    """THC-style integer-sum quantizer: ``levels`` (L) code levels each side of zero, int8 codes."""

    shared_positions = True  # codes on a shared grid can be summed: one AllReduce
    ratio_applies = False  # every entry is sent: the analysis shows ratio 1.0

    def __init__(self, ratio=1.0, layout=None, scope="layerwise", *, device="cpu", levels: int = 15):
        self.check_options(levels=levels)
        super().__init__(1.0, layout, scope, device=device)  # every entry is sent: ratio does not apply
        self.levels = levels

    @classmethod
    def check_options(cls, *, levels: int = 15):
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"scheme.compressor.levels={levels!r} is not allowed; it must be an integer in [1, 127]")

    def segment_ks(self, layout):
        return list(layout.sizes)  # every entry is sent

    def rounds(self, aggregation):
        return (Round("max", floats=len(self.layout)), Round("sum", ints=self.numel, int_dtype=torch.int8))

    def _segments(self):
        """(segment, start, size) of each tensor."""
        return enumerate(zip(self.layout.offsets, self.layout.sizes, strict=True))

    def send(self, r, step, mine):
        if r == 0:  # this rank's max |acc| per tensor; the MAX makes it the shared scale
            for j, (o, n) in self._segments():
                mine.floats[j] = step.acc[o : o + n].abs().max()
            return
        if step.world * self.levels > 127:
            raise ValueError(f"scheme.compressor.levels={self.levels} is not allowed with world_size={step.world}: "
                             f"the sum of the ranks' codes must fit int8 (world_size x levels <= 127)")
        scale = step.scratch["scale"]
        for j, (o, n) in self._segments():  # tensor j's own numbers, this rank's
            gen = torch.Generator(device=step.acc.device).manual_seed(self.tensor_seed(step.seed, j, step.rank))
            u = torch.rand(n, generator=gen, device=step.acc.device, dtype=step.acc.dtype)
            s = float(scale[j])
            x = step.acc[o : o + n] * (self.levels / s) if s > 0 else torch.zeros_like(u)
            mine.ints[o : o + n] = torch.floor(x + u).clamp_(-self.levels, self.levels).to(torch.int8)
        step.payload = Payload(scale.clone(), mine.ints, None)  # own codes: the memory forgets them

    def receive(self, r, step, got, out):
        if r == 0:
            step.scratch["scale"] = got.floats
            return
        self.decompress_add(step.scratch["scale"] / step.world, got.ints, out)

    def decompress_add(self, values, positions, out, *, indices=None):
        """``out += codes * scale / L`` per tensor (``values``: the scales)."""
        per_entry = torch.repeat_interleave(values.to(out.dtype) / self.levels,
                                            torch.tensor(self.layout.sizes, device=out.device))
        return out.add_(positions.to(out.dtype) * per_entry)

    def forget(self, memory, payload):
        """Error feedback keeps ``acc - c_r s / L``: this rank's own quantization error."""
        self.decompress_add(payload.values.neg(), payload.positions, memory)
