"""The host tier as plain records, out of one index and into a fresh one (spec §5.5).

Export takes what outlives a restart: every retained (not superseded, §9.3) snapshot whose image
(and tail) and every anchor-path block have a complete host copy, and exactly those paths, parents
first. Dead KV, superseded snapshots, device-only content and copies still Filling are left out
(§5.5: a dead block can never produce a hit; a superseded snapshot is the first thing host
eviction takes anyway).

At an orderly stop the save takes more (:func:`export_for_save`, issue #38): device-only
snapshots and blocks too, superseded snapshots after retained ones, densest first while the whole
fits the host tier (the tier the restarted server loads it into): the state of a chat's system
prompt often lives only on the device, or was superseded by the turn's later taps, and is what a
restarted server's next conversation resumes from. Slabs without a host copy get ids past the
pool's (:class:`SaveSource` says where their bytes are); the caller reads them from the device.

Adopt rebuilds chosen records as host-only entries of an empty index. A host tier smaller than the
file keeps whole snapshots, greedily by GDSF density without its time-dependent base (§5.5):
``(1 + hits) * prefill_seconds(0, F)`` per byte of image, tail and anchor path, each with the path
blocks it needs and no others. So an adopted index holds no dead KV either: a block no kept
snapshot resumes through could never be hit, and would only be the first host eviction.

Slab ids in records are opaque: the pool's slabs on export, the file's slab numbers once read. No
bytes move here; the caller copies each (record slab -> new pool slab) pair adopt returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

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
    return _records(
        snaps,
        lambda n: n.host_slab,
        lambda s: (tuple(s.host_slabs), s.tail_host_slab if s.tail else -1),
    )


def _records(
    snaps: list[Snapshot],
    node_slab: Callable[[BlockNode], int],
    snapshot_slabs: Callable[[Snapshot], tuple[tuple[int, ...], int]],
) -> HostExport:
    """``snaps`` (in record order) and exactly their anchor paths as records, parents first."""
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
            slab=node_slab(n),
        )
        for n in order
    ]
    records = []
    for s in snaps:
        image, tail = snapshot_slabs(s)
        records.append(
            SnapshotRecord(
                anchor=-1 if s.anchor.is_root else at[s.anchor.id],
                frontier=s.frontier,
                tail=s.tail,
                kind=int(s.kind),
                hits=s.hits,
                image_slabs=image,
                tail_slab=tail,
                cost=s.cost,
                size=s.size,
                h=s.h,
                durable=s.durable and not s.durable_expires,
            )
        )
    return HostExport(nodes, records)


# ================================================================ save at a stop (issue #38)
SOURCE_BLOCK, SOURCE_IMAGE, SOURCE_TAIL = 0, 1, 2


class SaveSource(NamedTuple):
    """Where a saved slab's bytes are when the host tier holds no copy of them."""

    what: int  # SOURCE_BLOCK / SOURCE_IMAGE / SOURCE_TAIL
    ref: Any  # the block's device handle / the snapshot's device slot / its tail's handle
    part: int = 0  # SOURCE_IMAGE: which of the image's slabs
    tokens: int = 0  # SOURCE_TAIL: the tail's length
    snapshot: int = -1  # SOURCE_IMAGE: the snapshot's id (a reader keeps one image at a time)


class SaveExport(NamedTuple):
    records: HostExport  # slab ids below the pool's n_slabs: host slabs; at or above: ``device``
    device: dict[int, SaveSource]
    device_snapshots: int  # snapshots whose image or tail is read from the device
    left_out: int  # complete snapshots the budget left out


def _on_host(state: object) -> bool:
    return state is R.RESIDENT


