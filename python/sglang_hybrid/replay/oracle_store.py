"""The oracle's memory: the longest common prefix with anything seen, at token granularity.

Contract: ``PrefixStore.insert(tokens)`` remembers a token sequence; ``lcp(tokens)`` returns the
length of the longest common prefix of ``tokens`` with any remembered sequence. Exact (token
bytes are compared, nothing is hashed), O(len / 64) dictionary steps plus one ``bisect`` per
call: sequences are kept as a tree of 64-token blocks; each node keeps its distinct next blocks
(full or partial) sorted, and the longest common prefix with a sorted set of strings is reached
by a lexicographic neighbour of the query.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

BLOCK = 64
_BB = BLOCK * 4  # bytes per block of int32 tokens


@dataclass(slots=True)
class _Node:
    children: dict[bytes, int] = field(default_factory=dict)  # full next block -> node
    nexts: list[bytes] = field(default_factory=list)  # sorted distinct next blocks, any length


def _common(a: bytes, b: bytes) -> int:
    """Common prefix length of two byte strings, in whole int32 tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // 4
    x = np.frombuffer(a[: n - n % 4], dtype=np.int32)
    y = np.frombuffer(b[: n - n % 4], dtype=np.int32)
    return int(np.argmin(x == y))


class PrefixStore:
    def __init__(self) -> None:
        self._nodes: list[_Node] = [_Node()]

    @staticmethod
    def _bytes(tokens: np.ndarray) -> bytes:
        return np.ascontiguousarray(tokens, dtype=np.int32).tobytes()

    def lcp(self, tokens: np.ndarray) -> int:
        data = self._bytes(tokens)
        node, pos = self._nodes[0], 0
        while pos + _BB <= len(data):
            child = node.children.get(data[pos : pos + _BB])
            if child is None:
                break
            node, pos = self._nodes[child], pos + _BB
        rest = data[pos : pos + _BB]
        best = 0
        if rest and node.nexts:
            i = bisect.bisect_left(node.nexts, rest)
            for j in (i - 1, i):
                if 0 <= j < len(node.nexts):
                    best = max(best, _common(rest, node.nexts[j]))
        return pos // 4 + best

    def insert(self, tokens: np.ndarray) -> None:
        data = self._bytes(tokens)
        node, pos = self._nodes[0], 0
        while pos < len(data):
            block = data[pos : pos + _BB]
            i = bisect.bisect_left(node.nexts, block)
            if i == len(node.nexts) or node.nexts[i] != block:
                node.nexts.insert(i, block)
            if len(block) < _BB:
                break
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = len(self._nodes)
                self._nodes.append(_Node())
            node, pos = self._nodes[child], pos + _BB
