"""The invariant checker (spec §10): recompute everything the index maintains incrementally.

Tests call :func:`check_integrity` after every step of a random operation sequence. It rebuilds
every count, list membership, link and GDSF value from scratch and compares, so it is
O(nodes x depth + snapshots x depth): meant for tests and debugging, never for the hot path.

List membership is recomputed here from each node's and tail's fields, the same function
``ResidencyTracker.node_changed`` / ``tail_changed`` apply; so a per-request fast path
(``ResidencyTracker.ref`` / ``release_path``) that diverged from them fails here, as does an LRU
entry counted with another footprint than its copy's.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from . import host_eviction
from . import valuation as val
from .device_slots import STAGING
from .gdsf_queue import holds_host_copy
from .keys import BLOCK_TOKENS
from .node import BlockNode, FastResidency
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


class IntegrityError(AssertionError):
    pass


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


def check_integrity(index: PrefixIndex) -> None:
    tree = index.tree
    nodes: list[BlockNode] = []
    stack = [tree.root]
    while stack:
        n = stack.pop()
        nodes.append(n)
        kids = list(n.iter_children())
        if len(kids) != n.n_children:
            _fail(f"{n}: n_children {n.n_children} != {len(kids)}")
        if (n.only_child is not None) != (n.n_children == 1) or (n.children is not None) != (
            n.n_children >= 2
        ):
            _fail(f"{n}: {n.n_children} children held as only_child / dict inconsistently")
        for c in kids:
            if c.parent is not n or c.depth != n.depth + 1:
                _fail(f"{c}: bad parent link")
            if tree.find_child(n, c.lookup_hash, c.tokens, c.extra) is not c:
                _fail(f"{c}: not found by exact lookup")
            stack.append(c)
    if len(nodes) - 1 != tree.n_nodes:
        _fail(f"tree counts {tree.n_nodes} nodes, found {len(nodes) - 1}")
    node_ids = {id(n) for n in nodes}

    # forks_below, bottom-up
    for n in reversed(nodes):
        want = (1 if n.n_children >= 2 else 0) + sum(c.forks_below for c in n.iter_children())
        if n.forks_below != want:
            _fail(f"{n}: forks_below {n.forks_below} != {want}")

    # lanes: contiguous paths; active refs
    refs: Counter[int] = Counter()
    for lane in index.lanes.values():
        prev = tree.root
        for node in lane.path:
            if node.parent is not prev or id(node) not in node_ids:
                _fail(f"lane {lane.id}: path is not a contiguous tree path")
            refs[id(node)] += 1
            prev = node
        for s in lane.pinned:
            if s.id not in index.snapshots:
                _fail(f"lane {lane.id} pins deleted {s}")

    # snapshots: validity, identity, links, values
    keys: set[tuple[int, bytes]] = set()
    slab_owner: dict[int, object] = {}
    tail_tokens = 0

    def own_slab(slab: int, owner: object) -> None:
        if slab in slab_owner:
            _fail(f"slab {slab} owned by {slab_owner[slab]} and {owner}")
        slab_owner[slab] = owner

    pinned_by_lanes: Counter[int] = Counter(s.id for ln in index.lanes.values() for s in ln.pinned)
    for s in index.snapshots.values():
        a = s.anchor
        if id(a) not in node_ids or s not in (a.snapshots or ()):
            _fail(f"{s}: anchor not in tree or not listing it")
        lo = BLOCK_TOKENS * (a.depth + 1)
        if not lo <= s.frontier < lo + BLOCK_TOKENS or len(s.tail) != 4 * (s.frontier - lo):
            _fail(f"{s}: frontier/tail inconsistent with anchor depth {a.depth}")
        if (id(a), s.tail) in keys:
            _fail(f"{s}: two snapshots with one (anchor, tail)")
        keys.add((id(a), s.tail))
        if not (s.image_on_device or s.image_on_host):
            _fail(f"{s}: image has no copy")
        if s.tail and not (s.tail_on_device or s.tail_on_host):
            _fail(f"{s}: tail has no copy")
        if not s.tail and (s.tail_on_device or s.tail_on_host):
            _fail(f"{s}: tail copies without a tail")
        if (s.device_slot >= 0) != s.image_on_device:
            _fail(f"{s}: device slot vs state")
        if s.image_on_device and index.slots.owner[s.device_slot] is not s:
            _fail(f"{s}: slot {s.device_slot} owned by {index.slots.owner[s.device_slot]}")
        if s.image_on_host:
            assert index.host is not None
            if len(s.host_slabs) != index.host.image_slabs:
                _fail(f"{s}: {len(s.host_slabs)} image slabs")
            for sl in s.host_slabs:
                own_slab(sl, s)
        elif s.host_slabs:
            _fail(f"{s}: slabs without a host image")
        if s.tail_on_host:
            own_slab(s.tail_host_slab, ("tail", s))
        if s.tail_on_device:
            tail_tokens += s.tail_device_tokens
        if s.superseded != (s in index.superseded):
            _fail(f"{s}: superseded flag vs list")
        if s.restore_pins < pinned_by_lanes[s.id]:
            _fail(f"{s}: fewer pins than lanes pinning it")
        want_anc = val.find_ancestor(s)
        if s.ancestor is not want_anc:
            _fail(f"{s}: ancestor {s.ancestor} != nearest above {want_anc}")
        if want_anc is not None and s not in want_anc.dependents:
            _fail(f"{s}: missing from its ancestor's dependents")
        for d in s.dependents:
            if d.ancestor is not s:
                _fail(f"{s}: dependent {d} points elsewhere")
        in_lru = s.tail_device_state is R.RESIDENT and s.restore_pins == 0
        if in_lru != (s in index.lru) or (
            in_lru and index.lru.is_backed(s) != (s.tail_host_state is R.RESIDENT)
        ):
            _fail(f"{s}: tail LRU membership")
    for s in index.snapshots.values():
        if s.superseded:
            continue  # unused until a hit retains it again, which revalues it (§9.3)
        cost, z, h = index.valuer.values(s)
        if (
            abs(cost - s.cost) > 1e-12 * max(1.0, cost)
            or abs(z - s.size) > 1e-6
            or abs(h - s.h) > 1e-9 * max(1.0, abs(h))
        ):
            _fail(
                f"{s}: stale GDSF values (C {s.cost} vs {cost}, Z {s.size} vs {z}, H {s.h} vs {h})"
            )
    if index.gdsf is not None:
        # The heap's lazy entries must find what a scan of every snapshot finds (gdsf_queue.py).
        queued, scanned = host_eviction.min_h_victim(index), host_eviction.scan_min_h_victim(index)
        if queued is not scanned:
            _fail(f"GDSF queue chose {queued}, a scan chooses {scanned}")
        for s in index.snapshots.values():  # the learned order samples from every candidate
            if not s.superseded and holds_host_copy(s) and not index.gdsf.in_pool(s):
                _fail(f"{s}: a host eviction candidate missing from the sampling pool")

    # per-branch path counters: own anchored snapshots + children whose count is nonzero
    live: dict[int, int] = {}
    retained: dict[int, int] = {}
    for n in reversed(nodes):  # preorder reversed: children before parents
        own = n.snapshots or ()
        live[id(n)] = len(own) + sum(1 for c in n.iter_children() if live[id(c)])
        retained[id(n)] = sum(1 for t in own if not t.superseded) + sum(
            1 for c in n.iter_children() if retained[id(c)]
        )

    # nodes: copies, pins, counts, list membership
    device_tokens = tail_tokens
    for n in nodes[1:]:
        if (n.device is None) != (n.device_state is R.ABSENT):
            _fail(f"{n}: device handle vs state")
        if (n.host_slab < 0) != (n.host_state is R.ABSENT):
            _fail(f"{n}: host slab vs state")
        if not (n.on_device or n.on_host):
            _fail(f"{n}: a node with no copy must have been deleted (§9.4)")
        if n.on_device:
            device_tokens += BLOCK_TOKENS
        if n.on_host:
            own_slab(n.host_slab, n)
        if n.active_refs != refs[id(n)]:
            _fail(f"{n}: active_refs {n.active_refs} != lanes mapping it {refs[id(n)]}")
        if n.active_refs and not n.on_device:
            _fail(f"{n}: mapped by a lane without a device copy (§10.3)")
        if n.live_snapshots_below != live[id(n)] or n.retained_below != retained[id(n)]:
            _fail(
                f"{n}: snapshot counts {n.live_snapshots_below}/{n.retained_below} "
                f"!= {live[id(n)]}/{retained[id(n)]}"
            )
        free = n.active_refs == 0 and n.restore_pins == 0
        in_lru = free and n.device_state is R.RESIDENT and n.host_state is not R.FILLING
        if in_lru != (n in index.lru):
            _fail(f"{n}: LRU membership")
        if in_lru:
            lost = index.residency.dead_first and n.live_snapshots_below == 0
            backed = n.host_state is R.RESIDENT
            lst = index.lru.dead if lost else index.lru.backed if backed else index.lru.unbacked
            if n not in lst:
                _fail(f"{n}: LRU list (dead {lost}, backed {backed})")
        dead = free and n.host_state is R.RESIDENT and n.live_snapshots_below == 0
        if dead != (n in index.dead):
            _fail(f"{n}: dead-KV membership")
    for n in index.dead:
        if id(n) not in node_ids:
            _fail(f"{n}: in the dead list but not in the tree")
    if device_tokens != index.device_tokens:
        _fail(f"device tokens {index.device_tokens} != {device_tokens}")
    lru_tokens = sum(
        sum(lst.values()) for lst in (index.lru.backed, index.lru.unbacked, index.lru.dead)
    )
    if lru_tokens != index.lru.tokens:
        _fail(f"LRU tokens {index.lru.tokens} != {lru_tokens}")
    if sum(index.lru.backed.values()) != index.lru.backed_tokens:
        _fail(f"backed LRU tokens {index.lru.backed_tokens} != {sum(index.lru.backed.values())}")
    for lst in (index.lru.backed, index.lru.unbacked, index.lru.dead):
        for e, tokens in lst.items():
            if isinstance(e, Snapshot):
                if e.id not in index.snapshots:
                    _fail(f"{e}: deleted snapshot in the LRU")
                want = e.tail_device_tokens
            elif id(e) not in node_ids:
                _fail(f"{e}: deleted node in the LRU")
            else:
                want = BLOCK_TOKENS
            if tokens != want:
                _fail(f"{e}: in the LRU with {tokens} tokens, its copy holds {want}")

    # slabs and slots
    if index.host is not None:
        for sl in index.host.reserved:  # an L3 fetch's destinations (``l3_adopt``)
            own_slab(sl, "reserved")
        if index.host.used != len(slab_owner):
            _fail(f"host pool counts {index.host.used} used slabs, owners hold {len(slab_owner)}")
        for sl in slab_owner:
            if not index.host.is_used(sl):
                _fail(f"slab {sl} owned but free")
        if len(set(index.host._free)) != len(index.host._free):
            _fail("host free list has duplicates")
    elif slab_owner:
        _fail("host slabs without a host tier")
    slots = index.slots
    free_slots = set(slots._free)
    if len(free_slots) != len(slots._free):
        _fail("slot free list has duplicates")
    for i, owner in enumerate(slots.owner):
        if owner is None:
            if i not in free_slots:
                _fail(f"slot {i} unowned but not free")
        elif i in free_slots:
            _fail(f"slot {i} owned and free")
        elif owner is not STAGING and (
            not isinstance(owner, Snapshot) or owner.id not in index.snapshots
        ):
            _fail(f"slot {i} owned by a deleted snapshot {owner}")
