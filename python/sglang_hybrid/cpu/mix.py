"""A platform-independent integer hash for the CPU workers' deterministic choices (tokens of
the token worker, the draft schedule of ``speculative.py``): no per-process seed, so every rank
and every run agrees."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """SplitMix64 finaliser: a cheap, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
