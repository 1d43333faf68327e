"""Tree nodes: one 64-token block of KV, its copies, and the counts that keep eviction exact.

A node is immutable once inserted (spec §10.2): tokens, extra key and parent never change.
Residency, pins and counts change, each field only by the writers its comment names (the index's
parts: ``tree``, ``residency``, ``transfers``, ``path_counts``, the facade ``prefix_index``);
:func:`~.invariants.check_integrity` proves them consistent after any step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .snapshot import Snapshot


class Residency(enum.IntEnum):
    ABSENT = 0
    RESIDENT = 1
    FILLING = 2  # a transfer is writing this copy; readers wait, nobody frees it (§6.5)


class FastResidency:
    """:class:`Residency`'s members as plain class attributes (the same objects). Code reads
    residency values through this one spelling (``R = FastResidency``) and names the type
    :class:`Residency`: CPython 3.11 reads an Enum member off its class ~80 ns slower than a
    plain class attribute, and the O(path) loops (pin, release, commit, match) read it per node."""

    ABSENT: Final = Residency.ABSENT
    RESIDENT: Final = Residency.RESIDENT
    FILLING: Final = Residency.FILLING


@dataclass(slots=True, eq=False)
class BlockNode:
    """Block ``depth`` of every prompt whose path runs through here: positions [64d, 64d+64)."""

    # Identity and place: set by ``BlockTree.add_child``, never changed after (§10.2), except
    # ``parent``, cleared by ``BlockTree.remove_leaf`` when the node leaves the tree.
    id: int
    parent: BlockNode | None
    depth: int  # block index b; the root is -1
    lookup_hash: int
    extra: int
    tokens: bytes  # exact packed tokens of the block (§5.1)
    # Children; only changed by ``BlockTree``. One child (a chain, most nodes): ``only_child``,
    # no dict. Two or more: ``children`` by lookup_hash, collisions chained via hash_next. A dict
    # per chain node was a third of a block's memory and one more object for the cyclic GC to
    # track (issue #15); the representation follows ``n_children`` exactly (``check_integrity``).
    only_child: BlockNode | None = None
    children: dict[int, BlockNode] | None = None
    hash_next: BlockNode | None = None
    n_children: int = 0
    # Device copy: an opaque handle owned by the binding (SGLang: the block's KV slot ids). Only
    # changed by ``PrefixIndex.commit`` (a lane's page becomes the copy), ``ResidencyTracker``
    # (attach, drop, delete) and ``HostTransfers.finish_node_fill`` (Filling -> Resident).
    device: object | None = None
    device_state: Residency = Residency.ABSENT
    # Host copy: a slab of the index's ``HostSlabPool``. Only changed by ``HostTransfers``
    # (write-through), ``PrefixIndex.drop_node_host`` / ``delete_subtree`` and
    # ``PrefixIndex.adopt_node`` (a restart, §5.5).
    host_slab: int = -1
    host_state: Residency = Residency.ABSENT
    # Liveness (§5.2). active_refs: lanes mapping this node; only changed by
    # ``ResidencyTracker.ref`` / ``release_path`` and ``PrefixIndex.commit`` (a new node starts
    # with its lane's ref). restore_pins: transfers touching it; only changed by
    # ``HostTransfers`` (fills, prefetch pins).
    active_refs: int = 0
    restore_pins: int = 0
    # Path counters, per branch: snapshots anchored here + children whose own count is nonzero.
    # Zero exactly when no (retained) snapshot's path includes this node, which is all §9.3 and
    # §9.4 ask; counting branches lets an update stop at the first ancestor already counted.
    # Only changed by ``path_counts`` (live: ``add_live``; retained: ``add_retained`` /
    # ``remove_retained``).
    live_snapshots_below: int = 0
    retained_below: int = 0
    # Nodes with >= 2 children in this subtree (Boundary rule, §9.3); only changed by BlockTree.
    forks_below: int = 0
    # The tick of its last pin or hit; only changed by ``PrefixIndex`` (open_lane, commit, touch).
    last_access: int = 0
    # End of the latest prompt whose last WINDOW_TOKENS ran through here (``followups``); only
    # changed by ``PrefixIndex.release``.
    prompt_end: int = 0
    # Snapshots anchored here; only changed by ``PrefixIndex`` (link and delete a snapshot).
    snapshots: list[Snapshot] | None = field(default=None)

    @property
    def is_root(self) -> bool:
        return self.depth < 0

    @property
    def on_device(self) -> bool:
        return self.device_state is not FastResidency.ABSENT

    @property
    def on_host(self) -> bool:
        return self.host_state is not FastResidency.ABSENT

    @property
    def end(self) -> int:
        """Token position after this block."""
        return 64 * (self.depth + 1)

    def iter_children(self) -> Iterator[BlockNode]:
        if self.only_child is not None:
            yield self.only_child
        elif self.children:
            for head in self.children.values():
                c: BlockNode | None = head
                while c is not None:
                    yield c
                    c = c.hash_next

    def __repr__(self) -> str:
        return (
            f"BlockNode(id={self.id}, depth={self.depth}, dev={self.device_state.name}, "
            f"host={self.host_state.name}, refs={self.active_refs}, pins={self.restore_pins}, "
            f"live={self.live_snapshots_below})"
        )
