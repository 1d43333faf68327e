"""Snapshot links and GDSF valuation (spec §9.3).

H(s) = L_s + (prior + hits + demand) * C(s) / Z(s), prior the spec's 1 learned per origin
C(s) = prefill_seconds(base=F_a, tokens=F_s - F_a) - restore_seconds(image), clamped at 0,
       a = the nearest retained (not superseded) snapshot above s on its path, or the root
Z(s) = image bytes + tail bytes + exclusive path bytes: host bytes of the path nodes below which
       s is the only retained snapshot

Each snapshot records its nearest snapshot above (``ancestor``) and those that record it
(``dependents``). The links are found by walking the tree, pruned by the path counters:
``live_snapshots_below`` says whether a subtree holds any snapshot at all and ``retained_below``
whether it holds a retained one, so no walk enters a subtree with nothing to find. Values are
recomputed for exactly the snapshots an event can change: the snapshot itself, the retained
snapshots that see it as their nearest retained ancestor, and the one snapshot whose exclusive path
shares nodes with it (found where the retained count along its path goes between 1 and 2).
"""

from __future__ import annotations

from collections.abc import Iterator

from .cost import CostModel
from .gdsf_queue import GdsfQueue
from .keys import BLOCK_TOKENS
from .node import BlockNode, FastResidency
from .snapshot import Snapshot


def tail_prefix_of(s: Snapshot, tokens: bytes) -> bool:
    """``s``'s tail tokens are a prefix of ``tokens`` (the tokens after its anchor)."""
    return tokens[: len(s.tail)] == s.tail


def is_above(s: Snapshot, d: Snapshot) -> bool:
    """``s`` lies on ``d``'s path strictly before it (the state of a prefix of ``d``'s prompt)."""
    if s.frontier >= d.frontier:
        return False
    a = d.anchor
    sd = s.anchor.depth
    if a.depth == sd:
        return a is s.anchor and tail_prefix_of(s, d.tail)
    if a.depth < sd:
        return False
    while a.depth > sd + 1:
        up = a.parent
        assert up is not None  # deeper than sd + 1 >= 1: not the root
        a = up
    return a.parent is s.anchor and tail_prefix_of(s, a.tokens)


def find_ancestor(s: Snapshot) -> Snapshot | None:
    """The nearest snapshot above ``s`` on its path (walks up from its anchor)."""
    best: Snapshot | None = None
    node = s.anchor
    for t in node.snapshots or ():
        if (
            t is not s
            and t.frontier < s.frontier
            and tail_prefix_of(t, s.tail)
            and (best is None or t.frontier > best.frontier)
        ):
            best = t
    if best is not None:
        return best
    child: BlockNode = node
    up = node.parent  # the walk up ends at the root's None
    while up is not None:
        if up.snapshots:
            for t in up.snapshots:
                if tail_prefix_of(t, child.tokens) and (best is None or t.frontier > best.frontier):
                    best = t
            if best is not None:
                return best
        child, up = up, up.parent
    return None


def find_dependents(s: Snapshot) -> list[Snapshot]:
    """Snapshots whose nearest snapshot above is ``s`` (``s`` already counted in the tree)."""
    out: list[Snapshot] = []
    anchor = s.anchor
    # Same anchor, longer tail extending s's: nearest are those with no other such in between.
    same = [t for t in anchor.snapshots or () if t is not s and is_above(s, t)]
    nearest_same = [t for t in same if not any(u is not t and is_above(u, t) for u in same)]
    out.extend(nearest_same)
    # Below the anchor: descend children whose first tokens continue s's tail and that no nearer
    # tail snapshot at the anchor covers, stopping at the first snapshots on each branch; a
    # subtree with no snapshot is never entered.
    stack = [
        c
        for c in anchor.iter_children()
        if tail_prefix_of(s, c.tokens) and not any(tail_prefix_of(t, c.tokens) for t in same)
    ]
    while stack:
        node = stack.pop()
        if node.live_snapshots_below == 0:
            continue
        mine = node.snapshots or ()
        if mine:
            top = [t for t in mine if not t.has_tail]
            if top:  # a tail-less snapshot at this node hides everything below it
                out.extend(top)
                continue
            nearest = [t for t in mine if not any(u is not t and is_above(u, t) for u in mine)]
            out.extend(nearest)
            stack.extend(
                c
                for c in node.iter_children()
                if not any(tail_prefix_of(t, c.tokens) for t in nearest)
            )
        else:
            stack.extend(node.iter_children())
    return out


def nearest_retained_above(s: Snapshot) -> Snapshot | None:
    a = s.ancestor
    while a is not None and a.superseded:
        a = a.ancestor
    return a


def retained_frontier_below(s: Snapshot) -> Iterator[Snapshot]:
    """Retained snapshots whose nearest retained ancestor is s (directly or via superseded ones)."""
    stack = list(s.dependents)
    while stack:
        d = stack.pop()
        if d.superseded:
            stack.extend(d.dependents)
        else:
            yield d


