"""SplitRule (issue #36): exact taps split only where the modelled saving exceeds a pass's cost."""

from __future__ import annotations

from sglang_hybrid.index import (
    CacheConfig,
    CostModel,
    HintKind,
    PrefixIndex,
    PromptKey,
    SnapshotKind,
    SplitRule,
    Tap,
    TapHint,
    TapPlanner,
    TapSource,
)
from sglang_hybrid.index.source_hits import ENDPOINT, HALF_LIFE, PRIOR_RATE, SourceHits
from sglang_hybrid.index.split_rule import EXPLORE_EVERY

# 27B on an H200 (index/presets.py): 3 ms a pass, 0.11 ms a token; the weight read left out
# (0) where the arithmetic below is about tokens.
COST = CostModel(token_s=1.1e-4, pair_s=8.0e-10, chunk_s=3e-3, chunk_tokens=8192, weight_read_s=0)
OPENER = int(TapSource.OPENER)


def _tap(p: int, source: TapSource = TapSource.OPENER, exact: bool = True) -> Tap:
    return Tap(p, exact, False, source)


def test_a_split_pays_when_the_expected_saving_exceeds_a_pass() -> None:
    rule = SplitRule(COST, grid=64)
    # Prior: one resume per tap. 60 tokens at 0.11 ms = 6.6 ms > 3 ms; 20 tokens = 2.2 ms < 3 ms.
    assert rule.pays(OPENER, 1060, 1000)
    assert not rule.pays(OPENER, 1020, 1000)
    # A source whose taps are seldom resumed from: 60 tokens no longer pay.
    for _ in range(100):
        rule.hits.note_published(OPENER)
    assert rule.hits.rate(OPENER) < 0.05
    assert not rule.pays(OPENER, 1060, 1000)
    # ... and often resumed: 20 tokens pay at three resumes per tap.
    for _ in range(400):
        rule.hits.note_hit(OPENER)
    assert rule.pays(OPENER, 1020, 1000)


def test_threshold_zero_splits_every_exact_tap_and_scales_the_bar() -> None:
    assert SplitRule(COST, threshold=0.0).pays(OPENER, 1001, 1000)
    strict = SplitRule(COST, threshold=3.0)
    assert not strict.pays(OPENER, 1060, 1000)  # 6.6 ms < 9 ms
    assert strict.pays(OPENER, 1100, 1000)  # 11 ms > 9 ms


def test_a_split_costs_a_pass_and_a_weight_read() -> None:
    with_read = CostModel(token_s=1.1e-4, pair_s=8.0e-10, chunk_s=3e-3, weight_read_s=14e-3)
    assert with_read.split_seconds() == 3e-3 + 14e-3
    rule = SplitRule(with_read, grid=64)
    assert not rule.pays(OPENER, 1063, 1000)  # 63 tokens, 6.9 ms: below 17 ms
    assert rule.pays(OPENER, 1200, 1000)  # 200 tokens, 22 ms


def test_the_capture_point_counts_from_the_base_in_the_first_pass() -> None:
    rule = SplitRule(COST, grid=64)
    assert rule.capture_point(3100, 2938) == 3066 and rule.captures(3066, 2938)
    assert rule.capture_point(2938 + 9000, 2938) == 11904  # past the first chunk: block grid
    assert rule.captures(11904, 2938) and not rule.captures(3100, 2938)
    assert SplitRule(COST, grid=1).capture_point(3100, 0) == 3100
    assert SplitRule(COST, grid=0).capture_point(3100, 0) == -1
    # A declined opener at 3100 after a base at 2938 moves to 3066 (a tail of 58 tokens).
    none = SplitRule(COST, grid=64, threshold=100.0)
    assert none.apply([_tap(3100)], base=2938) == [_tap(3066, exact=False)]


def test_declined_taps_move_to_the_grid_and_are_counted() -> None:
    rule = SplitRule(COST, grid=64, exact_tail=True)
    for _ in range(200):
        rule.hits.note_published(OPENER)  # openers are never resumed from
    taps = [_tap(2938, TapSource.STRUCTURAL), _tap(5010), _tap(6400, TapSource.TAIL, False)]
    out = rule.apply(taps, base=0)
    # The structural tap (prior rate) at 2938: the grid point 2880 is 58 tokens below: pays.
    # The opener at 5010 does not: it becomes a flexible tap at 4992. The tail at 6400 lies on
    # the grid the worker captures on: exact, no split needed.
    assert out == [
        Tap(2938, True, False, TapSource.STRUCTURAL),
        Tap(4992, False, False, TapSource.OPENER),
        Tap(6400, True, False, TapSource.TAIL),
    ]
    assert rule.declined == 1


