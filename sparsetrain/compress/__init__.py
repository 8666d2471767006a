"""Core library: gradient compressors and error feedback as plain tensor code.

No torch.distributed, no Hydra: usable from any training loop::

    from sparsetrain.compress import BlockRandomK, ErrorFeedback, Layout, step_seed

    layout = Layout.from_tensors(model.parameters())
    comp = BlockRandomK(0.01, layout, "layerwise")
    ef = ErrorFeedback(layout.total)
    payload = ef.step(flat_grad, comp, seed=step_seed(0, step))   # values + positions to send
    update = comp.decompress(payload.values, payload.positions)   # dense, zeros elsewhere

The quantizers (``SignSGD``, ``QSGD``: ``compress.quantize``) work the same way: their payload's
values are per-tensor scales, its positions the packed bits.
"""

from sparsetrain.compress.base import (
    SCOPES,
    Compressor,
    Payload,
    compressor_class,
    k_for,
    step_seed,
)
from sparsetrain.compress.feedback import ErrorFeedback, Memory, compression_stats, memory_class
from sparsetrain.compress.layout import (
    UNCOMPRESSED_RULES,
    Layout,
    as_layout,
    compressed_first,
    parse_uncompressed,
    uncompressed_flags,
)
from sparsetrain.compress.powersgd import PowerSGD
from sparsetrain.compress.quantize import (
    QSGD,
    Quantizer,
    SignSGD,
    pack_codes,
    packed_nbytes,
    unpack_codes,
)
from sparsetrain.compress.sampling import DistinctSampler
from sparsetrain.compress.schemes import BlockRandomK, NoCompression, RandomK, TopK

__all__ = [
    "SCOPES",
    "BlockRandomK",
    "Compressor",
    "DistinctSampler",
    "ErrorFeedback",
    "Memory",
    "compression_stats",
    "memory_class",
    "Layout",
    "NoCompression",
    "Payload",
    "PowerSGD",
    "QSGD",
    "Quantizer",
    "RandomK",
    "SignSGD",
    "TopK",
    "UNCOMPRESSED_RULES",
    "as_layout",
    "compressed_first",
    "compressor_class",
    "parse_uncompressed",
    "k_for",
    "pack_codes",
    "packed_nbytes",
    "unpack_codes",
    "step_seed",
    "uncompressed_flags",
]
