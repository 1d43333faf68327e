"""Content fetched from the shared third tier, L3, entering the index (issue #39; spec §5.4, §9.3).

A lookup that finds a deeper snapshot in L3 than the local tree holds (``l3_keys``) fetches its
path's missing blocks, its image and tail into host slabs *reserved* here: taken from the pool
(host eviction makes room as for any write, §9.3) but owned by no node or snapshot, so nothing
matches, restores or evicts them while bytes land off the scheduler thread. The local path the
lookup started from is pinned meanwhile (it is what the fetched blocks hang from). Once every
rank's copies landed and verified, :func:`adopt_fetched` enters them as host-only entries,
exactly as a restart adopts a cache file's (``persist.py``), into whatever the tree has become:
a block another request committed meanwhile keeps its node (the fetched slab becomes its host
copy, or goes back when it has one), a snapshot already there is not duplicated. The request is
then matched anew and restores from the host through the ordinary path (§6.4-6.5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from . import valuation as val
from .keys import BLOCK_TOKENS, PromptKey
from .node import BlockNode, FastResidency
from .snapshot import SnapshotKind

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


class Fetched(NamedTuple):
    """What one fetch brought, in reserved slabs."""

    first_block: int  # block index of block_slabs[0] (the local path's length at the lookup)
    block_slabs: list[int]  # one per block [first_block, anchor]
    frontier: int
    tail: bytes  # the snapshot's tail tokens
    kind: int  # SnapshotKind of the snapshot L3 held
    image_slabs: list[int]
    tail_slab: int  # -1: no tail


class Adopted(NamedTuple):
    new_blocks: int  # nodes created
    backed_blocks: int  # existing nodes that gained their host copy from L3
    snapshot: bool  # False: the tree already held it (its slabs went back)


def reserve_host(index: PrefixIndex, k: int) -> list[int] | None:
    """``k`` host slabs for a fetch, evicting per §9.3 for them; None when they cannot be had."""
    from .host_eviction import make_room

    host = index.host
    if host is None or not make_room(index, k):
        return None
    got = host.alloc(k)
    if got is None:
        return None
    host.reserved.update(got)
    return got


def release_reserved(index: PrefixIndex, slabs: list[int]) -> None:
    """A fetch failed or was not needed: its reserved slabs go back to the pool."""
    host = index.host
    assert host is not None
    for s in slabs:
        host.reserved.remove(s)
    host.release(slabs)


def _claim(index: PrefixIndex, slab: int) -> int:
    host = index.host
    assert host is not None
    host.reserved.remove(slab)
    return slab


def adopt_fetched(index: PrefixIndex, key: PromptKey, path: list[BlockNode], f: Fetched) -> Adopted:
    """Enter ``f`` under ``path`` (the pinned local path of the lookup, ``f.first_block`` long).

    Every reserved slab of ``f`` ends owned by an index entry or back in the pool. The caller
    unpins ``path`` afterwards."""
    tree = index.tree
    parent = path[f.first_block - 1] if f.first_block else tree.root
    made = backed = 0
    spare: list[int] = []
    for i, slab in enumerate(f.block_slabs):
        b = f.first_block + i
        h, tokens, x = key.hash(b), key.block(b), key.extra(b)
        child = tree.find_child(parent, h, tokens, x)
        if child is None:
            child = index.adopt_node(parent, h, tokens, x, _claim(index, slab))
            made += 1
        elif child.host_state is R.ABSENT:
            _attach_host(index, child, _claim(index, slab))
            backed += 1
        else:
            spare.append(slab)
        parent = child
    anchor_depth = f.frontier // BLOCK_TOKENS - 1
    if anchor_depth < 0:
        anchor = tree.root
    else:
        anchor = path[anchor_depth] if anchor_depth < f.first_block else parent
    if anchor.depth != anchor_depth:
        raise ValueError(f"fetched snapshot at F={f.frontier} does not hang from block {anchor}")
    have = any(s.tail == f.tail for s in anchor.snapshots or ())
    if have:
        spare += f.image_slabs
        if f.tail_slab >= 0:
            spare.append(f.tail_slab)
    else:
        image = tuple(_claim(index, s) for s in f.image_slabs)
        tail_slab = _claim(index, f.tail_slab) if f.tail_slab >= 0 else -1
        s = index.adopt_snapshot(
            anchor, f.frontier, f.tail, SnapshotKind(f.kind), 0, image, tail_slab
        )
        index.valuer.revalue(s)
    if spare:
        release_reserved(index, spare)
    return Adopted(made, backed, not have)


def _attach_host(index: PrefixIndex, node: BlockNode, slab: int) -> None:
    """A node the tree holds on the device only gains a host copy (its fetched bytes)."""
    node.host_slab, node.host_state = slab, R.RESIDENT
    index.residency.node_changed(node)
    if (owner := val.sole_retained_below(node)) is not None:
        index.valuer.revalue(owner)  # its exclusive path gained host bytes
    index.epoch += 1