def test_without_in_pass_capture_the_alternative_is_the_state_below() -> None:
    rule = SplitRule(COST, grid=0, exact_tail=False)
    for _ in range(200):
        rule.hits.note_published(OPENER)
    rule.hits.note_hit(OPENER)  # rate ~ 0.024
    # Without capture a declined tap leaves the resume at the base (or an accepted tap below):
    # 5000 tokens at 0.024 resumes a tap still pay, 20 or 60 past a snapshot do not.
    assert rule.apply([_tap(5000)], base=0) == [_tap(5000)]
    assert rule.apply([_tap(5020)], base=0, existing=[5000]) == []  # nothing on the grid above
    # Declined with a grid point above the snapshot: kept there as a flexible tap.
    assert rule.apply([_tap(5060)], base=0, existing=[5000]) == [_tap(5056, exact=False)]
    assert rule.declined == 2
    # The tail stays flexible (no split to decide) when --hybrid-tail-tap flexible.
    tail = _tap(6400, TapSource.TAIL, False)
    assert rule.apply([tail], base=0) == [tail]


def test_a_declined_tap_below_is_no_alternative_to_the_one_above() -> None:
    """Issue #37: without in-pass capture a declined tap's flexible fallback is taken only
    where a pass happens to end, so the tap above is priced against the state below both."""
    rule = SplitRule(COST, grid=0, exact_tail=True)
    followup = int(TapSource.FOLLOWUP)
    for _ in range(200):
        rule.hits.note_published(followup)  # follow-up taps are never resumed from
        rule.hits.note_published(int(TapSource.TAIL))  # one tail in ten is (rate ~0.12)
    for _ in range(20):
        rule.hits.note_hit(int(TapSource.TAIL))
    taps = [_tap(4992, TapSource.FOLLOWUP), _tap(5055, TapSource.TAIL)]
    out = rule.apply(taps, base=4000)
    # The follow-up tap is declined (it stays planned as a flexible tap), the tail is priced
    # over the 1055 tokens from the base, not the 63 from the declined tap: it splits.
    assert out == [_tap(4992, TapSource.FOLLOWUP, exact=False), _tap(5055, TapSource.TAIL)]
    assert rule.declined == 1


def test_every_nth_declined_decision_splits_to_keep_learning() -> None:
    rule = SplitRule(COST, grid=64)
    for _ in range(500):
        rule.hits.note_published(OPENER)
    answers = [rule.pays(OPENER, 1060, 1000) for _ in range(3 * EXPLORE_EVERY)]
    assert answers.count(True) == 3 and answers[EXPLORE_EVERY - 1]


def test_source_statistics_halve_by_publication_count_not_time() -> None:
    h = SourceHits()
    assert h.rate(OPENER) == PRIOR_RATE
    for _ in range(HALF_LIFE - 1):
        h.note_published(OPENER)
    h.note_hit(OPENER)
    before = h.published[OPENER]
    h.note_published(int(TapSource.TAIL))  # the HALF_LIFE-th publication halves every source
    assert h.published[OPENER] == before / 2 and h.hits[OPENER] == 0.5
    h.note_published(-1)  # a tap of unknown source (adopted after a restart): ignored
    assert h.events == HALF_LIFE
    h.note_published(ENDPOINT)  # endpoints count under their own key
    assert h.events == HALF_LIFE + 1 and h.published[ENDPOINT] == 1


def test_the_planner_calls_the_rule_once_per_plan() -> None:
    planner = TapPlanner(taps_per_request=4, ladder_tokens=4096, min_gap_tokens=1024)
    hints = [TapHint(5010, HintKind.OPENER)]

    def planned() -> list[tuple[int, bool]]:
        taps = planner.plan(6000, 0, hints)
        return [(t.position, t.exact) for t in taps if t.source is not TapSource.LADDER]

    assert planned() == [(5010, True), (5999, True)]  # the tail at n - 1 (issue #37)
    planner.split_rule = rule = SplitRule(COST, grid=64, exact_tail=True)
    for _ in range(500):
        rule.hits.note_published(OPENER)
    # The opener moved to 4992 (flexible); the tail at 5999 is off the grid the worker captures
    # on, and its split pays at the prior rate (a repeat resumes 47 tokens past 5952).
    assert planned() == [(4992, False), (5999, True)]
    assert rule.declined == 1


def test_the_index_feeds_publications_and_resumes_per_source() -> None:
    config = CacheConfig(
        host_cache_bytes=0,
        device_snapshot_slots=4,
        taps_per_request=2,
        tap_ladder_tokens=4096,
        tap_min_gap_tokens=1024,
        chunk_tokens=8192,
        concurrency=2,
    )
    index = PrefixIndex(config, image_bytes=1, slab_bytes=1, cost=COST)
    assert index.planner.split_rule is index.split_rule and index.split_rule.threshold == 0.0
    key = PromptKey(bytes(range(256)) * 2)  # 128 tokens of int32
    longer = PromptKey(key.data + bytes(256))
    m = index.match(key)
    lane = index.open_lane(m, None)
    index.commit(lane, key, 128, lambda i: i)
    slot = index.reserve_slot(lane, 128, SnapshotKind.TAP)
    assert slot is not None
    s = index.publish(lane, key, 128, slot, SnapshotKind.TAP, origin=OPENER)
    assert s is not None and index.split_rule.hits.published[OPENER] == 1
    index.release(lane)
    m2 = index.match(longer)
    lane2 = index.open_lane(m2, m2.best)
    assert m2.best is s and index.split_rule.hits.hits[OPENER] == 1
    index.release(lane2)
