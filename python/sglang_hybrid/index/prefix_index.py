"""PrefixIndex: the model-agnostic hybrid prefix cache index (spec §5-§10).

It decides and never moves bytes. Device copies are opaque handles the binding passes in (SGLang:
a block's KV slot ids); when the index drops one it queues the handle for the binding to free
(:meth:`drain_freed_device`). Host slabs and device snapshot slots are counted here; ``store/``
moves their bytes.

Contract with a binding, per request (a *lane*):

- :meth:`match` then :meth:`open_lane` with the chosen source snapshot (pins the path up to its
  frontier, counts a hit, pins the snapshot until :meth:`unpin_sources` after its copy);
- :meth:`commit` after every pass that completes blocks (§7.6);
- :meth:`reserve_slot` (supersedes per §9.3, takes a slot per §9.2), copy the live state into it,
  then :meth:`publish` (taps mid-prefill, the endpoint at finish or cancel, §7.4, §7.7);
- ``transfers.plan_writes`` / ``transfers.complete_writes`` (write-through) and :meth:`release`.

Its parts are composed objects, each the only writer of what it owns: ``residency``
(:class:`~.residency.ResidencyTracker`: the device LRU, the dead-KV list, device tokens, dropped
handles), ``transfers`` (:class:`~.transfers.HostTransfers`: the host copies' protocol, Filling
states, restore pins), ``tree``, ``slots``, ``host`` and ``valuer``. ``path_counts`` and ``links``
keep the snapshots' path counters and links, ``supersession`` answers what a new snapshot
supersedes. Lanes, snapshots, supersession, L and the clocks only this class changes (with the
functions it delegates to: ``publication``, ``eviction``, ``persist``). Upper layers change
the index only through its public methods and parts.

Every mutation keeps the invariants of §10; :func:`~.invariants.check_integrity` verifies them.
All bookkeeping is O(1) or O(path); a host victim is found in O(log snapshots) (the GDSF heap)
or O(64) (the learned order's sample).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from . import eviction, persist, publication
from . import valuation as val
from .config import CacheConfig
from .cost import CostModel
from .demotion import Reserve
from .device_lru import DeviceLRU
from .device_slots import DeviceSnapshotSlots
from .followups import WINDOW_TOKENS, FollowUpOffsets
from .gdsf_queue import GdsfQueue
from .hit_density import HitDensity
from .host_slabs import HostSlabPool
from .keys import BLOCK_BYTES, BLOCK_TOKENS, PromptKey
from .lane import Lane
from .match import Match, match_prompt
from .newcomers import GhostBlocks, ThrashMeter, snapshot_uses
from .node import BlockNode, FastResidency
from .persist import Adopted, AdoptPlan, HostExport
from .residency import ResidencyTracker
from .snapshot import Snapshot, SnapshotKind
from .source_hits import SourceHits, key_of
from .split_rule import SplitRule
from .stats import IndexStats
from .taps import END_TOKENS, Tap, TapHint, TapPlanner
from .transfers import HostTransfers
from .tree import BlockTree

R = FastResidency  # Residency, read faster (node.py)
NO_BOUND = 1 << 62  # a newcomer count every resident loses to


class PrefixIndex:
    def __init__(
        self, config: CacheConfig, *, image_bytes: int, slab_bytes: int, cost: CostModel
    ) -> None:
        self.config = config
        self.image_bytes = image_bytes
        self.slab_bytes = slab_bytes
        # Parts, each changed only through its own methods; who calls which is noted here.
        self.tree = BlockTree()  # structure: commit, delete_subtree, adopt_node
        # The LRU (with an exclusive host's dead list), dead KV, device tokens, dropped handles.
        self.residency = ResidencyTracker(dead_first=config.host_exclusive)
        self.transfers = HostTransfers(self)  # the binding's host copies (write, fill, prefetch)
        # An exclusive host's demotion reserve: evict_device counts, plan_demotions ticks.
        self.reserve = Reserve(config.demote_reserve_tokens)
        # Snapshot slots: taken and released only here (reserve, cancel, publish, drop, delete).
        self.slots = DeviceSnapshotSlots(config.device_snapshot_slots)
        # Host slabs: allocated and released only by this class, ``transfers`` and ``persist``.
        self.host: HostSlabPool | None = (
            HostSlabPool(config.host_cache_bytes, slab_bytes, image_bytes)
            if config.has_host
            else None
        )
        # Snapshots by id: publish, adopt_snapshot, delete_snapshot (only this class).
        self.snapshots: dict[int, Snapshot] = {}
        # GDSF victim order (§9.3), with a host tier: pushed by ``valuer`` on every new H and by
        # ``transfers`` when an image write starts; popped lazily by ``host_eviction``.
        self.gdsf: GdsfQueue | None = GdsfQueue(self.snapshots) if config.has_host else None
        # Reuse ages, hits and host evictions (``hit_density``): the host's learned order.
        self.density: HitDensity | None = HitDensity(config.host_order) if config.has_host else None
        self.valuer = val.Valuer(
            cost,
            image_bytes,
            slab_bytes,
            host=config.has_host,
            queue=self.gdsf,
            any_tier=config.host_exclusive,
        )
        self.planner = TapPlanner(  # its only state, over_budget, moves in plan_taps
            taps_per_request=config.taps_per_request,
            ladder_tokens=config.tap_ladder_tokens,
            min_gap_tokens=config.tap_min_gap_tokens,
        )
        self.followups = FollowUpOffsets()  # only open_lane observes; plan_taps reads
        # Which exact taps split (issue #36): the binding sets its threshold, grid and tail; its
        # per-source statistics move in publish and _hit. Threshold 0: every exact tap splits.
        # Resumes per snapshot origin (``source_hits``): the split rule's prices and GDSF's prior.
        # Moved in publish and _hit only.
        self.source_hits = SourceHits()
        self.split_rule = SplitRule(cost, threshold=0.0, hits=self.source_hits)
        self.planner.split_rule = self.split_rule
        # Scan resistance (``newcomers``): use counts of blocks that left the tree (eviction
        # remembers, commit recalls) and whether the cache thrashes (open_lane and commit).
        self.ghosts = GhostBlocks()
        self.thrash = ThrashMeter()
        # The rest is only changed by this class. Superseded snapshots, oldest supersession
        # first: supersede, a hit, delete.
        self.superseded: OrderedDict[Snapshot, None] = OrderedDict()
        self.lanes: dict[int, Lane] = {}  # open lanes: open_lane, release
        self.L = 0.0  # GDSF inflation (§9.3), monotonic: raise_inflation
        self.tick = 0  # the order of pins, hits, publications and supersessions
        # Bumps whenever a quote may have gone stale (§6.3); also bumped by ``transfers``.
        self.epoch = 0
        # The bumps of ``epoch`` that move no resume point (device copies dropped, subtrees
        # deleted, blocks committed): what ``resume_epoch`` leaves out. Only note_pressure
        # changes it.
        self._pressure_bumps = 0
        self.stats = IndexStats()
        self._next_snapshot = 1
        self._next_lane = 1

    # ================================================================ sizes and lists (read-only)
    @property
    def device_tokens(self) -> int:
        """Device tokens held by cache entries (nodes and tails)."""
        return self.residency.device_tokens

    @property
    def evictable_tokens(self) -> int:
        return self.residency.lru.tokens

    @property
    def protected_tokens(self) -> int:
        return self.residency.protected_tokens

    @property
    def lru(self) -> DeviceLRU:
        """The device LRU (§9.1), to read; ``residency`` changes it."""
        return self.residency.lru

    @property
    def dead(self) -> OrderedDict[BlockNode, None]:
        """Host KV no snapshot can reach (§9.3), to read; ``residency`` changes it."""
        return self.residency.dead

    @property
    def resume_epoch(self) -> int:
        """Changes whenever ``match(key).best`` may have changed for some prompt: snapshots
        published, deleted or adopted, fills begun or ended (§6.2). Dropping device copies does
        not change it (a match's best snapshot need not be on the device); a subtree deletion
        takes its snapshots through ``delete_snapshot``, which does. The coalescer keys its
        per-pass decision on it: under device pressure ``epoch`` moves every decode pass."""
        return self.epoch - self._pressure_bumps

    def drain_freed_device(self) -> list[tuple[object, int]]:
        """Device handles (and their token footprint) the index dropped since the last drain."""
        return self.residency.drain_freed()

    @property
    def requests(self) -> int:
        """Lanes opened so far: the clock of reuse ages (``hit_density``), counts, never time."""
        return self._next_lane - 1

    # ================================================================ lookup
    def match(self, key: PromptKey, limit: int | None = None) -> Match:
        return match_prompt(self.tree, key, limit)

    def touch(self, m: Match) -> None:
        """A hit: the path goes MRU, deepest first, so shallow blocks outlive deep ones."""
        self.tick += 1
        for node in reversed(m.path):
            node.last_access = self.tick
            self.residency.touch(node)

    # ================================================================ lanes
    def open_lane(self, m: Match, source: Snapshot | None, *, enabled: bool = True) -> Lane:
        """Start a request resuming at ``source`` (None: the root). Pins its path (§6.4)."""
        lane = Lane(id=self._next_lane, enabled=enabled, prompt_n=m.n)
        self._next_lane += 1
        self.tick += 1
        if m.path:
            x = m.path[-1]
            if m.branch_point is not None:
                # The walk left the tree at the end of path[-1]: a follow-up diverged this far
                # before the end of an earlier prompt that ran through there (``followups``).
                if x.prompt_end > x.end:
                    self.followups.observe(x.prompt_end - x.end)
            elif len(m.path) == (m.n - 1) // BLOCK_TOKENS and x.prompt_end > m.n:
                # The prompt stopped inside an earlier, longer one (issue #37): a state at
                # e - q serves it when q >= e - (n - 1). A repeat (e == n) is the tail's.
                self.followups.observe(x.prompt_end - m.n + 1)
        self.thrash.note_request(
            m.n, source.frontier if source is not None else 0, self.tree.n_nodes
        )
        if source is not None:
            if source.id not in self.snapshots:
                raise ValueError(f"{source} is no longer in the index")
            k = source.anchor.depth + 1
            if k > len(m.path) or (k and m.path[k - 1] is not source.anchor):
                raise ValueError(f"{source} is not on the matched path")
            self._hit(source)
            self.pin_snapshot(source)
            lane.pinned.append(source)
            lane.resumed_from = source
            lane.resumed_from_endpoint = source.kind is SnapshotKind.ENDPOINT
            # Past END_TOKENS: a resend of the same prompt (a regenerated answer) is no evidence.
            lane.left_answer = (
                source.sibling_endpoint >= 0 and m.n - 1 - source.frontier > END_TOKENS
            )
            path = m.path[:k]
            ref, tick = self.residency.ref, self.tick
            for node in path:
                ref(node)
                node.last_access = tick
                node.uses += 1
            lane.path.extend(path)
        self.lanes[lane.id] = lane
        return lane

    def unpin_sources(self, lane: Lane) -> None:
        """The lane's copies out of its source snapshot (state, tail) have landed."""
        for s in lane.pinned:
            self.unpin_snapshot(s)
        lane.pinned.clear()

    def commit(
        self, lane: Lane, key: PromptKey, upto: int, device_of: Callable[[int], object]
    ) -> list[tuple[int, BlockNode]]:
        """Blocks [committed, upto // 64) of the lane become tree nodes it holds (§7.6); returns
        the duplicates, ``(block, node)`` for each block the tree already held on the device: the
        lane's own page for it is the caller's to free (and to map the node's instead).

        ``device_of(i)`` gives the lane's device handle of the i-th block this call commits
        (block ``committed + i``); it is called only for blocks whose page the tree takes (a new
        node, or a host-only node adopting it). The commit stops before a block whose device copy
        is still landing (a restore or prefetch in flight): the lane's own copy could not be
        swapped for it yet; the next commit of the lane resumes there.
        """
        if not lane.enabled or lane.closed:
            return []
        start, end = len(lane.path), min(upto, key.n) // BLOCK_TOKENS
        if end <= start:
            return []
        hashes = key.ensure_hashes(end)
        data, bb = key.data, BLOCK_BYTES
        extra_of = key.extra if key.has_extras else None
        tree, path, ref = self.tree, lane.path, self.residency.ref
        ghosts = self.ghosts
        # Only duplicates are reported: a chunk's commit is mostly new blocks, and a record per
        # block cost the caller a Python loop over ~128 of them per chunk.
        dups: list[tuple[int, BlockNode]] = []
        parent = path[-1] if path else tree.root
        taken = 0  # blocks whose page the tree took
        self.tick += 1
        tick = self.tick
        # Anchors of evicted snapshots (``hit_density``): one dict probe per block, once any.
        density, now = self.density, self.requests
        lost = density.ghosts if density is not None and density.ghosts else None
        for b in range(start, end):
            h, tokens = hashes[b], data[b * bb : (b + 1) * bb]
            if lost is not None and h in lost:
                assert density is not None
                density.recall(h, now)
            x = extra_of(b) if extra_of is not None else 0
            node = tree.find_child(parent, h, tokens, x) if parent.n_children else None
            if node is None:
                # A new node is pinned by this lane and device-only: in neither the LRU nor the
                # dead list, as ``residency.node_changed`` would find (its copy is counted below).
                node = tree.add_child(parent, h, tokens, x)
                node.device, node.device_state = device_of(b - start), R.RESIDENT
                node.active_refs, node.last_access = 1, tick
                if len(ghosts):
                    was = ghosts.recall(h)
                    if was.recent:  # recomputed, though the cache held it recently (``newcomers``)
                        self.thrash.note_ghost_hit()
                    node.uses = was.uses + 1
                else:
                    node.uses = 1
                path.append(node)
                taken += 1
                parent = node
                continue
            state = node.device_state
            if state is R.FILLING:
                break
            ref(node)  # pinned first: an adopted copy never enters the LRU
            node.last_access = tick
            node.uses += 1
            path.append(node)
            if state is R.ABSENT:  # host-only: it adopts the lane's page
                node.device, node.device_state = device_of(b - start), R.RESIDENT
                taken += 1
            else:
                dups.append((b, node))
            parent = node
        self.residency.count_device(BLOCK_TOKENS * taken)
        # No match's best snapshot moves: new nodes hold no snapshot, and a commit ends no fill
        # (it stops at a Filling block). So a prefill chunk leaves ``resume_epoch`` alone.
        self.note_pressure(1)
        return dups

    def release(self, lane: Lane) -> None:
        """Drop the lane's refs; its nodes enter the device LRU deepest first (§7.7, §9.1)."""
        if lane.closed:
            return
        self.unpin_sources(lane)
        self.tick += 1
        n = lane.prompt_n
        if lane.enabled and n:
            # The prompt's last nodes learn its end: a later prompt leaving the tree there is an
            # observation of ``followups`` (nodes ending in (n - WINDOW_TOKENS, n]).
            for node in lane.path[max(0, (n - WINDOW_TOKENS) // BLOCK_TOKENS) : n // BLOCK_TOKENS]:
                node.prompt_end = n
        self.residency.release_path(lane.path, self.probation_uses(), lane.tails)
        lane.tails.clear()
        lane.path.clear()
        lane.closed = True
        del self.lanes[lane.id]

    def probation_uses(self) -> int:
        """Released blocks used at most this often enter the LRU at its evicting end: the next
        victim's count while the cache thrashes, else -1 (``newcomers``)."""
        if not self.thrash.thrashing:
            return -1
        victim = self.residency.lru.peek_victim()
        if victim is None:
            return -1
        if isinstance(victim, BlockNode):
            return victim.uses
        assert isinstance(victim, Snapshot)  # a tail
        return snapshot_uses(victim)

    def newcomer_uses(self, uses: int) -> int:
        """A newcomer's count as GDSF victims and slot owners must lose to it (``newcomers``):
        ``uses`` while the cache thrashes, else no bound."""
        return uses if self.thrash.thrashing else NO_BOUND

    # ================================================================ snapshots
    def plan_taps(
        self,
        key: PromptKey,
        m: Match,
        source: Snapshot | None,
        hints: Iterable[TapHint] = (),
        n: int | None = None,
    ) -> list[Tap]:
        """Taps for a prompt resuming at ``source`` (§7.1), deduplicated against its path.

        The branch point counts only when the exact KV match reaches at least one block past the
        source: then two requests provably diverge there. A request resuming from an endpoint
        skips the opener (its client echoes turns token for token).
        """
        n = key.n if n is None else n
        base = source.frontier if source is not None else 0
        # Only snapshots past the base can make a tap redundant.
        # A snapshot with a tail counts only where its tail tokens are this prompt's (O(63)).
        existing = [
            s.frontier
            for node in m.path[base // BLOCK_TOKENS :]
            if node.snapshots
            for s in node.snapshots
            if not s.tail
            or (s.frontier <= n and key.tokens(s.frontier - s.tail_len, s.frontier) == s.tail)
        ]
        bp = m.branch_point
        if bp is not None and bp < base + BLOCK_TOKENS:
            bp = None
        return self.planner.plan(
            n,
            base,
            hints,
            existing=existing,
            vision_spans=key.vision_spans,
            branch_point=bp,
            followup_offset=self.followups.offset(n - base),
            skip_opener=source is not None and source.kind is SnapshotKind.ENDPOINT,
        )

    # A snapshot's way in and out (§7.4, §9.2, §9.3): ``publication``'s functions, documented
    # there. Spelled out as methods: a class compiled by mypyc (``native``) binds no module
    # function assigned in its body.
    def reserve_slot(
        self, lane: Lane, frontier: int, kind: SnapshotKind, demand: int = 0, origin: int = 0
    ) -> int | None:
        return publication.reserve_slot(self, lane, frontier, kind, demand, origin)

    def cancel_slot(
        self,
        slot: int,
        lane: Lane | None = None,
        frontier: int = 0,
        kind: SnapshotKind = SnapshotKind.TAP,
    ) -> None:
        publication.cancel_slot(self, slot, lane, frontier, kind)

    def publish(
        self,
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
        s = publication.publish(
            self,
            lane,
            key,
            frontier,
            slot,
            kind,
            tail_device=tail_device,
            tail_device_tokens=tail_device_tokens,
            demand=demand,
            origin=origin,
        )
        if s is not None:
            self.source_hits.note_published(key_of(kind, origin))
        return s

    def delete_snapshot(self, s: Snapshot) -> None:
        publication.delete_snapshot(self, s)

    def pin_snapshot(self, s: Snapshot) -> None:
        """A copy reads ``s`` (a lane's copy-on-write, a restore, a write): kept whole meanwhile."""
        s.restore_pins += 1
        self.residency.tail_changed(s)

    def unpin_snapshot(self, s: Snapshot) -> None:
        s.restore_pins -= 1
        assert s.restore_pins >= 0, s
        self.residency.tail_changed(s)

    def _hit(self, s: Snapshot) -> None:
        publication.hit(self, s)

    def prior_of(self, kind: SnapshotKind, origin: int) -> float:
        """GDSF's prior of a new snapshot (``source_hits``): learned with a host tier, the spec's 1
        without (device slots turn over within seconds; docs/index.md says what it cost)."""
        if self.host is None:
            return 1.0
        return self.source_hits.prior(key_of(kind, origin))

    def raise_inflation(self, h: float) -> None:
        """GDSF's L rises to an evicted (or refused) priority ``h`` (§9.3). max(): revaluations
        may have lowered an old H below L, and L never falls."""
        self.L = max(self.L, h)

    def _revalue(
        self,
        recost: Sequence[Snapshot | None],
        resize: Sequence[Snapshot | None] = (),
    ) -> None:
        """Recompute C for ``recost`` and C and Z for ``resize``, once each (None and repeats ok).

        Z walks a path, C does not. The owners the retained-count helpers return are the only
        snapshots whose exclusive path can change with an event.
        """
        seen: set[int] = set()
        for t in resize:
            if t is not None and t.id not in seen and t.id in self.snapshots:
                seen.add(t.id)
                self.valuer.revalue(t)
        for t in recost:
            if t is not None and t.id not in seen and t.id in self.snapshots:
                seen.add(t.id)
                self.valuer.recost(t)

    # ================================================================ dropping copies (§9.1, §9.4)
    def drop_image_device(self, s: Snapshot) -> None:
        """Free the slot of ``s``'s image (its host copy remains)."""
        self.slots.release(s.device_slot)
        s.device_slot, s.device_state = -1, R.ABSENT
        self.epoch += 1

    def drop_node_host(self, n: BlockNode) -> None:
        """Free a node's host copy; with no device copy left the subtree goes too (§9.4)."""
        assert self.host is not None
        self.host.release([n.host_slab])
        n.host_slab, n.host_state = -1, R.ABSENT
        if n.device_state is R.ABSENT:
            self.delete_subtree(n)
        else:
            self.residency.node_changed(n)
            # Its exclusive path lost host bytes; with an exclusive host, Z counts either tier.
            if not self.valuer.any_tier and (owner := val.sole_retained_below(n)) is not None:
                self.valuer.revalue(owner)
        self.epoch += 1

    def drop_snapshot_host(self, s: Snapshot) -> None:
        """Free a snapshot's host copies (image and tail); its device copies stay (§9.3)."""
        assert self.host is not None
        if s.host_slabs:
            self.host.release(s.host_slabs)
        s.host_slabs, s.host_state = (), R.ABSENT
        if s.tail_host_slab >= 0:
            self.host.release([s.tail_host_slab])
            s.tail_host_slab, s.tail_host_state = -1, R.ABSENT
            self.residency.tail_changed(s)
        self.valuer.revalue(s)
        self.epoch += 1

    def delete_subtree(self, node: BlockNode) -> None:
        """Losing the last copy (§9.4): the node, everything below it and their snapshots go."""
        eviction.delete_subtree(self, node)

    def evict_device(self, tokens: int, *, backed_only: bool = False) -> int:
        """Free at least ``tokens`` device tokens from the LRU if it can; returns tokens freed.

        ``backed_only`` never drops a last copy (a prefetch must not, §6.6).
        """
        return eviction.evict_device(self, tokens, backed_only=backed_only)

    def note_pressure(self, bumps: int) -> None:
        """``bumps`` changes that move no resume point (device copies dropped, blocks deleted
        under pressure, blocks committed): ``epoch`` moves, ``resume_epoch`` does not."""
        self.epoch += bumps
        self._pressure_bumps += bumps

    # ================================================================ persistence (§5.5)
    def export_learned(self) -> dict[str, Any] | None:
        """The host's learned order, for the cache file (``persist.export_learned``)."""
        return persist.export_learned(self)

    def adopt_learned(self, state: dict[str, Any]) -> int:
        """A saved learned order taken; its events (``persist.adopt_learned``)."""
        return persist.adopt_learned(self, state)

    def export_host(self) -> HostExport:
        """The host tier as records: retained host-backed snapshots and their paths."""
        return persist.export_host(self)

    def plan_adopt(self, records: HostExport) -> AdoptPlan:
        """What of ``records`` this (empty) index's host budget holds, by GDSF density."""
        assert self.host is not None, "no host tier"
        return persist.plan_adopt(self, records, self.host.free)

    def adopt_host(self, records: HostExport, plan: AdoptPlan) -> Adopted:
        """Rebuild the planned records as host-only entries; returns the slab copies to make."""
        return persist.adopt_host(self, records, plan)

    def adopt_node(
        self, parent: BlockNode, lookup_hash: int, tokens: bytes, extra: int, slab: int
    ) -> BlockNode:
        """A host-only block rebuilt from saved records (``adopt_host``) in host slab ``slab``."""
        node = self.tree.add_child(parent, lookup_hash, tokens, extra)
        node.host_slab, node.host_state = slab, R.RESIDENT
        self.residency.node_changed(node)  # dead until a snapshot's path runs through it
        return node

    def adopt_snapshot(
        self,
        anchor: BlockNode,
        frontier: int,
        tail: bytes,
        kind: SnapshotKind,
        hits: int,
        image_slabs: tuple[int, ...],
        tail_slab: int,
    ) -> Snapshot:
        """A host-only snapshot rebuilt from saved records in the given host slabs, entered as
        :meth:`publish` enters one (§9.3). Its value is left to the caller: ``adopt_host``
        revalues every adopted snapshot once, in the final tree."""
        s = Snapshot(id=self._next_snapshot, anchor=anchor, frontier=frontier, tail=tail, kind=kind)
        self._next_snapshot += 1
        if tail:
            s.tail_host_slab, s.tail_host_state = tail_slab, R.RESIDENT
        s.host_slabs, s.host_state = image_slabs, R.RESIDENT
        s.hits, s.l_at, s.last_hit_tick, s.used_at = hits, self.L, self.tick, self.requests
        publication.link_snapshot(self, s)
        self.epoch += 1
        return s

    # ================================================================ checks
    def check_integrity(self) -> None:
        from .invariants import check_integrity

        check_integrity(self)
