"""Host-tier restores through SGLang's load-back protocol, asynchronously (spec §6.4-6.6).

:class:`LoadBack` is a part of :class:`~.cache.HybridRadixCache` (``cache.load_back``) and owns
the restores' staging slots and the admission pass in progress. SGLang's ``PrefillAdder`` budgets
a request whose best source is on the host and calls ``init_load_back`` once it accepts it. The
copies are issued there (``HostTier.restore``) and the request is held out of admission passes
until they retire; its next match (``restored_match``) answers the restored source as
device-resident with the lane the restore opened, and the image is copied on write from a staging
MambaPool slot. The restore's own lock on that lane goes once SGLang's admission locked it
(``on_admitted``). With inline copies the restore has retired when ``init_load_back`` returns and
the request is admitted in the same pass. ``poll`` runs once per scheduler iteration
(``plugin.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    InitLoadBackParams,
    MatchResult,
)

from ..index import BLOCK_TOKENS, PromptKey, Snapshot
from ..index.node import FastResidency
from .host_ops import PendingRestore
from .pages import ceil_to
from .request import ATTR, MatchHandle, ReqState, key_for, waiting_key

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from .cache import HybridRadixCache


FILL_WAIT_WINDOW = 64  # waiting requests checked for in-flight fills per pass, from the head


class LoadBack:
    def __init__(self, cache: HybridRadixCache) -> None:
        self.cache = cache
        # SGLang's allocators, the cache's for its whole life.
        self.mamba_allocator = cache.mamba_allocator
        self.allocator = cache.token_to_kv_pool_allocator
        self.page_size = cache.page_size
        self.device = cache.device
        # The admission pass in progress (its PrefillAdder), set as each candidate is selected
        # (``note_adder``): its remaining budget bounds an asynchronous restore and a prefetch.
        self.pass_adder: PrefillAdder | None = None
        # Restore staging slots (MambaPool) freed at the next poll; only changed here.
        self.free_next_poll: list[torch.Tensor] = []
        # Requests refused a staging slot, held out of admission passes until one frees (a
        # refused head would otherwise end every pass before the restored request behind it,
        # whose admission frees the slot). Request ids: every rank holds the same requests.
        self.staging_wait: set[str] = set()
        self.staging_refused = 0  # restores that waited for a staging slot
        self.staging_skipped = 0  # host hits recomputed: the pool leaves no staging slot at all

    def note_adder(self, adder: PrefillAdder | None) -> None:
        self.pass_adder = adder

    def staged_slots(self) -> int:
        """MambaPool slots held for restores: staging slots in flight or freed at the next poll
        (SGLang counts them protected, ``mamba_protected_size``)."""
        host = self.cache.host_tier
        staged = 0
        if host is not None and host.restores:
            staged = sum(p.staging is not None for p in host.restores.values())
        return staged + len(self.free_next_poll)

    def staging_room(self) -> int:
        """Staging slots an asynchronous restore may take now.

        SGLang hands running requests state slots without asking the cache: its admission
        counts requests (``--max-running-requests``), not MambaPool slots, and a failed slot
        allocation is fatal (``alloc_req_slots`` raises and the scheduler dies). So the pool
        keeps ``max_running`` slots for requests, the snapshot slots are the cache's, and
        staging takes only what is left; a burst of restores beyond that waits a pass each.
        """
        cache = self.cache
        spare = cache.state_slots - cache.snapshot_slot_count - cache.config.concurrency
        return spare - self.staged_slots()

    def copies_in_flight(self) -> bool:
        """Host copies not yet retired (or a staging slot not yet freed): the scheduler's loop
        keeps polling; nothing here is idle yet."""
        host = self.cache.host_tier
        return bool(self.free_next_poll) or (
            host is not None and bool(host.ops or host.backlog or host.restores)
        )

    # ================================================================ load-back
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, MatchHandle] | None:
        """Restore the host source SGLang's admission accepted (§6.4-6.5): open its lane (path
        and source pinned) and issue the copies of host-only blocks, tail and image.

        Asynchronous copies (the default): the request is not admitted now. It returns None
        (SGLang's adder ends this pass there, as for any deferred load-back) and the request is
        held out of admission passes until its copies retire (``held_for_restores``); then its
        next match answers the whole prefix as device-resident (``restored_match``) and it is
        admitted like any device hit. The restore's own hold on the lane (one lock) is dropped
        once SGLang's admission locked it (``on_admitted``). Inline copies (the replay harness)
        retire at once and the request is admitted in this pass, as SGLang's load-back expects.

        Returns None also when the device has no room for the pages even after evicting (retry
        later); ``(0, device handle)`` (resume from the device source) when a copy failed.
        """
        req = params.req
        assert req is not None  # Optional in SGLang's params; both of its callers pass the request
        star: MatchHandle = params.best_match_node
        dev: MatchHandle = req.last_node
        source = star.source
        host = self.cache.host_tier
        if self.cache.disable or host is None or source is None or star is dev:
            return 0, dev
        kv = req.kv
        adder = self.pass_adder
        if (
            not host.queue.synchronous
            and adder is not None
            and self._restore_pass_cost(star, source) > adder.cur_rem_tokens
        ):
            # The requests admitted earlier in this pass allocate their pages after the pass;
            # an asynchronous restore takes pages now and pins its path, which the pass's budget
            # counted as evictable. Only what the pass has left may go to it; else it waits for
            # the next pass.
            return None
        # The image's destination slot as a device index: its id is not read on the host.
        image_slot: torch.Tensor | None = None
        staging: torch.Tensor | None = None
        if source.image_on_device:
            pass  # copy-on-write from the source's slot (pinned by the lane)
        elif host.queue.synchronous:  # the image lands in the request's own slot now
            if not kv.holds_mamba:
                got = self.mamba_allocator.alloc(1)
                if got is None:
                    return None
                kv.mamba_pool_idx = got[0]
            assert kv.mamba_pool_idx is not None
            image_slot = kv.mamba_pool_idx.reshape(1).to(torch.int64)
        else:
            # The request is not admitted in this pass, and SGLang frees the state slot of a
            # request it did not admit: the image lands in a slot of the cache's own, which the
            # request copies on write from once admitted (freed at the next poll after that).
            if self.staging_room() <= 0:
                if not self.staged_slots():  # none will free: this pool has no staging room
                    self.staging_skipped += 1
                    return 0, dev
                self.staging_refused += 1
                self.staging_wait.add(req.rid)
                return None
            staging = self.mamba_allocator.alloc(1)
            if staging is None:
                return None
            image_slot = staging.reshape(1).to(torch.int64)
        assert star.match is not None and star.state is not None
        state = star.state
        lane = self.cache.index.open_lane(star.match, source, enabled=state.enabled)
        star.lane, star.locks = lane, 1  # the restore's own hold (see on_admitted)
        pending = host.restore(req.rid, star, lane, source, image_slot, staging)
        if pending is None:  # no room: nothing was touched
            self.cache.close_handle(star)
            if staging is not None:
                self.mamba_allocator.free(staging)
            return None
        state.restore = pending
        if not (pending.done or pending.failed):
            return None  # held until the copies retire (held_for_restores)
        ready = self._take_restore(req, state)
        if ready is None:  # the copy failed
            if dev.source is None:  # the slot may hold part of the image: start from zeros
                kv.mamba_cow_src_index, kv.mamba_needs_clear = None, True
            return 0, dev  # the copy-on-write set at match still points at s_dev
        self._set_restored_cow(kv, pending)
        kv.cache_protected_len = BLOCK_TOKENS * (star.prefix_len // BLOCK_TOKENS)
        return star.prefix_len - dev.prefix_len, star  # the hold goes at on_admitted

    def _restore_pass_cost(self, star: MatchHandle, source: Snapshot) -> int:
        """Tokens an asynchronous restore takes from the admission pass's budget: the pages of
        its host-only blocks and tail, and its path's blocks now evictable (its lane pins them)."""
        assert star.match is not None
        k = source.anchor.depth + 1
        lru = self.cache.index.lru
        absent = FastResidency.ABSENT
        blocks = sum(1 for n in star.match.path[:k] if n.device_state is absent or n in lru)
        tail = 0
        if source.tail and not source.tail_on_device:
            tail = ceil_to(source.tail_len, self.page_size)
        return blocks * BLOCK_TOKENS + tail

    def _take_restore(self, req: Req, state: ReqState) -> PendingRestore | None:
        """A retired restore of ``req``: the pending record when it succeeded; None (its hold
        dropped, its lane closed, later matches ignore host sources) when it failed."""
        pending = state.restore
        assert pending is not None and (pending.done or pending.failed)
        if pending.done:
            if not pending.counted:  # once, however many matches see it ready
                state.restored_bytes += pending.nbytes
                state.restored_tokens += pending.tokens
                pending.counted = True
                collector = self.cache.metrics_collector  # SGLang's load-back counter
                if collector is not None:
                    collector.increment_load_back_num_tokens(pending.tokens, "kv")
            return pending
        state.restore, state.no_host = None, True
        self._end_restore(req.rid, pending)
        return None

    def _end_restore(self, rid: str, pending: PendingRestore) -> None:
        """The restore's hold on its lane goes; its staging slot is freed at the next poll
        (a copy-on-write from it may still be queued in this pass)."""
        host = self.cache.host_tier
        assert host is not None
        host.restores.pop(rid, None)
        if pending.staging is not None:
            self.free_next_poll.append(pending.staging)
            pending.staging = None
        self.cache.close_handle(pending.handle)

    def poll(self) -> None:
        """Once per scheduler iteration (``plugin._before_next_batch``)."""
        if self.free_next_poll:
            self.mamba_allocator.free(torch.cat(self.free_next_poll))
            self.free_next_poll = []
        if self.cache.host_tier is not None:
            self.cache.host_tier.poll()

    def _set_restored_cow(self, kv: ReqKvInfo, pending: PendingRestore) -> None:
        source = pending.handle.source
        kv.mamba_needs_clear = False
        if pending.image_on_device:
            kv.mamba_cow_src_index = self.cache.slot_index(source.device_slot)
        elif pending.staging is not None:
            kv.mamba_cow_src_index = pending.staging.reshape(1).to(torch.int64)
        else:
            kv.mamba_cow_src_index = None  # the image was restored into the request's slot

    def restored_match(
        self, req: Req, state: ReqState, pkey: PromptKey, *, cow: bool
    ) -> MatchResult | None:
        """The match of a request whose restore retired: the restored source, now on the device,
        with the lane the restore opened. None: the restore failed (match afresh)."""
        pending, host = state.restore, self.cache.host_tier
        assert pending is not None and host is not None
        if not (pending.done or pending.failed):
            # Held requests are not matched; if SGLang matches one anyway, wait for it here
            # rather than admit a request whose state slot a copy is still writing.
            host.wait_for(pending)
        if self._take_restore(req, state) is None:
            return None
        star: MatchHandle = pending.handle
        assert star.match is not None
        f = star.prefix_len
        if cow:
            if not req.kv.holds_mamba:
                got = self.mamba_allocator.alloc(1)
                if got is None:  # no slot to resume into: give the restore up, match afresh
                    state.restore = None
                    self._end_restore(req.rid, pending)
                    return None
                req.kv.mamba_pool_idx = got[0]
            self._set_restored_cow(req.kv, pending)
            state.best_frontier = max(state.best_frontier, f)
            self.cache.publisher.plan(req, state, pkey, star.match, star.source)
        kv_len = star.match.kv_tokens
        return MatchResult(
            device_prefix_len=f,
            last_device_node=star,
            last_host_node=star,
            best_match_node=star,
            host_hit_length=0,
            cache_protected_len=BLOCK_TOKENS * (f // BLOCK_TOKENS),
            full_kv_hit_length=kv_len,
            full_device_match_len=kv_len,
        )

    def held_for_restores(self, queue: list[Req]) -> list[Req]:
        """Waiting requests to hold out of this admission pass while restores land: those whose
        own restore runs, those waiting for a staging slot (``staging_room``), and those near the
        queue's head whose prompt runs through blocks being filled (matched now they would
        resume short of the blocks on their way back, a request arriving with the one that
        restores them most of all, as coalescing's siblings do). O(requests checked x their
        blocks), only while a fill is in flight or a request waits for staging."""
        host = self.cache.host_tier
        if host is None:
            return []
        if self.staging_wait and (self.staging_room() > 0 or not self.staged_slots()):
            self.staging_wait.clear()  # a staging slot is free (or none will be): try again
        if not host.filling and not self.staging_wait:
            return []
        mine = host.restoring() | self.staging_wait
        filling = host.filling
        held: list[Req] = []
        for i, req in enumerate(queue):
            if req.rid in mine:
                held.append(req)
            elif filling and i < FILL_WAIT_WINDOW and (key := waiting_key(req)) is not None:
                m = self.cache.index.match(key)
                if m.settled_blocks < len(m.path):
                    held.append(req)
        return held

    def on_admitted(self, req: Req) -> None:
        """SGLang's admission locked the request's handle: a restore's own hold goes."""
        state = getattr(req, ATTR, None)
        if state is None or state.restore is None:
            return
        pending, state.restore = state.restore, None
        self._end_restore(req.rid, pending)  # drops one lock; the admission's keeps the lane

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        """SGLang aborts a waiting request (before it frees the request's state slot): a restore
        of it is waited for (every rank at the same point), then its lane is closed."""
        host = self.cache.host_tier
        pending = host.restores.pop(handle.rid, None) if host is not None else None
        if pending is None or host is None:
            return
        host.wait_for(pending)
        state = pending.handle.state
        if state is not None and state.restore is pending:
            state.restore = None
        self._end_restore(handle.rid, pending)

    # ================================================================ prefetch
    def prefetch_head(self, req: Req) -> int:
        """The FIFO head waits (§6.6): copy its source's host-only path blocks to the device.

        Only into room SGLang's admission pass left unpromised (its adder's ``rem_total_tokens``;
        no prefetch in a pass that considered no candidate). It retries only while the last
        attempt copied blocks or spare room grew, because matching walks the whole prompt path.
        """
        adder, host = self.pass_adder, self.cache.host_tier
        if self.cache.disable or host is None or req.kv.holds_kv or adder is None:
            return 0
        state = getattr(req, ATTR, None)
        if state is not None and state.restore is not None:
            return 0  # its own restore is in flight
        # Only what SGLang has not promised: its budget reserves pages for the running requests
        # (decode headroom, a chunked request's next chunks) and for this pass's admissions;
        # prefetching into those stopped the next chunk ("Prefill out of memory", reliability).
        spare = max(0, int(adder.rem_total_tokens))
        room = self.allocator.available_size() + self.cache.index.evictable_tokens
        last = getattr(state, "prefetch_room", None)
        if state is not None and last is not None and not state.prefetch_copied and room <= last:
            return 0
        tokens = req.origin_input_ids + req.output_ids
        key = key_for(state, tokens, len(tokens))
        m = self.cache.index.match(key)
        copied = host.prefetch(m.path, m.best, limit_tokens=spare)
        self.cache.free_dropped()
        if state is not None:
            state.prefetch_room, state.prefetch_copied = room, copied
        return copied
