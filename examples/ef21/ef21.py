"""EF21 (Richtarik, Sokolov, Fatkhullin, 2021, "EF21: A New, Simpler, Theoretically Better, and
Practically Faster Error Feedback"): each worker compresses the change of its gradient against its
own estimate, and the optimizer applies the shared estimate, not the averaged message. Per worker
i, on the compressed entries::

    c_i = C(grad_i - g_i)      # what worker i sends (top-k in conf/scheme/ef21_topk.yaml)
    g_i = g_i + c_i            # worker i's estimate of its gradient
    g   = g + mean_i(c_i)      # the shared estimate, the same on every worker
    apply g                    # the update the optimizer applies

``g_i`` and ``g`` start at zero when compression starts. Unlike error feedback, the memory
changes the applied update: ``forget`` adds this worker's own message to ``g_i`` and ``update``
(after the exchange) turns the averaged message into ``g``. This file is the whole method;
conf/scheme/ef21_topk.yaml puts it beside top-k.
"""

import torch

from sparsetrain.compress import Memory


class EF21(Memory):
    """``g_i`` (this worker's estimate, whose norm the logs show) and ``g`` (the shared one), one
    entry per compressed entry; checkpointed and moved across DDP buckets by the harness, as any
    memory's buffers. ``scheme.error_feedback=false``: the gradient is compressed and the averaged
    message applied, nothing kept."""

    BUFFERS = ("g_i", "g")
    transient = ("_acc",)  # rewritten by every accumulate before it is read: not state

    def __init__(self, numel, **kw):
        super().__init__(numel, **kw)
        self._acc = torch.empty_like(self.g_i)  # grad - g_i, the vector compressed (not state)

    def accumulate(self, grad):
        if not self.enabled:
            return self.gradient(grad, self.numel)
        # -g_i + grad is grad - g_i exactly (negation is exact, addition commutes)
        return self.add_into(torch.neg(self.g_i, out=self._acc), grad)

    def forget(self, payload, compressor):
        if not self.enabled:
            return
        if payload.decoded is not None:  # the update every rank decoded (PowerSGD's P Q^T)
            self.g_i.add_(payload.decoded)
        else:  # g_i += c_i: this worker's own message, decoded
            compressor.decompress_add(payload.values, payload.positions, self.g_i, indices=payload.indices)

    def update(self, average):
        if not self.enabled:
            return
        self.g.add_(average)  # g += mean_i(c_i)
        average.copy_(self.g)  # the optimizer applies g
