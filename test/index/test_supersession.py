"""Supersession and device snapshot slots (spec §9.2-9.3, §13.1 Supersession and admission)."""

from __future__ import annotations

import pytest
from helpers import Device, key, make_index, run

from sglang_hybrid.index import Residency, SnapshotKind
from sglang_hybrid.index.device_slots import SlotSource
from sglang_hybrid.index.taps import TapSource

X = list(range(1, 1000))


def test_lineage_supersedes_previous_and_a_hit_retains_it() -> None:
    idx, dev = make_index(host_slabs=200), Device()
    (e1,) = run(idx, dev, X[:100])
    assert not e1.superseded
    out = run(idx, dev, X[:200])  # turn 2 resumes from e1 and publishes its endpoint
    assert e1.superseded and out[-1].ancestor is e1
    # A retry of turn 2 with another continuation resumes from e1 again: retained...
    m = idx.match(key(X[:100] + [5, 5, 5]))
    assert m.best is e1
    lane = idx.open_lane(m, m.best)
    assert not e1.superseded and e1.hits == 2  # turn 2 was the first hit
    idx.release(lane)
    idx.check_integrity()
    # ...until that lineage moves on.
    run(idx, dev, X[:100] + [5] * 80)
    assert e1.superseded
    idx.check_integrity()


def test_taps_in_one_prompt_supersede_the_previous_tap_but_not_the_last() -> None:
    idx, dev = make_index(host_slabs=200, slots=6), Device()
    t1, t2, end = run(idx, dev, X[:300], taps=[128, 256])
    assert t1.superseded and not t2.superseded and not end.superseded


@pytest.mark.parametrize("origin", [TapSource.LADDER, TapSource.FOLLOWUP])
def test_ladder_and_followup_taps_are_not_superseded_by_the_same_prompts_later_taps(
    origin: TapSource,
) -> None:
    # Both are placed for a later prompt that shares this one's prefix and leaves it before the
    # end: the prompt's deeper taps cannot serve that prompt.
    idx, dev = make_index(host_slabs=200, slots=6), Device()
    t1, t2, end = run(idx, dev, X[:300], taps=[128, 256], origin=origin)
    assert not t1.superseded and not t2.superseded and not end.superseded
    # A later prompt that leaves this one between the two taps resumes from the first.
    m = idx.match(key(X[:200] + [7] * 70))
    assert m.best is t1
    # The lineage rule still holds: a request resuming from such a tap supersedes it.
    lane = idx.open_lane(m, m.best)
    idx.release(lane)
    run(idx, dev, X[:200] + [7] * 70)
    assert t1.superseded
    idx.check_integrity()


def test_boundary_superseded_only_while_the_tree_below_is_a_single_chain() -> None:
    idx, dev = make_index(host_slabs=400, slots=8), Device()
    (b,) = run(idx, dev, X[:130], taps=[128], endpoint=False, kind=SnapshotKind.BOUNDARY)
    run(idx, dev, X[:300])  # continues from b on a single chain: b is superseded
    assert b.superseded
    run(idx, dev, X[:128] + [7] * 130)  # another conversation diverges below b (hit: retained)
    assert not b.superseded
    run(idx, dev, X[:400])  # continues from b again: the tree below b has forked
    assert not b.superseded
    idx.check_integrity()


def test_slot_order_superseded_then_device_only_then_host_backed() -> None:
    idx, dev = make_index(host_slabs=0, slots=2), Device()
    (e1,) = run(idx, dev, X[:100])
    (e2,) = run(idx, dev, X[:200])  # supersedes e1
    assert e1.superseded and idx.slots.free == 0
    choice = idx.slots.choose(new_priority=0.0)
    assert choice is not None and choice.source is SlotSource.SUPERSEDED and choice.victim is e1
    (e3,) = run(idx, dev, list(range(5000, 5090)))
    assert e1.id not in idx.snapshots  # device-only and superseded: deleted with its slot
    # Both remaining owners are device-only and retained: value decides, only if worth as much.
    low = min((e2, e3), key=lambda s: s.h)
    assert idx.slots.choose(new_priority=low.h - 1e-9) is None
    choice = idx.slots.choose(new_priority=low.h)
    assert choice is not None and choice.source is SlotSource.DEVICE_ONLY and choice.victim is low
    idx.check_integrity()


def test_host_backed_slot_goes_to_the_least_recently_hit() -> None:
    idx, dev = make_index(host_slabs=400, slots=2), Device()
    (a,) = run(idx, dev, X[:100])
    (b,) = run(idx, dev, list(range(5000, 5100)))
    assert a.host_state is Residency.RESIDENT and b.host_state is Residency.RESIDENT
    lane = idx.open_lane(idx.match(key(X[:100] + [1])), a)  # a hit on a
    idx.release(lane)
    (c,) = run(idx, dev, list(range(6000, 6100)))
    assert a.device_slot >= 0 and b.device_slot == -1 and b.id in idx.snapshots
    assert c.device_slot >= 0
    idx.check_integrity()


