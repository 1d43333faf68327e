"""Follow-up offsets (issue #15): learned from branch points, planned as a tap, served."""

from __future__ import annotations

import random

from helpers import Device, key, make_index, run

from sglang_hybrid.index import HintKind, TapHint, TapPlanner, TapSource
from sglang_hybrid.index.followups import (
    HALF_LIFE,
    MIN_OBSERVATIONS,
    WINDOW_TOKENS,
    FollowUpOffsets,
)


def test_no_tap_before_enough_observations() -> None:
    f = FollowUpOffsets()
    for _ in range(MIN_OBSERVATIONS - 1):
        f.observe(300)
    assert f.offset(10_000) is None
    f.observe(300)
    assert f.offset(10_000) == 320  # the bin (256, 320] holds 300


def test_offsets_outside_the_window_teach_nothing() -> None:
    f = FollowUpOffsets()
    for _ in range(50):
        f.observe(0)
        f.observe(-5)
        f.observe(WINDOW_TOKENS + 1)
    assert f.observations == 0 and f.offset(100_000) is None


def test_long_prompts_cover_the_spread_short_ones_stay_near_the_tail() -> None:
    f = FollowUpOffsets()
    for o in range(8, 512, 8):  # uniform over (0, 512]
        f.observe(o)
    # Far from its base, covering every observed follow-up is worth a few hundred tokens.
    assert f.offset(20_000) == 512
    # Close to its base, P(o <= q) * (span - q) peaks lower; never a tap within a block of it.
    q = f.offset(600)
    assert q is not None and q < 512 and 600 - q >= 64
    assert f.offset(100) is None


def test_the_histogram_follows_a_change_of_traffic() -> None:
    f = FollowUpOffsets()
    for _ in range(HALF_LIFE):
        f.observe(1000)
    for _ in range(3 * HALF_LIFE):
        f.observe(100)
    # Old offsets still exist but weigh 1/8: covering them no longer pays on a 2k span.
    assert f.offset(2000) == 128


def test_planner_places_the_follow_up_tap_before_the_tail() -> None:
    planner = TapPlanner(taps_per_request=1, ladder_tokens=16384, min_gap_tokens=8192)
    taps = planner.plan(10_000, 0, followup_offset=512)
    assert [(t.position, t.source) for t in taps] == [(9472, TapSource.FOLLOWUP)]
    planner = TapPlanner(taps_per_request=2, ladder_tokens=16384, min_gap_tokens=8192)
    taps = planner.plan(10_000, 0, followup_offset=512)
    assert [t.source for t in taps] == [TapSource.FOLLOWUP, TapSource.TAIL]
    # Within END_TOKENS of the tail it absorbs it (one state, not two).
    taps = planner.plan(10_000, 0, followup_offset=5)
    assert TapSource.FOLLOWUP in {t.source for t in taps}
    assert TapSource.TAIL not in {t.source for t in taps}


def test_the_follow_up_tap_of_a_block_aligned_prompt_is_at_the_divergence() -> None:
    """A follow-up leaving a prompt of n tokens q tokens before its end diverges at n - q; with
    n - q on the grid the tap is there, not a block short (bench_serving's shared-prefix shape:
    2,048-token system prompts, 128-token questions)."""
    planner = TapPlanner(taps_per_request=2, ladder_tokens=16384, min_gap_tokens=8192)
    taps = planner.plan(2048 + 128, 0, followup_offset=128)
    assert (2048, TapSource.FOLLOWUP) in [(t.position, t.source) for t in taps]
    f = FollowUpOffsets()
    for _ in range(MIN_OBSERVATIONS):
        f.observe(128)
    assert f.offset(2048 + 128) == 128


def test_hinted_prompts_get_no_follow_up_tap() -> None:
    """A template's opener or a client's breakpoint already says where the prompt resumes;
    message boundaries alone (they only snap the ladder) do not."""
    planner = TapPlanner(taps_per_request=4, ladder_tokens=16384, min_gap_tokens=8192)
    for kind in (HintKind.OPENER, HintKind.STRUCTURAL, HintKind.EXPLICIT, HintKind.AUTOMATIC):
        taps = planner.plan(10_000, 0, [TapHint(3000, kind)], followup_offset=512)
        assert TapSource.FOLLOWUP not in {t.source for t in taps}, kind
    taps = planner.plan(10_000, 0, [TapHint(3000, HintKind.MESSAGE)], followup_offset=512)
    assert TapSource.FOLLOWUP in {t.source for t in taps}


def test_token_id_follow_ups_resume_at_the_learned_tap() -> None:
    """Conversations whose next turn diverges a few hundred tokens before the previous prompt's
    end (its last message rewritten): once learned, each next turn resumes just below that
    point instead of far back."""
    rng = random.Random(7)
    index, dev = make_index(slots=64, taps=2, ladder=16384, min_gap=8192), Device()
    served_late: list[int] = []
    for c in range(24):
        prompt = [rng.randrange(16, 2000) for _ in range(rng.randrange(3000, 5000))]
        for _turn in range(3):
            m = index.match(key(prompt))
            planned = index.plan_taps(key(prompt), m, m.best)
            run(index, dev, prompt, taps=[t.position for t in planned], endpoint=False)
            cut = len(prompt) - rng.randrange(100, 400)  # the last message is rewritten
            prompt = prompt[:cut] + [rng.randrange(16, 2000) for _ in range(600)]
            m = index.match(key(prompt))
            got = m.best.frontier if m.best is not None else 0
            if c >= 12:
                served_late.append(cut - got)
    # Every late follow-up resumes within 400 + 63 tokens of its divergence.
    assert served_late and max(served_late) < 400 + 64, served_late
    assert index.followups.observations >= MIN_OBSERVATIONS


def test_prompts_that_stop_inside_earlier_ones_are_observed_and_served() -> None:
    """Issue #37: a later prompt that is a strict prefix of an earlier one (a client re-sending
    all but its last message) is one observation, e - (n - 1); once learned, such prefixes
    resume just below their end instead of from the root. A repeat teaches nothing (the tail
    serves it)."""
    rng = random.Random(11)
    index, dev = make_index(slots=64, taps=2, ladder=16384, min_gap=8192), Device()
    served_late: list[int] = []
    for c in range(20):
        prompt = [rng.randrange(16, 2000) for _ in range(rng.randrange(3000, 5000))]
        m = index.match(key(prompt))
        planned = index.plan_taps(key(prompt), m, m.best)
        run(index, dev, prompt, taps=[t.position for t in planned], endpoint=False)
        before = index.followups.observations
        run(index, dev, prompt, endpoint=False)  # a repeat
        assert index.followups.observations == before
        short = prompt[: len(prompt) - 300]
        m = index.match(key(short))
        got = m.best.frontier if m.best is not None else 0
        run(index, dev, short, endpoint=False)
        assert index.followups.observations == before + 1
        if c >= 10:
            served_late.append(len(short) - got)
    assert index.followups.offset(4000) == 320  # observations of 301 fall in (256, 320]
    assert served_late and max(served_late) < 64 + 20, served_late
