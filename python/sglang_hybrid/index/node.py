"""Tree nodes: one 64-token block of KV, its copies, and the counts that keep eviction exact.

A node is immutable once inserted (spec §10.2): tokens, extra key and parent never change.
Residency, pins and counts change; :class:`~.tree.BlockTree` and :class:`~.prefix_index.PrefixIndex`
keep them consistent and :func:`~.invariants.check_integrity` proves it after any step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .snapshot import Snapshot


class Residency(enum.IntEnum):
    ABSENT = 0
    RESIDENT = 1
    FILLING = 2  # a transfer is writing this copy; readers wait, nobody frees it (§6.5)


class FastResidency:
    """:class:`Residency`'s members as plain class attributes (the same objects), for the
    O(path) loops (pin, release, commit): CPython 3.11 reads an Enum member off its class
    ~100 ns slower than a plain class attribute, twice per node per walk."""

    ABSENT = Residency.ABSENT
    RESIDENT = Residency.RESIDENT
    FILLING = Residency.FILLING


@dataclass(slots=True, eq=False)
class BlockNode:
    """Block ``depth`` of every prompt whose path runs through here: positions [64d, 64d+64)."""

    id: int
    parent: BlockNode | None
    depth: int  # block index b; the root is -1
    lookup_hash: int
    extra: int
    tokens: bytes  # exact packed tokens of the block (§5.1)
    children: dict[int, BlockNode] | None = None  # by lookup_hash; collisions chain via hash_next
    hash_next: BlockNode | None = None
    n_children: int = 0
    # Device copy: an opaque handle owned by the binding (SGLang: the block's KV slot ids).
    device: object | None = None
    device_state: Residency = Residency.ABSENT
    host_slab: int = -1
    host_state: Residency = Residency.ABSENT
    # Liveness (§5.2). active_refs: lanes mapping this node; restore_pins: transfers touching it.
    active_refs: int = 0
    restore_pins: int = 0
    # Path counters, per branch: snapshots anchored here + children whose own count is nonzero.
    # Zero exactly when no (retained) snapshot's path includes this node, which is all §9.3 and
    # §9.4 ask; counting branches lets an update stop at the first ancestor already counted.
    live_snapshots_below: int = 0
    retained_below: int = 0
    forks_below: int = 0  # nodes with >= 2 children in this subtree (Boundary rule, §9.3)
    last_access: int = 0
    # End of the latest prompt whose last WINDOW_TOKENS ran through here (``followups``); only
    # set by ``PrefixIndex.release``.
    prompt_end: int = 0
    snapshots: list[Snapshot] | None = field(default=None)  # anchored here

    @property
    def is_root(self) -> bool:
        return self.depth < 0

    @property
    def on_device(self) -> bool:
        return self.device_state is not Residency.ABSENT

    @property
    def on_host(self) -> bool:
        return self.host_state is not Residency.ABSENT

    @property
    def end(self) -> int:
        """Token position after this block."""
        return 64 * (self.depth + 1)

    def iter_children(self) -> Iterator[BlockNode]:
        if self.children:
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
