"""``HybridRadixCache``: SGLang's ``BasePrefixCache`` contract over the index (the device tier).

The index decides; SGLang's pools hold the bytes. How SGLang's calls map onto the spec:

- ``match_prefix`` walks the tree (§6.1), chooses the source (§6.2) and, for an admission attempt
  (``cow_mamba``), points SGLang's deferred mamba copy-on-write at the snapshot's slot. The hit is
  the source's frontier F, which may lie inside a block: then the row's positions
  [64*floor(F/64), F) are a private copy of the snapshot's tail, made when SGLang first asks for
  the prefix's slots (``prefix_device_indices``, i.e. once the request is admitted), and
  ``cache_protected_len`` stays on the block grid so SGLang frees that copy with the request.
- ``lock`` opens a lane (pins the path and the source, §6.4); ``unlock`` closes it and hands its
  blocks to the device LRU deepest first (§7.7).
- ``checkpoint`` commits the blocks a pass completed (§7.6): new blocks become tree nodes owning
  the request's slots; blocks the tree already holds are deduplicated (the request's slots are
  freed and the row repointed, as SGLang's own caches do). At chunk ends it publishes taps (a
  copy of the live state into a snapshot slot, §7.4); at finish the endpoint (§7.7) takes the
  request's state slot itself (no copy; the snapshot slot it displaced goes back to SGLang) and the
  partial last block's pages as its tail.
- Its parts are composed: the checkpoint path (commits, taps, endpoints, the cancel hook, and the
  taps a request plans at its match) is ``publisher`` (``publish.py``); host restores through
  SGLang's load-back, the prefetch and the per-iteration poll of the host tier's copies are
  ``load_back`` (``load_back.py``); the host tier's copies themselves are ``host_tier``
  (``host_tier.py``). SGLang's method names stay on this class and delegate to them.
- Snapshot slots are D extra ``MambaPool`` slots this cache holds from construction; SGLang sees
  them in ``mamba_evictable_size`` (cache, not load: its usage gauges, issue #38), so its idle
  identity holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheRequestHandle,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)

from ..index import BLOCK_TOKENS, CacheConfig, CostModel, Lane, Match, PrefixIndex, Snapshot
from ..index.admission import cheapest
from ..store.device import DevicePools, handle_to_slots, handles_to_slots, pool_device
from ..store.layout import build_layout
from .coalesce import Coalescer
from .flags import HybridOptions
from .host_tier import HostTier
from .l3_tier import L3Tier
from .load_back import LoadBack
from .metrics import CacheMetrics, with_dp_rank
from .mirror import PassSlots, feed_batch
from .pages import alloc_evicting, ceil_to, free_dropped
from .publish import Publisher
from .ranks import RankCheck
from .recent import Recent
from .request import ATTR, MatchHandle, ReqState, key_for, namespace_of
from .skips import Skips

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)


class HybridRadixCache(BasePrefixCache):
    def __init__(
        self,
        params: CacheInitParams,
        *,
        config: CacheConfig,
        options: HybridOptions,
        cost: CostModel | None = None,
        capture_grid: int | None = None,
        draft_kv_pools: Sequence[Any] = (),
    ) -> None:
        # SGLang types it as the plain ReqToTokenPool; a hybrid model's (HybridReqToTokenPool)
        # also has the mamba_pool and mamba_allocator read here
        r2t: Any = params.req_to_token_pool
        self.req_to_token_pool = r2t
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = bool(params.disable)
        self.config = config
        self.options = options
        self.mamba_allocator = r2t.mamba_allocator
        self.state_slots = int(r2t.mamba_pool.size)  # the MambaPool: requests, snapshots, staging
        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        # Every tensor handed to SGLang's pools and allocators is made on this device (the KV
        # pool's and the MambaPool's); "cpu" strings in this package only name host metadata.
        self.device = pool_device(kv_pool)
        # Speculative decoding: the draft model's KV pools (``draft.py``) move with the target's.
        self.pools = DevicePools(kv_pool, r2t.mamba_pool, self.device, draft_kv_pools)
        cache = r2t.mamba_pool.mamba_cache
        self._state_tensors = [*cache.conv, cache.temporal]
        self.layout = build_layout(self.pools.kv_buffers, self._state_tensors)
        self.image_bytes = self.layout.image_bytes
        self.block_bytes = self.layout.block_bytes
        self.slab_bytes = self.layout.slab_bytes
        self.cost = cost or CostModel()
        self.root_node = MatchHandle(None, None, 0)
        # Index snapshot slot -> MambaPool slot id; only changed by _reserve_slots, reset and
        # swap_state_slot. ``_slot_table`` holds the same ids on the device, so a slot handed to
        # SGLang (a copy-on-write source, a free) never needs a host-to-device copy.
        self._slot_ids: list[int] = []
        self._slot_table: torch.Tensor | None = None
        # The host tier's copies (``host_tier.py``), with ``--hybrid-host-cache-mib``; the index's
        # own ``host`` is the slab pool they copy into.
        self.host_tier: HostTier | None = None
        self.l3: L3Tier | None = None  # ``--hybrid-l3`` (``l3_tier.py``, set by the factory)
        self.skips = Skips()
        self.rank_check: RankCheck | None = None  # --hybrid-check-ranks (set by the factory)
        # zero-split: taps on each pass's grid of this many tokens (from where the request's
        # extend starts) are captured inside the pass, the others end it; 0: every tap splits.
        # 1 (any position) on the CPU workers (cpu/capture.py) and SGLang's GPU worker
        # (gdn_taps.py); the factory says which (plugin._resolve_tap_mode).
        if capture_grid is None:
            capture_grid = 1 if options.tap_mode == "zero-split" else 0
        self.capture_grid = capture_grid
        # Overlap scheduling (SGLang's event_loop_overlap): set from the scheduler before its
        # first pass (``bind_scheduler``).
        self.overlap = False
        self.bound_to: Scheduler | None = None  # the scheduler ``bind_scheduler`` last saw
        self.coalescer = Coalescer(self) if options.coalesce and not self.disable else None
        self.recent = Recent()  # the sequences released last, for GET /slots
        self._tp_group = getattr(params, "tp_cache_group", None)  # the host tier's MIN poll
        # Parts: what a pass's end publishes, and restores through SGLang's load-back.
        self.publisher = Publisher(self)
        self.load_back = LoadBack(self)
        self.index = self._new_index()
        self._reserve_slots(strict=True)
        self.metrics: CacheMetrics | None = None  # --enable-metrics (metrics.py)
        if getattr(params, "enable_metrics", False) and not self.disable:
            self.init_metrics_collector()
            labels = getattr(self.metrics_collector, "labels", None) or {}
            self.metrics = CacheMetrics(with_dp_rank(labels))

    def empty_index(self) -> None:
        """Replace the index by an empty one on the same memory (a persisted tier not loaded)."""
        self.index = self._new_index()

    @property
    def state_dtypes(self) -> list[str]:
        """The dtypes of the recurrent-state tensors, in layer order (the persisted fingerprint)."""
        return [str(t.dtype) for t in self._state_tensors]

    def _new_index(self) -> PrefixIndex:
        # The index may charge an image more than its bytes (``HybridOptions.image_charge_bytes``).
        charged = max(self.image_bytes, self.options.image_charge_bytes or 0)
        index = PrefixIndex(
            self.config, image_bytes=charged, slab_bytes=self.slab_bytes, cost=self.cost
        )
        rule = index.split_rule  # which exact taps end a pass (issue #36, index/split_rule.py)
        rule.threshold = self.options.split_threshold
        rule.cost = self.options.split_cost or self.cost
        rule.grid = self.capture_grid
        rule.exact_tail = self.options.tail_tap == "exact"
        if self.config.has_host and not self.disable:
            if self.host_tier is not None:
                self.host_tier.rebind(index)  # a reset keeps the allocation, drops the contents
            else:
                self.host_tier = HostTier(
                    index,
                    self.layout,
                    self.pools,
                    self.token_to_kv_pool_allocator,
                    self._state_tensors,
                    self._forward_order(),
                    self.page_size,
                    self.skips,
                    copy_mode=self.options.host_copy,
                    write_limit_bytes=self.options.host_write_mib << 20,
                    group=self._tp_group,
                )
        return index

    def _forward_order(self) -> list[tuple[str, int]]:
        """Every layer in model order, as ("kv", full-attention idx) or ("state", linear idx)."""
        kv_pool = self.pools.kv_pool
        full = getattr(kv_pool, "full_attention_layer_id_mapping", {})
        linear = getattr(self.req_to_token_pool, "mamba_map", {})
        order = sorted(
            [(g, "kv", i) for g, i in full.items()] + [(g, "state", i) for g, i in linear.items()]
        )
        # The draft model runs after the target: its layers come last (``DevicePools``).
        n_kv = len(self.pools.kv_buffers) // 2
        drafts = [("kv", i) for i in range(n_kv - self.pools.draft_layers, n_kv)]
        return [(kind, i) for _, kind, i in order] + drafts

    def bind_scheduler(self, scheduler: Scheduler) -> None:
        """Once, before the scheduler's first pass. Under overlap scheduling the next batch is
        scheduled while this one runs: pass ends are captured as part of the pass (``publish``),
        and on CUDA every copy the cache makes inside SGLang's pools, and every host copy, is
        ordered on the forward stream, so it lands after the pass that produced its source and
        before the next pass that writes it (the scheduler thread's own stream is the schedule
        stream there)."""
        self.bound_to = scheduler
        self.overlap = bool(getattr(scheduler, "enable_overlap", False))
        stream = getattr(scheduler, "forward_stream", None) if self.overlap else None
        if stream is not None and self.device.type == "cuda":
            self.pools.stream = stream
            if self.host_tier is not None:
                self.host_tier.order_after(stream)

    def note_adder(self, adder: PrefillAdder | None) -> None:
        """The admission pass in progress (its remaining budget bounds an asynchronous
        restore, ``LoadBack.init_load_back``); set as each candidate is selected."""
        self.load_back.note_adder(adder)

    # ================================================================ snapshot slots
    def _reserve_slots(self, *, strict: bool = False) -> bool:
        """Take the D snapshot slots from SGLang's allocator: at construction (``strict``: a
        pool too small is a startup error), and again after a flush (the flush hook, or the next
        match when the cache was reset some other way). After a flush a pool that cannot give
        them now is retried at the next match; until then no snapshot is taken."""
        if self.disable or self._slot_ids:
            return True
        n = self.config.device_snapshot_slots
        got = self.mamba_allocator.alloc(n)
        if got is None:
            if not strict:
                return False
            raise RuntimeError(
                f"--radix-cache hybrid could not reserve {n} snapshot slots: only "
                f"{self.mamba_allocator.available_size()} MambaPool slots are free; raise "
                f"--max-mamba-cache-size or lower --hybrid-device-snapshot-slots"
            )
        # One device->host read per reservation (startup, and after a flush), never per pass.
        self._slot_ids = [int(x) for x in got.tolist()]
        self._slot_table = got.to(torch.int64).clone()
        return True

    def after_flush(self) -> None:
        """SGLang's flush reset this cache, then cleared its pools (the snapshot slots with them):
        take the slots back at once. Left to the next match, the next admission pass would first
        pre-allocate a state slot for every waiting request and could leave too few."""
        self._reserve_slots()

    def slot_id(self, slot: int) -> int:
        return self._slot_ids[slot]

    def slot_index(self, slot: int) -> torch.Tensor:
        """The MambaPool slot of snapshot slot ``slot`` as a one-element device tensor (a copy:
        the table changes when an endpoint takes a request's slot)."""
        assert self._slot_table is not None  # (slots are reserved: _slot_ids is not empty)
        return self._slot_table[slot : slot + 1].clone()

    @property
    def snapshot_slot_count(self) -> int:
        """MambaPool slots the cache holds as snapshot slots (0 after a flush until reserved)."""
        return len(self._slot_ids)

    @property
    def slots_reserved(self) -> bool:
        """The snapshot slots are held (false after a flush until reserved again)."""
        return bool(self._slot_ids)

    def swap_state_slot(self, slot: int, state_slot: int) -> None:
        """Snapshot slot ``slot`` becomes MambaPool slot ``state_slot`` (an endpoint takes its
        request's state slot, §7.7); the slot it displaced goes back to SGLang."""
        assert self._slot_table is not None
        old = self.slot_index(slot)
        self._slot_ids[slot] = state_slot
        self._slot_table[slot] = state_slot  # a fill on the device: no host wait
        self.mamba_allocator.free(old)

    # ================================================================ SGLang contract: sizes
    def supports_mamba(self) -> bool:
        return True

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def evictable_size(self) -> int:
        return self.index.evictable_tokens

    def full_evictable_size(self) -> int:
        return self.index.evictable_tokens

    def protected_size(self) -> int:
        return self.index.protected_tokens

    def full_protected_size(self) -> int:
        return self.index.protected_tokens

    def mamba_evictable_size(self) -> int:
        # The snapshot slots are cache, not load (issue #38): SGLang's mamba_usage and
        # token_usage count pool slots neither free nor evictable as used by requests. They are
        # held for good (eviction reuses them, never returns them to the allocator), which
        # SGLang's admission reads only with the unified pool, refused (checks.py).
        return len(self._slot_ids)

    def mamba_protected_size(self) -> int:
        # The staging slots of asynchronous restores: states of requests about to run.
        return self.load_back.staged_slots()

    def total_size(self) -> tuple[int, int]:
        return self.index.device_tokens, len(self._slot_ids)

    # ================================================================ reset
    def reset(self) -> None:
        """Drop everything. SGLang clears its pools right after (flush), freeing our slots too."""
        self.index = self._new_index()
        self._slot_ids = []
        self._slot_table = None
        if self.coalescer is not None:
            self.coalescer.on_reset()
        if self.l3 is not None:
            self.l3.on_reset()

    # ================================================================ match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The deepest prefix this request may resume from (§6.1-6.2).

        SGLang's key already stops one token short of the prompt (``_compute_max_prefix_len``:
        the last token is always prefilled), so a state may sit at the key's very end: the index
        is asked about the key plus that token, whose rule "F <= n - 1" then allows F = len(key).

        With a host tier the hit is split as SGLang's load-back protocol expects: the device part
        (the deepest snapshot resident on the device) is ``device_prefix_len``; when a deeper
        snapshot on the host is cheaper to restore than the prefill it saves, the difference is
        ``host_hit_length`` and ``init_load_back`` restores it once the admission budget, which
        then counts the restore's pages, has accepted the request. A candidate SGLang probes and
        rejects restores nothing, and a budget that is full only for now makes it wait.
        """
        key, req = params.key, params.req
        if self.disable:
            return self._empty_result()
        self._reserve_slots()
        tokens = key.token_ids
        n = min(len(key) + 1, len(tokens))
        state = getattr(req, ATTR, None) if req is not None else None
        if req is not None and state is None:
            state = ReqState(
                key=key_for(None, tokens, n, namespace_of(key)),
                n_prompt=len(req.origin_input_ids),
                enabled=not req.skip_radix_cache_insert,
            )
            setattr(req, ATTR, state)
        pkey = key_for(state, tokens, n, namespace_of(key))
        if req is not None and state is not None and state.restore is not None:  # (state: req's)
            ready = self.load_back.restored_match(req, state, pkey, cow=bool(params.cow_mamba))
            if ready is not None:
                return ready
        m = self.index.match(pkey)
        source, host_source = self._choose(m)
        if state is not None and state.no_host:
            host_source = None  # its restore failed once: resume from the device or recompute
        if params.cow_mamba and req is not None and not self._prepare_state_slot(req, source):
            source = host_source = None  # no state slot to resume into: prefill from the root
            self._prepare_state_slot(req, None)
        f = source.frontier if source is not None else 0
        handle = MatchHandle(m, source, f, state)
        best = handle
        if host_source is not None:
            best = MatchHandle(m, host_source, host_source.frontier, state)
        # No LRU touch here: admission pins the path (out of the LRU) and release appends it at
        # the MRU end, which is the hit's recency; a probe that is not admitted is not a hit.
        if params.cow_mamba and req is not None and state is not None:
            state.best_frontier = m.best.frontier if m.best is not None else 0
            self.publisher.plan(req, state, pkey, m, best.source)
        kv = m.kv_tokens
        return MatchResult(
            device_prefix_len=f,
            last_device_node=handle,
            last_host_node=handle,
            best_match_node=best,
            host_hit_length=best.prefix_len - f,
            cache_protected_len=BLOCK_TOKENS * (f // BLOCK_TOKENS),
            full_kv_hit_length=kv,
            full_device_match_len=kv,
        )

    def _choose(self, m: Match) -> tuple[Snapshot | None, Snapshot | None]:
        """(device source, host source) (§6.2): the device source is the deepest snapshot resident
        on the device; the host source is the deepest valid one when it is not on the device and
        restoring it is cheaper than prefilling from the device source. Capacity is left to
        SGLang's admission budget (the restore's pages are part of the request's prefill there).
        """
        dev = m.best_device
        if self.host_tier is None or m.best is None or m.best is dev:
            return dev, None
        c = cheapest(self.index, m, request_tokens=m.n)
        return dev, (c.snapshot if c.snapshot is m.best else None)

    def _empty_result(self) -> MatchResult:
        return MatchResult(
            device_prefix_len=0,
            last_device_node=self.root_node,
            last_host_node=self.root_node,
            best_match_node=self.root_node,
            cache_protected_len=0,
        )

    def _prepare_state_slot(self, req: Req, source: Snapshot | None) -> bool:
        """SGLang's deferred copy-on-write: the lane's slot gets the device source's state (a
        host source's image is restored into the same slot by ``init_load_back`` instead).
        False: no MambaPool slot to resume into (the caller resumes from the root; SGLang's
        admission then waits for a slot as for any request)."""
        kv = req.kv
        if source is None:
            if kv.holds_mamba:
                kv.mamba_cow_src_index = None
                kv.mamba_needs_clear = True
            return True
        if not kv.holds_mamba:
            dst = self.mamba_allocator.alloc(1)
            if dst is None:
                return False
            kv.mamba_pool_idx = dst[0]
        kv.mamba_needs_clear = False
        kv.mamba_cow_src_index = self.slot_index(source.device_slot)
        return True

    # ================================================================ lock
    def inc_lock_ref(self, node: MatchHandle) -> IncLockRefResult:
        lane = self.open_handle(node)
        return IncLockRefResult(node_id=lane.id if lane is not None else None)

    def dec_lock_ref(
        self, node: MatchHandle, params: DecLockRefParams | None = None
    ) -> DecLockRefResult:
        self.close_handle(node)
        return DecLockRefResult()

    def lock(self, node: MatchHandle) -> TreeLock | None:
        lane = self.open_handle(node)
        return TreeLock(node, DecLockRefParams(node_id=lane.id if lane is not None else None))

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is not None:
            self.close_handle(lock.node)

    def open_handle(self, handle: MatchHandle) -> Lane | None:
        """Locks of one handle nest (SGLang pins the match around admission, then the
        admission locks it; a load-back opened the lane before either): they share one lane,
        closed by the last unlock."""
        if self.disable or handle.match is None:
            return None
        handle.locks += 1
        if handle.lane is not None and not handle.lane.closed:
            return handle.lane
        source = handle.source
        if source is not None and source.id not in self.index.snapshots:
            raise RuntimeError(f"the matched snapshot {source} was evicted before admission")
        enabled = handle.state.enabled if handle.state is not None else False
        handle.lane = self.index.open_lane(handle.match, source, enabled=enabled)
        return handle.lane

    def close_handle(self, handle: MatchHandle) -> None:
        if handle.locks > 1:
            handle.locks -= 1
            return
        handle.locks = 0
        lane = handle.lane
        if lane is not None and not lane.closed:
            self.publisher.cancel_inpass(handle)  # a pass that never reached its checkpoint
            if self.host_tier is not None:
                # Write-through in one operation at release (§7.6); the lane is released when
                # nothing copies from its path any more.
                self.host_tier.release_lane(lane)
            else:
                self.index.release(lane)
            self.free_dropped()
        handle.lane = None

    # ================================================================ prefix slots
    def path_device_indices(self, node: MatchHandle) -> torch.Tensor:
        handle = node
        if handle.match is None or handle.blocks == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        path = handle.match.path[: handle.blocks]
        return handles_to_slots((n.device for n in path), self.device)

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        """The request's prefix slots, on the device (SGLang writes them into its row). The
        host mirror of the row (``mirror.py``) learns them here: the path's handles on the
        host directly, a tail copy's fresh pages through a copy that lands before this pass's
        result is processed."""
        handle: MatchHandle = req.last_node
        base = self.path_device_indices(handle)
        if handle.match is not None:
            handle.rows.put_path([n.device for n in handle.match.path[: handle.blocks]])
        source = handle.source
        if source is None or not source.tail:
            return base[: req.prefix_len]
        if handle.tail_copy is None:
            handle.tail_copy = self._copy_tail(source)
            if handle.state is not None:
                handle.state.tail_copied = source.tail_len
            pos = BLOCK_TOKENS * handle.blocks
            handle.rows.put_pending(pos, PassSlots(handle.tail_copy), 0, source.tail_len)
        return torch.cat([base, handle.tail_copy[: source.tail_len]])

    def _copy_tail(self, source: Snapshot) -> torch.Tensor:
        """A private copy of the source's tail KV, on pages the request will own (§6.4). The
        copy runs on the forward stream under overlap scheduling, ordered after the schedule
        stream's allocation and index transfer (``DevicePools.copy_kv``)."""
        t = source.tail_len
        need = ceil_to(t, self.page_size)
        dst = alloc_evicting(self.token_to_kv_pool_allocator, need, self.evict_tokens)
        if dst is None:
            raise RuntimeError(
                f"out of KV memory copying a {t}-token snapshot tail; raise "
                f"--max-total-tokens or --mem-fraction-static"
            )
        src = handle_to_slots(source.tail_device, self.device)
        self.pools.copy_kv(dst[:t], src[:t])
        return dst

    def after_batch_built(self, batch: ScheduleBatch | None) -> None:
        """SGLang built ``batch`` (not launched yet): mirror the slots it allocated to the host
        without waiting (``mirror.feed_batch``)."""
        if not self.disable:
            feed_batch(batch)

    # ================================================================ checkpoints (``publisher``)
    def checkpoint(self, req: Req, *, up_to: int, **kwargs: object) -> None:
        self.publisher.checkpoint(req, up_to)

    def before_chunked_abort(self, scheduler: Scheduler, req: Req) -> None:
        self.publisher.before_chunked_abort(scheduler, req)

    def reserve_inpass(self, req: Req, start: int, end: int) -> None:
        self.publisher.reserve_inpass(req, start, end)

    def capture_pass_ends(self, batch: ScheduleBatch | None) -> None:
        self.publisher.capture_pass_ends(batch)

    def count_rounds(self, batch: ScheduleBatch | None, *, launched: bool) -> None:
        Publisher.count_rounds(batch, launched=launched)

    # ================================================================ load-back (``load_back``)
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, MatchHandle] | None:
        return self.load_back.init_load_back(params)

    def load_back_is_cache_owned(self) -> bool:
        # The restored blocks are the cache's, but a source inside a block also gives the request
        # a private copy of the tail (freed with the request): init_load_back sets
        # cache_protected_len to the block grid itself instead of SGLang's prefix_len.
        return False

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self.load_back.release_aborted_request(handle)

    def held_for_restores(self, queue: list[Req]) -> list[Req]:
        held = self.load_back.held_for_restores(queue)
        if self.l3 is not None:  # lookups and fetches from L3 in flight (``l3_tier.py``)
            mine = set(map(id, held))
            held += [r for r in self.l3.held(queue) if id(r) not in mine]
        return held

    def on_admitted(self, req: Req) -> None:
        self.load_back.on_admitted(req)

    def prefetch_head(self, req: Req) -> int:
        return self.load_back.prefetch_head(req)

    def poll(self) -> None:
        self.load_back.poll()
        if self.l3 is not None:
            self.l3.poll()

    def copies_in_flight(self) -> bool:
        return self.load_back.copies_in_flight() or (self.l3 is not None and self.l3.in_flight())

    # ================================================================ release
    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        if self.coalescer is not None:
            self.coalescer.forget(req.rid)
        state: ReqState | None = getattr(req, ATTR, None)
        if checkpointed and state is not None and state.enabled:
            self.recent.add(req.rid, state.key)  # GET /slots (boundaries.py)
        if self.metrics is not None:
            self.metrics.on_release(self)
        if not checkpointed:
            self.free_state_slot(req)

    def free_state_slot(self, req: Req) -> None:
        """Give the request's MambaPool slot back to SGLang (it did not become a snapshot's)."""
        if req.kv.holds_mamba:
            idx = req.kv.mamba_pool_idx
            assert idx is not None  # what holds_mamba tests
            self.mamba_allocator.free(idx.reshape(1).to(torch.int64))
            req.kv.mamba_pool_idx = None

    # ================================================================ eviction
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()  # SGLang's eviction-time metric only, never a decision
        freed = self.index.evict_device(params.num_tokens)
        if freed < params.num_tokens and self.host_tier is not None and self.host_tier.shed():
            # Write-through waiting for the bound pins its blocks; a decode never waits for it.
            freed += self.index.evict_device(params.num_tokens - freed)
        self.free_dropped()
        self.update_eviction_metrics(freed, start)
        return EvictResult(num_tokens_evicted=freed)

    def evict_tokens(self, tokens: int) -> None:
        """Evict cached blocks (device LRU) for ``tokens`` and hand their pages back."""
        self.index.evict_device(tokens)
        self.free_dropped()

    def free_dropped(self) -> None:
        """Return the device pages the index dropped to SGLang's allocator, in one call."""
        free_dropped(self.token_to_kv_pool_allocator, self.index.drain_freed_device(), self.device)

    # ================================================================ diagnostics
    def pretty_print(self) -> None:
        s = self.index.stats
        logger.info(
            "hybrid cache: %d nodes, %d snapshots, %d device tokens (%d evictable), %d/%d "
            "snapshot slots free; %s",
            self.index.tree.n_nodes,
            len(self.index.snapshots),
            self.index.device_tokens,
            self.index.evictable_tokens,
            self.index.slots.free,
            len(self._slot_ids),
            s,
        )

    def all_values_flatten(self) -> torch.Tensor:
        handles = [
            n.device
            for n in self.index.tree.subtree_postorder(self.index.tree.root)
            if n.device is not None
        ]
        handles += [s.tail_device for s in self.index.snapshots.values() if s.tail_device]
        return handles_to_slots(handles, self.device)

    def all_mamba_values_flatten(self) -> torch.Tensor:
        if self._slot_table is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self._slot_table.clone()

    def sanity_check(self) -> None:
        self.index.check_integrity()

    def stats(self) -> dict[str, int]:
        """The index's and the coalescer's counters, the skipped opportunities and the host
        tier's bytes."""
        out = {f: getattr(self.index.stats, f) for f in self.index.stats.__dataclass_fields__}
        c = self.coalescer
        out.update(
            coalesce_waiters=c.waiters_total if c is not None else 0,
            coalesce_holds=c.holds_total if c is not None else 0,
        )
        out.update(self.skips.as_dict(), taps_in_pass=self.publisher.taps_in_pass)
        host = self.host_tier
        if host is not None:
            out.update(
                host_written_bytes=host.written_bytes,
                host_restored_bytes=host.restored_bytes,
                host_restored_blocks=host.restored_blocks,
                host_prefetched_blocks=host.prefetched_blocks,
                **host.queue_stats(),
            )
        if self.l3 is not None:
            out.update(self.l3.stats())
        return out

    def decision_counters(self) -> tuple[int, ...]:
        """What this rank decided so far, for the TP rank check (``ranks.py``)."""
        return (
            *self.stats().values(),
            self.index.device_tokens,
            self.index.evictable_tokens,
            len(self.index.snapshots),
            self.index.slots.free,
        )

    # ================================================================ persistence (§5.5)
    def save_host_tier(self) -> bool:
        """Write the host tier to ``--hybrid-cache-file`` (``persistence.py``) once every
        in-flight write-through has landed; False when there is no file, or the save was
        abandoned or failed (the previous file stays)."""
        p = getattr(self, "persistence", None)
        if p is None or self.host_tier is None or self.disable:
            return False
        drain = getattr(self.host_tier, "drain", None)
        if drain is not None:
            drain()
        return p.save(self)

    def release_host_resources(self) -> None:
        """SGLang's graceful scheduler exit (after the event loop ended, never after an error):
        the orderly stop that saves the host tier."""
        self.save_host_tier()
        if self.host_tier is not None:
            self.host_tier.close()  # drains, then stops the copy worker (CPU)
        if self.l3 is not None:
            self.l3.close()
        super().release_host_resources()
