"""In-flight prefix coalescing in SGLang's waiting queue (spec §12.2; decision: ``index/coalesce``).

SGLang admits waiting requests in queue order, each matched against the tree as it stood after the
previous pass, so requests arriving together with a new shared prefix each prefill it. Before every
admission pass (an AROUND hook on ``Scheduler._get_new_batch_prefill_raw``) ``Coalescer.select``
walks the chunked request and the head of the waiting queue in order and, for each waiting request
whose prompt shares more with an earlier one than the cache can serve now, holds it out of the
pass and gives the earlier one (its sibling) an exact, Boundary tap at the divergence. The
sibling's pass then ends there (``chunking.py``), the snapshot publishes at its checkpoint, and in
a later pass the held request matches it like any cached prefix.

The whole waiting queue is also kept as a ``PrefixDemand`` (reconciled before each pass, O(queue)
set work plus O(blocks) per request that arrives or leaves): when a request is planned, the deepest
block boundary it shares with another waiting prompt becomes an exact Boundary tap, so the rest of
its group, admitted passes later, resumes there (``demand_cut``).

Held requests go back into the queue at their positions after the pass, so nothing behind them
waits for them, and nothing is pinned or allocated while they wait. A request stops waiting as
soon as the sibling's snapshot is servable, the sibling passes the target (its tap was skipped),
finishes or leaves, or after ``MAX_HOLD_PASSES`` passes. Multimodal requests, requests in a
namespace (LoRA, cache salt) and requests the cache does not insert never coalesce.
"""

from __future__ import annotations

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

MAX_HOLD_PASSES = 64  # a safety net: a sibling publishes within a few passes
WINDOW_PASSES = 4  # how far ahead in the queue (in passes' worth of prompt tokens) to look


class Coalescer:
    def reset_counters(self) -> None:
        """The cache was reset: the counters restart with the new index's."""
        self.waiters_total = self.holds_total = 0

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
        self._window_seen: tuple[Any, ...] = ()
        self._held: list[Any] = []  # the last decision, reused while nothing changed
        # Held rids since the last ``take_held``, kept only for the rank check (``record_held``):
        # nothing else drains it, so it is not recorded otherwise.
        self._held_now: list[str] | None = None

    # ------------------------------------------------------------ the pass
    def select(self, scheduler: Any, exclude: frozenset[str] = frozenset()) -> list[Any]:
        """The waiting requests to hold out of this admission pass (registers sibling cuts).

        ``exclude``: rids already held this pass (restores in flight); they still count as
        waiting for the queue's demand, so their blocks are not re-indexed every pass.
        """
        queue = scheduler.waiting_queue
        self._reconcile(queue)
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
            tuple(r.rid for r in window),
        )
        if seen == self._window_seen and all(
            self.holds.get(r.rid, MAX_HOLD_PASSES) < MAX_HOLD_PASSES for r in self._held
        ):
            for r in self._held:
                self.holds[r.rid] += 1
            self.holds_total += len(self._held)
            self._note_held(self._held)
            return list(self._held)
        self._window_seen = seen
        inflight: InflightPrefixes[Any] = InflightPrefixes()
        if chunked is not None and (key := waiting_key(chunked)) is not None:
            inflight.add(chunked, key)
        held: list[Any] = []
        holds: dict[str, int] = {}
        asked: dict[tuple[Any, int], int] = {}
        for req in window:
            key = waiting_key(req)
            if key is None:
                continue
            sib = inflight.sibling(key)
            target = self._target(key, sib, chunked) if sib is not None else None
            passes = self.holds.get(req.rid, 0)
            if target is not None and sib is not None and passes < MAX_HOLD_PASSES:
                if not passes:
                    self.waiters_total += 1
                self.holds_total += 1
                holds[req.rid] = passes + 1
                held.append(req)
                asked[sib.owner, target] = asked.get((sib.owner, target), 0) + 1
            else:
                inflight.add(req, key)  # a held request is never a sibling in its own pass
        for (sibling, target), waiters in asked.items():
            self._add_cut(sibling, target, waiters)
        self.holds = holds
        self._held = held
        self._prune(scheduler)
        self._note_held(held)
        return list(held)

    @staticmethod
    def _window(scheduler: Any, queue: list[Any]) -> list[Any]:
        """The head of the queue this pass could admit: at most twice the running-request cap,
        and prompts worth at most WINDOW_PASSES passes of prefill. Later requests cannot be
        admitted beside a sibling in this pass anyway; the queue's demand taps serve them. This
        bounds the per-pass work (each request in the window costs O(its blocks)).
        """
        limit = max(1, 2 * int(getattr(scheduler, "max_running_requests", 32) or 32))
        per_pass = max(
            int(getattr(scheduler, "max_prefill_tokens", 0) or 0),
            int(getattr(scheduler, "chunked_prefill_size", 0) or 0),
            BLOCK_TOKENS,
        )
        budget = WINDOW_PASSES * per_pass
        window: list[Any] = []
        for req in queue:
            if len(window) >= limit or budget <= 0:
                break
            window.append(req)
            budget -= len(req.origin_input_ids)
        return window

    def _target(self, key: PromptKey, sib: Sibling, chunked: Any) -> int | None:
        m = self.cache.index.match(key)
        servable = m.best.frontier if m.best is not None else 0
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
        if len(self.demand):
            shared = self.demand.shared(key, self_counted=rid in self.demand)
            target = min(shared.tokens, key.n - 1)
            target -= target % BLOCK_TOKENS
            if worth_a_split(self.cache.cost, base, target):
                asked[target] = max(asked.get(target, 0), shared.others)
        return asked

    def _reconcile(self, queue: list[Any]) -> None:
        """Bring ``demand`` in line with the waiting queue: arrivals in, departures out.

        SGLang runs an admission pass every scheduler iteration while requests wait (a long queue
        behind a full pool: every decode step), so an unchanged queue is recognised in O(1) by
        its length and its ends. A change that keeps all three (as many leave as arrive, none at
        either end) is caught at the next change; meanwhile a demand tap may be missed or
        spurious, never wrong (taps are optional; hits compare bytes).
        """
        fingerprint = (len(queue), queue[0].rid, queue[-1].rid) if queue else (0, "", "")
        if fingerprint == self._queue_seen:
            return
        self._queue_seen = fingerprint
        current = {r.rid: r for r in queue}
        demand = self.demand
        for rid in demand.owners():
            if rid not in current:
                demand.discard(rid)
        if len(demand) == len(current):
            return
        for rid, req in current.items():
            if rid not in demand and (key := waiting_key(req)) is not None:
                demand.add(rid, key)

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
    held_ids = {id(r) for r in held}
    scheduler.waiting_queue = [r for r in order if id(r) not in held_ids]
    try:
        return orig(scheduler, *args, **kwargs)
    finally:
        left = scheduler.waiting_queue
        left_ids = {id(r) for r in left}
        known = {id(r) for r in order}
        scheduler.waiting_queue = [r for r in order if id(r) in held_ids or id(r) in left_ids] + [
            r for r in left if id(r) not in known
        ]
