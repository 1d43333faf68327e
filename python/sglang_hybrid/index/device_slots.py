"""Device snapshot slots (spec §9.2): D state images resident beside the active lanes.

A slot is free, *staging* (a tap copied there, waiting for its blocks to commit, §7.4) or owned by
a published snapshot. A new tap or endpoint takes a slot in this order:

1. a free slot;
2. the slot of a superseded snapshot, oldest supersession first (it keeps its host copy or, with
   none, is deleted);
3. the slot of a device-only snapshot with the lowest GDSF priority, only when the new snapshot's
   estimated priority is at least as high (the old one is lost; L rises to its priority) and,
   while the cache thrashes, its use count higher (``newcomers``);
4. the slot of the least recently hit host-backed snapshot (it only loses its device copy).

Otherwise the new snapshot is skipped. Value decides for device-only owners because their slot is
their last copy; recency decides for host-backed ones because they stay restorable.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection
from typing import NamedTuple

from .newcomers import snapshot_uses
from .node import FastResidency
from .snapshot import Snapshot

STAGING = object()  # owner of a slot holding an unpublished tap


class SlotSource(enum.IntEnum):
    FREE = 1
    SUPERSEDED = 2
    DEVICE_ONLY = 3
    HOST_BACKED = 4


class SlotChoice(NamedTuple):
    slot: int
    source: SlotSource
    victim: Snapshot | None


class DeviceSnapshotSlots:
    def __init__(self, n: int) -> None:
        self.n = n
        self.owner: list[object | None] = [None] * n
        self._free = list(range(n - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def choose(
        self,
        new_priority: float,
        superseding: Collection[Snapshot] = (),
        rival_uses: int = 1 << 62,
    ) -> SlotChoice | None:
        """``superseding``: snapshots the new one supersedes, ranked as the newest supersessions.
        ``rival_uses``: the new snapshot's use count; a device-only owner used as often or more
        keeps its slot (``newcomers``: while the cache thrashes, the index passes it)."""
        if self._free:
            return SlotChoice(self._free[-1], SlotSource.FREE, None)
        superseded: Snapshot | None = None
        sup_tick = 0.0
        device_only: Snapshot | None = None
        backed: Snapshot | None = None
        resident = FastResidency.RESIDENT
        for owner in self.owner:
            if not isinstance(owner, Snapshot) or owner.restore_pins:
                continue
            if owner.superseded or owner in superseding:
                tick = owner.superseded_tick if owner.superseded else math.inf
                if superseded is None or tick < sup_tick:
                    superseded, sup_tick = owner, tick
            elif owner.host_state is not resident:
                if device_only is None or owner.h < device_only.h:
                    device_only = owner
            elif backed is None or owner.last_hit_tick < backed.last_hit_tick:
                backed = owner
        if superseded is not None:
            return SlotChoice(superseded.device_slot, SlotSource.SUPERSEDED, superseded)
        if (
            device_only is not None
            and new_priority >= device_only.h
            and snapshot_uses(device_only) < rival_uses
        ):
            return SlotChoice(device_only.device_slot, SlotSource.DEVICE_ONLY, device_only)
        if backed is not None:
            return SlotChoice(backed.device_slot, SlotSource.HOST_BACKED, backed)
        return None

    def take(self, slot: int, owner: object) -> None:
        if self.owner[slot] is None:
            self._free.remove(slot)  # O(D); D is small
        self.owner[slot] = owner

    def release(self, slot: int) -> None:
        if self.owner[slot] is None:
            raise AssertionError(f"snapshot slot {slot} released twice")
        self.owner[slot] = None
        self._free.append(slot)
