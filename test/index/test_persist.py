"""Export of the host tier as records and adoption into a fresh index (spec §5.5)."""

from __future__ import annotations

import random

from helpers import Device, key, make_index, run

from sglang_hybrid.index import PrefixIndex, Residency
from sglang_hybrid.index.persist import HostExport

R = Residency


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 5000) for _ in range(n)]


def populated(host_slabs: int = 400) -> PrefixIndex:
    index = make_index(host_slabs=host_slabs, slots=3)
    dev = Device()
    shared = ids(0, 256)
    # Two conversations over one preamble, each with a second turn; a retry; a short prompt
    # whose endpoint anchors at the root (tail only).
    a1 = shared + ids(1, 150)
    run(index, dev, a1, taps=[256])
    run(index, dev, a1 + ids(2, 100), taps=[320])
    b1 = shared + ids(3, 90)
    run(index, dev, b1, taps=[256])
    run(index, dev, ids(4, 40))
    run(index, dev, b1)
    return index


def saved_keys(index: PrefixIndex) -> set[tuple[bytes, int]]:
    """(path tokens + tail, hits) of every retained host-backed snapshot."""
    out = set()
    for s in index.snapshots.values():
        if s.superseded or s.host_state is not R.RESIDENT:
            continue
        path = b"".join(n.tokens for n in index.tree.path(s.anchor)) if s.anchor.depth >= 0 else b""
        out.add((path + s.tail, s.hits))
    return out


def fresh_like(index: PrefixIndex, host_slabs: int | None = None) -> PrefixIndex:
    assert index.host is not None
    return make_index(host_slabs=host_slabs or index.host.n_slabs, slots=3)


def test_round_trip_restores_every_saved_snapshot_host_only() -> None:
    index = populated()
    rec = index.export_host()
    assert rec.snapshots and rec.nodes
    # parents first, exactly the paths of the exported snapshots, no superseded snapshot
    assert all(r.parent < i for i, r in enumerate(rec.nodes))
    new = fresh_like(index)
    plan = new.plan_adopt(rec)
    assert len(plan.snapshots) == len(rec.snapshots)
    got = new.adopt_host(rec, plan)
    new.check_integrity()
    assert got.snapshots == len(rec.snapshots) and got.nodes == len(rec.nodes)
    assert new.tree.n_nodes == len(rec.nodes) and not new.dead  # no dead KV adopted
    assert saved_keys(new) == saved_keys(index)
    for s in new.snapshots.values():
        assert s.host_state is R.RESIDENT and s.device_state is R.ABSENT and s.device_slot < 0
        assert not s.superseded and (not s.tail or s.tail_host_state is R.RESIDENT)
    for n in new.tree.subtree_postorder(new.tree.root):
        if not n.is_root:
            assert n.host_state is R.RESIDENT and n.device_state is R.ABSENT
    # every copy lands in a distinct slab; record slabs are the old pool's
    assert len({dst for _, dst in got.copies}) == len(got.copies) == new.host.used  # type: ignore[union-attr]  # made with a host tier


def test_a_known_prompt_matches_the_adopted_snapshot() -> None:
    index = populated()
    new = fresh_like(index)
    new.adopt_host(index.export_host(), new.plan_adopt(index.export_host()))
    prompt = ids(0, 256) + ids(1, 150) + ids(2, 100) + ids(9, 30)
    old_m, new_m = index.match(key(prompt)), new.match(key(prompt))
    assert new_m.best is not None and old_m.best is not None
    assert new_m.best.frontier == old_m.best.frontier > 256
    assert new_m.best_device is None  # nothing is on the device after a restart
    # a request resuming from it restores and runs like any host source
    dev = Device()
    run(new, dev, prompt)
    new.check_integrity()


def test_superseded_snapshots_and_dead_kv_are_not_exported() -> None:
    index = populated()
    superseded = [s for s in index.snapshots.values() if s.superseded]
    assert superseded, "the scenario must supersede something"
    rec = index.export_host()
    retained = [s for s in index.snapshots.values() if not s.superseded]
    assert len(rec.snapshots) == len(retained) < len(index.snapshots)
    assert {(r.frontier, r.tail) for r in rec.snapshots} == {(s.frontier, s.tail) for s in retained}
    needed = set()
    for r in rec.snapshots:
        i = r.anchor
        while i >= 0:
            needed.add(i)
            i = rec.nodes[i].parent
    assert needed == set(range(len(rec.nodes)))  # only blocks some saved snapshot resumes through


