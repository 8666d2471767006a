"""The flat gradient buffer: every parameter's ``.grad`` is a view into one tensor."""

from __future__ import annotations

import torch

from sparsetrain.compress import as_layout, compressed_first


def flat_gradients(params, uncompressed=None, *, device=None, dtype=torch.float32):
    """One flat gradient buffer whose slices are the parameters' ``.grad`` (backward accumulates
    in place, the reducer reads and overwrites the buffer, the optimizer reads ``.grad``).

    ``uncompressed``: one flag per parameter (``compress.uncompressed_flags``); flagged tensors
    are placed last, the others first, each group in parameter order, so that the compressed
    part is one contiguous prefix (global scope compresses it as one vector) and the whole
    tensors one contiguous tail. Returns ``(flat, params_in_buffer_order, flags_in_that_order)``.
    """
    params = [p for p in params if p.requires_grad]
    flags = [False] * len(params) if uncompressed is None else [bool(f) for f in uncompressed]
    if len(flags) != len(params):
        raise ValueError(f"{len(flags)} uncompressed flags for {len(params)} parameters")
    order = compressed_first(flags)
    params = [params[i] for i in order]
    flags = [flags[i] for i in order]
    device = device if device is not None else (params[0].device if params else "cpu")
    flat = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
    for p, view in zip(params, as_layout(params).views(flat, [p.shape for p in params])):
        p.grad = view
    return flat, params, flags


def packed_runs(pieces) -> list[tuple[int, int, int]]:
    """``(offset in the buffer, offset in the packed part, length)`` of tensors ``(offset in the
    buffer, length)`` taken in order and packed one after another; tensors adjacent in the buffer
    too merge into one run (one copy instead of one per tensor)."""
    runs: list[list[int]] = []
    pos = 0
    for offset, n in pieces:
        if runs and runs[-1][0] + runs[-1][2] == offset:
            runs[-1][2] += n
        else:
            runs.append([offset, pos, n])
        pos += n
    return [(a, b, c) for a, b, c in runs]
