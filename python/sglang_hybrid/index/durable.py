"""Durable checkpoints (issue #16): snapshots a client pinned in the host tier until released.

``POST /hybrid/checkpoint`` with ``durable: true`` exempts a snapshot from host eviction
(superseded-first and GDSF skip it, ``host_eviction._evictable``): the highest retention there is.
Only a snapshot whose image, tail and whole path are resident on the host can be pinned: device
eviction then only ever drops its device copies (a host-backed block or image is dropped, never
deleted), and the dead-KV sweep never reaches its path (the snapshot keeps it live). Pinned bytes
are bounded by ``MAX_SHARE`` of the host tier, so pins can never leave the cache without room.
A pin without a TTL is kept across a restart (``--hybrid-cache-file``: ``persist.py`` saves the
flag and pins the snapshot again once adopted); a pin with a TTL is reloaded unpinned, since its
release was a timer of the previous server's HTTP process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .node import FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

MAX_SHARE = 0.5  # of the host tier's slabs, for the images and tails of durable snapshots


def _slabs(s: Snapshot) -> int:
    return len(s.host_slabs) + (1 if s.tail_host_slab >= 0 else 0)


def why_not_pinnable(index: PrefixIndex, s: Snapshot) -> str | None:
    """None when ``s`` can be made durable, else the reason."""
    host = index.host
    if host is None:
        return "durable checkpoints live in the host tier, which is off (--hybrid-host-cache-mib)"
    if s.durable:
        return None
    if not s.host_backed:
        return "its state is not in the host tier yet (its write is in flight or was refused)"
    node = s.anchor
    while node.parent is not None:
        if node.host_state is not FastResidency.RESIDENT:
            return "its prefix's KV is not in the host tier yet"
        node = node.parent
    pinned = sum(_slabs(x) for x in index.snapshots.values() if x.durable)
    if pinned + _slabs(s) > MAX_SHARE * host.n_slabs:
        return (
            f"durable checkpoints would hold more than {MAX_SHARE:.0%} of the host tier; "
            f"release some first"
        )
    return None


def set_durable(index: PrefixIndex, s: Snapshot, durable: bool, *, expires: bool = False) -> None:
    """Pin (``why_not_pinnable`` must have said None) or release ``s``; ``expires``: the pin has
    a TTL (released by a timer, so not kept across a restart)."""
    if durable and (why := why_not_pinnable(index, s)) is not None:
        raise ValueError(f"{s} cannot be made durable: {why}")
    s.durable = durable
    s.durable_expires = durable and expires
