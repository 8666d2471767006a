"""SplitMix64, QSGD's counter-based generator (``generator="counter"``): entry i's 64 bits are
``splitmix64(key + (i + 1) * GAMMA)``, a function of the step's key and i alone. The compiled
kernel (``compress._compiled``), numpy and torch (``quantize.counter_uniforms``) use these same
constants, so all three draw the same numbers. Pure Python: importing it costs nothing."""

from __future__ import annotations

GAMMA = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function on a 64-bit integer (Python ints: exact)."""
    x = (x ^ (x >> 30)) * MIX1 & MASK64
    x = (x ^ (x >> 27)) * MIX2 & MASK64
    return x ^ (x >> 31)


def counter_key(seed: int) -> int:
    """The stream's key for ``seed`` (a step's seed, per step and rank): SplitMix64's first output
    for it, so that nearby seeds give unrelated streams."""
    return splitmix64((int(seed) + GAMMA) & MASK64)
