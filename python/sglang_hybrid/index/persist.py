"""The host tier as plain records, out of one index and into a fresh one (spec §5.5).

Export takes what outlives a restart: every retained (not superseded, §9.3) snapshot whose image
(and tail) and every anchor-path block have a complete host copy, and exactly those paths, parents
first. Dead KV, superseded snapshots, device-only content and copies still Filling are left out
(§5.5: a dead block can never produce a hit; a superseded snapshot is the first thing host
eviction takes anyway).

Adopt rebuilds chosen records as host-only entries of an empty index. A host tier smaller than the
file keeps whole snapshots, greedily by GDSF density without its time-dependent base (§5.5):
``(1 + hits) * prefill_seconds(0, F)`` per byte of image, tail and anchor path, each with the path
blocks it needs and no others. So an adopted index holds no dead KV either: a block no kept
snapshot resumes through could never be hit, and would only be the first host eviction.

Slab ids in records are opaque: the pool's slabs on export, the file's slab numbers once read. No
bytes move here; the caller copies each (record slab -> new pool slab) pair adopt returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .durable import set_durable, why_not_pinnable
from .keys import BLOCK_BYTES, BLOCK_TOKENS, TOKEN_BYTES
from .node import BlockNode, FastResidency
from .snapshot import Snapshot, SnapshotKind

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


class AdoptError(ValueError):
    """Records that cannot form a valid index (a damaged file that passed its checksums)."""


@dataclass(slots=True)
class NodeRecord:
    parent: int  # index of the parent record; -1: the root
    lookup_hash: int
    extra: int
    tokens: bytes  # the block's packed tokens (BLOCK_BYTES)
    slab: int


@dataclass(slots=True)
class SnapshotRecord:
    anchor: int  # index of the anchor's node record; -1: the root
    frontier: int
    tail: bytes
    kind: int  # SnapshotKind
    hits: int
    image_slabs: tuple[int, ...]
    tail_slab: int  # -1: no tail
    # GDSF values at export (informational: adopt recomputes them in the new tree, §9.3)
    cost: float = 0.0
    size: float = 0.0
    h: float = 0.0
    durable: bool = False  # a client's pin without a TTL (``durable.py``): pinned again


class HostExport(NamedTuple):
    nodes: list[NodeRecord]  # parents before children
    snapshots: list[SnapshotRecord]


class AdoptPlan(NamedTuple):
    snapshots: list[int]  # record indices kept, in record order
    nodes: list[int]  # record indices of the blocks they need, in record order (parents first)
    slabs: int  # pool slabs the plan takes


class Adopted(NamedTuple):
    nodes: int
    snapshots: int
    copies: list[tuple[int, int]]  # (record slab, new pool slab), nodes first
    durable: int = 0  # snapshots pinned again
    durable_dropped: int = 0  # saved pins not kept: the plan left them out, or over the share


# ================================================================ export
def _saved(s: Snapshot) -> bool:
    if s.superseded or s.host_state is not R.RESIDENT:
        return False
    if s.tail and s.tail_host_state is not R.RESIDENT:
        return False
    node: BlockNode | None = s.anchor
    while node is not None and not node.is_root:
        if node.host_state is not R.RESIDENT:
            return False
        node = node.parent
    return True


def export_host(index: PrefixIndex) -> HostExport:
    """Host-resident retained snapshots and their paths as records (parents first)."""
    snaps = sorted((s for s in index.snapshots.values() if _saved(s)), key=lambda s: s.id)
    needed: dict[int, BlockNode] = {}
    for s in snaps:
        node: BlockNode | None = s.anchor
        while node is not None and not node.is_root and node.id not in needed:
            needed[node.id] = node
            node = node.parent
    order = sorted(needed.values(), key=lambda n: (n.depth, n.id))
    at = {n.id: i for i, n in enumerate(order)}
    nodes = [
        NodeRecord(
            parent=-1 if n.parent is None or n.parent.is_root else at[n.parent.id],
            lookup_hash=n.lookup_hash,
            extra=n.extra,
            tokens=n.tokens,
            slab=n.host_slab,
        )
        for n in order
    ]
    records = [
        SnapshotRecord(
            anchor=-1 if s.anchor.is_root else at[s.anchor.id],
            frontier=s.frontier,
            tail=s.tail,
            kind=int(s.kind),
            hits=s.hits,
            image_slabs=tuple(s.host_slabs),
            tail_slab=s.tail_host_slab if s.tail else -1,
            cost=s.cost,
            size=s.size,
            h=s.h,
            durable=s.durable and not s.durable_expires,
        )
        for s in snaps
    ]
    return HostExport(nodes, records)


# ================================================================ choose (§5.5)
def _path(records: HostExport, anchor: int) -> list[int]:
    out: list[int] = []
    i = anchor
    while i >= 0:
        out.append(i)
        i = records.nodes[i].parent
    return out


def plan_adopt(index: PrefixIndex, records: HostExport, free_slabs: int) -> AdoptPlan:
    """Whole snapshots by density, each with its path, while they fit in ``free_slabs``; a
    client's durable pins first (they are the highest retention there is, ``durable.py``)."""
    assert index.host is not None
    image = index.host.image_slabs
    slab_bytes = index.slab_bytes
    cost = index.valuer.cost
    paths = [_path(records, r.anchor) for r in records.snapshots]

    def density(i: int) -> float:
        r = records.snapshots[i]
        nbytes = index.image_bytes + (slab_bytes if r.tail else 0) + len(paths[i]) * slab_bytes
        return (1 + r.hits) * cost.prefill_seconds(0, r.frontier) / nbytes

    order = sorted(
        range(len(records.snapshots)),
        key=lambda i: (not records.snapshots[i].durable, -density(i), i),
    )
    taken_nodes: set[int] = set()
    kept: list[int] = []
    used = 0
    for i in order:
        r = records.snapshots[i]
        new = [n for n in paths[i] if n not in taken_nodes]
        need = image + (1 if r.tail else 0) + len(new)
        if used + need > free_slabs:
            continue
        used += need
        taken_nodes.update(new)
        kept.append(i)
    return AdoptPlan(sorted(kept), sorted(taken_nodes), used)


