"""Host copies in both directions (spec §6.5, §7.6, §9.3): write-through and restores.

:class:`HostTransfers` is a part of :class:`~.prefix_index.PrefixIndex` (``index.transfers``): the
protocol a binding follows around each copy it makes. Writes reserve host slabs (evicting per
§9.3, a snapshot image only when nothing worth more goes) and mark them Filling until the copy
completes; restores mark device destinations Filling and pin them until they land. Only it marks
copies Filling and changes nodes' ``restore_pins``; device copies are attached and dropped through
the index's ``residency``, snapshots pinned through :meth:`~.prefix_index.PrefixIndex.pin_snapshot`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import valuation as val
from .demotion import demotion_candidates
from .host_eviction import make_room
from .newcomers import snapshot_uses
from .node import BlockNode, FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .lane import Lane
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


class HostTransfers:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    # ================================================================ write-through (§7.6)
    def plan_writes(self, lane: Lane) -> list[tuple[BlockNode, int]]:
        """Host slabs for the lane's device-only blocks (write-through at release, §7.6).

        Marks them Filling on the host; the caller copies, then calls :meth:`complete_writes`.
        Blocks that find no room stay device-only (unbacked).
        """
        ix = self.index
        host = ix.host
        if host is None or not lane.enabled:
            return []
        todo = [n for n in lane.path if n.host_state is R.ABSENT and n.device_state is R.RESIDENT]
        uses = ix.newcomer_uses(todo[-1].uses) if todo else 0  # the deepest: its least used
        if todo and make_room(ix, len(todo), uses=uses):  # the common case: room for all at once
            slabs = host.alloc(len(todo))
            assert slabs is not None
            for node, slab in zip(todo, slabs, strict=True):
                node.host_slab, node.host_state = slab, R.FILLING
            return list(zip(todo, slabs, strict=True))
        out: list[tuple[BlockNode, int]] = []
        for node in todo:  # short of room: as many as eviction frees, root first
            if not make_room(ix, 1, uses=ix.newcomer_uses(node.uses)):
                break
            one = host.alloc(1)
            assert one is not None  # make_room made room for it
            slab = one[0]
            node.host_slab, node.host_state = slab, R.FILLING
            out.append((node, slab))
        return out

    def abort_writes(self, planned: list[tuple[BlockNode, int]]) -> None:
        """The binding's copy of ``planned`` failed: the slabs go back, the blocks stay
        device-only (their device copies are intact)."""
        ix = self.index
        assert ix.host is not None
        for node, slab in planned:
            assert node.host_state is R.FILLING and node.host_slab == slab, node
            node.host_slab, node.host_state = -1, R.ABSENT
            ix.residency.node_changed(node)
        ix.host.release([slab for _, slab in planned])
        ix.epoch += 1

    def complete_writes(self, written: list[tuple[BlockNode, int]]) -> None:
        changed = self.index.residency.node_changed
        for node, _ in written:
            node.host_state = R.RESIDENT
            changed(node)
        self._landed(written)

    def _landed(self, written: list[tuple[BlockNode, int]]) -> None:
        """Blocks gained host copies: the snapshots whose exclusive paths they are revalue (not
        with an exclusive host: Z counts the blocks' device copies already)."""
        ix = self.index
        if ix.valuer.any_tier:
            ix.epoch += 1
            return
        done = {id(n) for n, _ in written}
        owners: dict[int, Snapshot] = {}
        for node, _ in written:
            p = node.parent
            if node.retained_below == 1 and (
                p is None or id(p) not in done or p.retained_below != 1
            ):
                o = val.sole_retained_below(node)
                if o is not None:
                    owners[o.id] = o
        for o in owners.values():
            ix.valuer.revalue(o)
        ix.epoch += 1

    # ================================================================ demotion (``demotion``)
    def plan_demotions(self) -> list[tuple[BlockNode, int]]:
        """Host slabs for the unbacked blocks next in the device's eviction order (an exclusive
        host, once per scheduler iteration). Marks them Filling on the host, which keeps them out
        of the LRU; the caller copies, then calls :meth:`complete_demotions` (or
        :meth:`abort_demotions`). Room is made as for write-through; blocks that find none stay
        unbacked. A block deleted meanwhile (an unpinned ancestor lost its last copy, §9.4) took
        its slab with it: the copy's bytes are then discarded."""
        ix = self.index
        host = ix.host
        if host is None:
            return []
        ix.reserve.tick()
        todo = candidates = demotion_candidates(ix)
        if not candidates:
            return []
        if not make_room(ix, len(todo), uses=ix.newcomer_uses(todo[-1].uses)):
            todo = []
            for node in candidates:  # short of room: as many as eviction frees, oldest first
                if not make_room(ix, len(todo) + 1, uses=ix.newcomer_uses(node.uses)):
                    break
                todo.append(node)
        # Host eviction may have deleted a candidate's subtree (a dead ancestor swept).
        todo = [n for n in todo if n.device_state is R.RESIDENT and n.host_state is R.ABSENT]
        slabs = host.alloc(len(todo)) if todo else None
        if slabs is None:
            return []
        changed = ix.residency.node_changed
        for node, slab in zip(todo, slabs, strict=True):
            node.host_slab, node.host_state = slab, R.FILLING
            changed(node)
        return list(zip(todo, slabs, strict=True))

    def complete_demotions(self, planned: list[tuple[BlockNode, int]], planned_at: int) -> None:
        """The copies of ``planned`` (made when ``tick`` was ``planned_at``) landed."""
        ix = self.index
        live = [(n, slab) for n, slab in planned if _demoting(n, slab)]
        for node, _ in live:
            node.host_state = R.RESIDENT
        ix.residency.return_demoted([n for n, _ in live], planned_at)
        ix.stats.blocks_demoted += len(live)
        self._landed(live)

    def abort_demotions(self, planned: list[tuple[BlockNode, int]], planned_at: int) -> None:
        """The copy failed: the slabs go back, the blocks stay device-only and evictable."""
        ix = self.index
        assert ix.host is not None
        live = [(n, slab) for n, slab in planned if _demoting(n, slab)]
        for node, _ in live:
            node.host_slab, node.host_state = -1, R.ABSENT
        ix.host.release([slab for _, slab in live])
        ix.residency.return_demoted([n for n, _ in live], planned_at)
        ix.epoch += 1

    def plan_image_write(self, s: Snapshot) -> tuple[tuple[int, ...], int] | None:
        """Host slabs for ``s``'s image (and tail): refused when GDSF would have to evict something
        worth more (§9.3); then ``s`` stays device-only. Returns (image slabs, tail slab or -1).

        A superseded snapshot is not written: the host would evict it first, after it had
        displaced something retained to land; nor is a re-rendered answer's endpoint
        (``Snapshot.device_only``, issue #37)."""
        ix = self.index
        host = ix.host
        if host is None or s.host_state is not R.ABSENT or s.superseded or s.device_only:
            return None
        want_tail = bool(s.tail) and s.tail_host_state is R.ABSENT
        k = host.image_slabs + (1 if want_tail else 0)
        ix.pin_snapshot(s)  # the victim search must not pick the snapshot being written
        ok = make_room(ix, k, bound=s, uses=ix.newcomer_uses(snapshot_uses(s)))
        ix.unpin_snapshot(s)
        if not ok:
            ix.stats.image_writes_refused += 1
            return None
        slabs = host.alloc(k)
        assert slabs is not None
        tail_slab = slabs.pop() if want_tail else -1
        s.host_slabs, s.host_state = tuple(slabs), R.FILLING
        if want_tail:
            s.tail_host_slab, s.tail_host_state = tail_slab, R.FILLING
        if ix.gdsf is not None:
            ix.gdsf.push(s)  # a GDSF candidate from now on (evictable once written)
        ix.pin_snapshot(s)
        return s.host_slabs, tail_slab

    def abort_image_write(self, s: Snapshot) -> None:
        """The image (or tail) copy failed: its slabs go back and ``s`` stays device-only."""
        ix = self.index
        assert ix.host is not None and s.host_state is R.FILLING, s
        slabs = list(s.host_slabs)
        if s.tail_host_state is R.FILLING:
            slabs.append(s.tail_host_slab)
            s.tail_host_slab, s.tail_host_state = -1, R.ABSENT
        s.host_slabs, s.host_state = (), R.ABSENT
        ix.host.release(slabs)
        ix.unpin_snapshot(s)
        ix.epoch += 1

    def complete_image_write(self, s: Snapshot) -> None:
        s.host_state = R.RESIDENT
        if s.tail_host_state is R.FILLING:
            s.tail_host_state = R.RESIDENT
        self.index.unpin_snapshot(s)
        self.index.epoch += 1

    # ================================================================ restores (§6.5)
    # Destinations are Filling until they land, and pinned meanwhile.
    def begin_node_fill(self, node: BlockNode, device: object) -> None:
        assert node.device_state is R.ABSENT and node.host_state is R.RESIDENT, node
        node.restore_pins += 1
        self.index.residency.attach_node(node, device, R.FILLING)

    def finish_node_fill(self, node: BlockNode) -> None:
        node.device_state = R.RESIDENT
        node.restore_pins -= 1
        self.index.residency.node_changed(node)
        self.index.epoch += 1

    def abort_node_fill(self, node: BlockNode) -> None:
        """A restore into ``node`` failed: its destination pages go back (queued for the
        binding) and the node is host-only again."""
        assert node.device_state is R.FILLING, node
        node.restore_pins -= 1
        self.index.residency.drop_node_device(node)
        self.index.epoch += 1

    def pin_for_prefetch(self, nodes: list[BlockNode]) -> None:
        """Keep ``nodes`` (a blocked head's path) out of eviction while its prefetch runs."""
        changed = self.index.residency.node_changed
        for n in nodes:
            n.restore_pins += 1
            changed(n)

    def unpin_for_prefetch(self, nodes: list[BlockNode]) -> None:
        changed = self.index.residency.node_changed
        for n in nodes:
            n.restore_pins -= 1
            assert n.restore_pins >= 0, n
            changed(n)

    def begin_tail_fill(self, s: Snapshot, device: object, tokens: int) -> None:
        assert s.tail_device_state is R.ABSENT and s.tail_host_state is R.RESIDENT, s
        self.index.residency.attach_tail(s, device, tokens, R.FILLING)
        self.index.pin_snapshot(s)

    def finish_tail_fill(self, s: Snapshot) -> None:
        s.tail_device_state = R.RESIDENT
        self.index.unpin_snapshot(s)
        self.index.epoch += 1

    def abort_tail_fill(self, s: Snapshot) -> None:
        assert s.tail_device_state is R.FILLING, s
        self.index.residency.drop_tail_device(s)
        s.tail_device_tokens = 0  # as before the fill: admission sizes a restore by the tail
        self.index.unpin_snapshot(s)
        self.index.epoch += 1


def _demoting(node: BlockNode, slab: int) -> bool:
    """Still the demotion planned: not deleted (which released its slab) since."""
    return node.host_state is R.FILLING and node.host_slab == slab
