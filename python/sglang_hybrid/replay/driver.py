"""Offline replay through SGLang's real Scheduler on the CPU, in virtual time.

Contract: ``replay(trace, cache, settings) -> ReplayResult``.

- Builds SGLang's genuine ``Scheduler`` in process (``sglang_hybrid.cpu.loop``) with the replay
  worker (the token worker answering from scripts, ``worker.py``) and the pools of
  ``budget.plan_pools`` for ``cache`` (``caches.py``); SGLang's waiting queue, admission,
  chunked prefill, allocators, eviction and retraction run unmodified.
- Virtual time: a request is released at its arrival (open loop) or ``delay_s`` after the
  requests it waits for finished (closed loop), and handed to the Scheduler's dispatcher then.
  Each Scheduler iteration runs at most one forward pass, which advances the clock by
  ``BatchClock.pass_seconds`` of the work it did (plus host-to-device bytes restored, once a
  cache has a host tier). When nothing is queued or running, the clock jumps to the next
  release. A request's first token exists at the end of the pass that produced it.
- Every request is answered from its script (``trace.output_tokens``), checked against what
  SGLang streamed when it finishes (``ReplayError`` otherwise); tap hints travel as
  ``req.kv_hints`` to every cache (only ``hybrid`` reads them). The oracle's hit for a request is
  computed at its release from everything released before (``oracle_store``).
- At the end SGLang's own idle checks run on the drained scheduler (pool leaks, tree
  invariants). A request that can never fit (longer than the KV pool) raises ``ReplayError``
  before the run; a loop that stops making progress raises it too.
- ``warmup`` (``warmup.py``: unrelated traffic, disjoint from the trace) runs first, to its last
  finish, in the same scheduler and cache; the trace's releases start then (its arrival times
  shifted by the warm-up's end). Nothing of the warm-up is counted in the records, the pass
  counters, the host bytes or ``cache_stats`` (which become the counters' growth over the
  measured requests); ``result.warmup`` says what it was and how full it left the pools.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..index.keys import BLOCK_TOKENS
from ..sglang.pages import ceil_to
from .budget import DEFAULT_MAMBA_RATIO, PoolPlan, plan_pools
from .caches import (
    cache_environment,
    host_bytes_restored,
    host_cache_mib,
    image_charge_bytes,
    scheduler_kwargs,
    tiny_kv_bytes_per_token,
)
from .clock import BatchClock
from .errors import ReplayError
from .l3_model import (
    L3_CACHES,
    L3Meter,
    attach,
    base_cache,
    drop_store,
    l3_report,
    store_capacity_mib,
    store_url,
)
from .lru_store import LruPrefixStore
from .oracle_cache import HIT_ATTR
from .oracle_store import PrefixStore
from .progress import Progress
from .results import ReplayResult, RequestRecord
from .trace import Trace, TraceRequest, check_trace, kv_tokens, output_tokens
from .worker import ChunkGridReplayWorker, ReplayWorker

if TYPE_CHECKING:
    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.cpu.token_worker import BatchWork
    from sglang_hybrid.sglang.flags import TailTap, TapMode

# Scheduler iterations in a row that may run nothing while requests wait, before we call the
# loop stuck (SGLang can spend a few iterations retracting or waiting on a chunked request).
_MAX_IDLE_ITERATIONS = 1000


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    device: str = "h200"
    geometry: str = "qwen3.5-27b"
    device_bytes: int = 32 << 30
    host_bytes: int = 0
    max_running: int = 64
    chunk: int = 8192
    max_prefill_tokens: int = 16384
    mamba_ratio: float = DEFAULT_MAMBA_RATIO
    snapshot_slots: int | None = None
    tail_tap: TailTap = "exact"
    taps_per_request: int | None = None  # hybrid's --hybrid-taps-per-request (None: default)
    tap_ladder: int | None = None  # hybrid's --hybrid-tap-ladder
    tap_min_gap: int | None = None  # hybrid's --hybrid-tap-min-gap
    hybrid_page_size: int | None = None  # None: caches.PAGE_SIZE
    coalesce: bool = True  # the hybrid backend's in-flight prefix coalescing (spec §12.2)
    # What the cache runs (never "auto": the CLI resolves it as an H200 with SGLang's default
    # arguments would, ``inpass.replay_default``); split is what a GPU server gets today.
    tap_mode: TapMode = "split"
    # zero-split: "any" position (the CPU workers; SGLang's GPU worker with gdn_taps' recompute)
    # or "chunk" (each request's 64-token grid from its pass start: no recompute)
    capture_grid: str = "any"
    split_threshold: float = 1.0  # --hybrid-split-threshold (index/split_rule.py)
    host_order: str = "duel"  # --hybrid-host-order (index/hit_density.py)
    host_exclusive: bool | None = None  # --hybrid-host-exclusive (index/demotion.py)
    overlap: bool = False  # SGLang's overlap loop, for every cache that supports it (--overlap)
    l3_bytes: int = 0  # the L3 variants' store (``l3_model.py``), bytes of the geometry
    model_dir: str | None = None  # the tiny model; written once under the cache dir if unset
    progress: bool | None = None  # None: a bar when stderr is a terminal


def default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "sglang-hybrid" / "replay-tiny-qwen3_next"


def model_dir(settings: ReplaySettings) -> Path:
    from sglang_hybrid.cpu.tiny_model import write_tiny_model

    path = Path(settings.model_dir) if settings.model_dir else default_model_dir()
    return write_tiny_model(path, "qwen3_next", seed=0)


def plan_for(cache: str, settings: ReplaySettings) -> PoolPlan:
    from sglang_hybrid.index.presets import GEOMETRIES

    return plan_pools(
        base_cache(cache),
        device_bytes=settings.device_bytes,
        host_bytes=settings.host_bytes,
        geometry=GEOMETRIES[settings.geometry],
        max_running=settings.max_running,
        mamba_ratio=settings.mamba_ratio,
        snapshot_slots=settings.snapshot_slots,
    )


def replay(
    trace: Trace, cache: str, settings: ReplaySettings, warmup: Trace | None = None
) -> ReplayResult:
    """Replay ``trace`` against ``cache``, after ``warmup`` if given (see the module contract)."""
    check_trace(trace)
    if warmup is not None:
        from .warmup import check_disjoint

        check_trace(warmup)
        check_disjoint(warmup, trace)
    plan = plan_for(cache, settings)
    everything = [*trace.requests, *(warmup.requests if warmup is not None else ())]
    longest = max((r.n + r.output_len for r in everything), default=1)
    if longest + BLOCK_TOKENS > plan.kv_tokens:
        raise ReplayError(
            f"{cache}: the budget gives {plan.kv_tokens} KV tokens, but a request needs "
            f"{longest}; raise the budget or drop the request"
        )
    clock = BatchClock(settings.device, settings.geometry)
    path = model_dir(settings)
    tiny = tiny_kv_bytes_per_token(path)
    l3_url = None
    if cache in L3_CACHES:
        if settings.l3_bytes <= 0:
            raise ReplayError(f"{cache}: give the L3 store a size (--l3-gib)")
        l3_url = store_url(cache, store_capacity_mib(settings.l3_bytes, clock.geometry, tiny))
    kwargs = scheduler_kwargs(
        plan,
        chunk=settings.chunk,
        max_prefill_tokens=settings.max_prefill_tokens,
        context_length=ceil_to(longest + BLOCK_TOKENS, BLOCK_TOKENS),
        tail_tap=settings.tail_tap,
        coalesce=settings.coalesce,
        tap_mode=settings.tap_mode,
        split_threshold=settings.split_threshold,
        host_order=settings.host_order,
        host_exclusive=settings.host_exclusive,
        split_cost=clock.split_cost(),  # the split rule prices passes as this clock does
        taps_per_request=settings.taps_per_request,
        tap_ladder=settings.tap_ladder,
        tap_min_gap=settings.tap_min_gap,
        page_size=settings.hybrid_page_size if cache == "hybrid" else None,
        host_mib=host_cache_mib(plan.host_bytes, clock.geometry, tiny),
        overlap=settings.overlap,
        l3_url=l3_url,
        image_charge_bytes=image_charge_bytes(clock.geometry, tiny),
    )
    with cache_environment(base_cache(cache)):
        from sglang_hybrid.cpu.loop import InProcessScheduler

        worker = ChunkGridReplayWorker if settings.capture_grid == "chunk" else ReplayWorker
        sched = InProcessScheduler(path, worker="tokens", worker_class=worker, **kwargs)
        run = _Run(trace, cache, plan, clock, sched, settings, warmup)
        try:
            if l3_url is not None:
                run.l3 = attach(sched.tree_cache, lambda: run.now, cache, clock.geometry)
            return run.run()
        finally:
            if l3_url is not None:
                drop_store(sched.tree_cache)
            sched.close()
            del sched
            gc.collect()  # the pools are large; free them before the next replay builds its own


class _Run:
    """One replay loop (see the module contract)."""

    def __init__(
        self,
        trace: Trace,
        cache: str,
        plan: PoolPlan,
        clock: BatchClock,
        sched: InProcessScheduler,
        settings: ReplaySettings,
        warmup: Trace | None = None,
    ) -> None:
        self.trace, self.cache, self.plan, self.clock = trace, cache, plan, clock
        self.warmup = warmup
        self.sched = sched
        self.worker: ReplayWorker = sched.worker
        self.settings = settings
        self.oracle: PrefixStore | LruPrefixStore | None = None
        if cache == "oracle":
            self.oracle = PrefixStore()
        elif cache == "lru":  # the whole budget's bytes as KV (``budget.plan_pools``)
            self.oracle = LruPrefixStore(plan.device_bytes // clock.geometry.kv_bytes_per_token)
        self.records: dict[str, RequestRecord] = {}
        self.by_rid: dict[str, TraceRequest] = {}
        self.waiting_on: dict[str, list[str]] = {}
        self.deps_left: dict[str, int] = {}
        self.deps_done_at: dict[str, float] = {}
        self.releases: list[tuple[float, int, str]] = []
        self.order: dict[str, int] = {}
        self.now = 0.0
        self.restored = 0  # host bytes restored so far (modelled), warm-up included
        self.l3: L3Meter | None = None  # an L3 variant's link (``l3_model.py``)
        self.result = ReplayResult(
            cache=cache, trace=trace.name, plan=plan, clock=clock.describe(), records=[]
        )

    def _load(self, requests: list[TraceRequest], offset_s: float) -> None:
        """Schedule ``requests``' releases; open-loop arrivals shifted by ``offset_s``."""
        for r in requests:
            self.order[r.rid] = len(self.order)
            self.by_rid[r.rid] = r
            if r.arrival_s is not None:
                heapq.heappush(self.releases, (offset_s + r.arrival_s, self.order[r.rid], r.rid))
            else:
                self.deps_left[r.rid] = len(r.after)
                for a in r.after:
                    self.waiting_on.setdefault(a, []).append(r.rid)

    # ------------------------------------------------------------------ requests
    def _submit(self, rid: str, release_s: float) -> None:
        from sglang_hybrid.sglang.hints import make_envelope

        r = self.by_rid[rid]
        answer = output_tokens(r)
        self.worker.scripts[rid] = answer
        attrs: dict[str, Any] = {}
        if r.hint_positions:
            attrs["kv_hints"] = make_envelope(list(r.hint_positions), list(r.hint_kinds))
        if self.oracle is not None:
            attrs[HIT_ATTR] = self.oracle.lcp(r.input_ids)
            self.oracle.insert(kv_tokens(r))
        self.records[rid] = RequestRecord(
            rid=rid,
            tag=r.tag,
            session=r.session,
            release_s=release_s,
            prompt_tokens=r.n,
            output_tokens=r.output_len,
        )
        try:
            self.sched.submit(
                rid,
                r.input_ids.tolist(),
                r.output_len,
                sampling_overrides={"ignore_eos": True},
                **attrs,
            )
        except RuntimeError as e:  # SGLang refused it at the door (e.g. too long)
            self.result.notes.append(f"{rid} rejected: {e}")
            self._finished(rid)

    def _finished(self, rid: str, at: float | None = None) -> None:
        at = self.now if at is None else at
        rec = self.records[rid]
        rec.finish_s = at
        if rec.first_token_s is None:
            rec.first_token_s = at
        out = self.sched.results().get(rid)
        if out is not None:
            rec.cached_tokens = out.cached_tokens
            rec.finish_type = out.finish_type
            script = self.worker.scripts.get(rid)
            if (
                out.finish_type == "length"
                and script is not None
                and out.output_ids != script.tolist()
            ):
                # Later prompts echo the scripted answer; any other answer voids the replay.
                raise ReplayError(f"{self.cache}: {rid} answered other tokens than its script")
        self.worker.forget(rid)
        for dep in self.waiting_on.pop(rid, ()):
            self.deps_left[dep] -= 1
            self.deps_done_at[dep] = max(self.deps_done_at.get(dep, 0.0), at)
            if self.deps_left[dep] == 0:
                release = self.deps_done_at.pop(dep) + self.by_rid[dep].delay_s
                heapq.heappush(self.releases, (release, self.order[dep], dep))

    # ------------------------------------------------------------------ loop
    def run(self) -> ReplayResult:
        started = time.perf_counter()
        if self.warmup is not None:
            self._load(self.warmup.requests, 0.0)
            self._drain(None)
            self._after_warmup()
            started = time.perf_counter()
        self._load(self.trace.requests, self.now)
        bar = Progress(
            len(self.trace.requests), f"{self.trace.name}/{self.cache}", self.settings.progress
        )
        try:
            self._drain(bar)
            self.sched.on_idle()  # SGLang's own leak and tree checks on the drained scheduler
        finally:
            bar.close()
        self.result.wall_s = time.perf_counter() - started
        self.result.host_bytes_restored = self.restored - int(
            self.result.warmup.get("host_bytes_restored", 0)
        )
        if self.deps_left and any(self.deps_left.values()):
            stuck = [r for r, n in self.deps_left.items() if n]
            raise ReplayError(f"{len(stuck)} requests never released (e.g. {stuck[:3]})")
        self._collect()
        return self.result

    def _drain(self, bar: Progress | None) -> None:
        """Release and run requests until nothing is queued, running or left to release."""
        s = self.sched
        idle = 0
        while True:
            while self.releases and self.releases[0][0] <= self.now:
                at, _, rid = heapq.heappop(self.releases)
                self._submit(rid, at)
            # A finished prefill pass's requests join the running batch only in the next
            # iteration, so the previous batch counts as work (run_until_idle does the same).
            if not s.has_work() and s.scheduler.last_batch is None:
                if not self.releases:
                    return
                self.now = max(self.now, self.releases[0][0])
                continue
            before = self.now
            batch = s.step(idle_check=False)
            total = host_bytes_restored(s.tree_cache, self.clock.geometry)
            h2d, self.restored = total - self.restored, total
            works = self.worker.pending
            seconds = [self.clock.pass_seconds(w) for w in works]
            restore_s = self.clock.prefill.restore_seconds(h2d) if h2d else 0.0
            self.now += sum(seconds) + restore_s
            self._count(works, seconds, restore_s)
            works.clear()
            # Outputs come from the batch whose results this step processed. With overlap
            # scheduling that is the previous one (also when this step launched nothing), which
            # ended before this step's pass: on a GPU its results are processed while it runs.
            processed = s.processed
            at = before if s.overlap else self.now
            done = 0
            for req in processed.reqs if processed is not None else ():
                rec = self.records[req.rid]
                if rec.first_token_s is None and req.output_ids:
                    rec.first_token_s = at
                if req.finished() and rec.finish_s is None:
                    self._finished(req.rid, at)
                    done += 1
            if bar is not None and done:
                bar.advance(done, self.now)
            if batch is None:
                if self._wait_for_l3():
                    idle = 0
                    continue
                idle += 1
                if idle > _MAX_IDLE_ITERATIONS:
                    raise ReplayError(
                        f"{self.cache}: the scheduler ran nothing for {idle} iterations "
                        f"with {len(s.scheduler.waiting_queue)} requests waiting"
                    )
                continue
            idle = 0

    def _wait_for_l3(self) -> bool:
        """Nothing ran: requests wait for L3 lookups or fetches (or L3 writes are in flight).
        Jump the clock to the next L3 job's end, or the next release if earlier; False when no
        L3 job is in flight."""
        tier = getattr(self.sched.tree_cache, "l3", None) if self.l3 is not None else None
        t = tier.next_ready() if tier is not None else None
        if t is None or t <= self.now:
            return False
        if self.releases:
            t = min(t, self.releases[0][0])
        self.now = max(self.now, t)
        return True

    def _after_warmup(self) -> None:
        """Record what the warm-up was and left behind; zero the counters the trace reports."""
        assert self.warmup is not None
        res = self.result
        reqs = self.warmup.requests
        unfinished = [r.rid for r in reqs if self.records[r.rid].finish_s is None]
        if unfinished:
            raise ReplayError(f"{len(unfinished)} warm-up requests never finished")
        res.warmup = {
            "requests": len(reqs),
            "prompt_tokens": int(sum(r.n for r in reqs)),
            "output_tokens": int(sum(r.output_len for r in reqs)),
            "source": self.warmup.source,
            "end_s": self.now,
            "passes": res.passes,
            "host_bytes_restored": self.restored,
            **pool_fill(self.sched, self.plan),
            "cache_stats": cache_stats(self.sched.tree_cache),
        }
        res.passes = res.extend_passes = res.decode_passes = 0
        res.prefill_s = 0.0

    def _count(self, works: list[BatchWork], seconds: list[float], restore_s: float) -> None:
        res = self.result
        for w, t in zip(works, seconds, strict=True):
            res.passes += 1
            if w.decode_reqs and not w.extend_tokens:
                res.decode_passes += 1
            elif w.extend_tokens:
                res.extend_passes += 1
                res.prefill_s += t
        if any(w.extend_tokens for w in works):
            res.prefill_s += restore_s

    def _collect(self) -> None:
        w = self.worker
        for rid in (r.rid for r in self.trace.requests):
            rec = self.records[rid]
            rec.prefill_tokens = w.prefill.get(rid, 0)
            rec.recompute_tokens = w.recompute.get(rid, 0)
            rec.first_prefix = w.first_prefix.get(rid, 0)
            self.result.records.append(rec)
        stats = cache_stats(self.sched.tree_cache)
        before = self.result.warmup.get("cache_stats", {})
        assert isinstance(before, dict)
        self.result.cache_stats = {k: v - int(before.get(k, 0)) for k, v in stats.items()}
        if self.l3 is not None:
            self.result.l3 = l3_report(self.sched.tree_cache, self.l3, self.settings.l3_bytes)
        if self.plan.host_bytes and getattr(self.sched.tree_cache, "host_tier", None) is None:
            self.result.notes.append(
                "host bytes were requested but the hybrid backend ran device-only"
            )