# ================================================================ adopt
def adopt_host(index: PrefixIndex, records: HostExport, plan: AdoptPlan) -> Adopted:
    """Rebuild ``plan``'s records in ``index`` (which must be empty) as host-only entries."""
    host = index.host
    if host is None:
        raise AdoptError("the index has no host tier")
    if index.tree.n_nodes or index.snapshots:
        raise AdoptError("adopt needs an empty index")
    if plan.slabs > host.free:
        raise AdoptError(f"the plan needs {plan.slabs} slabs, {host.free} are free")
    tree = index.tree
    made: dict[int, BlockNode] = {}
    copies: list[tuple[int, int]] = []
    for i in plan.nodes:  # record order: parents first
        r = records.nodes[i]
        if r.parent >= 0 and r.parent not in made:
            raise AdoptError(f"block record {i} comes before its parent {r.parent}")
        parent = made[r.parent] if r.parent >= 0 else tree.root
        if len(r.tokens) != BLOCK_BYTES:
            raise AdoptError(f"block record {i} holds {len(r.tokens)} token bytes")
        if tree.find_child(parent, r.lookup_hash, r.tokens, r.extra) is not None:
            raise AdoptError(f"block record {i} repeats a block")
        one = host.alloc(1)
        assert one is not None  # the plan fits (checked against host.free above)
        slab = one[0]
        made[i] = index.adopt_node(parent, r.lookup_hash, r.tokens, r.extra, slab)
        copies.append((r.slab, slab))
    snaps: list[Snapshot] = []
    for i in plan.snapshots:
        sr = records.snapshots[i]
        if sr.anchor >= 0 and sr.anchor not in made:
            raise AdoptError(f"snapshot record {i}: its anchor block was not adopted")
        anchor = made[sr.anchor] if sr.anchor >= 0 else tree.root
        lo = BLOCK_TOKENS * (anchor.depth + 1)
        if not lo <= sr.frontier < lo + BLOCK_TOKENS or len(sr.tail) != TOKEN_BYTES * (
            sr.frontier - lo
        ):
            raise AdoptError(f"snapshot record {i}: frontier {sr.frontier} vs its anchor and tail")
        if any(t.tail == sr.tail for t in anchor.snapshots or ()):
            raise AdoptError(f"snapshot record {i} repeats a snapshot")
        if len(sr.image_slabs) != host.image_slabs or bool(sr.tail) != (sr.tail_slab >= 0):
            raise AdoptError(f"snapshot record {i}: slab count vs the host geometry")
        try:
            kind = SnapshotKind(sr.kind)
        except ValueError as e:
            raise AdoptError(f"snapshot record {i}: kind {sr.kind}") from e
        slabs = host.alloc(host.image_slabs + (1 if sr.tail else 0))
        assert slabs is not None  # the plan fits
        tail_slab = slabs.pop() if sr.tail else -1
        if sr.tail:
            copies.append((sr.tail_slab, tail_slab))
        copies.extend(zip(sr.image_slabs, slabs, strict=True))
        s = index.adopt_snapshot(
            anchor, sr.frontier, sr.tail, kind, sr.hits, tuple(slabs), tail_slab
        )
        snaps.append(s)
    # None of the blocks is dead now: every kept block is on a kept snapshot's path.
    for s in snaps:  # values once, in the final tree
        index.valuer.revalue(s)
    pinned = 0
    for i, s in zip(plan.snapshots, snaps, strict=True):
        if records.snapshots[i].durable and why_not_pinnable(index, s) is None:
            set_durable(index, s, True)
            pinned += 1
    saved = sum(1 for r in records.snapshots if r.durable)
    return Adopted(len(made), len(snaps), copies, pinned, saved - pinned)
