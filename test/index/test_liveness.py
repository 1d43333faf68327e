"""Liveness counts and losing the last copy (spec §9.4, §13.1 Liveness)."""

from __future__ import annotations

from helpers import Device, key, make_index, run

from sglang_hybrid.index import Residency


def _count_below(idx, node) -> int:
    return sum(1 for s in idx.snapshots.values() if node in idx.tree.path(s.anchor))


def test_counts_follow_interleaved_publish_evict_and_deletion() -> None:
    idx, dev = make_index(host_slabs=0, slots=6), Device()
    a = list(range(1, 400))
    b = a[:200] + list(range(5000, 5200))
    run(idx, dev, a, taps=[128, 256])
    run(idx, dev, b, taps=[320])
    shared = idx.match(key(a)).path[1]
    assert _count_below(idx, shared) == 5
    # Per branch: the tap anchored on block 1 itself, and block 2's subtree.
    assert shared.live_snapshots_below == 2

    def zero_iff_no_snapshot_below() -> None:
        for n in idx.tree.subtree_postorder(idx.tree.root):
            if n.parent is not None:
                assert (n.live_snapshots_below == 0) == (_count_below(idx, n) == 0)

    zero_iff_no_snapshot_below()
    # Device pressure without a host: unbacked eviction deletes b's leaf subtree first.
    freed = idx.evict_device(64)
    dev.collect(idx)
    idx.check_integrity()
    assert freed >= 64 and idx.stats.device_evicted_unbacked >= 1
    zero_iff_no_snapshot_below()


def test_losing_the_last_copy_deletes_exactly_the_subtree_snapshots() -> None:
    idx, dev = make_index(host_slabs=0, slots=8), Device()
    trunk = list(range(1, 257))  # 4 blocks
    left = trunk + list(range(700, 830))
    right = trunk + list(range(900, 1030))
    other = list(range(3000, 3200))
    run(idx, dev, left, taps=[256, 320])
    run(idx, dev, right, taps=[320])
    run(idx, dev, other, taps=[128])
    n_left_right = len(idx.snapshots)
    node3 = idx.match(key(trunk + [1])).path[3]  # block 3, parent of both branches
    below = {s.id for s in idx.snapshots.values() if node3 in idx.tree.path(s.anchor)}
    kept = {s.id for s in idx.snapshots.values()} - below
    idx.delete_subtree(node3)
    dev.collect(idx)
    idx.check_integrity()
    assert set(idx.snapshots) == kept and len(kept) < n_left_right
    assert idx.match(key(other + [1])).best is not None
    assert len(idx.match(key(left + [1])).path) == 3


def test_active_path_is_never_deleted_by_pressure() -> None:
    idx, dev = make_index(host_slabs=0), Device()
    ids = list(range(1, 300))
    k = key(ids)
    lane = idx.open_lane(idx.match(k), None)
    idx.commit(lane, k, 299, lambda b: dev.new())
    assert idx.evict_device(10_000) == 0  # everything is pinned by the lane
    assert all(n.device_state is Residency.RESIDENT for n in lane.path)
    idx.release(lane)
    assert idx.evict_device(10_000) == 4 * 64
    dev.collect(idx)
    idx.check_integrity()
    assert idx.tree.n_nodes == 0