def test_no_slot_skips_the_snapshot() -> None:
    idx, dev = make_index(host_slabs=0, slots=1), Device()
    (a,) = run(idx, dev, X[:300], endpoint=False, taps=[256])
    # A new request's tap is worth less than the device-only owner: it is skipped.
    out = run(idx, dev, list(range(5000, 5070)), taps=[64], endpoint=False)
    assert out == [] and idx.stats.skipped_no_slot == 1 and a.id in idx.snapshots


def test_a_continuing_step_s_last_tap_goes_with_its_endpoint() -> None:
    """Beyond the spec: the turn's first opener stays retained, later tool steps' openers do not
    (a template that strips thinking re-renders the whole turn back to its first opener), and a
    step that continued an endpoint is continued at its own endpoint (issue #37)."""
    idx, dev = make_index(host_slabs=400, slots=12), Device()
    o0, e0 = run(idx, dev, X[:300], taps=[256])  # the turn's first request (from the root)
    assert not o0.superseded and not e0.superseded  # nothing known of the template yet
    o1, e1 = run(idx, dev, X[:500], taps=[448])  # a tool step: resumes from e0
    assert e0.superseded and not o0.superseded and o1.superseded and not e1.superseded
    # The endpoint is valued by what it saves over o0, not over its own superseded tap.
    assert e1.ancestor is o1 and e1.cost > idx.valuer.values(o1)[0]
    o2, e2 = run(idx, dev, X[:700], taps=[640])  # the next step moves on from e1
    assert e1.superseded and o2.superseded and not o0.superseded and not e2.superseded
    # The next turn re-renders the history: it diverges after o0 and resumes from it.
    m = idx.match(key(X[:270] + [9] * 50))
    assert m.best is o0
    idx.check_integrity()


def test_a_re_rendered_answer_is_left_with_its_prompt_end_tap() -> None:
    """Issue #37: a next turn that re-renders the answer (a template stripping reasoning)
    resumes from the prompt-end tap and leaves that turn's endpoint; its own endpoint is kept
    off the host, since its next turn will leave it the same way, but stays retained on the
    device, where an agent's next tool step (seconds later) continues it."""
    idx, dev = make_index(host_slabs=400, slots=12), Device()
    t0, e0 = run(idx, dev, X[:300], taps=[299])  # prompt end (n - 1), then the answer's end
    assert t0.sibling_endpoint == e0.id and not t0.superseded and not e0.superseded
    assert not e0.device_only  # nothing is known of the template yet: written, as the spec
    turn1 = X[:299] + [7] * 100  # the answer re-rendered: it leaves the tree after the tap
    assert idx.match(key(turn1)).best is t0
    t1, e1 = run(idx, dev, turn1, taps=[398])
    assert t0.superseded and e0.superseded  # both of the turn the lineage moved on from
    assert not t1.superseded and not e1.superseded and t1.sibling_endpoint == e1.id
    assert e1.device_only
    assert t1.host_state is Residency.RESIDENT and e1.host_state is Residency.ABSENT
    assert e1.image_on_device
    idx.check_integrity()
    # A tool step that echoes the answer resumes from it on the device.
    step = [*turn1, 1, 2, 3]
    assert idx.match(key(step)).best is e1
    (e2,) = run(idx, dev, step, taps=[])
    assert e1.superseded and not e2.device_only  # it continued an endpoint: an echoing lane
    idx.check_integrity()


def test_a_regenerated_answer_is_no_evidence_of_the_template() -> None:
    """The same prompt resent resumes from its prompt-end tap without going past it: the new
    answer's endpoint stays retained (the conversation may continue from it)."""
    idx, dev = make_index(host_slabs=400, slots=12), Device()
    t0, e0 = run(idx, dev, X[:300], taps=[299])
    (e1,) = run(idx, dev, X[:299] + [5], taps=[])  # the same prompt, another answer token
    assert t0.superseded and e0.superseded and not e1.superseded
    idx.check_integrity()


def test_the_learned_prior_applies_with_a_host_tier_only() -> None:
    """GDSF's prior (``source_hits``): a tap origin never resumed from is valued below 1 with a
    host tier; on the device alone the spec's 1 stays (``PrefixIndex.prior_of``)."""
    for host_slabs, expect_learned in ((4000, True), (0, False)):
        idx, dev = make_index(host_slabs=host_slabs, slots=12), Device()
        for i in range(40):  # follow-up taps of prompts nobody continues
            base = 10_000 + 1000 * i
            run(idx, dev, list(range(base, base + 300)), taps=[128], origin=TapSource.FOLLOWUP)
        prior = idx.prior_of(SnapshotKind.TAP, int(TapSource.FOLLOWUP))
        assert (prior < 0.2) if expect_learned else prior == 1.0
        assert idx.prior_of(SnapshotKind.TAP, int(TapSource.OPENER)) == 1.0  # no evidence yet
        (t,) = run(
            idx,
            dev,
            list(range(90_000, 90_300)),
            taps=[128],
            origin=TapSource.FOLLOWUP,
            endpoint=False,
        )
        assert t.prior == prior
        idx.check_integrity()
