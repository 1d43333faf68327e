"""Residency bookkeeping (spec §9.1, §9.3): what follows from where a block's copies are.

:class:`ResidencyTracker` is a part of :class:`~.prefix_index.PrefixIndex` (``index.residency``)
and the only writer of the device LRU (free device copies, §9.1), the dead-KV list (free host
copies no snapshot can reach, §9.3), the device token count and the queue of dropped device
handles the binding frees. List membership is a function of a node's (or a tail's) fields:
:meth:`~ResidencyTracker.node_changed` and :meth:`~ResidencyTracker.tail_changed` re-derive it
after any change of them. The per-request pins (a lane pinning and releasing its path) take fast
paths instead, :meth:`~ResidencyTracker.ref` and :meth:`~ResidencyTracker.release_path`, which make
only the one transition their change can cause; :func:`~.invariants.check_integrity` recomputes
every membership from the fields, so a fast path that diverged fails there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .device_lru import DeviceLRU
from .keys import BLOCK_TOKENS
from .node import BlockNode, FastResidency, Residency
from .snapshot import Snapshot

R = FastResidency  # Residency, read faster (node.py)


class ResidencyTracker:
    def __init__(self, dead_first: bool = False) -> None:
        # Free nodes' and unpinned tails' device copies, backed ones first (§9.1); with
        # ``dead_first`` (an exclusive host) blocks no live snapshot lies below before both.
        self.lru = DeviceLRU()
        self.dead_first = dead_first
        # Free nodes whose host copy no snapshot reaches, oldest first (§9.3 dead KV).
        self.dead: OrderedDict[BlockNode, None] = OrderedDict()
        # Device tokens held by cache entries (nodes and tails, Filling ones included).
        self.device_tokens = 0
        # Device handles dropped since the binding last drained them (``drain_freed``).
        self._freed: list[tuple[object, int]] = []

    @property
    def evictable_tokens(self) -> int:
        return self.lru.tokens

    @property
    def protected_tokens(self) -> int:
        return self.device_tokens - self.lru.tokens

    def drain_freed(self) -> list[tuple[object, int]]:
        """Device handles (and their token footprint) dropped since the last drain."""
        out, self._freed = self._freed, []
        return out

    # ================================================================ the entry point
    def node_changed(self, n: BlockNode) -> None:
        """Re-derive the node's LRU and dead-KV membership from its fields.

        A free node whose host copy is Filling is being demoted (``demotion``; a write-through's
        lane pins its nodes): it stays out of the LRU until its copy lands, so no eviction
        frees the pages the copy reads."""
        free = n.active_refs == 0 and n.restore_pins == 0
        in_lru = free and n.device_state is R.RESIDENT and n.host_state is not R.FILLING
        backed = n.host_state is R.RESIDENT
        if in_lru:
            lost = self.dead_first and n.live_snapshots_below == 0
            if n in self.lru:
                self.lru.set_list(n, backed, lost)
            else:
                self.lru.add(n, BLOCK_TOKENS, backed, lost)
        elif n in self.lru:
            self.lru.remove(n)
        dead = free and backed and n.live_snapshots_below == 0
        if dead:
            if n not in self.dead:
                self.dead[n] = None
        elif n in self.dead:
            del self.dead[n]

    def tail_changed(self, s: Snapshot) -> None:
        """Re-derive the tail's LRU membership from the snapshot's fields."""
        in_lru = s.tail_device_state is R.RESIDENT and s.restore_pins == 0
        backed = s.tail_host_state is R.RESIDENT
        if in_lru:
            if s in self.lru:
                self.lru.set_list(s, backed)
            else:
                self.lru.add(s, s.tail_device_tokens, backed)
        elif s in self.lru:
            self.lru.remove(s)

    # ================================================================ fast paths (per request)
    # Both change only ``active_refs``. A node is *free* when it has no ref and no restore pin;
    # only a free node can be in either list, and only the free/pinned boundary moves it.
    def ref(self, node: BlockNode) -> None:
        """A lane pins ``node``. Equivalent to ``active_refs += 1; node_changed(node)``: when the
        ref makes a free node pinned, node_changed would take it out of the LRU exactly when its
        device copy is Resident and it is not being demoted (host copy Filling), and out of the
        dead list exactly when its host copy is Resident with no live snapshot below (where a
        free node is); any other ref leaves it in neither."""
        node.active_refs += 1
        if node.active_refs == 1 and node.restore_pins == 0:
            if node.device_state is R.RESIDENT and node.host_state is not R.FILLING:
                self.lru.remove(node)
            if node.host_state is R.RESIDENT and node.live_snapshots_below == 0:
                del self.dead[node]

    def release_path(
        self, path: list[BlockNode], probation: int = -1, tails: Sequence[Snapshot] = ()
    ) -> None:
        """A lane drops its refs on ``path``, deepest first, so that freed nodes enter the LRU
        deepest first (§9.1). Equivalent to ``active_refs -= 1; node_changed(node)`` per node:
        a node that becomes free was pinned, so in neither list, and node_changed would add it
        to the LRU (backed list when its host copy is Resident) when its device copy is Resident
        and to the dead list when its host copy is Resident with no live snapshot below. (A
        node being demoted, host copy Filling, stays out of the LRU until its copy lands.)

        Nodes used at most ``probation`` times enter at the evicting end instead, deepest
        nearest to it (``newcomers``: while the cache thrashes, a newcomer used no more often
        than the next victim is the next victim). ``tails``, the lane's taps with a tail, move
        with their anchors, just before them: a tail entered the LRU when its tap was
        published, mid-prefill, and would otherwise be older than the blocks it extends."""
        lru, dead, dead_first = self.lru, self.dead, self.dead_first
        resident, filling = R.RESIDENT, R.FILLING
        moved: list[Snapshot] = []
        for s in tails:
            if s in lru:
                moved.append(s)
                lru.remove(s)
        for s in moved:
            if s.anchor.uses > probation:
                lru.add(s, s.tail_device_tokens, s.tail_host_state is resident)
        behind: list[tuple[BlockNode, bool, bool]] = []
        for node in reversed(path):
            node.active_refs -= 1
            if node.active_refs == 0 and node.restore_pins == 0:
                backed = node.host_state is resident
                lost = node.live_snapshots_below == 0
                if node.device_state is resident and node.host_state is not filling:
                    if node.uses <= probation:
                        behind.append((node, backed, dead_first and lost))
                    else:
                        lru.add(node, BLOCK_TOKENS, backed, dead_first and lost)
                if backed and lost:
                    dead[node] = None
        for node, backed, gone in reversed(behind):  # shallowest first: the deepest at the head
            lru.add_head(node, BLOCK_TOKENS, backed, gone)
        for s in moved:
            if s.anchor.uses <= probation:
                lru.add_head(s, s.tail_device_tokens, s.tail_host_state is resident)

    def return_demoted(self, nodes: Sequence[BlockNode], planned_at: int) -> None:
        """Demoted ``nodes`` (oldest first), their host copies now Resident or given back,
        re-enter the LRU at the evicting end of their list, where they left it, the oldest
        nearest it: demotion took them because they were next. A node hit while its copy was in
        flight (``last_access`` after the plan's tick ``planned_at``; a ref keeps it out of the
        LRU, its release cannot add it while the copy is Filling) goes to the MRU end as that
        hit's release would have put it."""
        lru = self.lru
        for n in reversed(nodes):
            if (
                n.active_refs == 0
                and n.restore_pins == 0
                and n.device_state is R.RESIDENT
                and n not in lru
                and n.last_access <= planned_at
            ):
                lost = self.dead_first and n.live_snapshots_below == 0
                lru.add_head(n, BLOCK_TOKENS, n.host_state is R.RESIDENT, lost)
            self.node_changed(n)

    def touch(self, node: BlockNode) -> None:
        """A hit: the node's device copy (if free) goes to the MRU end of its list."""
        self.lru.touch(node)

    # ================================================================ device copies
    def count_device(self, tokens: int) -> None:
        """``PrefixIndex.commit`` made ``tokens`` of lane pages node copies (it sets the nodes'
        fields inline, on the per-block path; they are pinned, so in neither list)."""
        self.device_tokens += tokens

    def attach_node(self, n: BlockNode, device: object, state: Residency) -> None:
        n.device, n.device_state = device, state
        self.device_tokens += BLOCK_TOKENS
        self.node_changed(n)

    def attach_tail(self, s: Snapshot, device: object, tokens: int, state: Residency) -> None:
        """The tail's device copy (the caller re-derives membership once the pins are set)."""
        s.tail_device, s.tail_device_state, s.tail_device_tokens = device, state, tokens
        self.device_tokens += tokens

    def drop_node_device(self, n: BlockNode) -> None:
        """Free the node's device copy (queued for the binding); the node stays in the tree."""
        self.lru.discard(n)
        self._freed.append((n.device, BLOCK_TOKENS))
        self.device_tokens -= BLOCK_TOKENS
        n.device, n.device_state = None, R.ABSENT
        self.node_changed(n)

    def drop_tail_device(self, s: Snapshot) -> None:
        """Free the tail's device copy. ``tail_device_tokens`` stays: a restore needs as many."""
        self.lru.discard(s)
        self._freed.append((s.tail_device, s.tail_device_tokens))
        self.device_tokens -= s.tail_device_tokens
        s.tail_device, s.tail_device_state = None, R.ABSENT

    def forget_evicted(self, n: BlockNode) -> None:
        """:meth:`forget_node` for a victim ``lru.pop_victim`` took from the unbacked list: a free
        node whose device copy is its only one (so, with no host copy, not dead)."""
        self._freed.append((n.device, BLOCK_TOKENS))
        self.device_tokens -= BLOCK_TOKENS
        n.device, n.device_state = None, R.ABSENT

    def forget_node(self, n: BlockNode) -> None:
        """The node leaves the tree (§9.4): its device copy is freed, it leaves both lists."""
        if n.device_state is not R.ABSENT:
            self.lru.discard(n)
            self._freed.append((n.device, BLOCK_TOKENS))
            self.device_tokens -= BLOCK_TOKENS
            n.device, n.device_state = None, R.ABSENT
        self.dead.pop(n, None)
