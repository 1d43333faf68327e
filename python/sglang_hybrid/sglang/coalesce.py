"""In-flight prefix coalescing in SGLang's waiting queue (spec §12.2; decision: ``index/coalesce``).

SGLang admits waiting requests in queue order, each matched against the tree as it stood after the
previous pass, so requests arriving together with a new shared prefix each prefill it. Before every
admission pass (an AROUND hook on ``Scheduler._get_new_batch_prefill_raw``) ``Coalescer.select``
walks the chunked request and the head of the waiting queue in order and, for each waiting request
whose prompt shares more with an earlier one than the cache can serve now, holds it out of the
pass and gives the earlier one (its sibling) an exact, Boundary tap at the divergence. The
sibling's pass then ends there (``chunking.py``), the snapshot publishes at its checkpoint, and in
a later pass the held request matches it like any cached prefix.

The whole waiting queue is also kept as a ``PrefixDemand``, brought up to date when a plan reads
it (``_sync_demand``: O(blocks) per request that arrived or left since, an O(queue) reconcile only
when a count check flags what SGLang's append-and-admit order does not explain, and every
``FULL_SYNC_EVERY``-th time): when a request is planned, the deepest block boundary it shares with
another waiting prompt becomes an exact Boundary tap, so the rest of its group, admitted passes
later, resumes there (``demand_cut``).

Per pass the work is O(window) when the window and the resume points are unchanged; after a
sibling's chunk pass or a publication only the requests that had a sibling are decided again
(``_redecide``); a window of only prompts the last walk found pairwise disjoint (no shared full
block: at least 97 % of the walks over the first 2,000 Mooncake requests, counted once with a
throw-away script) holds nothing without a walk; any other changed window is walked (``_walk``,
O(blocks of the prompts new to it)). A pass in which SGLang admits nothing (``admits_nothing``)
is not looked at. A cache reset drops what was kept per ``resume_epoch`` (``on_reset``).
``test_coalesce_passes.py`` checks every shortcut against a full walk, pass by pass.

Held requests go back into the queue at their positions after the pass, so nothing behind them
waits for them, and nothing is pinned or allocated while they wait. A request stops waiting as
soon as the sibling's snapshot is servable, the sibling passes the target (its tap was skipped),
finishes or leaves, or after ``MAX_HOLD_PASSES`` admitting passes. Multimodal requests, requests
in a namespace (LoRA, cache salt) and requests the cache does not insert never coalesce.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ..index import BLOCK_TOKENS, PromptKey
from ..index.coalesce import (
    InflightPrefixes,
    PrefixDemand,
    Sibling,
    coalesce_target,
    worth_a_split,
)
from .request import ATTR, ReqState, waiting_key

if TYPE_CHECKING:
    from .cache import HybridRadixCache

_rid = attrgetter("rid")

MAX_HOLD_PASSES = 64  # a safety net: a sibling publishes within a few passes
WINDOW_PASSES = 4  # how far ahead in the queue (in passes' worth of prompt tokens) to look
FULL_SYNC_EVERY = 64  # demand syncs between O(queue) reconciles (``_sync_demand``)


class Coalescer:
    def __init__(self, cache: Any) -> None:
        self.cache = cache
        # sibling rid -> {frontier its prefill must stop at: requests held for it}
        self.cuts: dict[str, dict[int, int]] = {}
        self.holds: dict[str, int] = {}  # held rid -> consecutive passes held
        # Counters of this coalescer's own decisions (cache.stats() reports them); only changed
        # by ``select``, reset with the cache.
        self.waiters_total = 0  # requests held at least once
        self.holds_total = 0  # request-passes held
        self.demand: PrefixDemand[str] = PrefixDemand()  # the waiting queue's prompts, by rid
        self._queue_seen: tuple[int, str, str] = (0, "", "")
        # The waiting queue as the last admission pass began, when it changed since the demand
        # was reconciled (``_note_queue``); consumed by ``cuts_for``.
        self._changed_queue: list[Any] | None = None
        self._keyless: set[str] = set()  # waiting rids that never coalesce (no ``waiting_key``)
        self._planned: list[str] = []  # rids planned (so admitted) since the last demand sync
        self._syncs = 0
        # The admission window's prompts in flight, kept between passes (most passes walk the
        # same window; ``InflightPrefixes.begin``). Keyed by rid: equal on every rank.
        self._inflight: InflightPrefixes[Any] = InflightPrefixes()
        self._window_seen: tuple[Any, ...] = ()
        # The requests the last walk found a sibling for, in window order (``_redecide``); its
        # window is ``_window_seen``'s (a redecision keeps the window, a new window is walked).
        self._siblings: list[tuple[Any, PromptKey, Sibling]] = []
        self._servable: dict[str, tuple[int, int]] = {}  # rid -> (resume_epoch, frontier)
        # The rids of the last walk's window and chunked request (and None: no chunked request)
        # when no two of their prompts share a full block; empty otherwise (``select``).
        self._disjoint: frozenset[str | None] = frozenset()
        self._bounds_of: Any = None  # the scheduler ``_bounds`` were read from
        self._bounds = (0, 0)  # (requests, prompt tokens) an admission window holds at most
        self._held: list[Any] = []  # the last decision, reused while nothing changed
        # Held rids since the last ``take_held``, kept only for the rank check (``record_held``):
        # nothing else drains it, so it is not recorded otherwise.
        self._held_now: list[str] | None = None

    def on_reset(self) -> None:
        """The cache was reset (a new index): the counters restart with the new index's, and what
        was kept per ``resume_epoch`` goes (the new index counts its epochs from 0 again, so an
        old frontier or decision could be read as current)."""
        self.waiters_total = self.holds_total = 0
        self._servable.clear()
        self._window_seen = ()

    # ------------------------------------------------------------ the pass
    def select(self, scheduler: Any, exclude: frozenset[str] = frozenset()) -> list[Any]:
        """The waiting requests to hold out of this admission pass (registers sibling cuts).

        ``exclude``: rids already held this pass (restores in flight); they still count as
        waiting for the queue's demand, so their blocks are not re-indexed every pass.
        """
        queue = scheduler.waiting_queue
        self._note_queue(queue)
        if exclude:
            queue = [r for r in queue if r.rid not in exclude]
        if not queue:
            self.holds.clear()
            self._held, self._window_seen = [], ()
            return []
        chunked = getattr(scheduler, "chunked_req", None)
        window = self._window(scheduler, queue)
        # While the queue is blocked (a full pool), SGLang calls this every iteration: the same
        # window with the same resume points decides the same, so only the pass counts move
        # (O(window)). ``resume_epoch``, not ``epoch``: device evictions, every decode pass under
        # pressure, move no resume point (a decision reads only ``match().best``).
        # Keyed by request ids, never id(): every TP rank must decide the same, and CPython
        # reuses addresses differently on each rank (issue #10).
        seen = (
            chunked.rid if chunked is not None else None,
            getattr(chunked, "prefix_len", 0) if chunked is not None else 0,
            self.cache.index.resume_epoch,
            tuple(map(_rid, window)),
        )
        if seen == self._window_seen and all(
            self.holds.get(r.rid, MAX_HOLD_PASSES) < MAX_HOLD_PASSES for r in self._held
        ):
            for r in self._held:
                self.holds[r.rid] += 1
            self.holds_total += len(self._held)
            self._note_held(self._held)
            return list(self._held)
        last, self._window_seen = self._window_seen, seen
        if self._disjoint and self._disjoint.issuperset(seen[3]) and seen[0] in self._disjoint:
            # The last walk found no two of its prompts sharing a full block, and this pass
            # knows only them (the head was admitted, the chunked request moved on): still no
            # sibling anywhere, nothing to hold. O(window), no prompt lookups.
            self.holds = {}
            self._held = []
            return []
        if last and (last[0], last[3]) == (seen[0], seen[3]):  # the same chunked rid and window
            held = self._redecide(scheduler, chunked)
            if held is not None:
                return held
        return self._walk(scheduler, window, chunked)

    def _walk(self, scheduler: Any, window: list[Any], chunked: Any) -> list[Any]:
        """Decide the window in order: each request's sibling is the earliest deepest sharer
        among the chunked request and the window's requests before it that are not held."""
        inflight = self._inflight
        inflight.begin()
        self._servable.clear()  # kept for the window's requests only (it is rebuilt below)
        if chunked is not None and (key := waiting_key(chunked)) is not None:
            inflight.add(chunked.rid, chunked, key)
        held: list[Any] = []
        holds: dict[str, int] = {}
        asked: dict[tuple[Any, int], int] = {}
        siblings: list[tuple[Any, PromptKey, Sibling]] = []
        for req in window:
            key = waiting_key(req)
            if key is None:
                continue
            sib = inflight.sibling(key)
            if sib is not None:
                siblings.append((req, key, sib))
                target = self._hold_target(req, key, sib, chunked, holds)
                if target is not None:
                    held.append(req)
                    asked[sib.owner, target] = asked.get((sib.owner, target), 0) + 1
                    continue  # a held request is never a sibling in its own pass
            inflight.add(req.rid, req, key)
        self._siblings = siblings
        # No pair of these prompts shares a block (sharing is symmetric, so a walk in any order
        # finds a sibling where one exists): a later window of only them needs no walk.
        # (A held request has a sibling, so ``siblings`` empty means nothing was held.)
        rids = [*map(_rid, window), chunked.rid if chunked is not None else None, None]
        self._disjoint = frozenset(rids) if not siblings else frozenset()
        return self._settle(scheduler, held, holds, asked)

    def _redecide(self, scheduler: Any, chunked: Any) -> list[Any] | None:
        """The last walk's window again, only the resume points or the chunked request's progress
        moved: the siblings found then stand while the same requests are held (a sibling depends
        on the prompts in flight before a request, which are the window's requests not held), so
        only their targets are decided again: O(requests with a sibling), no prompt lookups. None
        when the held requests change: the caller walks the window."""
        held: list[Any] = []
        holds: dict[str, int] = {}
        asked: dict[tuple[Any, int], int] = {}
        for req, key, sib in self._siblings:
            target = self._hold_target(req, key, sib, chunked, holds)
            if target is not None:
                held.append(req)
                asked[sib.owner, target] = asked.get((sib.owner, target), 0) + 1
        if [r.rid for r in held] != [r.rid for r in self._held]:
            return None
        return self._settle(scheduler, held, holds, asked)

    def _hold_target(
        self, req: Any, key: PromptKey, sib: Sibling, chunked: Any, holds: dict[str, int]
    ) -> int | None:
        """The frontier ``req`` waits for this pass (its pass count entered in ``holds``), or
        None to admit it."""
        target = self._target(req.rid, key, sib, chunked)
        passes = self.holds.get(req.rid, 0)
        if target is None or passes >= MAX_HOLD_PASSES:
            return None
        holds[req.rid] = passes + 1
        return target

    def _settle(
        self,
        scheduler: Any,
        held: list[Any],
        holds: dict[str, int],
        asked: dict[tuple[Any, int], int],
    ) -> list[Any]:
        """Make a decision this pass's: counters, the siblings' cuts, the pass counts."""
        self.waiters_total += sum(1 for passes in holds.values() if passes == 1)
        self.holds_total += len(held)
        for (sibling, target), waiters in asked.items():
            self._add_cut(sibling, target, waiters)
        self.holds = holds
        self._held = held
        self._prune(scheduler)
        self._note_held(held)
        return list(held)

    def _window(self, scheduler: Any, queue: list[Any]) -> list[Any]:
        """The head of the queue this pass could admit: at most twice the running-request cap,
        and prompts worth at most WINDOW_PASSES passes of prefill. Later requests cannot be
        admitted beside a sibling in this pass anyway; the queue's demand taps serve them. This
        bounds the per-pass work (each request in the window costs O(its blocks)).
        """
        if self._bounds_of is not scheduler:  # its settings, read once (fixed for its life)
            limit = max(1, 2 * int(getattr(scheduler, "max_running_requests", 32) or 32))
            per_pass = max(
                int(getattr(scheduler, "max_prefill_tokens", 0) or 0),
                int(getattr(scheduler, "chunked_prefill_size", 0) or 0),
                BLOCK_TOKENS,
            )
            self._bounds_of, self._bounds = scheduler, (limit, WINDOW_PASSES * per_pass)
        limit, budget = self._bounds
        end = 0
        for req in queue:
            if end >= limit or budget <= 0:
                break
            end += 1
            budget -= len(req.origin_input_ids)
        return queue[:end]

    def _target(self, rid: str, key: PromptKey, sib: Sibling, chunked: Any) -> int | None:
        # The frontier the cache serves ``rid`` from, kept while no resume point moved: a chunk
        # pass of the sibling moves the decision's other inputs, not this one (O(path) a match).
        epoch = self.cache.index.resume_epoch
        seen = self._servable.get(rid)
        if seen is not None and seen[0] == epoch:
            servable = seen[1]
        else:
            m = self.cache.index.match(key)
            servable = m.best.frontier if m.best is not None else 0
            self._servable[rid] = (epoch, servable)
        sibling = sib.owner
        done = int(getattr(sibling, "prefix_len", 0) or 0) if sibling is chunked else 0
        return coalesce_target(
            sib.shared,
            n=key.n,
            sibling_n=len(sibling.origin_input_ids),
            sibling_done=done,
            servable=servable,
            cost=self.cache.cost,
        )

    def _add_cut(self, sibling: Any, target: int, waiters: int) -> None:
        self.cuts.setdefault(sibling.rid, {})[target] = waiters
        state: ReqState | None = getattr(sibling, ATTR, None)
        if state is not None and state.enabled and target not in state.taken:
            # Already planned (the chunked request, or matched in an earlier pass): its next
            # chunk is sized against the cut; a waiting one is planned again when matched.
            if target not in state.cuts:
                state.cuts = sorted({*state.cuts, target})
            state.boundary.add(target)
            state.demand[target] = max(state.demand.get(target, 0), waiters)

    def cuts_for(self, rid: str, key: PromptKey, base: int) -> dict[int, int]:
        """Exact Boundary taps to add to the plan of ``rid`` (prompt ``key``, resuming at
        ``base``), each with the requests known to wait for it: the cuts held requests asked of
        it, and its demand cut."""
        asked = {p: w for p, w in self.cuts.get(rid, {}).items() if base < p < key.n}
        if self._changed_queue is not None:
            self._sync_demand(self._changed_queue)
            self._changed_queue = None
        self._planned.append(rid)
        if len(self.demand):
            shared = self.demand.shared(key, self_counted=rid in self.demand)
            target = min(shared.tokens, key.n - 1)
            target -= target % BLOCK_TOKENS
            if worth_a_split(self.cache.cost, base, target):
                asked[target] = max(asked.get(target, 0), shared.others)
        return asked

    def _note_queue(self, queue: list[Any]) -> None:
        """Remember the waiting queue if it changed since the demand was last reconciled.

        SGLang runs an admission pass every scheduler iteration while requests wait (a long queue
        behind a full pool: every decode step), so an unchanged queue is recognised in O(1) by
        its length and its ends. A change that keeps all three (as many leave as arrive, none at
        either end) is caught at the next change; meanwhile a demand tap may be missed or
        spurious, never wrong (taps are optional; hits compare bytes). The sync itself waits
        until a plan reads the demand (``cuts_for``: a pass that admits a request).
        """
        fingerprint = (len(queue), queue[0].rid, queue[-1].rid) if queue else (0, "", "")
        if fingerprint != self._queue_seen:
            self._queue_seen = fingerprint
            self._changed_queue = queue

    def _sync_demand(self, queue: list[Any]) -> None:
        """Bring ``demand`` in line with ``queue`` in O(changes) where SGLang's own bookkeeping
        allows: requests planned since the last sync have left (admission is where plans
        happen), arrivals are appended at the queue's end (``Scheduler._add_request_to_queue``).
        Both are checked by the count (every waiting request is in the demand or keyless); a
        mismatch (an abort, a failed admission, a queue sorted by a priority policy) falls back
        to the O(queue) reconcile, as does every ``FULL_SYNC_EVERY``-th sync, so a change the
        count cannot see (as many unseen leaving as arriving) lasts a bounded time.
        """
        demand, keyless = self.demand, self._keyless
        for rid in self._planned:
            demand.discard(rid)
            keyless.discard(rid)
        self._planned.clear()
        self._syncs += 1
        if self._syncs % FULL_SYNC_EVERY:
            i = len(queue)
            while i and (rid := queue[i - 1].rid) not in demand and rid not in keyless:
                i -= 1
            for req in queue[i:]:
                if (key := waiting_key(req)) is not None:
                    demand.add(req.rid, key)
                else:
                    keyless.add(req.rid)
            if len(demand) + len(keyless) == len(queue):
                return
        self._reconcile(queue)

    def _reconcile(self, queue: list[Any]) -> None:
        """Bring ``demand`` in line with ``queue``: arrivals in, departures out."""
        # O(queue), but set algebra in C: the rids leave and arrive by difference; the arriving
        # requests are found from the queue's end, where SGLang appends them.
        current = set(map(_rid, queue))
        demand = self.demand
        for rid in demand.owner_set() - current:
            demand.discard(rid)
        self._keyless &= current
        arrived = current - demand.owner_set() - self._keyless
        for req in reversed(queue):
            if not arrived:
                break
            if req.rid in arrived:
                arrived.discard(req.rid)
                if (key := waiting_key(req)) is not None:
                    demand.add(req.rid, key)
                else:
                    self._keyless.add(req.rid)

    def record_held(self) -> None:
        """Keep the held request ids for ``take_held`` from now on (``--hybrid-check-ranks``)."""
        if self._held_now is None:
            self._held_now = []

    def _note_held(self, held: list[Any]) -> None:
        if self._held_now is not None:
            self._held_now.extend(r.rid for r in held)

    def take_held(self) -> tuple[str, ...]:
        """Request ids held since the last call (the rank check's per-pass record); empty
        unless ``record_held`` was called."""
        if not self._held_now:
            return ()
        held, self._held_now = tuple(self._held_now), []
        return held

    def forget(self, rid: str) -> None:
        self.cuts.pop(rid, None)

    def _prune(self, scheduler: Any) -> None:
        """Drop cuts of requests that left without a release (aborted while waiting)."""
        if len(self.cuts) <= 4 * max(1, len(scheduler.waiting_queue)) + 64:
            return
        alive = {r.rid for r in scheduler.waiting_queue}
        batch = getattr(scheduler, "running_batch", None)
        alive.update(r.rid for r in getattr(batch, "reqs", None) or ())
        chunked = getattr(scheduler, "chunked_req", None)
        if chunked is not None:
            alive.add(chunked.rid)
        self.cuts = {rid: c for rid, c in self.cuts.items() if rid in alive}


