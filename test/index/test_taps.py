"""TapPlanner properties (spec §7.1, §13.1 TapPlanner) over random prompts and boundaries."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hybrid.index import HintKind, TapHint, TapPlanner, TapSource
from sglang_hybrid.index.taps import END_TOKENS, MIN_RUNG_TOKENS, acceptance_order

KINDS = [
    HintKind.EXPLICIT,
    HintKind.OPENER,
    HintKind.STRUCTURAL,
    HintKind.AUTOMATIC,
    HintKind.MESSAGE,
]


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 200_000))
    base = draw(st.integers(0, max(0, n - 1))) // 64 * 64 if draw(st.booleans()) else 0
    hints = draw(
        st.lists(st.builds(TapHint, st.integers(0, n), st.sampled_from(KINDS)), max_size=12)
    )
    existing = draw(st.lists(st.integers(1, max(1, n // 64)).map(lambda b: 64 * b), max_size=4))
    spans = []
    if draw(st.booleans()) and n > 200:
        b = draw(st.integers(1, n - 100))
        spans = [(b, b + draw(st.integers(2, 2000)))]
    budget = draw(st.integers(0, 10))
    ladder = draw(st.sampled_from([1024, 4096, 16384]))
    gap = draw(st.sampled_from([256, 1024, 8192]))
    branch = draw(st.one_of(st.none(), st.integers(0, n).map(lambda p: p // 64 * 64)))
    return n, base, hints, existing, spans, budget, ladder, gap, branch


def _plan(sc, exact_tails: bool = True):
    n, base, hints, existing, spans, budget, ladder, gap, branch = sc
    planner = TapPlanner(
        taps_per_request=budget, ladder_tokens=ladder, min_gap_tokens=gap, exact_tails=exact_tails
    )
    return planner.plan(n, base, hints, existing=existing, vision_spans=spans, branch_point=branch)


@settings(max_examples=400, deadline=None)
@given(scenarios(), st.booleans())
def test_taps_are_placed_in_range_outside_spans_and_deduplicated(sc, exact_tails: bool) -> None:
    """Flexible taps (and every tap without exact tails) lie on the 64-token grid."""
    n, base, _, existing, spans, budget, _, _, _ = sc
    taps = _plan(sc, exact_tails)
    positions = [t.position for t in taps]
    assert positions == sorted(set(positions))
    assert len(taps) <= budget
    for t in taps:
        assert base < t.position <= n - 1
        if not (t.exact and exact_tails):
            assert t.position % 64 == 0
        assert not any(b < t.position < e for b, e in spans)
        assert t.position not in existing
        assert t.exact == (t.source is not TapSource.LADDER)  # the tail is exact (issue #37)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_is_deterministic(sc) -> None:
    assert _plan(sc) == _plan(sc)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_ladder_stays_logarithmic_and_respects_the_gap(sc) -> None:
    n, base, _, existing, _, _, ladder, gap, _ = sc
    taps = _plan(sc)
    rungs = [t for t in taps if t.source is TapSource.LADDER]
    # Spaced relative to the span below 4 G (issue #37), the gap with it.
    g = min(ladder, max(MIN_RUNG_TOKENS, (n - base) // 4))
    gap = min(gap, g // 2)
    assert len(rungs) <= max(0, math.log2(max(n - base, 1) / g)) + 1
    others = [base, *existing, *(t.position for t in taps if t.source is not TapSource.LADDER)]
    for r in rungs:
        assert all(abs(r.position - q) >= gap for q in others)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_budget_keeps_the_highest_priority_taps(sc) -> None:
    """Under a budget the plan is the first taps the unlimited plan accepts, in priority order."""
    n, base, hints, existing, spans, budget, ladder, gap, branch = sc
    unlimited = TapPlanner(taps_per_request=1000, ladder_tokens=ladder, min_gap_tokens=gap).plan(
        n, base, hints, existing=existing, vision_spans=spans, branch_point=branch
    )
    kept = _plan(sc)
    assert set(kept) == set(sorted(unlimited, key=acceptance_order)[:budget])
    explicit = [t for t in unlimited if t.source is TapSource.EXPLICIT]
    assert all(t in kept for t in sorted(explicit, key=acceptance_order)[:budget])


def test_opener_absorbs_the_prompt_tail_in_chat() -> None:
    p = TapPlanner(taps_per_request=8, ladder_tokens=4096, min_gap_tokens=1024)
    n = 3000
    taps = p.plan(n, 0, [TapHint(2990, HintKind.OPENER), TapHint(1500, HintKind.STRUCTURAL)])
    assert [(t.position, t.source) for t in taps] == [
        (1500, TapSource.STRUCTURAL),
        (2240, TapSource.LADDER),  # n - 750: rungs spaced relative to the span (issue #37)
        (2990, TapSource.OPENER),  # exact, with a tail; the tail tap (nominal 2999) is absorbed
    ]
    assert taps[0].boundary and not taps[1].boundary


def test_semantic_cluster_keeps_the_earliest_and_its_boundary() -> None:
    p = TapPlanner(taps_per_request=8, ladder_tokens=1 << 20, min_gap_tokens=1024)
    taps = p.plan(5000, 0, [TapHint(1000, HintKind.STRUCTURAL), TapHint(1040, HintKind.OPENER)])
    cluster = [t for t in taps if t.source in (TapSource.OPENER, TapSource.STRUCTURAL)]
    assert len(cluster) == 1 and cluster[0].position == 1000 and cluster[0].boundary
    floored = TapPlanner(
        taps_per_request=8, ladder_tokens=1 << 20, min_gap_tokens=1024, exact_tails=False
    ).plan(5000, 0, [TapHint(1000, HintKind.STRUCTURAL), TapHint(1040, HintKind.OPENER)])
    assert [t.position for t in floored if t.exact and t.source is not TapSource.TAIL] == [960]


def test_endpoint_resume_skips_the_opener() -> None:
    p = TapPlanner(taps_per_request=8, ladder_tokens=1 << 20, min_gap_tokens=1024)
    hints = [TapHint(2990, HintKind.OPENER)]
    assert any(t.source is TapSource.OPENER for t in p.plan(3000, 0, hints))
    assert not any(t.source is TapSource.OPENER for t in p.plan(3000, 0, hints, skip_opener=True))


def test_ladder_snaps_back_to_a_message_boundary() -> None:
    p = TapPlanner(taps_per_request=8, ladder_tokens=4096, min_gap_tokens=1024)
    taps = p.plan(20_000, 0, [TapHint(15_500, HintKind.MESSAGE)])
    rungs = sorted(t.position for t in taps if t.source is TapSource.LADDER)
    assert 15_488 in rungs  # n - G = 15904 snapped back to the boundary at 15500, floored
    assert rungs == sorted({15_488, 11_776, 3_584})


def test_branch_point_is_an_exact_boundary_tap() -> None:
    p = TapPlanner(taps_per_request=8, ladder_tokens=1 << 20, min_gap_tokens=1024)
    taps = p.plan(3000, 0, [], branch_point=960)
    assert Tap_at(taps, 960).exact and Tap_at(taps, 960).boundary


def Tap_at(taps, p):
    return next(t for t in taps if t.position == p)


def test_the_prompt_tail_is_exact_at_n_minus_1_for_every_n_mod_64() -> None:
    """Issue #37: a repeat resumes at n - 1 whatever n mod 64 is (it was floor64(n - 1))."""
    p = TapPlanner(taps_per_request=2, ladder_tokens=1 << 20, min_gap_tokens=1024)
    for n in range(2, 300):
        tails = [(t.position, t.exact) for t in p.plan(n, 0) if t.source is TapSource.TAIL]
        # Within a block of the base a repeat resumes there (less than a block short).
        assert tails == ([(n - 1, True)] if n - 1 >= 64 else []), n
    # Redundant within END_TOKENS of an anchor below it, or within a block of the base.
    for gap, planned in ((END_TOKENS, False), (END_TOKENS + 1, True)):
        taps = p.plan(1000, 0, existing=[999 - gap])
        assert (TapSource.TAIL in {t.source for t in taps}) is planned, gap
    for added, planned in ((63, False), (64, True)):
        taps = p.plan(5000 + added + 1, 5000)
        assert (TapSource.TAIL in {t.source for t in taps}) is planned, added


