"""GDSF victim order: a min-heap over (H, id) with lazy invalidation (spec §9.3).

Host eviction step 3 takes the retained host-resident snapshot with the lowest H. Scanning every
snapshot per eviction step is O(snapshots); this heap makes a step O(log n) amortised.

Entries are ``(h, id, snapshot)``. ``id`` breaks ties: ids are given in publication order and
``PrefixIndex.snapshots`` is filled in that order, so the heap returns exactly the snapshot the
old scan of that dict (first strict minimum) returned.

An entry is pushed whenever a snapshot that holds or is writing a host copy gets a new H (the
``Valuer`` is the only writer of H) and when a host image write starts. Entries are never
updated in place; an entry is stale when its snapshot is gone, superseded, holds no host copy,
or has another H now, and stale entries are dropped when they reach the top. A current entry of
a snapshot that may not be evicted right now (pinned, durable, filling) is set aside for one
search and pushed back. The heap is rebuilt when stale entries outnumber the snapshots.

The same pushes keep an unordered pool of candidates for the learned order (``hit_density``):
each candidate once (``Snapshot.pool_pos``), stale ones dropped when a draw meets them.
``sample`` draws from it by a counter-driven generator, so every TP rank draws the same.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from .node import FastResidency
from .snapshot import Snapshot

R = FastResidency

_SLACK = 64  # rebuild only when the heap holds this many more entries than twice the snapshots


def holds_host_copy(s: Snapshot) -> bool:
    """``s``'s image or tail is on the host or being written there."""
    return s.host_state is not R.ABSENT or s.tail_host_state is not R.ABSENT


class GdsfQueue:
    """Candidates for GDSF eviction; ``snapshots`` is the index's id -> snapshot map."""

    def __init__(self, snapshots: dict[int, Snapshot]) -> None:
        self._snapshots = snapshots  # read only: PrefixIndex owns it
        self._heap: list[tuple[float, int, Snapshot]] = []
        self._pool: list[Snapshot] = []  # candidates for ``sample``, each once, some stale
        self._draws = 0  # the sampler's state: draws so far

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, s: Snapshot) -> None:
        """``s``'s H may have changed or it gained a host copy: make its current H findable."""
        if s.superseded or not holds_host_copy(s):
            return  # not a candidate; a later revaluation or host write pushes it again
        if s.pool_pos < 0:
            s.pool_pos = len(self._pool)
            self._pool.append(s)
        heapq.heappush(self._heap, (s.h, s.id, s))
        if len(self._heap) > 2 * len(self._snapshots) + _SLACK:
            self._rebuild()

    def _current(self, h: float, s: Snapshot) -> bool:
        return (
            self._snapshots.get(s.id) is s and s.h == h and not s.superseded and holds_host_copy(s)
        )

    def min_victim(self, evictable: Callable[[Snapshot], bool]) -> Snapshot | None:
        """The candidate with the lowest (H, id) that ``evictable`` accepts; it stays queued."""
        heap = self._heap
        aside: list[tuple[float, int, Snapshot]] = []
        found: Snapshot | None = None
        while heap:
            h, _, s = heap[0]
            if not self._current(h, s):
                heapq.heappop(heap)
            elif evictable(s):
                found = s
                break
            else:
                aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def sample(self, k: int, evictable: Callable[[Snapshot], bool]) -> list[Snapshot]:
        """Up to ``k`` distinct current candidates that ``evictable`` accepts (all of them when
        the pool holds at most ``k``). O(k) draws, plus the stale entries met (dropped)."""
        pool = self._pool
        out: list[Snapshot] = []
        if len(pool) <= k:
            for s in list(pool):
                if not self._live(s):
                    self._drop(s)
                elif evictable(s):
                    out.append(s)
            return out
        seen: set[int] = set()
        for _ in range(2 * k):
            if not pool or len(out) >= k:
                break
            self._draws += 1
            # SplitMix64-style mix of the draw count: uniform, and the same on every rank.
            z = (self._draws * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
            s = pool[(z ^ (z >> 31)) % len(pool)]
            if not self._live(s):
                self._drop(s)
            elif s.id not in seen and evictable(s):
                seen.add(s.id)
                out.append(s)
        return out

    def in_pool(self, s: Snapshot) -> bool:
        """``s`` is in the sampling pool (``check_integrity``: every current candidate is)."""
        return 0 <= s.pool_pos < len(self._pool) and self._pool[s.pool_pos] is s

    def _live(self, s: Snapshot) -> bool:
        return self._snapshots.get(s.id) is s and not s.superseded and holds_host_copy(s)

    def _drop(self, s: Snapshot) -> None:
        """Swap-remove ``s`` from the pool; a later push adds it again."""
        pool, i = self._pool, s.pool_pos
        last = pool.pop()
        if last is not s:
            pool[i], last.pool_pos = last, i
        s.pool_pos = -1

    def _rebuild(self) -> None:
        self._heap = [
            (s.h, s.id, s)
            for s in self._snapshots.values()
            if not s.superseded and holds_host_copy(s)
        ]
        heapq.heapify(self._heap)
