"""Snapshots: a saved recurrent state at frontier F, anchored on the tree (spec §5.3, §9.3).

The state after tokens [0, F) is the image (SGLang: one MambaPool slot, conv + recurrent state of
every linear-attention layer). When F is not a multiple of 64 the snapshot also owns the KV of the
partial block as its *tail*: tail tokens are part of its identity, and there is at most one
snapshot per (anchor, tail tokens).

A snapshot exists only while it is valid: every path node, the tail and the image each keep at
least one copy (device or host). Validity is kept eagerly by the index, never checked lazily.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .node import BlockNode, FastResidency, Residency


class SnapshotKind(enum.IntEnum):
    TAP = 0  # planned in prefill (§7.1); lineage-private
    ENDPOINT = 1  # the live state at finish / cancel (§7.7)
    BOUNDARY = 2  # explicit or structural boundary, or a branch point: may be shared (§9.3)


@dataclass(slots=True, eq=False)
class Snapshot:
    # Identity: set when published (``PrefixIndex.publish`` / ``adopt_snapshot``), never changed.
    id: int
    anchor: BlockNode  # last full block below the frontier (the root when F < 64)
    frontier: int
    tail: bytes  # exact packed tokens [64*(anchor.depth+1), F)
    kind: SnapshotKind
    # Why it was planned: a ``TapSource`` value (0: not planned, an endpoint, or unknown after a
    # restart); reported by the boundary query (``resume_points``), never used to decide.
    origin: int = 0
    # Image copies. The device slot indexes the cache's D snapshot slots; only changed by
    # ``PrefixIndex`` (publish, drop_image_device, delete_snapshot).
    device_slot: int = -1
    device_state: Residency = Residency.ABSENT
    # Host copies of the image and the tail: only changed by ``HostTransfers`` (image writes)
    # and ``PrefixIndex`` (drop_snapshot_host, delete_snapshot, adopt_snapshot).
    host_slabs: tuple[int, ...] = ()
    host_state: Residency = Residency.ABSENT
    tail_host_slab: int = -1
    tail_host_state: Residency = Residency.ABSENT
    # Tail KV device copy (only when tail is non-empty), tail_device_tokens its footprint in
    # slots: only changed by ``ResidencyTracker`` (attach_tail, drop_tail_device) and
    # ``HostTransfers`` (a tail fill landing or failing).
    tail_device: object | None = None
    tail_device_state: Residency = Residency.ABSENT
    tail_device_tokens: int = 0
    # Copies reading this snapshot (COW into a lane, restore, write); only changed by
    # ``PrefixIndex.pin_snapshot`` / ``unpin_snapshot``.
    restore_pins: int = 0
    # Pinned by a client: exempt from host eviction; only changed by ``durable.set_durable``.
    durable: bool = False
    # The pin has a TTL (a timer of the server's HTTP process releases it): not kept across a
    # restart. Only changed by ``durable.set_durable``.
    durable_expires: bool = False
    # Supersession (§9.3); only changed by ``PrefixIndex`` (supersede, and a hit retaining again).
    superseded: bool = False
    superseded_tick: int = 0
    # A tap that was its request's last: the id of the endpoint that request published after
    # it, superseded once a later request resumes from this tap, since that request left the
    # endpoint's path (``supersession.lineage``); -1: none. Only set by ``PrefixIndex.publish``.
    sibling_endpoint: int = -1
    # The endpoint of a lane that re-rendered the answer before it (``Lane.left_answer``): its
    # own next turn will re-render this one too, minutes later, so it is never written to the
    # host; on the device it serves what comes within seconds (an agent's next tool step echoes
    # it). Only set by ``PrefixIndex.publish``.
    device_only: bool = False
    # GDSF (§9.3): H = l_at + (prior + hits + demand) * cost / size, ``prior`` the spec's 1
    # learned per origin (``source_hits``, fixed at publication). prior, hits, demand, l_at and
    # last_hit_tick are only changed by ``PrefixIndex`` (publish, a hit, adopt_snapshot); cost,
    # size and h only by ``Valuer`` (revalue, recost).
    prior: float = 1.0
    hits: int = 0
    demand: int = 0  # waiting requests known to resume here (§12.2): hits that have not come yet
    l_at: float = 0.0
    cost: float = 0.0
    size: float = 0.0
    h: float = 0.0
    last_hit_tick: int = 0
    # Requests opened (``PrefixIndex.requests``) at publication or the last hit: its age for
    # ``hit_density``. Only changed by ``PrefixIndex`` (publish, a hit, adopt_snapshot).
    used_at: int = 0
    # Resumes of its lineage before it was published: the snapshot its lane resumed from had
    # been resumed from ``inherited + hits`` times (a conversation's turn count, a prompt's
    # repeats). ``lineage_hits`` is LHD's frequency for ``hit_density``: each turn publishes a
    # new snapshot, so its own hits alone never count past one. Only set by ``PrefixIndex.publish``.
    inherited: int = 0
    # Its place in ``GdsfQueue``'s sampling pool, -1 when not there; only changed by the queue.
    pool_pos: int = -1
    # Nearest snapshot above on the path, and the snapshots that record this one as theirs;
    # only changed by ``links`` (link, unlink).
    ancestor: Snapshot | None = None
    dependents: list[Snapshot] = field(default_factory=list)

    @property
    def lineage_hits(self) -> int:
        return self.inherited + self.hits

    @property
    def tail_len(self) -> int:
        return self.frontier - 64 * (self.anchor.depth + 1)

    @property
    def has_tail(self) -> bool:
        return self.frontier % 64 != 0

    @property
    def image_on_device(self) -> bool:
        return self.device_state is not FastResidency.ABSENT

    @property
    def image_on_host(self) -> bool:
        return self.host_state is not FastResidency.ABSENT

    @property
    def tail_on_device(self) -> bool:
        return self.tail_device_state is not FastResidency.ABSENT

    @property
    def tail_on_host(self) -> bool:
        return self.tail_host_state is not FastResidency.ABSENT

    @property
    def complete_on_device(self) -> bool:
        return self.image_on_device and (not self.has_tail or self.tail_on_device)

    @property
    def host_backed(self) -> bool:
        return self.image_on_host and (not self.has_tail or self.tail_on_host)

    def __repr__(self) -> str:
        return (
            f"Snapshot(id={self.id}, F={self.frontier}, kind={self.kind.name}, "
            f"slot={self.device_slot}, host={self.host_state.name}, "
            f"superseded={self.superseded}, H={self.h:.3g})"
        )
