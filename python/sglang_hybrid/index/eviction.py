"""Device eviction and losing the last copy (spec §9.1, §9.4).

SGLang's ``evict`` asks for device tokens; :func:`evict_device` takes them from the device LRU
(``ResidencyTracker``), backed entries first: dropping a backed copy is bookkeeping, an unbacked
one loses the block, and with it everything below it (:func:`delete_subtree`).

Functions of one :class:`~.prefix_index.PrefixIndex`, which its ``evict_device`` and
``delete_subtree`` call (as ``persist`` holds persistence). They change the index's parts only
through those parts' methods and the index's own (``delete_snapshot``, ``note_pressure``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .node import BlockNode, FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


def delete_subtree(index: PrefixIndex, node: BlockNode) -> None:
    """The node, everything below it and their snapshots leave the index (§9.4)."""
    index.stats.subtree_deletions += 1
    # Most deletions are of a childless block (device eviction under pressure: 867k of the
    # Mooncake trace's victims), whose subtree is itself: no walk for them.
    nodes = (node,) if node.n_children == 0 else list(index.tree.subtree_postorder(node))
    for x in nodes:
        assert x.active_refs == 0 and x.restore_pins == 0, f"deleting pinned {x}"
        if x.snapshots:
            for s in list(x.snapshots):
                index.delete_snapshot(s)
        index.residency.forget_node(x)
        index.ghosts.remember(x, index.tree.n_nodes)
        if x.host_state is not R.ABSENT:
            assert index.host is not None
            index.host.release([x.host_slab])
            x.host_slab, x.host_state = -1, R.ABSENT
        index.tree.remove_leaf(x)
    index.note_pressure(1)


def evict_device(index: PrefixIndex, tokens: int, *, backed_only: bool = False) -> int:
    """Free at least ``tokens`` device tokens from the LRU if it can; returns tokens freed.

    ``backed_only`` never drops a last copy (a prefetch must not, §6.6).
    """
    residency, tree, stats = index.residency, index.tree, index.stats
    pop = residency.lru.pop_victim
    start = residency.device_tokens
    goal = start - tokens
    victims = 0
    while residency.device_tokens > goal:
        # Taken out of the LRU first: what follows drops the device copy, whose LRU removal
        # (``discard``) then finds nothing to do; the bare leaf's path skips it.
        popped = pop(backed_only)
        if popped is None:
            break
        victim = popped[0]
        victims += 1
        if type(victim) is BlockNode:
            if victim.host_state is R.RESIDENT:
                stats.device_evicted_backed += 1
                residency.drop_node_device(victim)
            elif victim.n_children == 0 and not victim.snapshots and victim.host_state is R.ABSENT:
                # The common victim under pressure (867k of the Mooncake trace's): a bare leaf
                # whose device copy is its only copy. Its subtree is itself: deleted in one step
                # (``check_integrity`` recomputes what this touches). No snapshot lies below a
                # bare leaf: dead, nothing is lost.
                stats.device_evicted_dead += 1
                stats.subtree_deletions += 1
                residency.forget_evicted(victim)
                index.ghosts.remember(victim, tree.n_nodes)
                tree.remove_leaf(victim)
            else:
                if victim.live_snapshots_below:
                    stats.device_evicted_unbacked += 1  # a resumable path loses its last copy
                else:
                    stats.device_evicted_dead += 1
                delete_subtree(index, victim)
        else:
            assert isinstance(victim, Snapshot)
            if victim.tail_host_state is R.RESIDENT:
                stats.device_evicted_backed += 1
                residency.drop_tail_device(victim)
            else:
                stats.device_evicted_unbacked += 1
                index.delete_snapshot(victim)
    index.note_pressure(victims)  # device pressure moves no resume point
    index.reserve.note_evicted(start - residency.device_tokens)
    if victims:
        index.thrash.note_eviction()
    return start - residency.device_tokens
