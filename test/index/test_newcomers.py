"""Scan-resistant placement (issue #37, ``newcomers``): ghosts, the thrash meter, both tiers."""

from __future__ import annotations

import random

import pytest
from helpers import Device, key, make_index

from sglang_hybrid.index import SnapshotKind
from sglang_hybrid.index.newcomers import GHOST_SPAN, GhostBlocks, Recalled, ThrashMeter
from sglang_hybrid.index.node import BlockNode


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 2000) for _ in range(n)]


def serve(index, dev, ids: list[int], capacity: int) -> int:
    """One request on a device of ``capacity`` tokens, in SGLang's order: matched and its source
    pinned, then room for what it computes evicted, then its pass, its planned taps (a tail
    with each inside a block), its endpoint, write-through and release. Returns its reuse."""
    k = key(ids)
    m = index.match(k)
    src = m.best
    got = src.frontier if src is not None else 0
    taps = [t.position for t in index.plan_taps(k, m, src)]
    lane = index.open_lane(m, src)
    need = index.device_tokens + len(ids) - got - capacity
    if need > 0:
        index.evict_device(need)
        dev.collect(index)
    index.unpin_sources(lane)
    index.commit(lane, k, len(ids), lambda b: dev.new())
    for p in [*taps, len(ids)]:
        kind = SnapshotKind.ENDPOINT if p == len(ids) else SnapshotKind.TAP
        slot = index.reserve_slot(lane, p, kind)
        if slot is None:
            continue
        tail = dev.new() if p % 64 else None
        s = index.publish(lane, k, p, slot, kind, tail_device=tail, tail_device_tokens=p % 64)
        if s is None and tail is not None:
            dev.live.discard(tail)
        if s is not None and index.host is not None and index.transfers.plan_image_write(s):
            index.transfers.complete_image_write(s)
    if index.host is not None:
        index.transfers.complete_writes(index.transfers.plan_writes(lane))
    index.release(lane)
    dev.collect(index)
    index.check_integrity()
    return got


def cycle(index, dev, capacity: int, *, n: int = 14, size: int = 3000) -> list[int]:
    """Issue #37's cyclic scenario: n distinct prompts, then each again with 5 more tokens."""
    rng = random.Random(3)
    prompts = [toks(rng, size) for _ in range(n)]
    for p in prompts:
        serve(index, dev, p, capacity)
    return [serve(index, dev, p + toks(rng, 5), capacity) for p in prompts]


def test_ghosts_remember_counts_of_blocks_that_left() -> None:
    g = GhostBlocks()
    node = BlockNode(1, None, 0, 0xABC, 0, b"")
    node.uses = 3
    g.remember(node, tree_nodes=10)
    assert g.recall(0xABC) == Recalled(3, True) and g.recall(0xABC) == Recalled(0, False)
    for h in range(10_000):
        other = BlockNode(2, None, 0, h, 0, b"")
        other.uses = 1
        g.remember(other, tree_nodes=2000)
    # Recent: as many as the tree held at its largest (ARC's span, what the thrash meter reads);
    # counts: GHOST_SPAN times as many.
    assert len(g.recent) == 2000 and len(g) == GHOST_SPAN * 2000
    assert g.recall(9_999) == Recalled(1, True)  # left last
    assert g.recall(7_999) == Recalled(1, False)  # left 2,001 departures ago: a count, no thrash
    assert g.recall(0) == Recalled(0, False)  # forgotten


def test_the_meter_says_thrashing_only_under_pressure_and_without_hits() -> None:
    t = ThrashMeter()
    assert not t.thrashing  # nothing evicted yet: LRU's order
    t.note_eviction()
    assert t.thrashing  # evicting, nothing served: a scan's first pass
    t.note_request(1000, 900, tree_nodes=100)
    assert not t.thrashing  # hits dominate: recency works
    for _ in range(20):
        t.note_ghost_hit()
    assert t.thrashing  # 1,280 tokens recomputed that the cache held recently, 900 served
    for _ in range(100):  # traffic decays both
        t.note_request(100_000, 0, tree_nodes=100)
    assert t.ghost_tokens < 1 and t.hit_tokens < 1


def test_a_cycle_larger_than_the_device_keeps_a_stable_part() -> None:
    """14 prompts of 3,000 tokens through 16,384 device tokens, twice: LRU evicts what the next
    request needs (0 of 14); keeping residents on ties, four prompts stay (all that fits beside
    the one running)."""
    index, dev = make_index(slots=32, taps=2, ladder=4096, min_gap=2048), Device()
    got = cycle(index, dev, 16384)
    print(f"\ndevice-only cycle: {got}")
    assert sum(g > 0 for g in got) >= 4
    assert index.thrash.ghost_hits_total > 0


@pytest.mark.parametrize("host", [0, 400])
def test_without_the_rule_the_cycle_reuses_nothing(host: int) -> None:
    """The check that the scenarios bite: LRU's and GDSF's placement (never thrashing)."""
    index, dev = make_index(host_slabs=host, slots=32, taps=8 if host else 2), Device()
    index.thrash.enabled = False
    got = cycle(index, dev, 8192 if host else 16384)
    print(f"\nwithout the rule, host slabs {host}: {got}")
    assert sum(g > 0 for g in got) <= 2


def test_the_host_tier_keeps_a_stable_part_too() -> None:
    """A host tier of 24,000 tokens of slabs behind 8,192 device tokens: GDSF with L kept the
    last prompts written; counts keep the first ones, and round two restores them."""
    index, dev = make_index(host_slabs=400, slots=32, taps=8, slab_bytes=100), Device()
    got = cycle(index, dev, 8192)
    print(f"\nhost-tier cycle: {got}")
    assert sum(g > 0 for g in got) >= 5


def test_recency_traffic_keeps_lru_placement() -> None:
    """Conversations whose next turn comes while the cache still holds the last one: hits
    dominate, the cache never counts as thrashing, and every next turn resumes."""
    rng = random.Random(5)
    index, dev = make_index(slots=32, taps=2, ladder=4096, min_gap=2048), Device()
    convs = [toks(rng, 1000) for _ in range(6)]
    late = []
    for turn in range(6):
        for i, c in enumerate(convs):
            got = serve(index, dev, c, 16384)
            if turn >= 2:
                late.append(got)
            convs[i] = c + toks(rng, 200)
    assert not index.thrash.thrashing
    assert all(g >= 1000 for g in late), late
