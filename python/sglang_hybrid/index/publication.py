"""Snapshot publication: slots, publish, supersession, hits and deletion (spec §7.4, §9.2, §9.3).

A lane's snapshot is published in two steps: :func:`reserve_slot` takes a device slot (the
lineage it will supersede offered as the victim first, §9.2) and the binding copies the live
state into it; :func:`publish` enters the snapshot (listed on its anchor, counted retained,
linked, its lineage superseded, values recomputed). :func:`hit` counts a resume and retains a
superseded snapshot again. :func:`delete_snapshot` is the way out, with every copy. Functions of
one :class:`~.prefix_index.PrefixIndex`, which its methods of the same names call (as
``eviction`` and ``persist``); they change the index's parts only through those parts' methods
and the index's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import links
from . import valuation as val
from .device_slots import STAGING, SlotSource
from .keys import BLOCK_TOKENS, PromptKey
from .lane import Lane
from .node import FastResidency
from .path_counts import add_live, add_retained, remove_retained
from .snapshot import Snapshot, SnapshotKind
from .source_hits import key_of
from .supersession import lineage, may_supersede
from .taps import END_TOKENS

if TYPE_CHECKING:
    from .prefix_index import PrefixIndex

R = FastResidency  # Residency, read faster (node.py)


def reserve_slot(
    index: PrefixIndex,
    lane: Lane,
    frontier: int,
    kind: SnapshotKind,
    demand: int = 0,
    origin: int = 0,
) -> int | None:
    """A device snapshot slot for the lane's next snapshot, or None (skip it, §9.2).

    The lane's lineage (the snapshot it resumed from; its previous tap when this is a tap) is
    superseded by this snapshot (§9.3) and is offered as a slot victim first, so the slot
    comes from the lineage when it can. The supersession itself is applied when the new
    snapshot is published (or at once when no slot is found): counting the new snapshot
    first keeps every counter walk between the two snapshots instead of up to the root.
    """
    if not lane.enabled:
        return None
    superseding = lineage(lane, frontier, kind, index.snapshots)
    base = max(
        (
            t.frontier
            for t in (lane.resumed_from, lane.last_tap)
            if t is not None and t.frontier < frontier
        ),
        default=0,
    )
    prior = index.prior_of(kind, origin)
    estimate = index.valuer.estimate(
        index.L, base, frontier, frontier % BLOCK_TOKENS != 0, demand, prior
    )
    # Its count (``newcomers``): the anchor's, once committed (a tap reserved before its pass
    # has only the blocks below it: a block not committed yet counts once), and the requests
    # known to be waiting for it.
    k = frontier // BLOCK_TOKENS
    uses = (lane.path[k - 1].uses if 0 < k <= len(lane.path) else 1) + demand
    choice = index.slots.choose(
        estimate, superseding=superseding, rival_uses=index.newcomer_uses(uses)
    )
    if choice is None:
        index.stats.skipped_no_slot += 1
        if any(isinstance(o, Snapshot) and not o.restore_pins for o in index.slots.owner):
            # Refused on value (§9.2 step 3): the newcomer is GDSF's victim, so L rises to
            # its priority. Beyond the spec: without this, residents hit once long ago keep
            # every later tap out for good (L only moved on evictions, and none happen).
            index.raise_inflation(estimate)
        index._revalue(*supersede_all(index, superseding))
        return None
    victim = choice.victim
    if victim is not None:
        keeps_host_copy = victim.host_state is R.RESIDENT
        if choice.source is SlotSource.HOST_BACKED or (
            choice.source is SlotSource.SUPERSEDED and keeps_host_copy
        ):
            index.drop_image_device(victim)
        else:
            if choice.source is SlotSource.DEVICE_ONLY:
                index.raise_inflation(victim.h)
            delete_snapshot(index, victim)
    index.slots.take(choice.slot, STAGING)
    return choice.slot


def cancel_slot(
    index: PrefixIndex,
    slot: int,
    lane: Lane | None = None,
    frontier: int = 0,
    kind: SnapshotKind = SnapshotKind.TAP,
) -> None:
    """Hand back a reserved slot unused; the lane's lineage below ``frontier`` still moved
    on (a lane given)."""
    assert index.slots.owner[slot] is STAGING, slot
    index.slots.release(slot)
    if lane is not None:
        index._revalue(*supersede_all(index, lineage(lane, frontier, kind, index.snapshots)))


def publish(
    index: PrefixIndex,
    lane: Lane,
    key: PromptKey,
    frontier: int,
    slot: int,
    kind: SnapshotKind,
    *,
    tail_device: object | None = None,
    tail_device_tokens: int = 0,
    demand: int = 0,
    origin: int = 0,
) -> Snapshot | None:
    """Publish the state in staging ``slot`` at ``frontier`` (§7.4, §7.7).

    ``demand``: waiting requests known to resume here (§12.2), valued as hits until they do.

    The lane must have committed every full block below the frontier; a partial last block
    needs ``tail_device`` (a cache-owned copy of its KV). A duplicate (same anchor and tail) is
    a no-op that refreshes recency and returns None: the slot goes back to the free slots and
    the tail handle stays the caller's.
    """
    k = frontier // BLOCK_TOKENS
    if len(lane.path) < k:
        raise ValueError(
            f"publish at {frontier} before blocks [0, {BLOCK_TOKENS * k}) were committed"
        )
    if frontier % BLOCK_TOKENS and tail_device is None:
        raise ValueError(f"frontier {frontier} is inside a block and no tail was given")
    anchor = lane.path[k - 1] if k else index.tree.root
    tail = key.tokens(BLOCK_TOKENS * k, frontier)
    index.tick += 1
    for s in anchor.snapshots or ():
        if s.tail == tail:
            s.last_hit_tick = index.tick
            if demand:
                s.demand += demand
                index.valuer.recost(s)
            index.stats.duplicate_publications += 1
            cancel_slot(index, slot, lane, frontier, kind)
            return None
    s = Snapshot(
        id=index._next_snapshot,
        anchor=anchor,
        frontier=frontier,
        tail=tail,
        kind=kind,
        origin=origin,
    )
    index._next_snapshot += 1
    s.device_slot, s.device_state = slot, R.RESIDENT
    index.slots.take(slot, s)
    if tail:
        index.residency.attach_tail(s, tail_device, tail_device_tokens, R.RESIDENT)
    s.l_at, s.last_hit_tick, s.used_at = index.L, index.tick, index.requests
    s.demand = demand
    src = lane.resumed_from
    s.inherited = src.inherited + src.hits if src is not None else 0
    s.prior = index.prior_of(kind, origin)  # fixed now: values stay checkable
    owner = link_snapshot(index, s)
    # The lineage is read now, not at reservation: a lane may hold several reservations at
    # once (taps captured inside one pass), each superseding the ones published before it.
    moved_on = lineage(lane, frontier, kind, index.snapshots)
    if kind is SnapshotKind.ENDPOINT and lane.left_answer:
        s.device_only = True  # its next turn will re-render this answer too (supersession.py)
    recost, resize = supersede_all(index, moved_on)
    index._revalue([*val.retained_frontier_below(s), *recost], [s, owner, *resize])
    index.residency.tail_changed(s)
    if kind is SnapshotKind.ENDPOINT:
        index.stats.endpoints_published += 1
        end_tap = lane.last_tap
        if end_tap is not None and lane.prompt_n - end_tap.frontier <= END_TOKENS + 1:
            # The prompt's end (its n - 1 tail, or an opener at the end): a later request that
            # resumes there re-rendered this answer or regenerated it (supersession.lineage).
            end_tap.sibling_endpoint = s.id
    else:
        index.stats.taps_published += 1
        lane.last_tap = s
        if tail:
            lane.tails.append(s)
    lane.published += 1
    index.epoch += 1
    return s


def link_snapshot(index: PrefixIndex, s: Snapshot) -> Snapshot | None:
    """Enter a new retained snapshot: counted retained, listed at its anchor, its ancestor and
    dependents linked (§9.3). Returns the snapshot that owned its path before (to revalue)."""
    anchor = s.anchor
    owner = add_retained(s)  # before s is listed: the owner is someone else
    if anchor.snapshots is None:
        anchor.snapshots = []
    anchor.snapshots.append(s)
    index.snapshots[s.id] = s
    add_live(anchor, +1, index.residency)
    links.link(s)
    return owner


def supersede_all(
    index: PrefixIndex, snaps: list[Snapshot]
) -> tuple[list[Snapshot | None], list[Snapshot | None]]:
    """Supersede each; returns (snapshots whose C changed, snapshots whose Z changed)."""
    recost: list[Snapshot | None] = []
    resize: list[Snapshot | None] = []
    for s in snaps:
        if not may_supersede(s, index.snapshots):
            continue
        recost += val.retained_frontier_below(s)
        s.superseded = True
        index.tick += 1
        s.superseded_tick = index.tick
        index.superseded[s] = None
        resize.append(remove_retained(s))
    return recost, resize


def delete_snapshot(index: PrefixIndex, s: Snapshot) -> None:
    assert s.restore_pins == 0, f"deleting pinned {s}"
    retained = not s.superseded
    below = list(val.retained_frontier_below(s)) if retained else []
    peers = s.anchor.snapshots
    assert peers is not None  # a snapshot is always listed on its anchor
    peers.remove(s)
    if not s.anchor.snapshots:
        s.anchor.snapshots = None
    del index.snapshots[s.id]
    index.superseded.pop(s, None)
    owner = remove_retained(s) if retained else None
    add_live(s.anchor, -1, index.residency)
    links.unlink(s)
    if s.device_slot >= 0:
        index.slots.release(s.device_slot)
        s.device_slot, s.device_state = -1, R.ABSENT
    if index.host is not None:
        if s.host_slabs:
            index.host.release(s.host_slabs)
        if s.tail_host_slab >= 0:
            index.host.release([s.tail_host_slab])
    s.host_slabs, s.host_state = (), R.ABSENT
    s.tail_host_slab, s.tail_host_state = -1, R.ABSENT
    if s.tail_device_state is not R.ABSENT:
        index.residency.drop_tail_device(s)
    index._revalue(below, [owner])
    index.epoch += 1


def hit(index: PrefixIndex, s: Snapshot) -> None:
    """A lane resumed from ``s``: an expected hit (demand) came, the learned statistics count it
    (per origin; for the host order at its age, classed by the lineage's resumes), and a
    superseded ``s`` is retained again until the lineage moves on (§9.3)."""
    if s.demand:
        s.demand -= 1
    s.hits += 1
    origin = key_of(s.kind, s.origin)
    index.source_hits.note_hit(origin)
    if index.density is not None:
        index.density.note_hit(origin, s.lineage_hits - 1, index.requests - s.used_at)
    s.l_at, s.last_hit_tick, s.used_at = index.L, index.tick, index.requests
    if s.superseded:
        owner = add_retained(s)  # while still flagged: the owner is someone else
        s.superseded = False
        del index.superseded[s]
        index._revalue(list(val.retained_frontier_below(s)), [s, owner])
    else:
        index.valuer.recost(s)
