"""Supersession (spec §9.3): which snapshots a lane's new snapshot supersedes.

A lane's new snapshot supersedes the snapshot the lane resumed from and, for a tap, the lane's
previous tap (ladder and follow-up taps excepted, see ``lineage``): a conversation moving on
leaves its older states to the first host eviction. A Boundary snapshot is shared by prompts
that diverge after it, so it is superseded only while the tree below it is a single chain.
:class:`~.prefix_index.PrefixIndex` applies what these queries return (it owns the
``superseded`` list); they change nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from .lane import Lane
from .snapshot import Snapshot, SnapshotKind
from .taps import TapSource
from .tree import BlockTree


def may_supersede(s: Snapshot, snapshots: Mapping[int, Snapshot]) -> bool:
    """``s`` is in the index, retained, and not a Boundary still shared by a fork below it."""
    if s.superseded or s.id not in snapshots:
        return False
    return s.kind is not SnapshotKind.BOUNDARY or BlockTree.is_single_chain(s.anchor)


def lineage(
    lane: Lane, frontier: int, kind: SnapshotKind, snapshots: Mapping[int, Snapshot]
) -> list[Snapshot]:
    """What a new snapshot of ``lane`` at ``frontier`` supersedes, plus two rules beyond the spec.

    The spec keeps every prompt's last tap retained, for a next turn whose template re-renders
    the reply. But a template that strips thinking re-renders the whole last turn, so the next
    turn diverges at the turn's *first* opener: the last tap of a request that itself resumed
    from an endpoint (a tool step continuing the turn) serves only a retry of that request.
    Once the lineage moves on from its endpoint, that tap is superseded too, so its slot goes
    before the turn's first opener's (which GDSF values low: it saves few tokens over the
    snapshot below it).

    A ladder or follow-up tap is never superseded by its own prompt's later taps (issue #18's
    host-tier anomaly). Both are placed for a later prompt that shares this one's prefix and
    leaves it before the end (the ladder: anywhere; the follow-up tap: where later prompts were
    seen to leave earlier ones), which the prompt's deeper taps cannot serve. Superseded, they
    were the first thing either tier evicted, so under pressure a prompt kept only its tail (one
    server with a host tier reused 5,120 tokens of a Mooncake slice, 31,744 without). GDSF values
    them by what they save over the snapshot below. A request that resumes from one still
    supersedes it (``src``), as any lineage does.
    """
    src = lane.resumed_from
    step_tap = None
    if src is not None and src.lineage_tap >= 0:
        step_tap = snapshots.get(src.lineage_tap)
    last = lane.last_tap if kind is not SnapshotKind.ENDPOINT else None
    if last is not None and last.origin in (TapSource.LADDER, TapSource.FOLLOWUP):
        last = None  # kept for prompts leaving this one before its end (above)
    out: list[Snapshot] = []
    for t in (src, last, step_tap):
        if t is not None and t.frontier < frontier and may_supersede(t, snapshots) and t not in out:
            out.append(t)
    return out
