"""The GDSF queue (index/gdsf_queue.py) returns what a scan of every snapshot returns.

The scan (first strict minimum of H in publication order, over retained snapshots that hold a
host copy and may be evicted) is the definition; the heap must agree after any sequence of H
changes, host copies gained and lost, supersessions, pins and deletions.
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.index import Residency, Snapshot, SnapshotKind
from sglang_hybrid.index.gdsf_queue import GdsfQueue
from sglang_hybrid.index.tree import BlockTree

R = Residency


def _evictable(s: Snapshot) -> bool:
    return s.restore_pins == 0 and s.host_state is R.RESIDENT


def _scan(snapshots: dict[int, Snapshot]) -> Snapshot | None:
    best: Snapshot | None = None
    for s in snapshots.values():
        if not s.superseded and _evictable(s) and (best is None or s.h < best.h):
            best = s
    return best


def _snapshot(i: int, tree: BlockTree) -> Snapshot:
    return Snapshot(id=i, anchor=tree.root, frontier=64 * i, tail=b"", kind=SnapshotKind.TAP)


def test_ties_go_to_the_oldest_and_stale_entries_are_skipped() -> None:
    tree, snaps = BlockTree(), {}
    q = GdsfQueue(snaps)
    a, b, c = (_snapshot(i, tree) for i in (1, 2, 3))
    for s in (a, b, c):
        snaps[s.id] = s
        s.host_state, s.h = R.RESIDENT, 1.0
        q.push(s)
    assert q.min_victim(_evictable) is a
    a.h = 5.0  # revalued: the old entry is stale
    q.push(a)
    assert q.min_victim(_evictable) is b
    b.restore_pins = 1  # pinned: set aside for this search, not lost
    assert q.min_victim(_evictable) is c
    b.restore_pins = 0
    assert q.min_victim(_evictable) is b
    del snaps[b.id]
    c.host_state = R.ABSENT  # gave up its host copy
    assert q.min_victim(_evictable) is a


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_the_scan_under_random_changes(seed: int) -> None:
    rng = random.Random(seed)
    tree, snaps = BlockTree(), {}
    q = GdsfQueue(snaps)
    next_id = 1
    for _ in range(3000):
        op = rng.random()
        live = list(snaps.values())
        if op < 0.2 or not live:
            s = _snapshot(next_id, tree)
            next_id += 1
            snaps[s.id] = s
            s.h = float(rng.randrange(8))  # few values: many ties
            if rng.random() < 0.7:
                s.host_state = rng.choice((R.RESIDENT, R.FILLING))
            q.push(s)
        else:
            s = rng.choice(live)
            if op < 0.45:
                s.h = float(rng.randrange(8))
                q.push(s)  # every H change pushes (the Valuer)
            elif op < 0.55:
                s.host_state = R.ABSENT
            elif op < 0.65:
                s.host_state = R.RESIDENT  # a host write completes or starts: pushed
                q.push(s)
            elif op < 0.72:
                s.superseded = not s.superseded
                if not s.superseded:
                    q.push(s)  # un-superseded by a hit: recosted
            elif op < 0.82:
                s.restore_pins = rng.choice((0, 0, 1))
            else:
                del snaps[s.id]
        assert q.min_victim(_evictable) is _scan(snaps)
    s = next(iter(snaps.values()))
    s.host_state = R.RESIDENT
    q.push(s)
    assert len(q) <= 2 * len(snaps) + 64  # a push rebuilds when stale entries pile up