def export_for_save(index: PrefixIndex, budget_slabs: int) -> SaveExport:
    """Every snapshot whose image, tail and path are complete on the host or the device, chosen
    as adopt chooses (a client's pins first, then retained before superseded, densest first, each
    with the path blocks it needs) while they fit ``budget_slabs``; host copies are preferred."""
    assert index.host is not None
    complete = [s for s in index.snapshots.values() if _complete(s)]
    paths = {s.id: _node_path(s) for s in complete}
    tail_slabs = {s.id: 1 if s.tail else 0 for s in complete}
    density = _density(index, {s.id: (s.hits, s.frontier, len(paths[s.id])) for s in complete})
    order = sorted(complete, key=lambda s: (not s.durable, s.superseded, -density(s.id), s.id))
    kept, _nodes, _used = _take(
        [(s.id, index.host.image_slabs + tail_slabs[s.id], paths[s.id]) for s in order],
        budget_slabs,
    )
    chosen = sorted((s for s in complete if s.id in kept), key=lambda s: s.id)
    device: dict[int, SaveSource] = {}
    next_id = [index.host.n_slabs]
    image_slabs = index.host.image_slabs

    def virtual(src: SaveSource) -> int:
        i = next_id[0]
        next_id[0] += 1
        device[i] = src
        return i

    def node_slab(n: BlockNode) -> int:
        if _on_host(n.host_state):
            return n.host_slab
        return virtual(SaveSource(SOURCE_BLOCK, n.device))

    from_device: set[int] = set()

    def snapshot_slabs(s: Snapshot) -> tuple[tuple[int, ...], int]:
        if _on_host(s.host_state):
            image = tuple(s.host_slabs)
        else:
            from_device.add(s.id)
            image = tuple(
                virtual(SaveSource(SOURCE_IMAGE, s.device_slot, k, snapshot=s.id))
                for k in range(image_slabs)
            )
        tail = -1
        if s.tail:
            if _on_host(s.tail_host_state):
                tail = s.tail_host_slab
            else:
                from_device.add(s.id)
                tail = virtual(SaveSource(SOURCE_TAIL, s.tail_device, tokens=s.tail_len))
        return image, tail

    records = _records(chosen, node_slab, snapshot_slabs)
    return SaveExport(records, device, len(from_device), len(complete) - len(chosen))


def _complete(s: Snapshot) -> bool:
    """Image, tail and every anchor-path block resident on the host or the device."""
    if not (_on_host(s.host_state) or s.device_state is R.RESIDENT):
        return False
    if s.tail and not (_on_host(s.tail_host_state) or s.tail_device_state is R.RESIDENT):
        return False
    node: BlockNode | None = s.anchor
    while node is not None and not node.is_root:
        if not (_on_host(node.host_state) or node.device_state is R.RESIDENT):
            return False
        node = node.parent
    return True


def _node_path(s: Snapshot) -> list[int]:
    out: list[int] = []
    node: BlockNode | None = s.anchor
    while node is not None and not node.is_root:
        out.append(node.id)
        node = node.parent
    return out


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
    snaps = records.snapshots
    paths = [_path(records, r.anchor) for r in snaps]
    density = _density(index, {i: (r.hits, r.frontier, len(paths[i])) for i, r in enumerate(snaps)})
    order = sorted(range(len(snaps)), key=lambda i: (not snaps[i].durable, -density(i), i))
    kept, taken_nodes, used = _take(
        [(i, image + (1 if snaps[i].tail else 0), paths[i]) for i in order], free_slabs
    )
    return AdoptPlan(sorted(kept), sorted(taken_nodes), used)


def _density(index: PrefixIndex, of: dict[int, tuple[int, int, int]]) -> Callable[[int], float]:
    """GDSF density without its time-dependent base (§5.5): ``(1 + hits) * prefill_seconds(0,
    F)`` per byte of image, tail and path; ``of``: key -> (hits, frontier, path blocks)."""
    slab_bytes, image_bytes, cost = index.slab_bytes, index.image_bytes, index.valuer.cost

    def density(key: int) -> float:
        hits, frontier, path_blocks = of[key]
        tail = slab_bytes if frontier % BLOCK_TOKENS else 0
        nbytes = image_bytes + tail + path_blocks * slab_bytes
        return (1 + hits) * cost.prefill_seconds(0, frontier) / nbytes

    return density


def _take(order: list[tuple[int, int, list[int]]], budget: int) -> tuple[set[int], set[int], int]:
    """Greedy, in ``order``: (key, own slabs, path block ids) while the slabs they add fit
    ``budget`` (a path block shared with one already taken costs nothing again)."""
    taken_nodes: set[int] = set()
    kept: set[int] = set()
    used = 0
    for key, own, path in order:
        new = [n for n in path if n not in taken_nodes]
        need = own + len(new)
        if used + need > budget:
            continue
        used += need
        taken_nodes.update(new)
        kept.add(key)
    return kept, taken_nodes, used


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


# ================================================================ the learned host order
def export_learned(index: PrefixIndex) -> dict[str, Any] | None:
    """The host's learned order (``hit_density``) as plain values, for the cache file's header:
    a restarted server keeps ranking by the reuse ages it learned instead of GDSF's until 256
    new events. None without a host tier."""
    d = index.density
    return d.export_state(index.requests) if d is not None else None


def adopt_learned(index: PrefixIndex, state: dict[str, Any]) -> int:
    """Take a saved learned order (ghost times rebased on this index's request count); returns
    its events, 0 without a host tier. ValueError, nothing changed, when it does not fit this
    version's classes and bins or is malformed."""
    d = index.density
    if d is None:
        return 0
    d.restore_state(state, index.requests)
    return d.events
