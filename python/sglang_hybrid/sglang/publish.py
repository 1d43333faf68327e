"""What a pass's end publishes (spec §7.4-§7.7): block commits, taps, endpoints, a cancel's work.

:class:`Publisher` is a part of :class:`~.cache.HybridRadixCache` (``cache.publisher``): SGLang's
``checkpoint`` lands here, and the taps a request plans at its match come from here. At a chunk
end the completed blocks are committed (§7.6: new blocks become tree nodes owning the request's
slots; blocks the tree already holds are deduplicated, the request's slots freed and the row
repointed) and the taps due there are taken (a copy of the live state into a snapshot slot,
§7.4; an exact tap inside a block also copies the partial block's KV as its tail). At finish the
endpoint takes the request's state slot itself and the partial last block's pages as its tail
(§7.7). A chunked prefill being cancelled publishes what its last pass computed first.

No host sync (issue #35): the request's slot ids come from its host row mirror (``mirror.py``),
or stay on the device (``DeviceSlots`` handles) where the mirror does not cover them; its
MambaPool slot is used as a device index, or read from the mirror at finish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cpu.taps import TAPS_ATTR, TAPS_DONE_ATTR, mark_tap_done
from ..index import (
    BLOCK_TOKENS,
    Lane,
    Match,
    PromptKey,
    Snapshot,
    SnapshotKind,
    TapSource,
)
from ..index.taps import END_TOKENS
from ..store.device import DeviceSlots, block_handles, handles_to_slots, slots_to_handle, to_device
from ..store.handles import device_block_handles
from .hints import pins_endpoint, tap_hints
from .pages import alloc_evicting, ceil_to, free_slots
from .request import ATTR, InPassTap, MatchHandle, ReqState, key_for

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    from .cache import HybridRadixCache


def _realised(state: ReqState, due: list[int]) -> tuple[SnapshotKind, int, int]:
    """A snapshot realising the taps ``due``: Boundary if any is one; the most waiting demand;
    the origin of the highest-priority one (``TapSource`` values rank by priority; 0: none)."""
    kind = SnapshotKind.BOUNDARY if any(p in state.boundary for p in due) else SnapshotKind.TAP
    demand = max((state.demand.get(p, 0) for p in due), default=0)
    origin = min((o for p in due if (o := state.origin.get(p, 0))), default=0)
    return kind, demand, origin


def _committed(lane: Lane, frontier: int) -> bool:
    """Every full block below ``frontier`` is on the lane's path (a commit stops before a block
    whose device copy is still landing; a snapshot there waits for a later pass)."""
    return len(lane.path) >= frontier // BLOCK_TOKENS


class Publisher:
    def __init__(self, cache: HybridRadixCache) -> None:
        self.cache = cache
        # SGLang's pools and allocators, the cache's for its whole life.
        self.pools = cache.pools
        self.allocator = cache.token_to_kv_pool_allocator
        self.req_to_token_pool = cache.req_to_token_pool
        self.page_size = cache.page_size
        self.skips = cache.skips
        # Taps the model worker captured inside a pass (zero-split); only changed here.
        self.taps_in_pass = 0

    # ================================================================ the plan (at match)
    def plan(
        self, req: Req, state: ReqState, key: PromptKey, m: Match, source: Snapshot | None
    ) -> None:
        """The taps the request's passes will publish (§7.1), on its record: exact ones end a
        pass (``cuts``), flexible ones are taken where a pass ends; the coalescer's cuts where
        waiting requests will resume join them (§12.2)."""
        cache = self.cache
        n = state.n_prompt
        if not state.enabled or n < 2:
            state.cuts, state.flexible = [], []
            return
        pkey = key.prefix(n) if key.n > n else key
        planner = cache.index.planner
        dropped, declined = planner.over_budget, cache.index.split_rule.declined
        taps = cache.index.plan_taps(pkey, m, source, tap_hints(req, n), n=n)
        if planner.over_budget > dropped:
            self.skips.note("tap_over_budget", req.rid, count=planner.over_budget - dropped)
        if cache.index.split_rule.declined > declined:
            count = cache.index.split_rule.declined - declined
            self.skips.note("split_declined", req.rid, count=count)
        # The split rule kept the exact taps whose split pays and moved the others (and, with
        # --hybrid-tail-tap flexible, the prompt tail) to the grid (index/split_rule.py).
        state.cuts = [t.position for t in taps if t.exact]
        state.flexible = [t.position for t in taps if t.position not in state.cuts]
        state.boundary = {t.position for t in taps if t.boundary}
        state.origin = {t.position: int(t.source) for t in taps}
        state.taken = set()
        state.demand = {}
        state.capture_grid = cache.capture_grid
        if cache.coalescer is not None:  # where waiting requests will resume (spec §12.2)
            base = source.frontier if source is not None else 0
            state.demand = cache.coalescer.cuts_for(req.rid, pkey, base)
            if state.demand:
                for p in state.demand:
                    state.origin.setdefault(p, int(TapSource.COALESCE))
                state.cuts = sorted({*state.cuts, *state.demand})
                state.flexible = [p for p in state.flexible if p not in state.demand]
                state.boundary.update(state.demand)

    # ================================================================ checkpoints
    def checkpoint(self, req: Req, up_to: int) -> None:
        self._checkpoint(req, up_to, terminal=req.finished())

    def before_chunked_abort(self, scheduler: Scheduler, req: Req) -> None:
        """A chunked prefill is being cancelled (§7.7): its last pass ran but was never stashed.

        Commit that pass and publish the endpoint there before SGLang frees the row; SGLang then
        releases the request without a checkpoint and frees only what we did not take.
        """
        pending = getattr(scheduler, "_pending_chunked_abort_req", None)
        if pending is None or pending is not req or not req.kv.holds_kv:
            return
        end = req.extend_end
        if end is None or end <= req.prefix_len or end != req.kv.kv_committed_len:
            return
        self._checkpoint(req, end, terminal=True)

    def _checkpoint(self, req: Req, up_to: int, *, terminal: bool) -> None:
        finished = terminal
        if self.cache.disable or req.lock is None or getattr(req, ATTR, None) is None:
            if finished:
                self.cache.free_state_slot(req)
            return
        handle: MatchHandle = req.lock.node
        lane = handle.lane
        state: ReqState = getattr(req, ATTR)
        if lane is None or lane.closed:
            if finished:
                self.cache.free_state_slot(req)
            return
        if not state.sources_unpinned:
            # The first pass has run: SGLang's copy-on-write and our tail copy are done.
            self.cache.index.unpin_sources(lane)
            state.sources_unpinned = True
            missed = state.best_frontier - handle.prefix_len
            if missed > 0:  # a tier held a deeper state than this request resumed from
                self.skips.note("recomputed_held", f"{req.rid}: {missed} tokens")
                self.skips.recomputed_tokens += missed
            if self.cache.metrics is not None:  # the hit is final once the first pass has run
                self.cache.metrics.on_admitted(handle, state)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        # Everything below reads the key's tokens before ``up_to`` only, so a chunk end takes the
        # request's own key, not a prefix copy: the hashes its commit computes stay with it.
        key = state.key
        if up_to > key.n:
            key = key_for(state, req.full_untruncated_fill_ids, up_to)
        self._commit(handle, lane, key, row, up_to)
        protected = BLOCK_TOKENS * len(lane.path)
        if handle.inpass:
            self._settle_inpass(req, handle, state, lane, key, row, up_to)
        if finished:
            protected = self._finish(req, state, lane, key, row, up_to, protected)
        else:
            self._publish_taps(req, state, lane, key, row, up_to)
        req.kv.cache_protected_len = max(req.kv.cache_protected_len, protected)
        self.cache.free_dropped()

    def _commit(
        self, handle: MatchHandle, lane: Lane, key: PromptKey, row: torch.Tensor, up_to: int
    ) -> None:
        start = len(lane.path)
        end = up_to // BLOCK_TOKENS
        if end <= start:
            return
        a, b = BLOCK_TOKENS * start, BLOCK_TOKENS * end
        # One handle per block; the index takes the ones it keeps by position. From the host
        # mirror (bytes, split in C), else kept on the device.
        host = handle.rows.read(a, b)
        handles: list[bytes] | list[DeviceSlots]
        handles = block_handles(host) if host is not None else device_block_handles(row[a:b])
        dups = self.cache.index.commit(lane, key, up_to, handles.__getitem__)
        if dups:
            # The tree already holds these blocks: free the request's copies, map the tree's.
            # Block positions are host data: indices reach the device through pinned memory.
            blocks = np.array([blk for blk, _ in dups], dtype=np.int64)
            pos = (blocks[:, None] * BLOCK_TOKENS + np.arange(BLOCK_TOKENS)).reshape(-1)
            idx = to_device(torch.from_numpy(pos), row.device)
            free_slots(self.allocator, row[idx].to(torch.int64))
            tree = [n.device for _, n in dups]
            row[idx] = handles_to_slots(tree, row.device).to(row.dtype)
            for (blk, _), h in zip(dups, tree):
                at = BLOCK_TOKENS * blk
                if isinstance(h, bytes):
                    handle.rows.put(at, np.frombuffer(h, dtype=np.int32))
                else:
                    handle.rows.forget(at, at + BLOCK_TOKENS)

    def _publish_taps(
        self, req: Req, state: ReqState, lane: Lane, key: PromptKey, row: torch.Tensor, up_to: int
    ) -> None:
        """A chunk ended at ``up_to``: take the exact tap there or flexible taps it reached.

        Under overlap scheduling the next batch may already have advanced the live state, so
        nothing is copied here: the pass's end was captured as it ran (``reserve_inpass``)."""
        if self.cache.overlap:
            return
        due = state.due_at(up_to)
        if not due:
            return
        state.taken.update(due)
        kind, demand, origin = _realised(state, due)
        self._take_snapshot(req, lane, key, row, up_to, kind, demand, origin)

    # ---------------------------------------------------------------- in-pass taps
    def reserve_inpass(self, req: Req, start: int, end: int) -> None:
        """Before the pass [start, end): a staging slot for each tap captured as part of it,
        handed to the model worker as ``req.hybrid_state_taps`` (``cpu/taps.py``): taps on its
        grid inside it (zero-split) and, under overlap scheduling, the tap at its end, which
        ``capture_pass_ends`` copies once the pass is launched (spec §7.4; the worker leaves a
        pair at the pass's end alone)."""
        state: ReqState | None = getattr(req, ATTR, None)
        lock = getattr(req, "lock", None)
        if state is None or lock is None or not state.enabled:
            return
        handle: MatchHandle = lock.node
        lane = handle.lane
        if lane is None or lane.closed:
            return
        self.cancel_inpass(handle)  # a previous pass's leftovers (never the case normally)
        if not self.cache.slots_reserved:  # not reserved again yet (after a flush)
            return
        for p in state.capturable(start, end):
            kind, demand, origin = _realised(state, [p])
            self._reserve_staged(req, handle, state, lane, p, kind, demand, origin)
        if self.cache.overlap:
            due = state.due_at(end, {t.position for t in handle.inpass})
            if due:
                kind, demand, origin = _realised(state, due)
                self._reserve_staged(req, handle, state, lane, end, kind, demand, origin, due)
        setattr(req, TAPS_ATTR, [(t.position, self.cache.slot_id(t.slot)) for t in handle.inpass])
        setattr(req, TAPS_DONE_ATTR, [])
        self.cache.free_dropped()  # a slot's victim may have left a tail's pages to hand back

    def _reserve_staged(
        self,
        req: Req,
        handle: MatchHandle,
        state: ReqState,
        lane: Lane,
        p: int,
        kind: SnapshotKind,
        demand: int,
        origin: int,
        covers: list[int] | None = None,
    ) -> None:
        slot = self.cache.index.reserve_slot(lane, p, kind, demand, origin)
        if slot is None:
            self.skips.note("tap_no_slot", f"{req.rid} at {p}")
            state.taken.update((p, *(covers or ())))
            return
        handle.inpass.append(InPassTap(p, slot, kind, demand, tuple(covers or ()), origin))

    @staticmethod
    def count_rounds(batch: ScheduleBatch | None, *, launched: bool) -> None:
        """A speculative decode round of ``batch`` was launched / its result is being processed
        (``ReqState.rounds_launched`` / ``rounds_processed``; see ``_finish``)."""
        if batch is None or batch.spec_algorithm.is_none() or not batch.forward_mode.is_decode():
            return
        for req in batch.reqs:
            state = getattr(req, ATTR, None)
            if state is None:
                continue
            if launched:
                state.rounds_launched += 1
            else:
                state.rounds_processed += 1

    def capture_pass_ends(self, batch: ScheduleBatch | None) -> None:
        """Right after an extend pass was launched (overlap scheduling): copy each request's live
        state into the slot reserved for the tap at its pass's end. The copy is ordered after
        this pass and before the next one (the forward stream, ``DevicePools.stream``); the
        checkpoint that publishes it may come after the next batch advanced the live state."""
        if not self.cache.overlap or batch is None or not batch.forward_mode.is_extend():
            return
        for req in batch.reqs:
            taps = getattr(req, TAPS_ATTR, None)
            lock = getattr(req, "lock", None)
            if not taps or lock is None or not req.kv.holds_mamba:
                continue
            end = req.extend_end
            for t in lock.node.inpass:
                if t.position == end:
                    # Device indices: the request's slot is not read on the host here.
                    dst = self.cache.slot_index(t.slot)
                    src = req.kv.mamba_pool_idx
                    assert src is not None  # (holds_mamba, tested above)
                    self.pools.copy_state(src, dst)
                    mark_tap_done(req, t.position)

    def _settle_inpass(
        self,
        req: Req,
        handle: MatchHandle,
        state: ReqState,
        lane: Lane,
        key: PromptKey,
        row: torch.Tensor,
        up_to: int,
    ) -> None:
        """The pass ran: publish what the worker captured, hand back the other slots."""
        done = set(getattr(req, TAPS_DONE_ATTR, None) or ())
        taps, handle.inpass = handle.inpass, []
        setattr(req, TAPS_ATTR, None)
        for t in taps:
            if t.position not in done or t.position > up_to or not _committed(lane, t.position):
                self.cache.index.cancel_slot(t.slot, lane, t.position, t.kind)
                continue
            state.taken.add(t.position)
            state.taken.update(t.covers)
            tail = None
            if t.position % BLOCK_TOKENS:
                tail = self._copy_request_tail(row, t.position)
                if tail is None:
                    self.skips.note("tap_no_tail_page", f"{req.rid} at {t.position}")
                    self.cache.index.cancel_slot(t.slot, lane, t.position, t.kind)
                    continue
            s = self._publish_staged(
                lane, key, t.position, t.slot, t.kind, tail, t.demand, t.origin
            )
            if s is not None and not t.covers:  # captured inside the pass, not at its end
                self.taps_in_pass += 1

    def cancel_inpass(self, handle: MatchHandle) -> None:
        taps, handle.inpass = handle.inpass, []
        for t in taps:
            self.cache.index.cancel_slot(t.slot, handle.lane, t.position, t.kind)

    def _take_snapshot(
        self,
        req: Req,
        lane: Lane,
        key: PromptKey,
        row: torch.Tensor,
        frontier: int,
        kind: SnapshotKind,
        demand: int = 0,
        origin: int = 0,
    ) -> Snapshot | None:
        if not self.cache.slots_reserved or not _committed(lane, frontier):
            return None  # no slots (after a flush, until reserved again), or blocks not committed
        tail = self._copy_request_tail(row, frontier) if frontier % BLOCK_TOKENS else None
        if frontier % BLOCK_TOKENS and tail is None:
            # No KV room for the tail even after evicting: skip the tap (§9.2: optional).
            self.skips.note("tap_no_tail_page", f"{req.rid} at {frontier}")
            return None
        slot = self.cache.index.reserve_slot(lane, frontier, kind, demand, origin)
        if slot is None:
            self.skips.note("tap_no_slot", f"{req.rid} at {frontier}")
            if tail is not None:
                free_slots(self.allocator, tail)
            return None
        src = req.kv.mamba_pool_idx
        assert src is not None  # a request being checkpointed holds its state slot
        self.pools.copy_state(src, self.cache.slot_index(slot))
        return self._publish_staged(lane, key, frontier, slot, kind, tail, demand, origin)

    def _publish_staged(
        self,
        lane: Lane,
        key: PromptKey,
        frontier: int,
        slot: int,
        kind: SnapshotKind,
        tail: torch.Tensor | None,
        demand: int,
        origin: int = 0,
    ) -> Snapshot | None:
        """Publish the state staged in ``slot`` (and ``tail``, a cache-owned KV copy on pages
        just allocated: its handle stays on the device)."""
        s = self.cache.index.publish(
            lane,
            key,
            frontier,
            slot,
            kind,
            tail_device=DeviceSlots(tail.to(torch.int64)) if tail is not None else None,
            tail_device_tokens=0 if tail is None else int(tail.numel()),
            demand=demand,
            origin=origin,
        )
        if s is None and tail is not None:  # a duplicate: the tail copy stays ours to free
            free_slots(self.allocator, tail)
        if s is not None and self.cache.host_tier is not None:
            self.cache.host_tier.write_snapshot(s, self.cache.slot_id(slot), lane)
        return s

    def _copy_request_tail(self, row: torch.Tensor, frontier: int) -> torch.Tensor | None:
        """Cache-owned pages holding a copy of the request's KV in [floor64(f), f), or None.

        The request keeps its own pages (it still computes into them), so an exact tap inside a
        block pays a copy of at most 63 tokens. Like any allocation it evicts cached blocks by
        the device LRU when the pool is short: evictable cache is free memory in a server that
        has run for a while, and the request's own path is pinned by its lane (issue #11).
        """
        base = BLOCK_TOKENS * (frontier // BLOCK_TOKENS)
        need = ceil_to(frontier, self.page_size) - base
        dst = alloc_evicting(self.allocator, need, self.cache.evict_tokens)
        if dst is None:
            return None
        t = frontier - base
        self.pools.copy_kv(dst[:t], row[base:frontier].to(torch.int64))
        return dst

    def _finish(
        self,
        req: Req,
        state: ReqState,
        lane: Lane,
        key: PromptKey,
        row: torch.Tensor,
        up_to: int,
        protected: int,
    ) -> int:
        """Terminal settlement (§7.7): the endpoint takes the state slot and the partial page."""
        assert req.lock is not None  # (via _checkpoint, which returns early without a lock)
        handle: MatchHandle = req.lock.node
        f = up_to
        live = req.kv.kv_committed_len
        took_slot = False
        # A checkpoint request (``POST /hybrid/checkpoint``) wants its endpoint wherever it ends;
        # others only at least a block past the deepest state below (§7.7).
        gap = 1 if pins_endpoint(req) else BLOCK_TOKENS
        # The live state sits after every committed token; a stop that trims the output leaves
        # it ahead of the KV the request keeps, and then there is no exact endpoint to publish.
        # So does a speculative round launched before this result was processed (overlap
        # scheduling, a stop token): SGLang keeps none of its tokens, but it ran.
        if (
            lane.enabled
            and self.cache.slots_reserved
            and _committed(lane, f)
            and f == live
            and state.rounds_launched <= state.rounds_processed
            and f >= gap
            and self._spaced(lane, f, gap)
        ):
            slot = self.cache.index.reserve_slot(lane, f, SnapshotKind.ENDPOINT)
            if slot is not None:
                base = BLOCK_TOKENS * (f // BLOCK_TOKENS)
                tail_end = ceil_to(f, self.page_size)
                tail: bytes | DeviceSlots | None = None
                if f % BLOCK_TOKENS:
                    tail = self._tail_handle(handle, row, base, f, tail_end)
                s = self.cache.index.publish(
                    lane,
                    key,
                    f,
                    slot,
                    SnapshotKind.ENDPOINT,
                    tail_device=tail,
                    tail_device_tokens=tail_end - base,
                )
                if s is not None:
                    # The state slot becomes the snapshot's; the slot it displaced goes back.
                    # The slot id on the host, from the request's mirror (mirror.py).
                    self.cache.swap_state_slot(slot, handle.slot_of(req))
                    req.kv.mamba_pool_idx = None
                    took_slot = True
                    if tail is not None:
                        protected = tail_end  # the tail's pages are the cache's now
                    if self.cache.host_tier is not None:
                        self.cache.host_tier.write_snapshot(s, self.cache.slot_id(slot), lane)
        if not took_slot:
            self.cache.free_state_slot(req)
        return protected

    def _tail_handle(
        self, handle: MatchHandle, row: torch.Tensor, begin: int, f: int, end: int
    ) -> bytes | DeviceSlots:
        """The handle of every slot of the pages holding row positions [begin, f) (``end``:
        ``f`` rounded up to a page): from the host mirror, else on the device."""
        ps = self.page_size
        host = handle.rows.read(begin, f)
        if host is not None:
            firsts = host[::ps]
            return slots_to_handle((firsts[:, None] + np.arange(ps)[None, :]).reshape(-1))
        firsts_d = row[begin:end:ps].to(torch.int64)
        if ps == 1:
            return DeviceSlots(firsts_d)
        offs = torch.arange(ps, device=row.device)
        return DeviceSlots((firsts_d[:, None] + offs[None, :]).reshape(-1))

    @staticmethod
    def _spaced(lane: Lane, f: int, gap: int) -> bool:
        """An endpoint at ``f`` is ``gap`` tokens past every snapshot on the lane's path below
        it (§7.7), except a prompt-tail tap (issue #37), which it need only pass by more than
        END_TOKENS: the tail serves a re-sent prompt, the endpoint one that continues past the
        answer, so a short answer keeps both (GDSF values the endpoint by the few tokens it
        saves over the tail)."""
        tail, tail_gap = TapSource.TAIL, min(gap, END_TOKENS + 1)

        def too_close(s: Snapshot) -> bool:
            d = f - s.frontier
            return d > 0 and d < (tail_gap if s.origin == tail else gap)

        for s in (lane.resumed_from, lane.last_tap):
            if s is not None and too_close(s):
                return False
        for node in reversed(lane.path):
            if f - node.end >= gap:  # anything shallower is far enough anyway
                break
            for s in node.snapshots or ():
                if too_close(s):
                    return False
        return True
