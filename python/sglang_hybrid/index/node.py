"""Tree nodes: one 64-token block of KV, its copies, and the counts that keep eviction exact.

A node is immutable once inserted (spec §10.2): tokens, extra key and parent never change.
Residency, pins and counts change, each field only by the writers its comment names (the index's
parts: ``tree``, ``residency``, ``transfers``, ``path_counts``, the facade ``prefix_index``);
:func:`~.invariants.check_integrity` proves them consistent after any step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(slots=True, eq=False, init=False)
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
    only_child: BlockNode | None
    children: dict[int, BlockNode] | None
    hash_next: BlockNode | None
    n_children: int
    # Device copy: an opaque handle owned by the binding (SGLang: the block's KV slot ids). Only
    # changed by ``PrefixIndex.commit`` (a lane's page becomes the copy), ``ResidencyTracker``
    # (attach, drop, delete) and ``HostTransfers.finish_node_fill`` (Filling -> Resident).
    device: object | None
    device_state: Residency
    # Host copy: a slab of the index's ``HostSlabPool``. Only changed by ``HostTransfers``
    # (write-through), ``PrefixIndex.drop_node_host`` / ``delete_subtree``,
    # ``PrefixIndex.adopt_node`` (a restart, §5.5) and ``l3_adopt`` (a fetch from L3).
    host_slab: int
    host_state: Residency
    # Liveness (§5.2). active_refs: lanes mapping this node; only changed by
    # ``ResidencyTracker.ref`` / ``release_path`` and ``PrefixIndex.commit`` (a new node starts
    # with its lane's ref). restore_pins: transfers touching it; only changed by
    # ``HostTransfers`` (fills, prefetch pins).
    active_refs: int
    restore_pins: int
    # Path counters, per branch: snapshots anchored here + children whose own count is nonzero.
    # Zero exactly when no (retained) snapshot's path includes this node, which is all §9.3 and
    # §9.4 ask; counting branches lets an update stop at the first ancestor already counted.
    # Only changed by ``path_counts`` (live: ``add_live``; retained: ``add_retained`` /
    # ``remove_retained``).
    live_snapshots_below: int
    retained_below: int
    # Nodes with >= 2 children in this subtree (Boundary rule, §9.3); only changed by BlockTree.
    forks_below: int
    # The tick of its last pin or hit; only changed by ``PrefixIndex`` (open_lane, commit, touch).
    last_access: int
    # End of the latest prompt whose last WINDOW_TOKENS ran through here (``followups``); only
    # changed by ``PrefixIndex.release``.
    prompt_end: int
    # Requests that entered this block, with the count it had when it last left the tree
    # (``newcomers``: scan-resistant placement); only changed by ``PrefixIndex`` (open_lane,
    # commit).
    uses: int
    # Snapshots anchored here; only changed by ``PrefixIndex`` (link and delete a snapshot).
    snapshots: list[Snapshot] | None

    # Written out, not generated: mypyc compiles this one, while the ``__init__`` ``dataclass``
    # generates stays interpreted (~0.9 us a node; commit creates one per new block, issue #15).
    def __init__(
        self,
        id: int,
        parent: BlockNode | None,
        depth: int,
        lookup_hash: int,
        extra: int,
        tokens: bytes,
    ) -> None:
        self.id = id
        self.parent = parent
        self.depth = depth
        self.lookup_hash = lookup_hash
        self.extra = extra
        self.tokens = tokens
        self.only_child = None
        self.children = None
        self.hash_next = None
        self.n_children = 0
        self.device = None
        self.device_state = FastResidency.ABSENT
        self.host_slab = -1
        self.host_state = FastResidency.ABSENT
        self.active_refs = 0
        self.restore_pins = 0
        self.live_snapshots_below = 0
        self.retained_below = 0
        self.forks_below = 0
        self.last_access = 0
        self.prompt_end = 0
        self.uses = 0
        self.snapshots = None

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
