"""Fixtures of the reliability suite: SGLang's real Scheduler with ``--radix-cache hybrid``.

Like ``test/sglang`` (whose ``CheckingWorker`` this suite reuses): SGLang's strict busy pool check
after every pass, its idle leak check and tree sanity check (the index's ``check_integrity``) when
it drains, and a worker that proves every pass's prefix KV and resumed state are the ones an
uncached run would hold. ``Harness`` adds the checks SGLang does not make: the KV and MambaPool
identities after every pass, and at idle no lane, pin, protected token or snapshot slot left.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import Stuck

POISON = -1.0  # CheckingWorker's values are hashes in [0, 2**23)
os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
os.environ["SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK"] = "1"

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "sglang"):  # checking_worker lives beside the backend tests
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


@pytest.fixture(scope="session", autouse=True)
def _plugin(sglang_plugin: None) -> None:
    pass


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The pools' tensors are tiny: on a shared 2-core machine two torch threads made every pass
    about five times slower (measured), as the CPU model worker also found."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def live_requests(sched: Any) -> list[Any]:
    """Every request the scheduler knows about (a prefill batch joins the running batch at the
    next pass, so the last batch counts too), once each."""
    seen: dict[int, Any] = {}
    for r in [
        *sched.running_batch.reqs,
        *sched.waiting_queue,
        *(sched.last_batch.reqs if sched.last_batch else ()),
        sched.chunked_req,
    ]:
        if r is not None:
            seen.setdefault(id(r), r)
    return list(seen.values())


class Harness:
    """One scheduler plus the pool and index checks of the reliability suite."""

    def __init__(self, sched: Any) -> None:
        self.s = sched
        self.n = 0

    @property
    def cache(self) -> Any:
        return self.s.tree_cache

    @property
    def hybrid(self) -> bool:
        return hasattr(self.cache, "index")

    def run(self, ids: list[int], max_new: int = 4, rid: str | None = None, **attrs: Any) -> Any:
        rid = rid or f"r{self.n:06d}"
        self.n += 1
        self.s.submit(rid, ids, max_new, **attrs)
        self.step_all()
        return self.s.results()[rid]

    max_passes = 20_000  # a run that does not drain by then is stuck (a livelock)

    def step_all(self) -> None:
        """Passes until idle, every pass checked, then the idle checks."""
        passes = 0
        while self.s.has_work():
            self.s.step()
            self.check_pass()
            passes += 1
            if passes >= self.max_passes:
                s = self.s.scheduler
                raise Stuck(
                    f"not drained after {passes} passes: waiting "
                    f"{[r.rid for r in s.waiting_queue][:5]}, running "
                    f"{[r.rid for r in s.running_batch.reqs][:5]}"
                )
        self.s.on_idle()
        self.check_idle()

    # ------------------------------------------------------------ after every pass
    def check_pass(self) -> None:
        if self.hybrid:
            self.cache.index.check_integrity()
        self.check_kv()
        self.check_mamba()
        self.poison_free()

    def poison_free(self) -> None:
        """Overwrite every free KV slot and free MambaPool slot with a value no run computes.

        Nothing may read a free slot: a page the tree still maps after freeing it, or a state
        slot handed to a request without its copy-on-write or clear, then fails
        ``CheckingWorker``'s check at the next pass instead of passing by luck (a recycled
        slot often still holds what a correct run would have written)."""
        s = self.s.scheduler
        alloc = s.token_to_kv_pool_allocator
        free = alloc.get_all_free_pages()
        if free is not None and free.numel():
            free = free.to(torch.int64)
            if s.page_size > 1:
                offs = torch.arange(s.page_size, device=free.device)
                free = (free[:, None] * s.page_size + offs[None, :]).reshape(-1)
            kv = alloc.get_kvcache()
            kv = getattr(kv, "full_kv_pool", kv)
            for buf in (*kv.k_buffer, *kv.v_buffer):
                buf[free] = POISON
        pool = s.req_to_token_pool
        slots = pool.mamba_allocator.free_slots
        if len(slots):
            slots = torch.as_tensor(slots, dtype=torch.int64)
            cache = pool.mamba_pool.mamba_cache
            for t in (cache.temporal, *cache.conv):
                t[:, slots] = POISON

    def check_kv(self) -> None:
        """KV identity: available + evictable + protected + rows live requests own == pool."""
        from sglang.srt.managers.scheduler_components.pool_stats_observer import (
            kv_private_tokens,
        )

        s = self.s.scheduler
        alloc = s.token_to_kv_pool_allocator
        page = s.page_size
        held = sum(kv_private_tokens(r.kv, page) for r in live_requests(s) if r.kv.holds_kv)
        tc = s.tree_cache
        total = alloc.available_size() + tc.evictable_size() + tc.protected_size() + held
        size = s.req_to_token_pool.schedulable_token_capacity(alloc.size)
        assert total == size, (
            f"KV identity: available {alloc.available_size()} + evictable {tc.evictable_size()}"
            f" + protected {tc.protected_size()} + requests {held} = {total} != pool {size}"
        )

    def check_mamba(self) -> None:
        """MambaPool identity: available + cache's slots + slots live requests hold == pool."""
        s = self.s.scheduler
        pool = s.req_to_token_pool
        held = sum(1 for r in live_requests(s) if r.kv.holds_mamba)
        tc = s.tree_cache
        avail = pool.mamba_allocator.available_size()
        total = avail + tc.mamba_protected_size() + tc.mamba_evictable_size() + held
        assert total == pool.mamba_pool.size, (
            f"mamba identity: available {avail} + cache {tc.mamba_protected_size()} + "
            f"{tc.mamba_evictable_size()} + "
            f"requests {held} = {total} != pool {pool.mamba_pool.size}"
        )

    # ------------------------------------------------------------ at idle
    def check_idle(self) -> None:
        """Nothing left over on a drained scheduler (SGLang's own idle check ran before)."""
        s = self.s.scheduler
        alloc = s.token_to_kv_pool_allocator
        tc = s.tree_cache
        assert not live_requests(s) or all(not r.kv.holds_kv for r in live_requests(s))
        assert (
            alloc.available_size() + tc.evictable_size()
            == s.req_to_token_pool.schedulable_token_capacity(alloc.size)
        )
        if not self.hybrid:
            return
        from sglang_hybrid.index import Residency
        from sglang_hybrid.index.device_slots import STAGING

        idx = tc.index
        idx.check_integrity()
        assert not idx.lanes, f"lanes left open at idle: {sorted(idx.lanes)}"
        assert idx.protected_tokens == 0, f"{idx.protected_tokens} protected tokens at idle"
        for n in idx.tree.subtree_postorder(idx.tree.root):
            if n.parent is None:
                continue
            assert n.active_refs == 0 and n.restore_pins == 0, f"pinned at idle: {n}"
            assert n.device_state is not Residency.FILLING, f"filling at idle: {n}"
        for x in idx.snapshots.values():
            assert x.restore_pins == 0, f"pinned at idle: {x}"
            assert x.tail_device_state is not Residency.FILLING, f"filling at idle: {x}"
        assert STAGING not in idx.slots.owner, "a snapshot slot left staging at idle"
        want = 0 if tc.disable else tc.config.device_snapshot_slots
        slots = tc._slot_ids
        assert len(slots) in (0, want), f"{len(slots)} snapshot slots held, configured {want}"
        assert len(set(slots)) == len(slots), f"a snapshot slot held twice: {slots}"
        pool = s.req_to_token_pool
        assert pool.mamba_allocator.available_size() == pool.mamba_pool.size - len(slots), (
            f"MambaPool: {pool.mamba_allocator.available_size()} free of {pool.mamba_pool.size}"
            f" with {len(slots)} snapshot slots"
        )


