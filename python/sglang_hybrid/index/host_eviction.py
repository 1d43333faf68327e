"""Host eviction (spec §9.3): dead KV first, then superseded snapshots, then GDSF.

To free slabs (with an exclusive host, ``demotion``, step 0 after the dead-KV sweep gives up
host copies of blocks the device holds before anything else):

1. dead-KV sweep: host copies of nodes no snapshot can reach (``live_snapshots_below == 0``, no
   refs, no pins) can never produce a hit; leaves first, so no child outlives its parent's copy;
2. otherwise the oldest superseded snapshot goes entirely (both copies; L unchanged), then 1;
3. otherwise the retained snapshot with the minimum H, then 1 (its exclusive path just died);
   L := H(victim). A victim still complete on the device only gives up its host copy. While the
   cache thrashes, only for a newcomer used more often than the victim (``newcomers``).
   Once the reuse ages are learned (``hit_density``), the victim may instead be the lowest
   ``density * C / Z`` among a sample, snapshots reached by one request only first (a protected
   class: ``density_victim``): GDSF's cost and size, its recency order replaced by what the
   traffic's ages say; the two orders duel by their victims' early returns (issue #37).

An image write bounds step 3 with its own priority: GDSF never inserts what it would evict next,
so when the victim is worth more the write is refused and the new snapshot stays device-only
(§9.2); under the learned order the newcomer is priced at age 0. KV block writes are not
bounded. Pinned, durable or filling objects are never touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .demotion import drop_duplicates
from .hit_density import GDSF, LEARNED, SAMPLE
from .newcomers import snapshot_uses
from .node import BlockNode, FastResidency
from .snapshot import Snapshot
from .source_hits import key_of

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


def make_room(
    index: PrefixIndex,
    k: int,
    *,
    bound: Snapshot | None = None,
    uses: int = 1 << 62,
) -> bool:
    """Evict until ``k`` slabs are free; False (having evicted only what it may) when it cannot.

    ``bound``: the snapshot being written; a victim worth more than it is not evicted.
    ``uses``: the newcomer's use count; GDSF's victim goes only when used less often
    (``newcomers``: while the cache thrashes the index passes it, else it is unbounded)."""
    host = index.host
    assert host is not None
    if k > host.n_slabs:
        return False
    while host.free < k:
        if index.dead:
            index.thrash.note_eviction()
            _sweep_one(index)
            continue
        if drop_duplicates(index, k - host.free):  # an exclusive host's step 0: nothing lost
            continue
        index.thrash.note_eviction()
        victim = _oldest_superseded(index)
        if victim is not None:
            index.stats.host_superseded_evicted += 1
            index.delete_snapshot(victim)
            continue
        order = index.density.order() if index.density is not None else GDSF
        learned = order == LEARNED
        victim = density_victim(index) if learned else min_h_victim(index)
        if victim is None or (
            bound is not None
            and _worth(index, victim, learned) > _worth(index, bound, learned, age=0)
        ):
            return False
        if snapshot_uses(victim) >= uses:
            return False
        index.stats.host_gdsf_evicted += 1
        index.stats.host_learned_evicted += learned
        if not learned:
            index.raise_inflation(victim.h)  # GDSF's aging; the learned order has no H to age by
        gone = not victim.complete_on_device
        if index.density is not None:
            anchor = victim.anchor
            index.density.note_eviction(
                key_of(victim.kind, victim.origin),
                victim.lineage_hits,
                victim.used_at,
                index.requests,
                anchor.lookup_hash if gone and not anchor.is_root else 0,
                order,
            )
        if gone:
            index.delete_snapshot(victim)
        else:
            index.drop_snapshot_host(victim)
    return True


def _evictable(s: Snapshot) -> bool:
    return (
        s.restore_pins == 0
        and not s.durable  # a client's durable checkpoint (``durable.py``)
        and s.host_state is not R.FILLING
        and s.tail_host_state is not R.FILLING
        and (s.host_state is R.RESIDENT or s.tail_host_state is R.RESIDENT)
    )


def _oldest_superseded(index: PrefixIndex) -> Snapshot | None:
    for s in index.superseded:
        if _evictable(s):
            return s
    return None


def min_h_victim(index: PrefixIndex) -> Snapshot | None:
    """The retained host-resident snapshot with the lowest H, ties to the oldest (§9.3)."""
    assert index.gdsf is not None  # a host tier has its queue
    return index.gdsf.min_victim(_evictable)


def _worth(index: PrefixIndex, s: Snapshot, learned: bool, age: int | None = None) -> float:
    """What step 3 compares: H, or under the learned order density * C / Z (at ``age``)."""
    if not learned:
        return s.h
    assert index.density is not None
    a = index.requests - s.used_at if age is None else age
    d = index.density.density(key_of(s.kind, s.origin), s.lineage_hits, a)
    return d * s.cost / s.size if s.size > 0 else 0.0


def density_victim(index: PrefixIndex) -> Snapshot | None:
    """The lowest ``density * C / Z`` among ``SAMPLE`` evictable candidates, probation first;
    ties to the one used longest ago, then the oldest (``hit_density``).

    Probation: a snapshot whose anchor block only one request reached (``snapshot_uses``, ghost
    counts included) goes before any that more reached, whatever their densities: segmented
    LRU's protected segment (Karedla et al., 1994), entered on a second use. A prompt or prefix
    met twice is likely met again, one met once (most of the Mooncake trace's prompts never
    return) is what fills the host. Offline (``benchmark/replay/block_orders.py``, ``ghost_slru``)
    that order reuses 37.3 % of the Mooncake trace at the host's 3.4 M tokens of KV against LRU's
    34.1 %. Measured here: Mooncake + host 34.1 % (33.5 % without), the hint-less chat 51.8 %
    (51.4 %); alone, without ``GhostBlocks``' older segment to recognise late returns, it lost the
    chat 1.5 points (``docs/benchmarks.md``)."""
    assert index.gdsf is not None
    best: Snapshot | None = None
    key = (False, 0.0, 0, 0)
    for s in index.gdsf.sample(SAMPLE, _evictable):
        k = (snapshot_uses(s) > 1, _worth(index, s, True), s.used_at, s.id)
        if best is None or k < key:
            best, key = s, k
    return best


def scan_min_h_victim(index: PrefixIndex) -> Snapshot | None:
    """``min_h_victim`` by an O(snapshots) scan: what ``check_integrity`` compares it with."""
    best: Snapshot | None = None
    for s in index.snapshots.values():
        if not s.superseded and _evictable(s) and (best is None or s.h < best.h):
            best = s
    return best


def _sweep_one(index: PrefixIndex) -> None:
    node = next(iter(index.dead))
    # Leaves first: descend while a child also holds a dead host copy.
    while True:
        nxt: BlockNode | None = None
        for c in node.iter_children():
            if c in index.dead:
                nxt = c
                break
        if nxt is None:
            break
        node = nxt
    index.stats.host_dead_swept += 1
    index.drop_node_host(node)
