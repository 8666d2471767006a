"""From a scheme, scope, aggregation and ratio to a flat buffer and its reducer. Which
combinations are allowed is ``comm.rules``' to say (``check_combination``, also used by
config.validate).
"""

from __future__ import annotations

import torch

from sparsetrain.comm.dense import DenseReducer
from sparsetrain.comm.flat import flat_gradients
from sparsetrain.comm.protocol import Reducer
from sparsetrain.comm.rules import check_combination
from sparsetrain.comm.sparse import SparseReducer
from sparsetrain.compress import Layout, as_layout, compressor_class, uncompressed_flags
from sparsetrain.scheme_catalog import is_dense


def build_reducer(
    scheme: str,
    scope: str,
    aggregation: str,
    ratio: float,
    layout,
    *,
    world_size: int,
    rank: int,
    seed: int,
    error_feedback: bool = True,
    uncompressed=None,
    warmup_steps: int = 0,
    group=None,
    device="cpu",
    dtype=torch.float32,
    compressor=None,
    memory=None,
    shapes=None,
    fast_path: bool = False,
) -> Reducer:
    """The reducer for a scheme/scope/aggregation; ``DenseReducer`` for ``scheme='none'``.

    ``layout``: a ``Layout``, the parameters (one segment each), their sizes, or a total numel.
    ``compressor``: how to build the compressor once the layout is known, called as
    ``compressor(ratio, layout, scope, device=...)``: what ``scheme.compressor`` in the config
    instantiates to (a ``functools.partial`` of the scheme's class with its options, e.g.
    ``partial(BlockRandomK, block_size=256)``), or the class itself; required unless
    ``scheme='none'``.
    ``memory``: the memory's class, or a ``functools.partial`` of it with its options (what the
    scheme's ``memory`` node instantiates to), built as ``memory(numel, enabled=error_feedback,
    device=..., dtype=...)``; None: ``ErrorFeedback``.
    ``uncompressed``: one flag per segment, True for the tensors that travel whole; they must be
    the last segments (``flat_gradients`` orders the buffer so). ``warmup_steps``: dense steps
    before compression starts. ``shapes``: one per segment, the tensors' shapes (for a
    compressor with ``needs_shapes``: PowerSGD compresses each as a matrix; the sparse schemes
    need only sizes). ``fast_path``: error feedback + compression in fused kernels where there
    are some (``train.fast_path``, ``compress.fused``: on CUDA), the same messages and memory.
    Raises ``ValueError`` with a one-line message for invalid combinations.
    """
    check_combination(scheme, scope, aggregation, ratio, compressor)
    layout = as_layout(layout)
    esize = torch.empty((), dtype=dtype).element_size()
    flags = [False] * len(layout) if uncompressed is None else [bool(f) for f in uncompressed]
    if len(flags) != len(layout):
        raise ValueError(f"{len(flags)} uncompressed flags for a layout of {len(layout)} segments")
    n_compressed = flags.index(True) if True in flags else len(flags)  # segments before the first whole one
    if not all(flags[n_compressed:]):
        raise ValueError("uncompressed segments must come last in the flat buffer (see flat_gradients)")
    if is_dense(scheme) or n_compressed == 0:  # nothing to compress: dense SGD
        return DenseReducer(layout.total, esize, group=group)
    options = {}
    if compressor_class(compressor).needs_shapes:
        if shapes is None or len(shapes) != len(layout):
            raise ValueError(f"scheme={scheme!r} needs the shape of each of the {len(layout)} tensors: shapes=...")
        options["shapes"] = [tuple(int(d) for d in s) for s in shapes[:n_compressed]]
    compressed = Layout(layout.sizes[:n_compressed])
    return SparseReducer(
        compressor(ratio, compressed, scope, device=device, **options),
        aggregation=aggregation,
        world_size=world_size,
        rank=rank,
        seed=seed,
        error_feedback=error_feedback,
        memory=memory,
        uncompressed_numel=layout.total - compressed.total,
        warmup_steps=warmup_steps,
        group=group,
        device=device,
        dtype=dtype,
        fast_path=fast_path,
    )


def build_exchange(
    params,
    scheme: str,
    scope: str = "layerwise",
    aggregation: str = "allgather",
    ratio: float = 0.01,
    *,
    uncompressed="1d",
    device=None,
    dtype=torch.float32,
    **reducer_options,
):
    """The flat gradient buffer and its reducer for ``params``, as the trainer builds them, so
    that benchmarks time exactly what training runs.

    ``uncompressed`` is the rule of ``scheme.uncompressed`` (``"1d"``, ``"none"`` or N); it does
    not apply to dense SGD. ``reducer_options`` go to ``build_reducer`` (world_size, rank, seed,
    error_feedback, warmup_steps, group, compressor: the scheme's compressor factory). Returns ``(flat,
    params_in_buffer_order, reducer)``.
    """
    params = [p for p in params if p.requires_grad]
    rule = uncompressed if not is_dense(scheme) else "none"  # the rule "none": no tensor travels whole
    flags = uncompressed_flags([p.shape for p in params], rule)
    flat, params, flags = flat_gradients(params, flags, device=device, dtype=dtype)
    reducer = build_reducer(scheme, scope, aggregation, ratio, Layout.from_tensors(params),
                            uncompressed=flags, device=flat.device, dtype=dtype,
                            shapes=[tuple(p.shape) for p in params], **reducer_options)
    return flat, params, reducer
