"""Core library: gradient compressors and error feedback as plain tensor code.

No torch.distributed, no Hydra: usable from any training loop::

    from sparsetrain.compress import ErrorFeedback, Layout, get_compressor

    layout = Layout.from_tensors(model.parameters())
    comp = get_compressor("blockk")(0.01, layout, "layerwise")
    ef = ErrorFeedback(layout.total)
    payload = ef.step(flat_grad, comp, seed=step_seed(0, step))   # values + positions to send
    update = comp.decompress(payload.values, payload.positions)   # dense, zeros elsewhere
"""

from sparsetrain.compress import schemes as _schemes  # noqa: F401  (registers the schemes)
from sparsetrain.compress.base import (
    SCOPES,
    Compressor,
    Payload,
    available,
    compressor_factory,
    get_compressor,
    k_for,
    register,
    step_seed,
)
from sparsetrain.compress.feedback import ErrorFeedback
from sparsetrain.compress.layout import (
    UNCOMPRESSED_RULES,
    Layout,
    as_layout,
    compressed_first,
    parse_uncompressed,
    uncompressed_flags,
)
from sparsetrain.compress.sampling import DistinctSampler
from sparsetrain.compress.schemes import BlockRandomK, NoCompression, RandomK, TopK

__all__ = [
    "SCOPES",
    "BlockRandomK",
    "Compressor",
    "DistinctSampler",
    "ErrorFeedback",
    "Layout",
    "NoCompression",
    "Payload",
    "RandomK",
    "TopK",
    "UNCOMPRESSED_RULES",
    "as_layout",
    "available",
    "compressed_first",
    "compressor_factory",
    "get_compressor",
    "parse_uncompressed",
    "k_for",
    "register",
    "step_seed",
    "uncompressed_flags",
]