def around_prefill_pass(
    cache: HybridRadixCache, orig: Any, scheduler: Any, *args: Any, **kwargs: Any
) -> Any:
    """Hold requests out of the pass, run it, put them back in their places: coalescing
    requests, and requests waiting for host-tier restores (``LoadBack.held_for_restores``).

    The caller (``plugin.py``) checks that ``cache`` is ours: ``cache.py`` imports this module,
    so this module does not import it back."""
    if admits_nothing(scheduler, kwargs.get("running_batch", args[-1] if args else None)):
        return orig(scheduler, *args, **kwargs)
    held = cache.held_for_restores(scheduler.waiting_queue)
    if cache.coalescer is not None:
        # A restoring request neither coalesces nor is anyone's sibling this pass.
        restoring = frozenset(r.rid for r in held)
        held = held + cache.coalescer.select(scheduler, exclude=restoring)
    if not held:
        return orig(scheduler, *args, **kwargs)
    order = list(scheduler.waiting_queue)
    # Object identity within one pass (every object alive throughout): membership only, no
    # order or decision depends on the values of id().
    # (The id sets of whole queues are built by ``set(map(id, ...))``: in C, hundreds of waiting
    # requests each pass a request is held.)
    held_ids = set(map(id, held))
    scheduler.waiting_queue = [r for r in order if id(r) not in held_ids]
    try:
        return orig(scheduler, *args, **kwargs)
    finally:
        left = scheduler.waiting_queue
        left_ids = set(map(id, left))
        known = set(map(id, order))
        scheduler.waiting_queue = [r for r in order if id(r) in held_ids or id(r) in left_ids] + [
            r for r in left if id(r) not in known
        ]


def admits_nothing(scheduler: Any, running_batch: Any) -> bool:
    """Whether this admission pass returns before it reads the waiting queue: the queue is empty,
    or the running batch is full, with no chunked request (SGLang 0.5.23's first check in
    ``_get_new_batch_prefill_raw``, after the two resets it makes before it). A long queue behind
    a full pool makes most passes such a pass, and holding requests out of it changes nothing;
    their hold counts wait for the next pass that admits. Anything unrecognised reads as a pass
    that admits (the hold is decided as usual)."""
    if getattr(scheduler, "chunked_req", None) is not None:
        return False
    if not scheduler.waiting_queue:
        return True
    if not getattr(running_batch, "batch_is_full", False):
        return False
    if getattr(scheduler, "enable_priority_preemption", True) or getattr(
        scheduler, "is_hybrid_swa", True
    ):
        return False  # SGLang resets the flag first
    return not running_batch.is_empty()  # so does an empty batch