def cache_stats(tree_cache: Any) -> dict[str, int]:
    """The cache's own counters: ``HybridRadixCache.stats()`` (the index's counters, skipped
    opportunities, host bytes), else an index's stats dataclass; {} for SGLang's caches."""
    stats = getattr(tree_cache, "stats", None)
    if callable(stats):
        return {k: int(v) for k, v in stats().items()}
    index = getattr(tree_cache, "index", None)
    if index is not None and dataclasses.is_dataclass(index.stats):
        return {k: int(v) for k, v in dataclasses.asdict(index.stats).items()}  # type: ignore[arg-type]  # is_dataclass admits a class; stats is an instance
    return {}


def pool_fill(sched: InProcessScheduler, plan: PoolPlan) -> dict[str, int]:
    """How full a drained scheduler's pools are: KV tokens in use (all cache: nothing runs), of
    them evictable, and state slots the cache holds (hybrid: its snapshot slots in use)."""
    s = sched.scheduler
    tree = sched.tree_cache
    out = {
        "kv_tokens": plan.kv_tokens,
        "kv_used": plan.kv_tokens - int(s.token_to_kv_pool_allocator.available_size()),  # type: ignore[attr-defined]  # SGLang's pool-setup result types it object
        "kv_evictable": int(tree.evictable_size()),
        "state_slots": plan.state_slots,
    }
    index = getattr(tree, "index", None)
    if index is not None and hasattr(index, "slots"):
        out["snapshot_slots"] = int(index.slots.n)
        out["snapshot_slots_used"] = int(index.slots.n - index.slots.free)
    else:
        mamba = getattr(s.req_to_token_pool, "mamba_allocator", None)
        if mamba is not None:
            out["state_slots_used"] = plan.state_slots - int(mamba.available_size())
    return out
