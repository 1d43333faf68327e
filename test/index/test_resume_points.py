"""Resume points on a prompt's path and where a cut lands (issue #16, ``resume_points.py``)."""

from __future__ import annotations

import random

from helpers import Device, key, make_index, run

from sglang_hybrid.index import SnapshotKind
from sglang_hybrid.index.resume_points import (
    ALIGNED,
    FULL,
    PARTIAL,
    SNAPPED,
    place_cut,
    resume_points,
)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 5000) for _ in range(n)]


def _state(index):
    """Everything a read could disturb: the clock, LRU order, every snapshot's valuation."""
    snaps = sorted(
        (s.id, s.hits, s.demand, s.h, s.last_hit_tick, s.restore_pins)
        for s in index.snapshots.values()
    )
    lru = [id_of(e) for e in (*index.lru.backed, *index.lru.unbacked)]
    return index.tick, lru, snaps, repr(index.stats)


def id_of(entry) -> int:
    return entry.id


def test_points_are_the_snapshots_the_prompt_repeats() -> None:
    index, dev = make_index(slots=6), Device()
    a = _ids(1, 700)
    run(index, dev, a, taps=[128, 320])  # and the endpoint at 700 (a 60-token tail)
    longer = a + _ids(2, 50)
    assert [p.position for p in resume_points(index.tree, key(longer))] == [128, 320, 700]
    assert all(p.tier == "device" for p in resume_points(index.tree, key(longer)))
    kinds = {p.position: p.snapshot.kind for p in resume_points(index.tree, key(longer))}
    assert kinds[700] is SnapshotKind.ENDPOINT
    # A prompt ending exactly at a point includes it (the next prompt continues past it).
    assert [p.position for p in resume_points(index.tree, key(a[:320]))] == [128, 320]
    # Diverging inside the endpoint's tail block: the endpoint is not on this path.
    diverged = a[:680] + _ids(3, 40)
    assert [p.position for p in resume_points(index.tree, key(diverged))] == [128, 320]
    # Another prompt altogether: nothing.
    assert resume_points(index.tree, key(_ids(4, 300))) == []


def test_a_query_changes_nothing() -> None:
    index, dev = make_index(slots=6), Device()
    a = _ids(5, 900)
    run(index, dev, a, taps=[256, 512])
    run(index, dev, _ids(6, 300))
    before = _state(index)
    for n in (100, 300, 600, 900):
        resume_points(index.tree, key(a[:n]))
    assert _state(index) == before
    index.check_integrity()


def test_where_a_cut_lands() -> None:
    index, dev = make_index(slots=6), Device()
    a = _ids(7, 700)
    run(index, dev, a, taps=[128, 320])
    points = resume_points(index.tree, key(a + _ids(8, 400)))
    exact = place_cut(points, 320, 512)
    assert (exact.verdict, exact.retained_prefix_tokens, exact.delta) == (ALIGNED, 320, 0)
    snapped = place_cut(points, 500, 512)
    assert (snapped.verdict, snapped.retained_prefix_tokens, snapped.delta) == (SNAPPED, 320, 180)
    assert "180 tokens back" in snapped.reason
    far = place_cut(points, 1000, 100)
    assert (far.verdict, far.retained_prefix_tokens, far.delta) == (PARTIAL, 700, 300)
    assert "prefilled again" in far.reason
    early = place_cut(points, 100, 512)
    assert (early.verdict, early.retained_prefix_tokens) == (FULL, 0)
    assert "past the cut" in early.reason
    none = place_cut([], 400, 512)
    assert none.verdict == FULL and "no resume point" in none.reason
