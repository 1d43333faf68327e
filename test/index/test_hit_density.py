"""The host tier's learned order (``hit_density``, issue #37): densities from reuse ages, GDSF
before evidence, the victim among a deterministic sample, the same on every rank."""

from __future__ import annotations

import pytest
from helpers import Device, make_index, run

from sglang_hybrid.index import ConfigError, SnapshotKind, resolve_config
from sglang_hybrid.index.hit_density import (
    EXPLORE_EVERY,
    GDSF,
    LEARNED,
    SAMPLE,
    WARM,
    HitDensity,
    age_bin,
    freq_class,
)
from sglang_hybrid.index.host_eviction import density_victim, make_room, min_h_victim
from sglang_hybrid.index.source_hits import ENDPOINT


def _late_reuse(d: HitDensity, key: int = ENDPOINT, n: int = WARM) -> None:
    """Snapshots resumed from 40-60 requests after their last use, or never (evicted at 200)."""
    for i in range(n):
        if i % 4:
            d.note_hit(key, 0, 40 + i % 21)
        else:
            d.note_eviction(key, 0, 0, 200, 0, LEARNED)


def test_reuse_that_comes_late_values_the_old_above_the_young() -> None:
    d = HitDensity()
    _late_reuse(d)
    assert d.ready
    young, due, dead = (d.density(ENDPOINT, 0, a) for a in (2, 38, 300))
    assert due > young > 0.0  # a snapshot nearly due is worth more than one just used
    assert dead == 0.0  # older than any resume ever seen


def test_reuse_that_decays_with_age_keeps_lru_order() -> None:
    d = HitDensity()
    _pareto(d)
    ages = [1, 4, 16, 64, 200]
    values = [d.density(ENDPOINT, 0, a) for a in ages]
    assert values == sorted(values, reverse=True)


def test_a_class_with_few_events_reads_the_pool() -> None:
    d = HitDensity()
    _late_reuse(d)  # endpoints only
    d.note_hit(3, 0, 1)  # one event of another origin
    assert d.density(3, 0, 50) == d.density(ENDPOINT, 0, 50)
    assert d.density(3, 2, 50) == d.density(ENDPOINT, 2, 50)  # no frequency class: all of them


def test_a_snapshot_resumed_from_often_is_valued_by_its_own_class() -> None:
    """LHD's frequency classes: a prefix many requests resume from is resumed from again soon,
    while most snapshots of the same origin never are (GDSF's frequency term, learned)."""
    d = HitDensity()
    for i in range(WARM):
        d.note_eviction(ENDPOINT, 0, 0, 30, 0, GDSF)  # most: never resumed from, evicted at 30
        if i % 2:
            d.note_hit(ENDPOINT, 2 + i % 5, 4)  # a few: resumed from again and again, soon
    assert d.density(ENDPOINT, 3, 2) > 0.0 == d.density(ENDPOINT, 0, 2)
    assert d.density(ENDPOINT, 3, 8) == 0.0  # past every resume seen


def test_a_conversation_counts_its_turns_across_its_snapshots() -> None:
    """Each turn publishes a new endpoint, so a snapshot's own hits never pass one: LHD's
    frequency is its lineage's (the turns before it, a prompt's repeats), inherited from the
    snapshot its lane resumed from."""
    idx, dev = make_index(host_slabs=400, slots=4), Device()
    prompt = list(range(1, 130))
    ends = []
    for turn in range(4):
        (s,) = run(idx, dev, prompt)
        assert s.kind is SnapshotKind.ENDPOINT and s.frontier == len(prompt)
        ends.append(s)
        prompt = prompt + [1000 * (turn + 1) + t for t in range(70)]  # the next turn continues it
    assert [s.inherited for s in ends] == [0, 1, 2, 3]
    assert [s.lineage_hits for s in ends] == [1, 2, 3, 3]  # the last one not resumed from yet
    idx.check_integrity()
    # Classes by lineage hits: one each up to 3, then wider (a session's 10th turn is like its 9th).
    hits = (0, 1, 2, 3, 4, 5, 6, 8, 9, 15, 16, 1000)
    assert tuple(map(freq_class, hits)) == (0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7)


