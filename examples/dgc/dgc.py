"""Deep Gradient Compression's memory (Lin et al. 2018): momentum correction with factor masking.

With plain error feedback the optimizer's momentum acts on the exchanged (sparse) gradient; DGC
moves the momentum before the compression instead, so that what is kept and sent later carries
it too. Per worker, on the compressed entries::

    u = m * u + grad        # momentum, local
    v = v + u               # what has not been sent yet, momentum included
    send C(v);  v = v - sent (as decoded);  u = 0 where sent   # factor masking

Run it with the optimizer's own momentum off (``optim.momentum=0 optim.nesterov=false``): the memory
holds it.
This file is the whole method; conf/scheme/dgc_randk.yaml puts it beside random-k.
"""

from sparsetrain.compress import Memory


class MomentumCorrection(Memory):
    """``velocity`` (v, whose norm the logs show) and ``momentum`` (u), one entry per compressed
    entry; checkpointed and moved across DDP buckets by the harness, as any memory's buffers."""

    BUFFERS = ("velocity", "momentum")

    def __init__(self, numel, *, momentum: float = 0.9, **kw):
        super().__init__(numel, **kw)
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"scheme.memory.momentum={momentum!r} is not allowed; it must be in [0, 1)")
        self.m = float(momentum)

    def accumulate(self, grad):
        if not self.enabled:  # scheme.error_feedback=false: nothing kept, the gradient itself
            return self.gradient(grad, self.numel)
        self.add_into(self.momentum.mul_(self.m), grad)
        return self.velocity.add_(self.momentum)

    def forget(self, payload, compressor):
        if not self.enabled:
            return
        compressor.forget(self.velocity, payload)  # v = v - sent, as the compressor decodes it
        if payload.indices is None:  # everything was sent
            self.momentum.zero_()
        else:
            self.momentum.index_fill_(0, payload.indices, 0)
