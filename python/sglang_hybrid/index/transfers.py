"""Host copies in both directions (spec §6.5, §7.6, §9.3): write-through and restores.

A mixin of :class:`~.prefix_index.PrefixIndex`. Writes reserve host slabs (evicting per §9.3, a
snapshot image only when nothing worth more goes) and mark them Filling until the binding's copy
completes; restores mark device destinations Filling and pin them until they land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import valuation as val
from .keys import BLOCK_TOKENS
from .node import BlockNode, Residency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .host_slabs import HostSlabPool
    from .lane import Lane
    from .prefix_index import IndexStats

R = Residency


class HostTransfers:
    # State owned by PrefixIndex (declared for readers and type checkers).
    host: HostSlabPool | None
    stats: IndexStats
    device_tokens: int
    epoch: int
    _freed: list[tuple[object, int]]

    def plan_writes(self, lane: Lane) -> list[tuple[BlockNode, int]]:
        """Host slabs for the lane's device-only blocks (write-through at release, §7.6).

        Marks them Filling on the host; the caller copies, then calls :meth:`complete_writes`.
        Blocks that find no room stay device-only (unbacked).
        """
        if self.host is None or not lane.enabled:
            return []
        from .host_eviction import make_room

        todo = [n for n in lane.path if n.host_state is R.ABSENT and n.device_state is R.RESIDENT]
        if todo and make_room(self, len(todo)):  # the common case: room for all in one go
            slabs = self.host.alloc(len(todo))
            assert slabs is not None
            for node, slab in zip(todo, slabs, strict=True):
                node.host_slab, node.host_state = slab, R.FILLING
            return list(zip(todo, slabs, strict=True))
        out: list[tuple[BlockNode, int]] = []
        for node in todo:  # short of room: as many as eviction frees, root first
            if not make_room(self, 1):
                break
            slab = self.host.alloc(1)[0]  # type: ignore[index]
            node.host_slab, node.host_state = slab, R.FILLING
            out.append((node, slab))
        return out

    def abort_writes(self, planned: list[tuple[BlockNode, int]]) -> None:
        """The binding's copy of ``planned`` failed: the slabs go back, the blocks stay
        device-only (their device copies are intact)."""
        assert self.host is not None
        for node, slab in planned:
            assert node.host_state is R.FILLING and node.host_slab == slab, node
            node.host_slab, node.host_state = -1, R.ABSENT
            self._node_changed(node)
        self.host.release([slab for _, slab in planned])
        self.epoch += 1

    def complete_writes(self, written: list[tuple[BlockNode, int]]) -> None:
        done = {id(n) for n, _ in written}
        owners: dict[int, Snapshot] = {}
        for node, _ in written:
            node.host_state = R.RESIDENT
            self._node_changed(node)
        for node, _ in written:
            p = node.parent
            if node.retained_below == 1 and (
                p is None or id(p) not in done or p.retained_below != 1
            ):
                o = val.sole_retained_below(node)
                if o is not None:
                    owners[o.id] = o
        for o in owners.values():
            self.valuer.revalue(o)
        self.epoch += 1

    def plan_image_write(self, s: Snapshot) -> tuple[tuple[int, ...], int] | None:
        """Host slabs for ``s``'s image (and tail): refused when GDSF would have to evict something
        worth more (§9.3); then ``s`` stays device-only. Returns (image slabs, tail slab or -1)."""
        if self.host is None or s.host_state is not R.ABSENT:
            return None
        from .host_eviction import make_room

        want_tail = bool(s.tail) and s.tail_host_state is R.ABSENT
        k = self.host.image_slabs + (1 if want_tail else 0)
        self.pin_snapshot(s)  # the victim search must not pick the snapshot being written
        ok = make_room(self, k, bound=s.h)
        self.unpin_snapshot(s)
        if not ok:
            self.stats.image_writes_refused += 1
            return None
        slabs = self.host.alloc(k)
        assert slabs is not None
        tail_slab = slabs.pop() if want_tail else -1
        s.host_slabs, s.host_state = tuple(slabs), R.FILLING
        if want_tail:
            s.tail_host_slab, s.tail_host_state = tail_slab, R.FILLING
        self.pin_snapshot(s)
        return s.host_slabs, tail_slab

    def abort_image_write(self, s: Snapshot) -> None:
        """The image (or tail) copy failed: its slabs go back and ``s`` stays device-only."""
        assert self.host is not None and s.host_state is R.FILLING, s
        slabs = list(s.host_slabs)
        if s.tail_host_state is R.FILLING:
            slabs.append(s.tail_host_slab)
            s.tail_host_slab, s.tail_host_state = -1, R.ABSENT
        s.host_slabs, s.host_state = (), R.ABSENT
        self.host.release(slabs)
        self.unpin_snapshot(s)
        self.epoch += 1

    def complete_image_write(self, s: Snapshot) -> None:
        s.host_state = R.RESIDENT
        if s.tail_host_state is R.FILLING:
            s.tail_host_state = R.RESIDENT
        self.unpin_snapshot(s)
        self.epoch += 1

    # Restores (host -> device) mark destinations Filling until they land (§6.5).
    def begin_node_fill(self, node: BlockNode, device: object) -> None:
        assert node.device_state is R.ABSENT and node.host_state is R.RESIDENT, node
        node.device, node.device_state = device, R.FILLING
        node.restore_pins += 1
        self.device_tokens += BLOCK_TOKENS
        self._node_changed(node)

    def finish_node_fill(self, node: BlockNode) -> None:
        node.device_state = R.RESIDENT
        node.restore_pins -= 1
        self._node_changed(node)
        self.epoch += 1

    def abort_node_fill(self, node: BlockNode) -> None:
        """A restore into ``node`` failed: its destination pages go back (queued for the
        binding) and the node is host-only again."""
        assert node.device_state is R.FILLING, node
        node.restore_pins -= 1
        self._freed.append((node.device, BLOCK_TOKENS))
        self.device_tokens -= BLOCK_TOKENS
        node.device, node.device_state = None, R.ABSENT
        self._node_changed(node)
        self.epoch += 1

    def pin_for_prefetch(self, nodes: list[BlockNode]) -> None:
        """Keep ``nodes`` (a blocked head's path) out of eviction while its prefetch runs."""
        for n in nodes:
            n.restore_pins += 1
            self._node_changed(n)

    def unpin_for_prefetch(self, nodes: list[BlockNode]) -> None:
        for n in nodes:
            n.restore_pins -= 1
            assert n.restore_pins >= 0, n
            self._node_changed(n)

    def begin_tail_fill(self, s: Snapshot, device: object, tokens: int) -> None:
        assert s.tail_device_state is R.ABSENT and s.tail_host_state is R.RESIDENT, s
        s.tail_device, s.tail_device_state, s.tail_device_tokens = device, R.FILLING, tokens
        self.device_tokens += tokens
        self.pin_snapshot(s)

    def finish_tail_fill(self, s: Snapshot) -> None:
        s.tail_device_state = R.RESIDENT
        self.unpin_snapshot(s)
        self.epoch += 1

    def abort_tail_fill(self, s: Snapshot) -> None:
        assert s.tail_device_state is R.FILLING, s
        self._freed.append((s.tail_device, s.tail_device_tokens))
        self.device_tokens -= s.tail_device_tokens
        s.tail_device, s.tail_device_state, s.tail_device_tokens = None, R.ABSENT, 0
        self.unpin_snapshot(s)
        self.epoch += 1
