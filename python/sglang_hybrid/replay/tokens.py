"""Deterministic token ids inside the tiny model's vocabulary.

Contract:
- Every generated token id lies in ``[TOKEN_FLOOR, VOCAB_SIZE)`` (the tiny models' vocabulary is
  2048 ids; ids below ``TOKEN_FLOOR`` are the tokenizer's specials). Caches only compare token
  identity, so any deterministic map into that range serves; content never needs to decode.
- ``hashed_tokens(seed, stream, n, avoid=())`` returns ``n`` int32 ids that depend only on
  ``(seed, stream, i)``: SplitMix64 over a 64-bit key, vectorised with numpy, identical on every
  platform. Distinct streams collide on a whole 64-token block with probability ~2048**-64.
- ``avoid`` ids (e.g. chat-template markers) are remapped to the next allowed id, so generated
  content can never fake a role header or a thinking tag.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

VOCAB_SIZE = 2048
# The token worker leaves ids below this to special tokens; content stays above it too.
TOKEN_FLOOR = 16
_SPAN = VOCAB_SIZE - TOKEN_FLOOR

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic is the point)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def stream_key(seed: int, stream: int) -> int:
    """A 64-bit key for one token stream: (seed, stream) mixed, so nearby ids decorrelate."""
    a = _splitmix(np.array([seed & ((1 << 64) - 1)], dtype=np.uint64))
    b = _splitmix(a ^ np.uint64(stream & ((1 << 64) - 1)))
    return int(b[0])


def hashed_tokens(seed: int, stream: int, n: int, avoid: Iterable[int] = ()) -> np.ndarray:
    """``n`` token ids of stream ``stream`` under ``seed`` (see the module contract)."""
    if n < 0:
        raise ValueError(f"token count must be non-negative, got {n}")
    key = np.uint64(stream_key(seed, stream))
    with np.errstate(over="ignore"):
        x = _splitmix(np.arange(n, dtype=np.uint64) * _GOLDEN ^ key)
    ids = (TOKEN_FLOOR + (x % np.uint64(_SPAN))).astype(np.int32)
    bad = sorted({int(a) for a in avoid if TOKEN_FLOOR <= int(a) < VOCAB_SIZE})
    if bad:
        # Remap each marker id to the next id that is not a marker (wrapping inside the range).
        allowed = np.setdiff1d(np.arange(TOKEN_FLOOR, VOCAB_SIZE, dtype=np.int32), bad)
        mask = np.isin(ids, bad)
        if mask.any():
            pos = np.searchsorted(allowed, ids[mask]) % len(allowed)
            ids[mask] = allowed[pos]
    return ids