def test_a_smaller_host_tier_keeps_whole_snapshots_by_density() -> None:
    index = populated()
    rec = index.export_host()
    image = index.host.image_slabs  # type: ignore[union-attr]  # populated() has a host tier
    # room for the cheapest snapshot alone plus a little: never a partial path
    new = fresh_like(index, host_slabs=image + 12)
    plan = new.plan_adopt(rec)
    assert 0 < len(plan.snapshots) < len(rec.snapshots)
    got = new.adopt_host(rec, plan)
    new.check_integrity()
    assert got.snapshots == len(plan.snapshots)
    for s in new.snapshots.values():
        assert all(n.host_state is R.RESIDENT for n in new.tree.path(s.anchor))
    # the densest snapshot is among those kept
    cost = new.valuer.cost

    def density(i: int) -> float:
        r = rec.snapshots[i]
        depth, j = 0, r.anchor
        while j >= 0:
            depth, j = depth + 1, rec.nodes[j].parent
        size = new.image_bytes + (new.slab_bytes if r.tail else 0) + depth * new.slab_bytes
        return (1 + r.hits) * cost.prefill_seconds(0, r.frontier) / size

    best = max(range(len(rec.snapshots)), key=density)
    fits = image + (1 if rec.snapshots[best].tail else 0) <= image + 12
    assert not fits or best in plan.snapshots


def _pin(index: PrefixIndex, *, expires: bool) -> tuple[bytes, int]:
    """Make the least dense pinnable snapshot durable; its (path + tail, hits) key."""
    from sglang_hybrid.index.durable import set_durable, why_not_pinnable

    s = min(
        (
            s
            for s in index.snapshots.values()
            if not s.superseded and not why_not_pinnable(index, s)
        ),
        key=lambda s: (s.frontier, s.id),
    )
    set_durable(index, s, True, expires=expires)
    path = b"".join(n.tokens for n in index.tree.path(s.anchor)) if s.anchor.depth >= 0 else b""
    return path + s.tail, s.hits


def durable_keys(index: PrefixIndex) -> set[tuple[bytes, int]]:
    out = set()
    for s in index.snapshots.values():
        if s.durable:
            path = (
                b"".join(n.tokens for n in index.tree.path(s.anchor))
                if s.anchor.depth >= 0
                else b""
            )
            out.add((path + s.tail, s.hits))
    return out


def test_a_durable_pin_is_kept_across_the_round_trip() -> None:
    """A client's pin without a TTL comes back pinned; one with a TTL (released by a timer of
    the previous server) comes back an ordinary snapshot."""
    index = populated()
    kept = _pin(index, expires=False)
    rec = index.export_host()
    assert sum(r.durable for r in rec.snapshots) == 1
    new = fresh_like(index)
    got = new.adopt_host(rec, new.plan_adopt(rec))
    new.check_integrity()
    assert durable_keys(new) == {kept} and got.durable == 1 and got.durable_dropped == 0
    assert not any(s.durable_expires for s in new.snapshots.values())

    index = populated()
    _pin(index, expires=True)
    rec = index.export_host()
    assert not any(r.durable for r in rec.snapshots)
    new = fresh_like(index)
    new.adopt_host(rec, new.plan_adopt(rec))
    assert durable_keys(new) == set()


def test_a_smaller_tier_keeps_the_durable_pin_before_denser_snapshots() -> None:
    """Pins are the highest retention: a snapshot a small host tier leaves out by density is
    kept once a client pinned it."""
    from sglang_hybrid.index.durable import set_durable, why_not_pinnable

    index = populated()
    image = index.host.image_slabs  # type: ignore[union-attr]  # populated() has a host tier
    room = image + 12
    rec = index.export_host()
    left_out = [
        i
        for i, r in enumerate(rec.snapshots)
        if i not in fresh_like(index, host_slabs=room).plan_adopt(rec).snapshots
        and image + (1 if r.tail else 0) + len(_path_of(rec, r.anchor)) <= room
    ]
    assert left_out, "the scenario must leave a snapshot that fits alone out by density"
    r = rec.snapshots[left_out[0]]
    (s,) = [
        s
        for s in index.snapshots.values()
        if (s.frontier, s.tail) == (r.frontier, r.tail) and not s.superseded
    ]
    assert why_not_pinnable(index, s) is None
    set_durable(index, s, True)
    rec = index.export_host()
    new = fresh_like(index, host_slabs=room)
    plan = new.plan_adopt(rec)
    assert next(i for i, x in enumerate(rec.snapshots) if x.durable) in plan.snapshots
    got = new.adopt_host(rec, plan)
    new.check_integrity()
    assert got.durable == 1 and got.durable_dropped == 0
    assert [(x.frontier, x.tail) for x in new.snapshots.values() if x.durable] == [
        (r.frontier, r.tail)
    ]


