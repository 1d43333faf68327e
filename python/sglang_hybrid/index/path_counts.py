"""Snapshot path counters (spec §5.2, §9.3): ``live_snapshots_below`` and ``retained_below``.

Counts are per branch (own anchored snapshots + children whose count is nonzero), so an update
propagates only while a count crosses zero: publishing below a live snapshot stops at it. Zero
still means exactly "no snapshot's path includes this node" (§5.2); ``retained_below`` counts only
retained (not superseded) snapshots, which is what the exclusive path of GDSF's Z needs (§9.3).
These functions are the only writers of the two fields; :class:`~.prefix_index.PrefixIndex` calls
them when it links, supersedes, retains again or deletes a snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import valuation as val
from .node import BlockNode, FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .residency import ResidencyTracker

R = FastResidency  # Residency, read faster (node.py)


def add_live(node: BlockNode, delta: int, residency: ResidencyTracker) -> None:
    """Count a snapshot anchored at ``node`` in (+1) or out (-1) along its path."""
    changed = residency.node_changed
    while node.parent is not None:
        before = node.live_snapshots_below
        node.live_snapshots_below = before + delta
        if (before == 0) == (before + delta == 0):
            return
        # Liveness decides dead-KV membership, which needs a host copy, and with an exclusive
        # host the device LRU's dead list: re-derive there.
        if node.host_state is R.RESIDENT or (
            residency.dead_first and node.device_state is R.RESIDENT
        ):
            changed(node)
        node = node.parent


def add_retained(s: Snapshot) -> Snapshot | None:
    """Count ``s`` as retained; returns the snapshot whose exclusive path it now shares.

    ``s`` must not yet be visible as retained at its anchor (unlisted or still flagged).
    """
    node = s.anchor
    while node.parent is not None and not node.retained_below:
        node = node.parent
    owner = val.sole_retained_below(node) if node.parent is not None else None
    node = s.anchor
    while node.parent is not None:
        node.retained_below += 1
        if node.retained_below > 1:
            break
        node = node.parent
    return owner


def remove_retained(s: Snapshot) -> Snapshot | None:
    """Stop counting ``s`` (already flagged); returns the snapshot whose exclusive path grew."""
    node = s.anchor
    while node.parent is not None:
        node.retained_below -= 1
        if node.retained_below:
            return val.sole_retained_below(node)
        node = node.parent
    return None
