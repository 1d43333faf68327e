"""Seeded token text for generated messages.

Contract: ``ContentSource(seed, avoid)`` hands out fresh token runs: ``text(n)`` returns ``n`` ids
from a stream no earlier call used (streams are numbered in call order, so a generator that
makes the same calls gets the same tokens), never one of the ``avoid`` ids (the template's
markers), all inside the tiny vocabulary. ``name(i)`` is a short fixed run standing for a
function name, the same for the same ``i`` across sessions.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..tokens import hashed_tokens

_NAMES = 1 << 48  # stream numbers reserved for function names


class ContentSource:
    def __init__(self, seed: int, avoid: Iterable[int]) -> None:
        self.seed = seed
        self.avoid = frozenset(avoid)
        self._next = 0

    def text(self, n: int) -> np.ndarray:
        self._next += 1
        return hashed_tokens(self.seed, self._next, n, self.avoid)

    def name(self, i: int) -> np.ndarray:
        return hashed_tokens(self.seed, _NAMES + i, 3, self.avoid)
