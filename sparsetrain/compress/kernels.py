"""Compiled CPU kernels of the quantizers (numba), bit-identical to their numpy paths.

The numpy paths of ``quantize.py`` make several full passes over the gradient per call (absolute
values, comparisons, a bit stream, packing), and numpy's PCG64 hands out one float per call
through a function pointer. These kernels do each operation in one or two passes, with the same
floating-point operations in the same order, so every packed byte, scale and decoded float is the
one the numpy path gives (``tests/test_quantize.py`` checks both paths against one reference):

- ``sign_encode``: per segment the sum of ``|a|`` in numpy's own order (pairwise: blocks of 128
  entries summed in 8 lanes, halves split at a multiple of 8; see ``_pairwise_abs_sum``; the 8
  lanes are one vector add a row, ``_lane_abs_sums``), then the sign bits, packed.
- ``decode_many`` (both quantizers): W messages added into ``out`` in one sweep, each entry
  receiving ``+= m_0``, then ``+= m_1``, ... (the sequential loop's floats); each packed byte's
  values come from a 256-entry table (``decode_table``).
- ``qsgd_encode``: ``|a| x factor + u``, rounded, signed, packed, with u drawn block by block:
  with QSGD's ``generator="counter"`` (the default) from SplitMix64 at counter i
  (``_draw_counter``), as ``quantize.counter_uniforms`` draws it; with ``"pcg64"`` from PCG64 as
  numpy draws it (``random(dtype=...)`` of ``default_rng(seed)``): the 128-bit LCG step and
  XSL-RR output (``_pcg_next``), float32 from the top 24 bits of each 32-bit half (low half
  first), float64 from the top 53 bits.

Loops run over blocks of ``BLOCK`` entries and, inside them, over whole array views: LLVM
vectorizes those (a loop over a computed ``range(start, stop)`` of a larger array it did not).

Which path runs: ``SPARSETRAIN_KERNELS=numba`` (the default where numba is installed) or ``numpy``;
``available()`` says whether these kernels are in use. numba is an optional dependency (the
``fast`` extra, which ``make`` installs): without it the numpy paths run, slower, with the same
results. The kernels live in ``compress._compiled``, imported on first use (``_compiled``), so
that runs without a quantizer do not import numba. Compiled code is cached beside that file
(numba's ``cache=True``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import numpy as np

CHOICES = ("numba", "numpy")

def wanted() -> str:
    """The backend ``SPARSETRAIN_KERNELS`` asks for (default ``numba``); one clear error otherwise."""
    value = os.environ.get("SPARSETRAIN_KERNELS", "numba")
    if value not in CHOICES:
        raise ValueError(f"SPARSETRAIN_KERNELS={value!r} is not allowed; use one of {', '.join(CHOICES)}")
    return value


def installed() -> bool:
    """Whether numba is installed (found, not imported)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _compiled():
    """The kernels' module (``compress._compiled``), imported on first use: numba's import costs
    about 0.2 s, which only runs with a quantizer on the CPU need. An installed numba that fails
    to import raises here (set SPARSETRAIN_KERNELS=numpy to run without it)."""
    from sparsetrain.compress import _compiled as module

    return module


def available() -> bool:
    """Whether the quantizers' CPU paths use these kernels (numba installed and not turned off)."""
    return wanted() == "numba" and installed()


def backend() -> str:
    """``numba <version>`` or ``numpy``: what a run's provenance records (without importing numba)."""
    return f"numba {importlib.metadata.version('numba')}" if available() else "numpy"


def __getattr__(name: str):
    """The compiled kernels (``sign_encode``, ``decode_many``, ``qsgd_encode``, ...) and ``numba``
    itself, from ``compress._compiled`` on first use; ``numba`` is None where it is not installed."""
    if name == "numba" and not installed():
        return None
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(_compiled(), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


#: the code widths ``decode_many`` (and ``warm``) take: whole codes in each byte
WHOLE_CODE_BITS = (1, 2, 4, 8)


@functools.cache
def decode_table(bits: int, signs: bool = False) -> np.ndarray:
    """``decode_many``'s table: for each byte, its ``8 // bits`` values as int8 in one word
    (uint8, 16, 32 or 64 for 8, 4, 2 or 1 bits): the code's two's complement value, or with
    ``signs`` (signSGD's one bit) +1 for bit 0 and -1 for bit 1."""
    if bits not in WHOLE_CODE_BITS:
        raise ValueError(f"decode_table: bits={bits!r} is not allowed; the compiled decode takes whole codes "
                         f"in a byte: {', '.join(map(str, WHOLE_CODE_BITS))} bits an entry")
    per = 8 // bits
    codes = (np.arange(256)[:, None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
    values = 1 - 2 * codes if signs else np.where(codes >= 1 << (bits - 1), codes - (1 << bits), codes)
    word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[per]
    return np.ascontiguousarray(values.astype(np.int8)).view(word).reshape(256)


@functools.cache
def warm(bits: int, signs: bool = False) -> None:
    """Compile every kernel a quantizer of ``bits`` bits uses (signSGD: ``signs``), for float32,
    once per process, on a few entries: the first compilation on a machine takes seconds, and it
    belongs to the quantizer's construction, not to a timed step (later processes load it from
    numba's cache)."""
    c = _compiled()
    a, bounds = np.zeros(9, np.float32), np.array([0, 9], dtype=np.int64)
    wire = np.zeros((9 * bits + 7) // 8, dtype=np.uint8)
    if signs:
        c.sign_encode(a, bounds, np.zeros(1, np.float32), wire)
    else:
        c.qsgd_encode(a, np.zeros(1, np.float32), bounds, 1, bits, *pcg64_state(0), wire, np.uint64(0), False)
    c.decode_many(np.zeros((1, 1), np.float32), decode_table(bits, signs), wire.reshape(1, -1), bounds, bits, a)


def pcg64_state(seed: int) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """``default_rng(seed)``'s PCG64 state and increment as four 64-bit halves (hi, lo, hi, lo)."""
    st = np.random.PCG64(int(seed)).state["state"]
    low = (1 << 64) - 1
    return (np.uint64(st["state"] >> 64), np.uint64(st["state"] & low),
            np.uint64(st["inc"] >> 64), np.uint64(st["inc"] & low))