def exclusive_path_bytes(s: Snapshot, slab_bytes: int, any_tier: bool = False) -> int:
    """Host bytes of the path blocks only ``s`` keeps; ``any_tier``: of those with a copy on
    either tier (an exclusive host, ``demotion``: a block's tier changes as it ages, its claim
    on the two tiers' sum does not, so a snapshot is not ranked by where its blocks are now)."""
    if s.superseded:
        return 0
    total = 0
    resident = FastResidency.RESIDENT
    node: BlockNode | None = s.anchor
    while node is not None and not node.is_root and node.retained_below == 1:
        if node.host_state is resident or (any_tier and node.device_state is resident):
            total += slab_bytes
        node = node.parent
    return total


def sole_retained_below(node: BlockNode) -> Snapshot | None:
    """The only retained snapshot at or below ``node``, if there is exactly one.

    Counts are per branch, so a count of 1 means one branch: follow it down while every count
    stays 1 until the node holding the snapshot; any fork on the way means there are several.
    """
    while node.retained_below == 1:
        for t in node.snapshots or ():
            if not t.superseded:
                return t  # count 1 and its own: nothing retained below it
        for c in node.iter_children():
            if c.retained_below:
                node = c
                break
        else:
            raise AssertionError("retained_below counts disagree with the tree")
    return None


class Valuer:
    """Computes C, Z and H for snapshots with one cost model and one geometry; the only writer
    of ``Snapshot.h``, so it tells the GDSF queue (``queue``, with a host tier) of every new H."""

    def __init__(
        self,
        cost: CostModel,
        image_bytes: int,
        slab_bytes: int,
        *,
        host: bool = True,
        queue: GdsfQueue | None = None,
        any_tier: bool = False,
    ) -> None:
        self.cost = cost
        self.image_bytes = image_bytes
        self.slab_bytes = slab_bytes
        self.restore_image_s = cost.restore_seconds(image_bytes)
        # Without a host tier no node is host-resident, so every exclusive path holds 0 bytes:
        # skip that O(path) walk, run on every revaluation.
        self.host = host
        self.queue = queue
        self.any_tier = any_tier  # Z counts path blocks on either tier (an exclusive host)

    # The spec's three formulas, each written once (§9.3); the float operations and their order
    # are what every caller computed before, so values are bit-identical.
    def _c(self, base: int, frontier: int) -> float:
        """C: prefill seconds from ``base`` to ``frontier`` saved, minus restoring the image."""
        return max(0.0, self.cost.prefill_seconds(base, frontier - base) - self.restore_image_s)

    def _z(self, has_tail: bool, path_bytes: int) -> int:
        """Z: the image, the tail's slab, and the path bytes only this snapshot keeps."""
        return self.image_bytes + (self.slab_bytes if has_tail else 0) + path_bytes

    @staticmethod
    def _h(l_at: float, uses: float, c: float, z: float) -> float:
        """H = L + (prior + hits + demand) * C / Z, ``uses`` = prior + hits + demand (the spec's
        prior is 1; ours is learned per origin, ``source_hits``)."""
        return l_at + uses * c / z

    def values(self, s: Snapshot) -> tuple[float, float, float]:
        """(C, Z, H) of ``s`` from the current tree, without storing them."""
        a = nearest_retained_above(s)
        c = self._c(a.frontier if a is not None else 0, s.frontier)
        path_bytes = exclusive_path_bytes(s, self.slab_bytes, self.any_tier) if self.host else 0
        z = float(self._z(s.has_tail, path_bytes))
        return c, z, self._h(s.l_at, s.prior + s.hits + s.demand, c, z)

    def revalue(self, s: Snapshot) -> None:
        s.cost, s.size, s.h = self.values(s)
        if self.queue is not None:
            self.queue.push(s)

    def recost(self, s: Snapshot) -> None:
        """Only C (and H) changed: its nearest retained ancestor moved or it was hit."""
        a = nearest_retained_above(s)
        s.cost = self._c(a.frontier if a is not None else 0, s.frontier)
        s.h = self._h(s.l_at, s.prior + s.hits + s.demand, s.cost, s.size)
        if self.queue is not None:
            self.queue.push(s)

    def estimate(
        self,
        l_now: float,
        base: int,
        frontier: int,
        has_tail: bool,
        demand: int = 0,
        prior: float = 1.0,
    ) -> float:
        """H of a snapshot about to be published: no hits yet (``demand`` requests are known to
        be waiting for it, §12.2), the blocks since ``base`` its own."""
        own_blocks = frontier // BLOCK_TOKENS - base // BLOCK_TOKENS
        c = self._c(base, frontier)
        return self._h(l_now, prior + demand, c, self._z(has_tail, own_blocks * self.slab_bytes))
