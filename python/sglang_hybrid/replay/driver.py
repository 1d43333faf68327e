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
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .budget import DEFAULT_MAMBA_RATIO, PoolPlan, plan_pools
from .caches import (
    cache_environment,
    host_bytes_restored,
    host_cache_mib,
    scheduler_kwargs,
    tiny_kv_bytes_per_token,
)
from .clock import BatchClock
from .errors import ReplayError
from .oracle_cache import HIT_ATTR
from .oracle_store import PrefixStore
from .progress import Progress
from .results import ReplayResult, RequestRecord
from .trace import Trace, TraceRequest, check_trace, kv_tokens, output_tokens
from .worker import ReplayWorker

if TYPE_CHECKING:
    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.cpu.token_worker import BatchWork

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
    tail_tap: str = "exact"
    taps_per_request: int | None = None  # hybrid's --hybrid-taps-per-request (None: default)
    tap_ladder: int | None = None  # hybrid's --hybrid-tap-ladder
    tap_min_gap: int | None = None  # hybrid's --hybrid-tap-min-gap
    hybrid_page_size: int | None = None  # None: caches.PAGE_SIZE
    coalesce: bool = True  # the hybrid backend's in-flight prefix coalescing (spec §12.2)
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
        cache,
        device_bytes=settings.device_bytes,
        host_bytes=settings.host_bytes,
        geometry=GEOMETRIES[settings.geometry],
        max_running=settings.max_running,
        mamba_ratio=settings.mamba_ratio,
        snapshot_slots=settings.snapshot_slots,
    )