def test_age_bins_resolve_short_and_long_ages() -> None:
    assert [age_bin(a) for a in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert age_bin(1000) < age_bin(1100) < age_bin(1300)  # eight bins an octave
    assert age_bin(1 << 30) == age_bin(1 << 31)  # the last bin is open


def _conversations(
    n: int, *, host_slabs: int, image_bytes: int = 1000, host_order: str = "duel"
) -> tuple:
    """``n`` host-resident endpoints of distinct two-block prompts, one request apart."""
    idx = make_index(host_slabs=host_slabs, slots=1, image_bytes=image_bytes, host_order=host_order)
    dev = Device()
    ends = []
    for i in range(n):
        (s,) = run(idx, dev, [10_000 * (i + 1) + t for t in range(129)])
        assert s.kind is SnapshotKind.ENDPOINT
        ends.append(s)
    for s in ends:  # host copies only: equal GDSF values, so GDSF's order is recency
        if s.image_on_device:
            idx.drop_image_device(s)
    idx.evict_device(1 << 30, backed_only=True)
    dev.collect(idx)
    return idx, dev, ends


def test_gdsf_decides_until_the_ages_are_learned() -> None:
    idx, _, _ = _conversations(4, host_slabs=60)
    assert idx.density is not None and not idx.density.ready
    expected = min_h_victim(idx)
    assert expected is not None
    assert make_room(idx, idx.host.free + 1)
    assert expected.id not in idx.snapshots or not expected.image_on_host


def _pareto(d: HitDensity) -> None:
    for i in range(WARM):  # most resumes come soon, a few very late
        d.note_hit(ENDPOINT, 0, int(((i + 0.5) / WARM) ** -1.0))


def test_the_learned_order_follows_the_traffic_s_reuse_ages() -> None:
    """Four conversations of equal C / Z, one request apart: where reuse comes late the host
    lets the one used last go; where it decays with age, the one used first."""
    for learn, goes in ((_late_reuse, -1), (_pareto, 0)):
        idx, _, ends = _conversations(5, host_slabs=80)
        assert idx.density is not None
        learn(idx.density)
        idx.density.regret[GDSF] = 1.0  # GDSF's victims came back early: the learned order decides
        keep = ends[:4]
        idx.delete_snapshot(ends[4])  # the youngest, its prior lowest: out of the way
        while idx.dead:  # its exclusive path: swept before any snapshot goes
            assert make_room(idx, idx.host.free + 1)
        assert idx.stats.host_gdsf_evicted == 0
        idx.check_integrity()
        victim = density_victim(idx)
        assert victim is keep[goes], (learn.__name__, victim)
        assert make_room(idx, idx.host.free + 1)
        assert idx.stats.host_gdsf_evicted == 1
        assert victim.id not in idx.snapshots or not victim.image_on_host
        assert all(s.image_on_host for s in keep if s is not victim)
        idx.check_integrity()


def test_an_operator_fixes_the_host_order() -> None:
    """``--hybrid-host-order``: 'gdsf' keeps the spec's order where the duel would follow the
    learned one (GDSF's victims came back early), 'learned' decides every step once the ages are
    learned (no exploration steps); GDSF decides before that under every choice."""
    for order in ("gdsf", "learned"):
        idx, _, ends = _conversations(5, host_slabs=80, host_order=order)
        d = idx.density
        assert d is not None and d.order() == GDSF  # nothing learned yet
        _pareto(d)
        d.regret[GDSF] = 1.0
        want = GDSF if order == "gdsf" else LEARNED
        assert {d.order() for _ in range(2 * EXPLORE_EVERY)} == {want}
        keep = ends[:4]
        idx.delete_snapshot(ends[4])
        while idx.dead:
            assert make_room(idx, idx.host.free + 1)
        by_gdsf, by_density = min_h_victim(idx), density_victim(idx)
        assert by_gdsf is not by_density  # the two orders disagree here
        victim = by_gdsf if order == "gdsf" else by_density
        assert victim is not None
        assert make_room(idx, idx.host.free + 1)
        assert idx.stats.host_gdsf_evicted == 1
        assert idx.stats.host_learned_evicted == (order == "learned")
        assert victim.id not in idx.snapshots or not victim.image_on_host, order
        assert all(s.image_on_host for s in keep if s is not victim)
        idx.check_integrity()
    with pytest.raises(ValueError, match="give one of duel, gdsf, learned"):
        HitDensity("lru")
    with pytest.raises(ConfigError, match="--hybrid-host-order 'lru': give one of"):
        resolve_config(concurrency=1, chunk_tokens=1, host_order="lru")


def test_a_snapshot_one_request_reached_goes_before_one_more_reached() -> None:
    """The learned order's protected class: whatever the densities say, a snapshot whose anchor
    block a second request reached (ghost counts included) outlives those reached once; among
    protected ones the densities decide again."""
    idx, _, ends = _conversations(5, host_slabs=80)
    assert idx.density is not None
    _late_reuse(idx.density)
    idx.density.regret[GDSF] = 1.0
    keep = ends[:4]
    idx.delete_snapshot(ends[4])
    while idx.dead:
        assert make_room(idx, idx.host.free + 1)
    assert density_victim(idx) is keep[-1]  # late reuse: the one used last goes
    # A second request reached its block (or a ghost said one had before it left the tree).
    keep[-1].anchor.uses = 2
    assert density_victim(idx) is keep[-2]
    for s in keep:
        s.anchor.uses = 2
    assert density_victim(idx) is keep[-1]
    assert make_room(idx, idx.host.free + 1)
    assert not keep[-1].image_on_host or keep[-1].id not in idx.snapshots
    idx.check_integrity()


def test_the_sample_is_bounded_and_the_same_on_every_rank() -> None:
    n = SAMPLE + 40  # more candidates than a sample holds: the draw is exercised
    victims = []
    for _ in range(2):  # two ranks, the same requests
        idx, _, _ = _conversations(n, host_slabs=4 * n + 8, image_bytes=100)
        assert idx.density is not None
        _late_reuse(idx.density)
        idx.density.regret[GDSF] = 1.0
        assert idx.gdsf is not None
        drawn = idx.gdsf.sample(SAMPLE, lambda s: True)
        assert len(drawn) == SAMPLE and len({s.id for s in drawn}) == SAMPLE
        victims.append([])
        for _ in range(5):
            v = density_victim(idx)
            assert v is not None
            victims[-1].append(v.id)
            assert make_room(idx, idx.host.free + 1)
            idx.check_integrity()
    assert victims[0] == victims[1]


def test_an_evicted_snapshot_resumed_later_counts_as_the_hit_it_would_have_been() -> None:
    """Ghosts: an order that evicts at some age never sees a hit beyond it, unless the evicted
    snapshot's anchor block, committed again, says when it would have been resumed from."""
    idx, dev, ends = _conversations(4, host_slabs=60)
    d = idx.density
    assert d is not None
    victim = min_h_victim(idx)
    assert victim is not None and victim.anchor.lookup_hash
    while victim.id in idx.snapshots:
        assert make_room(idx, idx.host.free + 1)
    assert victim.anchor.lookup_hash in d.ghosts
    evicted = sum(sum(h) for h in d.evictions)
    assert evicted > 0 and sum(sum(h) for h in d.hits) == 0
    i = ends.index(victim)
    for _ in range(3):  # three other requests: the conversation comes back at age 3 + 4 - i
        run(idx, dev, [900_000 + t for t in range(70)], endpoint=False)
    run(idx, dev, [10_000 * (i + 1) + t for t in range(129)] + [5, 6])  # the next turn
    assert victim.anchor.lookup_hash not in d.ghosts
    assert sum(sum(h) for h in d.evictions) == evicted - 4  # its four classes
    assert sum(sum(h) for h in d.hits) >= 4
    idx.check_integrity()


def test_the_orders_duel_by_their_victims_early_returns() -> None:
    """The order whose victims come back sooner than the cache's usual eviction age loses; the
    other one still decides every EXPLORE_EVERY-th step, so it keeps being measured."""
    d = HitDensity()
    _late_reuse(d)  # ready; its evictions were the learned order's, at age 200
    assert d.preferred() == GDSF  # no early return yet: the spec's order
    now = 1_000
    for i in range(40):  # a quarter of GDSF's victims come back 5 requests after eviction
        d.note_eviction(ENDPOINT, 0, now - 100, now, 10_000 + i, GDSF)
        d.recall(10_000 + i, now + (5 if i % 4 == 0 else 10_000))
    assert d.regret[GDSF] > 0 == d.regret[LEARNED]
    assert d.preferred() == LEARNED
    orders = [d.order() for _ in range(4 * EXPLORE_EVERY)]
    assert orders.count(GDSF) == 4 and orders.count(LEARNED) == 4 * EXPLORE_EVERY - 4
    for i in range(400):  # now the learned order's victims come back at once
        d.note_eviction(ENDPOINT, 0, now - 100, now, 20_000 + i, LEARNED)
        d.recall(20_000 + i, now + 1)
    assert d.preferred() == GDSF


def test_the_learned_order_survives_a_restart_as_plain_values() -> None:
    """``export_state`` / ``restore_state`` (the cache file's header): a fresh HitDensity takes
    the histograms, the duel and the ghosts, the ghosts' times rebased on the new request count,
    and ranks exactly as the saved one; a state of another shape or out of range is refused
    with nothing changed."""
    import json

    d = HitDensity()
    _late_reuse(d)
    d.note_eviction(ENDPOINT, 1, 90, 100, 0xABC, LEARNED)  # a ghost: used at 90, evicted at 100
    d.regret[GDSF] = 2.0
    saved = json.loads(json.dumps(d.export_state(now=120)))  # through JSON, as the file does
    e = HitDensity()
    e.restore_state(saved, now=5)  # a restarted index has counted 5 requests
    assert e.ready and e.events == d.events and e.preferred() == d.preferred()
    for key, hits, age in ((ENDPOINT, 0, 2), (ENDPOINT, 0, 38), (ENDPOINT, 1, 50), (3, 2, 7)):
        assert e.density(key, hits, age) == d.density(key, hits, age)
    assert e.ghosts[0xABC][2] == 90 - 120 + 5 and e.ghosts[0xABC][5] == 100 - 120 + 5
    d.recall(0xABC, 130)  # the same return, 10 requests after the save, on both
    e.recall(0xABC, 15)
    assert e.density(ENDPOINT, 1, 40) == d.density(ENDPOINT, 1, 40)
    before = e.export_state(now=15)
    for bad in (
        {**saved, "shape": [1, 2]},
        {**saved, "hits": [[10**6, 0, 1.0]]},
        {**saved, "hits": [[0, 0, -1.0]]},
        {**saved, "mass": [0.0]},
        {k: v for k, v in saved.items() if k != "ghosts"},
    ):
        with pytest.raises(ValueError):
            e.restore_state(bad, now=15)
        assert e.export_state(now=15) == before
