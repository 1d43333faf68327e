"""The exclusive host (``index/demotion.py``): duplicates go first, demotion ahead of eviction.

Blocks are 64 tokens; a block slab is 100 B and an image 10 slabs. ``chunk=64, concurrency=1``
makes the demotion reserve 2 * (64 + 64) = 256 tokens: four blocks.
"""

from __future__ import annotations

from helpers import Device, key, make_index, run

from sglang_hybrid.index import BlockNode, Residency
from sglang_hybrid.index.demotion import demotion_candidates

A = list(range(1, 514))  # 8 blocks and a token; a tap at 512 anchors on the 8th
B = list(range(1000, 1384))  # 6 blocks, no snapshot


def _index(exclusive: bool):  # type: ignore[no-untyped-def]
    return make_index(
        host_slabs=20, slots=4, host_exclusive=exclusive, chunk=64, concurrency=1
    ), Device()


def _path(idx, ids: list[int]) -> list[BlockNode]:  # type: ignore[no-untyped-def]
    m = idx.match(key(ids))
    return list(m.path)


def _next_victims_unbacked():  # type: ignore[no-untyped-def]
    """A's shallow blocks device-only and next to go (step 0 gave up their host copies, the
    backed blocks before them evicted)."""
    idx, dev = _index(True)
    run(idx, dev, A, taps=[512], endpoint=False)
    run(idx, dev, B, endpoint=False)
    idx.evict_device(10 * 64)
    dev.collect(idx)
    return idx, dev


def test_reserve_follows_chunk_and_concurrency() -> None:
    idx, _ = _index(True)
    assert idx.config.demote_reserve_tokens == 256
    assert make_index(host_slabs=20).config.demote_reserve_tokens == 0  # not exclusive
    assert make_index(host_exclusive=True).config.demote_reserve_tokens == 0  # no host


def test_host_gives_up_copies_the_device_holds_before_any_snapshot() -> None:
    for exclusive in (False, True):
        idx, dev = _index(exclusive)
        (sa,) = run(idx, dev, A, taps=[512], endpoint=False)
        assert idx.host.free == 2  # 8 blocks and a 10-slab image
        run(idx, dev, B, endpoint=False)  # its 6 blocks need 4 more slabs
        path = _path(idx, A)
        if not exclusive:  # GDSF gave up A's image (it keeps its device slot)
            assert idx.stats.host_gdsf_evicted == 1 and sa.host_state is Residency.ABSENT
            assert idx.stats.host_duplicates_dropped == 0
            continue
        # Four duplicates went instead, from the end the device keeps longest (the shallowest
        # blocks: a release enters its path deepest first), leaving the reserve backed.
        assert idx.stats.host_gdsf_evicted == 0 and sa.host_state is Residency.RESIDENT
        assert idx.stats.host_duplicates_dropped == 4
        assert [n.host_state for n in path] == [Residency.ABSENT] * 4 + [Residency.RESIDENT] * 4
        assert all(n.device_state is Residency.RESIDENT for n in path)
        assert all(idx.lru.is_backed(n) is False for n in path[:4])
        idx.check_integrity()


def test_demoted_blocks_are_evicted_as_bookkeeping() -> None:
    idx, dev = _index(True)
    (sa,) = run(idx, dev, A, taps=[512], endpoint=False)
    run(idx, dev, B, endpoint=False)
    path = _path(idx, A)
    assert demotion_candidates(idx) == []  # the backed list covers the reserve
    idx.evict_device(10 * 64)  # A's deep blocks and B's: all backed
    dev.collect(idx)
    assert idx.stats.device_evicted_unbacked == 0
    # What the next pass would evict is now unbacked: A's shallow blocks, oldest first.
    assert demotion_candidates(idx) == path[:4][::-1]
    tick = idx.tick
    planned = idx.transfers.plan_demotions()
    assert [n for n, _ in planned] == path[:4][::-1]
    # In flight: Filling on the host, out of the LRU (no eviction frees the pages read).
    assert all(n.host_state is Residency.FILLING and n not in idx.lru for n in path[:4])
    assert idx.evict_device(1 << 20) == 0
    idx.check_integrity()
    idx.transfers.complete_demotions(planned, tick)
    assert idx.stats.blocks_demoted == 4
    assert list(idx.lru.backed) == path[:4][::-1]  # the evicting end, oldest first
    idx.check_integrity()
    idx.evict_device(4 * 64)
    dev.collect(idx)
    # Nothing was lost: A's whole path and its snapshot are on the host alone.
    assert idx.stats.device_evicted_unbacked == 0 and sa.id in idx.snapshots
    assert all(n.host_state is Residency.RESIDENT and not n.on_device for n in path)
    m = idx.match(key(A + [7]))
    assert m.best is sa and m.best.frontier == 512
    idx.check_integrity()