def test_an_opener_at_the_end_keeps_its_own_position() -> None:
    """The chat resend of issue #37: the opener lies 48 tokens after the system block's end.
    Clustered, the state sat at the system block's end and a resent request resumed there; at
    the request's end the opener is its own tap, named by its rule, and absorbs the tail."""
    p = TapPlanner(taps_per_request=2, ladder_tokens=1 << 20, min_gap_tokens=1024)
    hints = [TapHint(215, HintKind.STRUCTURAL), TapHint(263, HintKind.OPENER)]
    taps = p.plan(266, 0, hints)
    assert [(t.position, t.source) for t in taps] == [
        (215, TapSource.STRUCTURAL),
        (263, TapSource.OPENER),
    ]
    # An opener that is not the request's end still clusters, named by the hint kept.
    taps = p.plan(1000, 0, [TapHint(215, HintKind.STRUCTURAL), TapHint(263, HintKind.OPENER)])
    assert [(t.position, t.source) for t in taps if t.source is not TapSource.TAIL] == [
        (215, TapSource.STRUCTURAL)
    ]


def test_a_prompt_of_a_few_thousand_tokens_gets_rungs() -> None:
    """Issue #37: the ladder's spacing is relative below 4 G, so a prefix of a 4,000-token
    prompt finds a state inside it (the spec's ladder starts at n - G, 16,384 by default)."""
    p = TapPlanner(taps_per_request=4, ladder_tokens=16384, min_gap_tokens=8192)
    rungs = [t.position for t in p.plan(4000, 0) if t.source is TapSource.LADDER]
    assert rungs == [1984, 2944]  # n - 2000, n - 1000 on the grid
    # Long prompts keep the spec's ladder.
    rungs = [t.position for t in p.plan(100_000, 0) if t.source is TapSource.LADDER]
    assert rungs == [100_000 - 65536 - 32, 100_000 - 32768 - 32, 100_000 - 16384 - 32]
