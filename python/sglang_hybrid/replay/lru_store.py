"""The free-state LRU bound's memory: the oracle's store, limited to a capacity, LRU (issue #37).

What it models: a cache of ``capacity`` tokens of KV, with a recurrent state free at every
position, that evicts the least recently used 64-token block (leaves first) and resumes a request
at its longest common prefix with what it still holds. Against ``oracle_store.PrefixStore`` (the
same without a limit) it answers "what would plain LRU reuse with these bytes, if states cost
nothing": the bound ``docs/benchmarks.md`` compares the host tier with (``--caches lru``).

Contract: ``LruPrefixStore(capacity).lcp(tokens)`` is the longest common prefix of ``tokens`` with
the blocks held (full 64-token blocks, then part of a next block held below the last one: a
remembered sequence's partial last block is held as an entry of its own), and marks them used;
``insert(tokens)`` holds every block of ``tokens`` (and its partial last block), marks them used,
and evicts least recently used entries until at most ``capacity`` tokens are held (never one of
the sequence just inserted while older entries remain). Recency: a path is marked deepest first,
so a parent is always more recent than its children and the least recently used entry is a leaf.
Exact (bytes compared), O(len / 64) per call plus the evictions.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import numpy as np

from .oracle_store import _common

BLOCK = 64
_BB = BLOCK * 4  # bytes per block of int32 tokens

Entry = tuple[int, bytes]  # (parent node id, block bytes: a full block or a partial last one)


class LruPrefixStore:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < BLOCK:
            raise ValueError(f"an LRU of {capacity_tokens} tokens holds no block")
        self.capacity = capacity_tokens
        self.tokens = 0  # tokens held
        self.evicted_tokens = 0
        # (parent, block) -> child node id (full blocks) or -1 (a partial block)
        self._children: dict[Entry, int] = {}
        self._nexts: dict[int, list[bytes]] = {}  # node -> its next blocks held, sorted
        self._lru: OrderedDict[Entry, int] = OrderedDict()  # entry -> its tokens, LRU first
        self._kids: dict[int, int] = {}  # node -> entries held below it (full and partial)
        self._next = 1  # node ids; 0 is the root

    @staticmethod
    def _bytes(tokens: np.ndarray) -> bytes:
        return np.ascontiguousarray(tokens, dtype=np.int32).tobytes()

    def _walk(self, data: bytes) -> tuple[list[Entry], int]:
        """Entries of the longest held full-block path, and its end in bytes."""
        node, pos, path = 0, 0, []
        while pos + _BB <= len(data):
            e = (node, data[pos : pos + _BB])
            child = self._children.get(e)
            if child is None:
                break
            path.append(e)
            node, pos = child, pos + _BB
        return path, pos

    def _mark(self, path: list[Entry]) -> None:
        for e in reversed(path):  # deepest first: parents end up more recent
            self._lru.move_to_end(e)

    def lcp(self, tokens: np.ndarray) -> int:
        data = self._bytes(tokens)
        path, pos = self._walk(data)
        node = self._children[path[-1]] if path else 0
        rest = data[pos : pos + _BB]
        best, best_entry = 0, None
        nexts = self._nexts.get(node)
        if rest and nexts:  # a lexicographic neighbour holds the longest common prefix
            i = bisect.bisect_left(nexts, rest)
            for j in (i - 1, i):
                if 0 <= j < len(nexts) and (n := _common(rest, nexts[j])) > best:
                    best, best_entry = n, (node, nexts[j])
        if best_entry is not None:
            path = [*path, best_entry]
        self._mark(path)
        return pos // 4 + best

    def insert(self, tokens: np.ndarray) -> None:
        data = self._bytes(tokens)
        path, pos = self._walk(data)
        node = self._children[path[-1]] if path else 0
        while pos < len(data):
            block = data[pos : pos + _BB]
            e = (node, block)
            if e not in self._children:
                full = len(block) == _BB
                child = self._next if full else -1
                if full:
                    self._next += 1
                bisect.insort(self._nexts.setdefault(node, []), block)
                self._children[e] = child
                self._lru[e] = len(block) // 4
                self._kids[node] = self._kids.get(node, 0) + 1
                self.tokens += len(block) // 4
            path.append(e)
            if len(block) < _BB:
                break
            node, pos = self._children[e], pos + _BB
        self._mark(path)
        keep = set(path)
        while self.tokens > self.capacity and self._lru:
            e = next(iter(self._lru))
            if e in keep:
                break  # only this sequence is left: it stays whole, over capacity
            self._evict(e)

    def _evict(self, e: Entry) -> None:
        child = self._children.pop(e)
        assert child < 0 or not self._kids.get(child), "an LRU victim must be a leaf"
        tokens = self._lru.pop(e)
        self.tokens -= tokens
        self.evicted_tokens += tokens
        parent, block = e
        self._kids[parent] -= 1
        nexts = self._nexts[parent]
        del nexts[bisect.bisect_left(nexts, block)]
        if child >= 0:
            self._kids.pop(child, None)
            self._nexts.pop(child, None)
