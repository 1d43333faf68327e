"""Residency of device and host copies, and device pressure (spec §9.1, §9.4).

A mixin of :class:`~.prefix_index.PrefixIndex`: the single place that re-derives LRU and dead-KV
membership from a node's or tail's fields, the drops that free copies (queuing device handles for
the binding), subtree deletion when the last copy goes, and the device LRU eviction loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import valuation as val
from .keys import BLOCK_TOKENS
from .node import BlockNode, FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .device_lru import DeviceLRU
    from .device_slots import DeviceSnapshotSlots
    from .host_slabs import HostSlabPool
    from .prefix_index import IndexStats
    from .tree import BlockTree
    from .valuation import Valuer

R = FastResidency  # Residency, read faster (node.py)


class DeviceResidency:
    # State owned by PrefixIndex (declared for readers and type checkers).
    tree: BlockTree
    lru: DeviceLRU
    slots: DeviceSnapshotSlots
    host: HostSlabPool | None
    stats: IndexStats
    valuer: Valuer
    dead: dict[BlockNode, None]
    device_tokens: int
    epoch: int
    _freed: list[tuple[object, int]]

    def _node_changed(self, n: BlockNode) -> None:
        """Re-derive LRU and dead-KV membership from the node's fields (the single place)."""
        free = n.active_refs == 0 and n.restore_pins == 0
        in_lru = free and n.device_state is R.RESIDENT
        backed = n.host_state is R.RESIDENT
        if in_lru:
            if n in self.lru:
                self.lru.set_backed(n, backed)
            else:
                self.lru.add(n, BLOCK_TOKENS, backed)
        elif n in self.lru:
            self.lru.remove(n)
        dead = free and backed and n.live_snapshots_below == 0
        if dead:
            if n not in self.dead:
                self.dead[n] = None
        elif n in self.dead:
            del self.dead[n]

    def _tail_changed(self, s: Snapshot) -> None:
        in_lru = s.tail_device_state is R.RESIDENT and s.restore_pins == 0
        backed = s.tail_host_state is R.RESIDENT
        if in_lru:
            if s in self.lru:
                self.lru.set_backed(s, backed)
            else:
                self.lru.add(s, s.tail_device_tokens, backed)
        elif s in self.lru:
            self.lru.remove(s)

    def _drop_image_device(self, s: Snapshot) -> None:
        self.slots.release(s.device_slot)
        s.device_slot, s.device_state = -1, R.ABSENT
        self.epoch += 1

    def _drop_tail_device(self, s: Snapshot) -> None:
        self.lru.discard(s)
        self._freed.append((s.tail_device, s.tail_device_tokens))
        self.device_tokens -= s.tail_device_tokens
        s.tail_device, s.tail_device_state = None, R.ABSENT

    def _drop_node_device(self, n: BlockNode) -> None:
        self.lru.discard(n)
        self._freed.append((n.device, BLOCK_TOKENS))
        self.device_tokens -= BLOCK_TOKENS
        n.device, n.device_state = None, R.ABSENT
        self._node_changed(n)

    def drop_node_host(self, n: BlockNode) -> None:
        """Free a node's host copy; with no device copy left the subtree goes too (§9.4)."""
        assert self.host is not None
        self.host.release([n.host_slab])
        n.host_slab, n.host_state = -1, R.ABSENT
        if n.device_state is R.ABSENT:
            self.delete_subtree(n)
        else:
            self._node_changed(n)
            if (owner := val.sole_retained_below(n)) is not None:
                self.valuer.revalue(owner)  # its exclusive path lost host bytes
        self.epoch += 1

    def drop_snapshot_host(self, s: Snapshot) -> None:
        """Free a snapshot's host copies (image and tail); its device copies stay (§9.3)."""
        assert self.host is not None
        if s.host_slabs:
            self.host.release(s.host_slabs)
        s.host_slabs, s.host_state = (), R.ABSENT
        if s.tail_host_slab >= 0:
            self.host.release([s.tail_host_slab])
            s.tail_host_slab, s.tail_host_state = -1, R.ABSENT
            self._tail_changed(s)
        self.valuer.revalue(s)
        self.epoch += 1

    def delete_subtree(self, node: BlockNode) -> None:
        """Losing the last copy (§9.4): the node, everything below it and their snapshots go."""
        self.stats.subtree_deletions += 1
        for x in list(self.tree.subtree_postorder(node)):
            assert x.active_refs == 0 and x.restore_pins == 0, f"deleting pinned {x}"
            for s in list(x.snapshots or ()):
                self.delete_snapshot(s)
            if x.device_state is not R.ABSENT:
                self.lru.discard(x)
                self._freed.append((x.device, BLOCK_TOKENS))
                self.device_tokens -= BLOCK_TOKENS
                x.device, x.device_state = None, R.ABSENT
            if x.host_state is not R.ABSENT:
                assert self.host is not None
                self.host.release([x.host_slab])
                x.host_slab, x.host_state = -1, R.ABSENT
            self.dead.pop(x, None)
            self.tree.remove_leaf(x)
        self.epoch += 1

    # ================================================================ device pressure (§9.1)
    def evict_device(self, tokens: int, *, backed_only: bool = False) -> int:
        """Free at least ``tokens`` device tokens from the LRU if it can; returns tokens freed.

        ``backed_only`` never drops a last copy (a prefetch must not, §6.6).
        """
        start = self.device_tokens
        while start - self.device_tokens < tokens:
            if backed_only:
                victim = next(iter(self.lru.backed), None)
            else:
                victim = self.lru.peek_victim()
            if victim is None:
                break
            if isinstance(victim, BlockNode):
                if victim.host_state is R.RESIDENT:
                    self.stats.device_evicted_backed += 1
                    self._drop_node_device(victim)
                else:
                    self.stats.device_evicted_unbacked += 1
                    self.delete_subtree(victim)
            else:
                assert isinstance(victim, Snapshot)
                if victim.tail_host_state is R.RESIDENT:
                    self.stats.device_evicted_backed += 1
                    self._drop_tail_device(victim)
                else:
                    self.stats.device_evicted_unbacked += 1
                    self.delete_snapshot(victim)
            self.epoch += 1
        return start - self.device_tokens