def test_without_demotion_the_same_eviction_loses_the_path() -> None:
    """The counterfactual: the duplicates were given up and nothing wrote them back."""
    idx, dev = _index(True)
    (sa,) = run(idx, dev, A, taps=[512], endpoint=False)
    run(idx, dev, B, endpoint=False)
    idx.evict_device(14 * 64)
    dev.collect(idx)
    assert idx.stats.device_evicted_unbacked >= 1 and sa.id not in idx.snapshots
    idx.check_integrity()


def test_a_block_deleted_while_demoting_discards_its_copy() -> None:
    idx, dev = _next_victims_unbacked()
    path = _path(idx, A)
    tick = idx.tick
    planned = idx.transfers.plan_demotions()
    assert len(planned) == 4
    used = idx.host.used
    idx.delete_subtree(path[0])  # e.g. an unpinned ancestor lost its last copy (§9.4)
    dev.collect(idx)
    assert idx.host.used < used  # the demotions' slabs went with the blocks
    idx.transfers.complete_demotions(planned, tick)  # lands in slabs nobody owns: ignored
    assert idx.stats.blocks_demoted == 0
    idx.check_integrity()


def test_a_block_hit_while_demoting_lands_at_the_mru_end() -> None:
    """A request reaching blocks whose demotion is in flight: its release cannot put them back
    in the LRU (their host copy is Filling), so the landing does, where the hit would have."""
    idx, dev = _next_victims_unbacked()
    shallow = _path(idx, A)[:4]
    tick = idx.tick
    planned = idx.transfers.plan_demotions()
    assert [n for n, _ in planned] == shallow[::-1]
    run(idx, dev, A[:129], endpoint=False, write=False)  # commits through the first two
    assert all(n.last_access > tick and n not in idx.lru for n in shallow[:2])
    idx.transfers.complete_demotions(planned, tick)
    # The two not hit at the evicting end, deepest first; the two hit at the MRU end.
    assert list(idx.lru.backed) == [shallow[3], shallow[2], shallow[0], shallow[1]]
    idx.check_integrity()


def test_a_failed_demotion_leaves_the_blocks_unbacked_at_the_evicting_end() -> None:
    idx, _ = _next_victims_unbacked()
    free = idx.host.free
    planned = idx.transfers.plan_demotions()
    idx.transfers.abort_demotions(planned, idx.tick)
    assert idx.host.free >= free  # every slab it took went back
    assert list(idx.lru.unbacked)[:4] == [n for n, _ in planned]
    assert all(n.host_state is Residency.ABSENT for n, _ in planned)
    idx.check_integrity()


def test_dead_blocks_leave_the_device_first() -> None:
    """With an exclusive host, blocks no live snapshot lies below go before any other: the
    device's share of the two tiers is what requests can resume through."""
    for exclusive in (False, True):
        idx, dev = _index(exclusive)
        (sa,) = run(idx, dev, A, taps=[512], endpoint=False, write=False)  # 8 live, unbacked
        run(idx, dev, B, endpoint=False, write=False)  # 6 newer blocks, no snapshot: dead
        dead = _path(idx, B)
        assert all(n.live_snapshots_below == 0 for n in dead)
        idx.evict_device(6 * 64)
        dev.collect(idx)
        left = [n for n in _path(idx, A) if n.on_device]
        if not exclusive:  # LRU order: A was older; its deepest blocks went, and its snapshot
            assert len(left) < 8 and sa.id not in idx.snapshots and _path(idx, B)
            continue
        assert len(left) == 8 and sa.id in idx.snapshots and not _path(idx, B)  # B's went
        # A snapshot dying makes its exclusive path dead: it moves to the dead list at once.
        idx.delete_snapshot(sa)
        assert all(n in idx.lru.dead for n in _path(idx, A))
        idx.check_integrity()
