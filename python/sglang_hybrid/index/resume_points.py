"""Resume points on a prompt's path, and where a compaction cut lands among them (issue #16).

A client that compacts a long context (keep a head, summarise the middle, keep the tail) keeps
reuse only where a state exists exactly at the end of the kept head. ``resume_points`` lists every
valid snapshot on a prompt's path: the positions a later prompt that shares the prompt up to
there resumes from (``match.py``'s rules, with ``F <= n``: a later prompt continues past the end).
``place_cut`` says what a cut at position c keeps, in the vocabulary of
``shared/spec/cache-coherence.md`` (its decision steps 5, 6 and 8; forward alignment is the
client's to choose, as it changes the cut).

Read-only: nothing here touches recency, hit counts or GDSF values. O(k + snapshots on the path).
"""

from __future__ import annotations

from typing import NamedTuple

from .keys import BLOCK_TOKENS, PromptKey
from .match import match_prompt
from .node import FastResidency
from .snapshot import Snapshot
from .tree import BlockTree

ALIGNED = "aligned"
SNAPPED = "snapped"
PARTIAL = "partial-reuse"
FULL = "full-re-prefill"


class ResumePoint(NamedTuple):
    position: int  # the snapshot's frontier F: tokens [0, F) need no prefill
    snapshot: Snapshot
    tier: str  # "device" (image, tail and path resident) or "host" (a restore brings it back)


class CutPlacement(NamedTuple):
    verdict: str  # aligned / snapped / partial-reuse / full-re-prefill
    retained_prefix_tokens: int  # what the next prompt, cut at ``cut``, reuses
    delta: int  # cut - retained (0 when aligned)
    reason: str


def resume_points(tree: BlockTree, key: PromptKey) -> list[ResumePoint]:
    """Every valid snapshot at ``F <= key.n`` whose path and tail the prompt repeats, by F."""
    n = key.n
    if n == 0:
        return []
    # One token more lets the walk admit F = n (match_prompt keeps F <= n - 1 for the prompt
    # itself, whose last token is always prefilled); its value never enters a comparison.
    m = match_prompt(tree, key.extend(b"\0\0\0\0"))
    filling = FastResidency.FILLING
    out: list[ResumePoint] = []
    for j in range(len(m.path) + 1):
        anchor = m.path[j - 1] if j else tree.root
        for s in anchor.snapshots or ():
            f = s.frontier
            if f > n or s.device_state is filling or s.tail_device_state is filling:
                continue
            if s.tail and key.tokens(BLOCK_TOKENS * j, f) != s.tail:
                continue
            if key.vision_spans and key.in_vision_span(f) is not None:
                continue
            on_device = j <= m.device_blocks and s.complete_on_device
            out.append(ResumePoint(f, s, "device" if on_device else "host"))
    out.sort(key=lambda p: p.position)
    return out


def place_cut(points: list[ResumePoint], cut: int, tolerance: int) -> CutPlacement:
    """Where a prompt cut at ``cut`` (the kept head's end) resumes: at a point exactly there
    (aligned), at the deepest point below it within ``tolerance`` tokens (snapped), at a deeper
    but farther point (partial-reuse: the tokens after it are prefilled again), or nowhere."""
    below = [p for p in points if p.position <= cut]
    if not below:
        if points:
            why = f"the first resume point is at {points[0].position}, past the cut at {cut}"
        else:
            why = "no resume point is held on this prompt's path"
        return CutPlacement(FULL, 0, cut, f"{why}; the next prompt is prefilled from the start")
    p = below[-1]
    delta = cut - p.position
    kind = p.snapshot.kind.name.lower()
    where = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} snapshot on the {p.tier}"
    if delta == 0:
        return CutPlacement(ALIGNED, p.position, 0, f"{where} sits exactly at the cut")
    if delta <= tolerance:
        return CutPlacement(SNAPPED, p.position, delta, f"snapped {delta} tokens back onto {where}")
    return CutPlacement(
        PARTIAL,
        p.position,
        delta,
        f"the nearest resume point below the cut is {delta} tokens back (tolerance "
        f"{tolerance}): {where} at {p.position}; the {delta} tokens after it are prefilled again",
    )