def replay(trace: Trace, cache: str, settings: ReplaySettings) -> ReplayResult:
    """Replay ``trace`` against ``cache`` (see the module contract)."""
    check_trace(trace)
    plan = plan_for(cache, settings)
    longest = max((r.n + r.output_len for r in trace.requests), default=1)
    if longest + 64 > plan.kv_tokens:
        raise ReplayError(
            f"{cache}: the budget gives {plan.kv_tokens} KV tokens, but a request needs "
            f"{longest}; raise the budget or drop the request"
        )
    clock = BatchClock(settings.device, settings.geometry)
    path = model_dir(settings)
    kwargs = scheduler_kwargs(
        plan,
        chunk=settings.chunk,
        max_prefill_tokens=settings.max_prefill_tokens,
        context_length=-(-(longest + 64) // 64) * 64,
        tail_tap=settings.tail_tap,
        coalesce=settings.coalesce,
        taps_per_request=settings.taps_per_request,
        tap_ladder=settings.tap_ladder,
        tap_min_gap=settings.tap_min_gap,
        page_size=settings.hybrid_page_size if cache == "hybrid" else None,
        host_mib=host_cache_mib(plan.host_bytes, clock.geometry, tiny_kv_bytes_per_token(path)),
    )
    with cache_environment(cache):
        from sglang_hybrid.cpu.loop import InProcessScheduler

        sched = InProcessScheduler(path, worker="tokens", worker_class=ReplayWorker, **kwargs)
        try:
            return _Run(trace, cache, plan, clock, sched, settings).run()
        finally:
            sched.close()
            _release_watchdogs(sched.scheduler)
            del sched
            gc.collect()  # the pools are large; free them before the next replay builds its own


def _release_watchdogs(scheduler: object) -> None:
    """Let a closed Scheduler (and its pools) be freed.

    SGLang's watchdog threads never stop and their callbacks close over the Scheduler, so every
    Scheduler built in a process stays alive with its pools (a sweep grew by the pools' size per
    replay). The callbacks are replaced by inert ones; the daemon threads keep sleeping.
    """
    for name in ("watchdog", "soft_watchdog"):
        dog = getattr(scheduler, name, None)
        if dog is not None and hasattr(dog, "is_active"):
            dog.is_active = lambda: False
            dog.get_counter = lambda: 0
            dog.dump_info = None


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
    ) -> None:
        self.trace, self.cache, self.plan, self.clock = trace, cache, plan, clock
        self.sched = sched
        self.worker: ReplayWorker = sched.worker
        self.settings = settings
        self.oracle = PrefixStore() if cache == "oracle" else None
        self.records: dict[str, RequestRecord] = {}
        self.by_rid: dict[str, TraceRequest] = {r.rid: r for r in trace.requests}
        self.waiting_on: dict[str, list[str]] = {}
        self.deps_left: dict[str, int] = {}
        self.deps_done_at: dict[str, float] = {}
        self.releases: list[tuple[float, int, str]] = []
        for i, r in enumerate(trace.requests):
            if r.arrival_s is not None:
                self.releases.append((r.arrival_s, i, r.rid))
            else:
                self.deps_left[r.rid] = len(r.after)
                for a in r.after:
                    self.waiting_on.setdefault(a, []).append(r.rid)
        heapq.heapify(self.releases)
        self.order = {r.rid: i for i, r in enumerate(trace.requests)}
        self.now = 0.0
        self.result = ReplayResult(
            cache=cache, trace=trace.name, plan=plan, clock=clock.describe(), records=[]
        )

    # ------------------------------------------------------------------ requests
    def _submit(self, rid: str, release_s: float) -> None:
        from sglang_hybrid.sglang.hints import make_envelope

        r = self.by_rid[rid]
        answer = output_tokens(r)
        self.worker.scripts[rid] = answer
        attrs: dict[str, object] = {}
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

    def _finished(self, rid: str) -> None:
        rec = self.records[rid]
        rec.finish_s = self.now
        if rec.first_token_s is None:
            rec.first_token_s = self.now
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
            self.deps_done_at[dep] = max(self.deps_done_at.get(dep, 0.0), self.now)
            if self.deps_left[dep] == 0:
                at = self.deps_done_at.pop(dep) + self.by_rid[dep].delay_s
                heapq.heappush(self.releases, (at, self.order[dep], dep))

    # ------------------------------------------------------------------ loop
    def run(self) -> ReplayResult:
        s = self.sched
        bar = Progress(
            len(self.trace.requests), f"{self.trace.name}/{self.cache}", self.settings.progress
        )
        started = time.perf_counter()
        idle = 0
        restored = 0
        try:
            while True:
                while self.releases and self.releases[0][0] <= self.now:
                    at, _, rid = heapq.heappop(self.releases)
                    self._submit(rid, at)
                # A finished prefill pass's requests join the running batch only in the next
                # iteration, so the previous batch counts as work (run_until_idle does the same).
                if not s.has_work() and s.scheduler.last_batch is None:
                    if not self.releases:
                        break
                    self.now = max(self.now, self.releases[0][0])
                    continue
                batch = s.step(idle_check=False)
                total = host_bytes_restored(s.tree_cache, self.clock.geometry)
                h2d, restored = total - restored, total
                works = self.worker.pending
                self.now += sum(self.clock.pass_seconds(w) for w in works)
                self.now += self.clock.prefill.restore_seconds(h2d) if h2d else 0.0
                self._count(works)
                works.clear()
                if batch is None:
                    idle += 1
                    if idle > _MAX_IDLE_ITERATIONS:
                        raise ReplayError(
                            f"{self.cache}: the scheduler ran nothing for {idle} iterations "
                            f"with {len(s.scheduler.waiting_queue)} requests waiting"
                        )
                    continue
                idle = 0
                done = 0
                for req in batch.reqs:
                    rec = self.records[req.rid]
                    if rec.first_token_s is None and req.output_ids:
                        rec.first_token_s = self.now
                    if req.finished() and rec.finish_s is None:
                        self._finished(req.rid)
                        done += 1
                bar.advance(done, self.now)
            s.on_idle()  # SGLang's own leak and tree checks on the drained scheduler
        finally:
            bar.close()
        self.result.wall_s = time.perf_counter() - started
        self.result.host_bytes_restored = restored
        if self.deps_left and any(self.deps_left.values()):
            stuck = [r for r, n in self.deps_left.items() if n]
            raise ReplayError(f"{len(stuck)} requests never released (e.g. {stuck[:3]})")
        self._collect()
        return self.result

    def _count(self, works: list[BatchWork]) -> None:
        res = self.result
        for w in works:
            res.passes += 1
            if w.decode_reqs and not w.extend_tokens:
                res.decode_passes += 1
            elif w.extend_tokens:
                res.extend_passes += 1

    def _collect(self) -> None:
        w = self.worker
        for rid in (r.rid for r in self.trace.requests):
            rec = self.records[rid]
            rec.prefill_tokens = w.prefill.get(rid, 0)
            rec.recompute_tokens = w.recompute.get(rid, 0)
            rec.first_prefix = w.first_prefix.get(rid, 0)
            self.result.records.append(rec)
        index = getattr(self.sched.tree_cache, "index", None)
        if index is not None and dataclasses.is_dataclass(index.stats):
            self.result.cache_stats = dataclasses.asdict(index.stats)
        if self.plan.host_bytes and getattr(self.sched.tree_cache, "host", None) is None:
            self.result.notes.append(
                "host bytes were requested but the hybrid backend ran device-only"
            )
