"""TapPlanner (spec §7.1): where a prefill saves recurrent states for later requests to resume from.

Candidates, in priority order:

1. explicit markers (client breakpoints)                      exact, Boundary
2. the branch point (beyond the spec, see below)              exact, Boundary
3. the generation opener of the final assistant turn          exact
4. structural boundaries (end of tools / leading system)      exact, Boundary
   protocol-automatic markers plan like structural ones       exact, Tap
5. the follow-up tap n - q, q learned from where later
   prompts left earlier ones or stopped inside them
   (``followups``, beyond the spec; only for prompts
   without hints 1, 3, 4)                                     exact, on the grid
6. the prompt tail, n - 1                                     exact (issue #37)
7. the ladder n - g * 2^k, g = min(G, (n - base) / 4),
   snapped back to a message boundary within the gap          flexible

Every tap lies in (base, n - 1] and never strictly inside a Vision span (a candidate inside one
moves to the span start). Exact taps keep their position (spec §7.1: the split is worth it because
later prompts diverge exactly there) and are published with the partial block before them as a
tail; ``exact_tails=False`` floors them to the 64-token grid instead, for callers that cannot hold
tails. Flexible taps are floored to the grid and realised where a pass ends anyway.

Proximity: semantic boundaries (opener, structural, automatic) closer than 64 tokens form one
cluster that keeps only its earliest position, named by the hint there, and its Boundary-ness if
any member had it; an opener at the request's end (within ``END_TOKENS`` of n: only the generation
prompt follows it) stays out of clusters and keeps its own position, since a resent request
resumes there (issue #37: clustered with a system block ending 51 tokens earlier, a resent chat
request resumed 51 tokens short every time). A snapshot serves every prompt diverging after it,
so a non-explicit candidate is dropped when an accepted tap, an existing snapshot on the path or
the base lies at most 64 tokens before it; ladder candidates keep the gap on both sides instead.

The prompt tail (issue #37): one prompt token is always prefilled, so n - 1 is the deepest state a
repeat can use, and the tail tap is exact there (a partial block as its tail): a repeat resumes
at n - 1 whatever n mod 64 is (on the grid it resumed up to 63 tokens short). It is redundant
when an anchor lies within ``END_TOKENS`` before n - 1 (an opener at the end absorbs it: one
state per chat request, a few tokens short), and when the request adds less than a block after
the state it resumed from (a repeat resumes there, < 64 tokens short: on the agent workload
without hints, tool steps with short tool results tapping there cost 2.8 % more prefill at 32
GiB than they saved, by the slots they took). In zero-split mode it is captured inside the pass;
in split mode it ends a pass, as the grid tail did, and the binding's split rule decides.

At most ``taps_per_request`` are kept; the planner counts the taps that budget drops
(``over_budget``), its only state.

Branch point (Marconi's admission rule): when a request's exact KV match reaches at least 64 tokens
past the snapshot it resumes from, two requests provably diverge at the deepest matched block
boundary, so a state there will be shared. Traffic without template hints depends on it.

The plan depends only on its inputs: deterministic, no I/O, O(hints + log n).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from .keys import BLOCK_TOKENS

if TYPE_CHECKING:
    from .split_rule import SplitRule


class HintKind(enum.IntEnum):
    EXPLICIT = 1  # a client-named breakpoint
    OPENER = 3  # start of the final assistant generation
    STRUCTURAL = 4  # end of tools, end of the leading system/developer block
    AUTOMATIC = 5  # protocol-automatic marker: planned as structural, published as a plain tap
    MESSAGE = 9  # any message boundary: only snaps ladder taps


class TapSource(enum.IntEnum):
    EXPLICIT = 1
    BRANCH = 2
    OPENER = 3
    STRUCTURAL = 4
    AUTOMATIC = 5
    FOLLOWUP = 6
    TAIL = 7
    LADDER = 8
    COALESCE = 9  # not planned here: where waiting requests will resume (spec §12.2)


class TapHint(NamedTuple):
    position: int  # a frontier: the state after tokens [0, position)
    kind: HintKind


class Tap(NamedTuple):
    position: int
    exact: bool
    boundary: bool
    source: TapSource


# A repeat may resume this many tokens short of n - 1 (the generation prompt after an opener is a
# few tokens; Qwen3's with an empty think block is 7): an anchor within it makes the tail tap
# redundant, and an opener within it of n is the request's end (issue #37).
END_TOKENS = 16
# The ladder's smallest spacing: rungs closer than this to each other save too little to hold a
# snapshot slot (a 4 x 512-token prompt still gets rungs at 1/2 and 3/4 of its span).
MIN_RUNG_TOKENS = 512


class TapPlanner:
    def __init__(
        self,
        *,
        taps_per_request: int,
        ladder_tokens: int,
        min_gap_tokens: int,
        exact_tails: bool = True,
    ) -> None:
        self.taps_per_request = taps_per_request
        self.ladder_tokens = ladder_tokens
        self.min_gap_tokens = min_gap_tokens
        self.exact_tails = exact_tails
        self.over_budget = 0  # taps dropped by taps_per_request, over the planner's life
        self.split_rule: SplitRule | None = None  # which exact taps split (``split_rule.py``)

    def plan(
        self,
        n: int,
        base: int,
        hints: Iterable[TapHint] = (),
        *,
        existing: Sequence[int] = (),
        vision_spans: Sequence[tuple[int, int]] = (),
        branch_point: int | None = None,
        followup_offset: int | None = None,
        skip_opener: bool = False,
    ) -> list[Tap]:
        """Taps for a prompt of ``n`` tokens resuming at ``base``, sorted by position.

        ``existing`` are frontiers of snapshots already on this prompt's path; ``branch_point`` is
        the end of the exact KV match (a multiple of 64) when it is known.
        """
        if self.taps_per_request <= 0 or n - 1 <= base:
            return []

        def snap(p: int, exact: bool = False) -> int | None:
            if exact and self.exact_tails:
                p = _span_point(min(p, n - 1), vision_spans)
            else:
                p = _grid_point(min(p, n - 1), vision_spans)
            return p if base < p else None

        hints = sorted(hints)
        cands: list[Tap] = []
        for h in hints:
            if h.kind is HintKind.EXPLICIT and (p := snap(h.position, True)) is not None:
                cands.append(Tap(p, True, True, TapSource.EXPLICIT))
        if branch_point is not None and (p := snap(branch_point, True)) is not None:
            cands.append(Tap(p, True, True, TapSource.BRANCH))
        for tap in self._semantic_clusters(hints, skip_opener, n):
            if (p := snap(tap.position, True)) is not None:
                cands.append(tap._replace(position=p))
        # Only for prompts that carry no hint of where they will be resumed: a template's opener
        # or structural marks or a client's breakpoints already say it, and on such traffic the
        # learned tap only takes slots and supersessions from them (agent replay: +1 % prefill).
        if (
            followup_offset is not None
            and all(h.kind is HintKind.MESSAGE for h in hints)
            and (p := snap(n - followup_offset)) is not None
        ):
            # On the grid but exact: a pass must end there (a flexible tap would be taken at
            # the next pass end, the prompt tail, which is what it is meant to precede).
            cands.append(Tap(p, True, False, TapSource.FOLLOWUP))
        if (p := snap(n - 1, True)) is not None:
            cands.append(Tap(p, True, False, TapSource.TAIL))
        # Rungs spaced relative to the span (issue #37): a prompt of a few thousand tokens whose
        # prefix is sent again gets states inside it too; past 4 G the ladder is G * 2^k as in
        # the spec. The gap scales with the spacing.
        g = min(self.ladder_tokens, max(MIN_RUNG_TOKENS, (n - base) // 4))
        gap = min(self.min_gap_tokens, g // 2)
        messages = [h.position for h in hints if h.kind is not HintKind.EXPLICIT]
        k = 0
        while (raw := n - g * (1 << k)) > base:
            if (p := snap(_snap_back(raw, messages, gap))) is not None:
                cands.append(Tap(p, False, False, TapSource.LADDER))
            k += 1

        cands.sort(key=acceptance_order)
        taken: set[int] = set(existing)
        accepted: list[Tap] = []
        anchors = sorted({base, *existing})  # positions a candidate may be redundant against
        for tap in cands:
            p = tap.position
            if p in taken:
                continue
            if tap.source is TapSource.LADDER:
                if any(abs(p - q) < gap for q in anchors):
                    continue
            elif tap.source is TapSource.TAIL:
                # Redundant within END_TOKENS of an anchor (a repeat resumes a few tokens short
                # of n - 1), or within a block of the base (issue #37; see the docstring).
                if n - 1 - base < BLOCK_TOKENS or any(
                    0 <= n - 1 - q <= END_TOKENS for q in anchors
                ):
                    continue
            elif tap.source is not TapSource.EXPLICIT and any(
                0 <= p - q <= BLOCK_TOKENS for q in anchors
            ):
                continue
            if len(accepted) >= self.taps_per_request:
                self.over_budget += 1  # a tap the budget dropped (counted, issue #11)
                continue
            accepted.append(tap)
            taken.add(p)
            anchors.append(p)
        accepted.sort()
        if self.split_rule is not None:  # splits only where they pay (issue #36)
            accepted = self.split_rule.apply(accepted, base=base, existing=existing)
        return accepted

    @staticmethod
    def _semantic_clusters(hints: Sequence[TapHint], skip_opener: bool, n: int) -> list[Tap]:
        """Opener / structural / automatic hints, single-linkage clustered at < 64 tokens; an
        opener at the request's end is a cluster of its own (see the module docstring)."""
        out: list[Tap] = []
        sem: list[TapHint] = []
        for h in hints:
            if h.kind is HintKind.OPENER:
                if skip_opener:
                    continue
                if n - h.position <= END_TOKENS:
                    out.append(Tap(h.position, True, False, TapSource.OPENER))
                    continue
            if h.kind in (HintKind.OPENER, HintKind.STRUCTURAL, HintKind.AUTOMATIC):
                sem.append(h)
        i = 0
        while i < len(sem):
            j = i + 1
            while j < len(sem) and sem[j].position - sem[j - 1].position < BLOCK_TOKENS:
                j += 1
            members = sem[i:j]
            # Named by the hint at the position kept (the rule that made the state there);
            # hints are sorted, so several at that position give the highest priority's name.
            first = members[0]
            boundary = any(h.kind is HintKind.STRUCTURAL for h in members)
            out.append(Tap(first.position, True, boundary, _SOURCE_OF[first.kind]))
            i = j
        return out


def acceptance_order(tap: Tap) -> tuple[int, int]:
    """Sources are numbered in priority order; within one, deeper states serve more prompts."""
    return int(tap.source), -tap.position


_SOURCE_OF = {
    HintKind.OPENER: TapSource.OPENER,
    HintKind.STRUCTURAL: TapSource.STRUCTURAL,
    HintKind.AUTOMATIC: TapSource.AUTOMATIC,
}


def _span_point(p: int, spans: Sequence[tuple[int, int]]) -> int:
    """``p``, or the start of the Vision span it lies strictly inside."""
    for begin, end in spans:
        if begin < p < end:
            return begin
    return p


def _grid_point(p: int, spans: Sequence[tuple[int, int]]) -> int:
    """Floor ``p`` to the grid; inside a Vision span, retry from the span start (p only falls)."""
    while True:
        p -= p % BLOCK_TOKENS
        for begin, end in spans:
            if begin < p < end:
                p = begin
                break
        else:
            return p


def _snap_back(p: int, boundaries: Sequence[int], gap: int) -> int:
    """The latest boundary in [p - gap, p], else ``p`` (``boundaries`` sorted)."""
    best = p
    for q in boundaries:
        if q > p:
            break
        if q >= p - gap:
            best = q
    return best