def _path_of(rec: HostExport, anchor: int) -> list[int]:
    out, i = [], anchor
    while i >= 0:
        out.append(i)
        i = rec.nodes[i].parent
    return out


def test_a_tier_too_small_for_any_snapshot_plans_nothing() -> None:
    index = populated()
    rec = index.export_host()
    new = make_index(host_slabs=index.host.image_slabs + 1, slots=3)  # type: ignore[union-attr]  # as above
    deep_only = HostExport(rec.nodes, [r for r in rec.snapshots if r.anchor >= 1])
    plan = new.plan_adopt(deep_only)
    assert plan.snapshots == [] and plan.nodes == [] and plan.slabs == 0
    new.adopt_host(deep_only, plan)
    new.check_integrity()
    assert new.tree.n_nodes == 0


def test_adopt_refuses_records_that_cannot_form_an_index() -> None:
    import pytest

    from sglang_hybrid.index.persist import AdoptError

    index = populated()
    rec = index.export_host()
    new = fresh_like(index)
    bad = HostExport(rec.nodes, [*rec.snapshots, rec.snapshots[0]])  # a repeated snapshot
    with pytest.raises(AdoptError):
        new.adopt_host(bad, new.plan_adopt(bad))


def _slabs(rec: HostExport) -> int:
    return len(rec.nodes) + sum(len(r.image_slabs) + (r.tail_slab >= 0) for r in rec.snapshots)


def test_a_save_takes_device_only_and_superseded_snapshots_within_the_budget() -> None:
    """At an orderly stop (issue #38): snapshots whose image, tail or blocks live only on the
    device, and superseded ones, are saved too, densest first (retained before superseded)
    within the host tier's size; their slabs are named by a source to read from the device."""
    from sglang_hybrid.index.persist import SOURCE_BLOCK, SOURCE_IMAGE, export_for_save

    index = populated()
    dev = Device()
    # A third conversation on the preamble never written through: its blocks past the
    # preamble, its tap and its endpoint are on the device only.
    run(index, dev, ids(0, 256) + ids(5, 200), taps=[320], write=False)
    host = index.host
    assert host is not None
    everything = export_for_save(index, host.n_slabs)
    superseded = sum(1 for s in index.snapshots.values() if s.superseded)
    assert superseded and everything.device_snapshots >= 2 and everything.left_out == 0
    assert len(everything.records.snapshots) == len(index.snapshots)  # all complete here
    assert len(everything.records.snapshots) > len(index.export_host().snapshots)
    kinds = {src.what for src in everything.device.values()}
    assert kinds >= {SOURCE_BLOCK, SOURCE_IMAGE}
    assert min(everything.device) == host.n_slabs  # past every host slab id
    used = {r.slab for r in everything.records.nodes} | {
        x for r in everything.records.snapshots for x in (*r.image_slabs, r.tail_slab) if x >= 0
    }
    assert set(everything.device) <= used
    # The records adopt like a host export (the bytes are the caller's to copy).
    new = fresh_like(index)
    got = new.adopt_host(everything.records, new.plan_adopt(everything.records))
    new.check_integrity()
    assert got.snapshots == len(everything.records.snapshots)
    # A tier smaller than the content: bounded, densest first, retained before superseded.
    budget = host.image_slabs * 3 + 10
    small = export_for_save(index, budget)
    assert 0 < len(small.records.snapshots) < len(everything.records.snapshots)
    assert _slabs(small.records) <= budget and small.left_out > 0
    # Retained before superseded: with room for one snapshot and its path, a retained one.
    one = export_for_save(index, host.image_slabs + 1 + 8)
    (r,) = one.records.snapshots
    (s,) = [x for x in index.snapshots.values() if (x.frontier, x.tail) == (r.frontier, r.tail)]
    assert not s.superseded
