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
    """What a new snapshot of ``lane`` at ``frontier`` supersedes, plus rules beyond the spec.

    A conversation keeps its template: how a lane was reached predicts how its own successor
    will reach it (issue #37). The spec keeps every prompt's last tap retained, for a next turn
    whose template re-renders the reply; both kinds of template are common and a snapshot
    image weighs thousands of tokens of KV (2,349 at the 27B geometry), so keeping both states
    of every turn halved what a host tier held of hint-less chat.

    - A lane that resumed from an endpoint continues answers as they were generated (an agent
      harness's tool steps, a template that keeps every turn): its successor resumes from its
      endpoint, and its last tap serves only a retry of this request. The endpoint supersedes
      that tap when it is published (lineage_tap once waited for the next step; the endpoint
      was valued by the few tokens it adds over the tap and went first under pressure).
    - A lane that resumed from an earlier request's prompt-end tap and went on past it
      re-rendered that request's answer (a template that strips reasoning): that answer's
      endpoint is left for good (``sibling_endpoint``; only a resend with the reasoning echoed
      could use it) and is superseded with the tap, and the lane's own endpoint is kept off the
      host (``Lane.left_answer``, ``Snapshot.device_only``): its next turn will re-render it
      too, minutes later, but within a turn an agent's tool step echoes it seconds later
      (publishing it superseded cost the agent replay up to 3 % more prefill).
    - A lane reached otherwise (from the root, a ladder rung, a boundary) keeps both, as the
      spec does: nothing is known of its template yet.

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
    # The answer the lane's source was the prompt end of: resuming there, the lane left it.
    sibling = None
    if src is not None and src.sibling_endpoint >= 0:
        sibling = snapshots.get(src.sibling_endpoint)
    last = lane.last_tap
    if kind is SnapshotKind.ENDPOINT and not lane.resumed_from_endpoint:
        last = None  # a re-rendering successor resumes there
    if last is not None and last.origin in (TapSource.LADDER, TapSource.FOLLOWUP):
        last = None  # kept for prompts leaving this one before its end (above)
    out: list[Snapshot] = []
    for t in (src, last):
        if t is not None and t.frontier < frontier and may_supersede(t, snapshots) and t not in out:
            out.append(t)
    # Off the lane's path (it would have resumed there otherwise): its depth says nothing.
    if sibling is not None and sibling is not src and may_supersede(sibling, snapshots):
        out.append(sibling)
    return out
