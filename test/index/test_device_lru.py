"""Device LRU (spec §9.1, §13.1): tail-first, hits to MRU, backed first, pins respected."""

from __future__ import annotations

from helpers import Device, key, make_index, run

from sglang_hybrid.index import BlockNode, PromptKey


def _victims(idx) -> list[int]:
    """Depths of LRU entries in eviction order (backed list first)."""
    return [e.depth for e in (*idx.lru.backed, *idx.lru.unbacked) if isinstance(e, BlockNode)]


def test_release_appends_deepest_first_so_tails_leave_first() -> None:
    idx, dev = make_index(), Device()
    run(idx, dev, list(range(1, 320)), endpoint=False)
    assert _victims(idx) == [3, 2, 1, 0]


def test_hit_moves_path_to_mru() -> None:
    idx, dev = make_index(), Device()
    a = list(range(1, 200))
    b = list(range(500, 700))
    run(idx, dev, a, endpoint=False)
    run(idx, dev, b, endpoint=False)
    first_b = idx.match(key(b)).path
    assert next(iter(idx.lru.unbacked)) is idx.match(key(a)).path[-1]
    idx.touch(idx.match(key(a + [1])))
    order = list(idx.lru.unbacked)
    assert order[: len(first_b)] == list(reversed(first_b))  # b is now least recent
    assert order[-1] is idx.match(key(a)).path[0]  # shallowest of the hit is most recent


def test_backed_entries_are_consumed_before_unbacked() -> None:
    idx, dev = make_index(host_slabs=50), Device()
    a = list(range(1, 200))
    run(idx, dev, a, endpoint=False)  # written through: backed
    k = key(list(range(900, 1100)))
    lane = idx.open_lane(idx.match(k), None)
    idx.commit(lane, k, 200, lambda b: dev.new())
    idx.release(lane)  # not written: unbacked, and more recent than a's blocks
    idx.touch(idx.match(key(a + [1])))  # a's blocks become the most recent, but backed
    assert idx.evict_device(64) == 64
    dev.collect(idx)
    # The victim came from the backed list although it is the most recently used.
    assert idx.stats.device_evicted_backed == 1 and idx.stats.device_evicted_unbacked == 0
    idx.check_integrity()


def test_pinned_entries_are_never_returned() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(1, 200))
    run(idx, dev, ids, endpoint=False)
    k = PromptKey.from_ids(ids)
    m = idx.match(k)
    node = m.path[0]
    idx.transfers.pin_for_prefetch([node])  # a restore pin, as a prefetch takes
    idx.evict_device(10_000)
    dev.collect(idx)
    assert node.device is not None and node.parent is idx.tree.root
    idx.transfers.unpin_for_prefetch([node])
    idx.check_integrity()