@pytest.fixture
def build(make_scheduler: Callable[..., Any], qwen3_next_dir: Path) -> Iterator[Callable[..., Any]]:
    """``build(backend="hybrid"|"none", page=1, chunk=128, opts=..., **kw)`` -> Harness.

    ``"none"`` is the uncached reference (``disable_radix_cache``)."""
    from checking_worker import CheckingWorker
    from sched_args import scheduler_args

    def _build(
        backend: str = "hybrid",
        *,
        page: int = 1,
        chunk: int = 128,
        opts: dict | None = None,
        **kw: Any,
    ) -> Harness:
        args = scheduler_args(backend, page=page, chunk=chunk, opts=opts, **kw)
        sched = make_scheduler(qwen3_next_dir, worker="tokens", worker_class=CheckingWorker, **args)
        return Harness(sched)

    yield _build


@pytest.fixture
def retractions(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts SGLang's ``ScheduleBatch.retract_decode`` calls and the requests they retracted."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    counts = {"calls": 0, "retracted": 0, "aborted": 0}
    orig = ScheduleBatch.retract_decode

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        counts["calls"] += 1
        counts["retracted"] += len(out[0])
        counts["aborted"] += len(out[2])
        return out

    monkeypatch.setattr(ScheduleBatch, "retract_decode", counting)
    return counts
