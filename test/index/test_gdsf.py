"""Host eviction (spec §9.3, §13.1 Host GDSF): hand-computed values, dead KV first, L monotonic.

UNIT_COST makes C(s) the number of tokens between s and its nearest retained ancestor, and
restores free; images are 10 slabs of 100 B and every block slab is 100 B.
"""

from __future__ import annotations

import pytest
from helpers import Device, key, make_index, run

from sglang_hybrid.index import Residency, SnapshotKind
from sglang_hybrid.index.host_eviction import make_room

TRUNK = list(range(1, 129))  # blocks A0, A1
B = list(range(1000, 1128))  # blocks B2, B3
C = list(range(2000, 2064))  # block C2


def test_two_siblings_hand_computed_and_exclusive_path_freed() -> None:
    idx, dev = make_index(host_slabs=26, slots=1), Device()
    (s2,) = run(idx, dev, TRUNK + C + [9], taps=[192], endpoint=False)
    assert s2.h == pytest.approx(192 / 1300)  # A0 A1 C2 are all its own
    (s1,) = run(idx, dev, TRUNK + B + [9], taps=[256], endpoint=False)
    # s1 took s2's slot (host-backed, least recently hit); the trunk is now shared.
    assert s2.device_slot == -1 and s1.device_slot == 0
    assert s2.h == pytest.approx(192 / 1100)
    assert s1.h == pytest.approx(256 / 1200)
    assert idx.host.free == 1
    assert make_room(idx, 12)
    idx.check_integrity()
    c2 = s2.anchor
    assert s2.id not in idx.snapshots  # the lower H went, entirely (not on the device)
    assert c2.host_state is Residency.ABSENT  # its exclusive path became dead KV and was swept
    assert pytest.approx(192 / 1100) == idx.L
    assert s1.h == pytest.approx(256 / 1400)  # the trunk is s1's alone now
    assert idx.stats.host_gdsf_evicted == 1 and idx.stats.host_dead_swept == 1


def test_nested_ancestor_descendant() -> None:
    idx, dev = make_index(host_slabs=40, slots=4), Device()
    x = list(range(1, 300))
    (sa,) = run(idx, dev, x[:150], taps=[128], endpoint=False)
    (sb,) = run(idx, dev, x, taps=[256], endpoint=False, source="root")
    assert sb.ancestor is sa and not sa.superseded
    assert sa.h == pytest.approx(128 / 1000)  # X0 X1 are shared with sb
    assert sb.h == pytest.approx(128 / 1200)  # saves 256 - 128 tokens; X2 X3 are its own
    # The descendant is the cheaper one to lose.
    from sglang_hybrid.index.host_eviction import min_h_victim

    assert min_h_victim(idx) is sb


def test_frequency_multiplies_value() -> None:
    idx, dev = make_index(host_slabs=40, slots=4), Device()
    x = list(range(1, 300))
    (sa,) = run(idx, dev, x[:150], taps=[128], endpoint=False)
    run(idx, dev, x, taps=[256], endpoint=False, source="root")
    before = sa.h  # published with L = 0: C / Z
    run(idx, dev, x[:140] + [7, 7], endpoint=False)  # resumes from sa: one hit
    assert sa.hits == 1
    assert sa.h == pytest.approx(idx.L + 2 * before)


def test_dead_kv_is_reclaimed_before_any_snapshot() -> None:
    idx, dev = make_index(host_slabs=30, slots=4), Device()
    run(idx, dev, list(range(5000, 5300)), endpoint=False)  # 4 host blocks, no snapshot: dead
    (s,) = run(idx, dev, TRUNK + [3], taps=[128], endpoint=False)
    dead_before = len(idx.dead)
    assert dead_before == 4
    assert make_room(idx, idx.host.free + 3)
    assert s.id in idx.snapshots and s.host_state is Residency.RESIDENT
    assert len(idx.dead) == 1 and idx.stats.host_dead_swept == 3
    idx.check_integrity()


def test_dead_sweep_goes_leaves_first() -> None:
    idx, dev = make_index(host_slabs=30, slots=4), Device()
    run(idx, dev, list(range(5000, 5300)), endpoint=False)
    chain = sorted(idx.dead, key=lambda n: n.depth)
    idx.evict_device(10_000)  # host-backed: device copies dropped, nodes stay host-only
    dev.collect(idx)
    assert make_room(idx, idx.host.free + 1)
    # The deepest block went; its parents are intact.
    assert chain[-1].parent is None and all(n.parent is not None for n in chain[:-1])
    idx.check_integrity()


def test_superseded_goes_before_retained_and_L_is_monotonic() -> None:
    idx, dev = make_index(host_slabs=60, slots=4), Device()
    x = list(range(1, 400))
    (e1,) = run(idx, dev, x[:100])  # endpoint at 100
    run(idx, dev, x[:300])  # resumes from e1 and moves on: e1 superseded
    assert e1.superseded
    ls = [idx.L]
    while idx.snapshots:
        victim_superseded = any(s.superseded for s in idx.snapshots.values())
        n_before = {s.id for s in idx.snapshots.values()}
        if not make_room(idx, idx.host.free + 1):
            break
        gone = n_before - set(idx.snapshots)
        if victim_superseded and gone:
            assert e1.id in gone
        ls.append(idx.L)
        idx.check_integrity()
    assert ls == sorted(ls)


def test_image_write_displaces_only_snapshots_worth_no_more() -> None:
    idx, dev = make_index(host_slabs=20, slots=4), Device()
    (big,) = run(idx, dev, list(range(1, 400)), taps=[384], endpoint=False)
    assert big.host_state is Residency.RESIDENT and idx.host.free == 4  # 10 image + 6 blocks
    assert big.h == pytest.approx(384 / 1600)
    (small,) = run(idx, dev, list(range(7000, 7100)), taps=[64], endpoint=False, write=False)
    assert small.h < big.h
    assert idx.transfers.plan_image_write(small) is None  # would have to evict something worth more
    assert idx.stats.image_writes_refused == 1
    assert small.host_state is Residency.ABSENT and big.host_state is Residency.RESIDENT
    idx.check_integrity()


def test_size_counts_only_host_resident_exclusive_blocks() -> None:
    idx, dev = make_index(host_slabs=40, slots=4), Device()
    (s,) = run(
        idx,
        dev,
        list(range(1, 200)),
        taps=[128],
        kind=SnapshotKind.BOUNDARY,
        endpoint=False,
        write=False,
    )
    assert s.size == 1000  # nothing of its path is on the host yet
    k = key(list(range(1, 200)))
    lane = idx.open_lane(idx.match(k), s)
    idx.unpin_sources(lane)
    idx.transfers.complete_writes(idx.transfers.plan_writes(lane))
    idx.release(lane)
    assert s.size == 1000 + 2 * 100
    idx.check_integrity()
