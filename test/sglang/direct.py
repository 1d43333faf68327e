"""Drive a prefix cache through SGLang's own helpers, without a Scheduler.

Real ``Req`` objects and real pools on ``device="cpu"`` (``SGLANG_HYBRID_TEST_DEVICE=cuda``: on
the GPU, for the GPU check ``benchmark/gpu/check_backend.py``) (built as SGLang's test kit
``sglang/test/kits/unified_radix_cache/fixtures.py`` builds them), and the request lifecycle
as the scheduler runs it: ``Req.init_next_round_input`` (-> ``match_kv_cache`` with mamba
copy-on-write), ``lock``, SGLang's allocation helpers, the deferred copy-on-write, a pass,
``checkpoint_kv_cache`` at every chunk end and at the prompt end, decode steps, and
``release_kv_cache`` at finish or abort. The pass is the checking worker's oracle: it proves the
resumed state and every prefix KV slot before writing its own.
"""

from __future__ import annotations

import contextlib
import os
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from checking_worker import prefix_hashes
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.runtime_context import publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

from sglang_hybrid.sglang import chunking

LINEAR, FULL = [0, 1, 2, 4, 5, 6], [3, 7]  # 3 linear : 1 full attention, two of each run
DEVICE = os.environ.get("SGLANG_HYBRID_TEST_DEVICE", "cpu")  # where the pools live


@dataclass
class Pools:
    page: int
    r2t: HybridReqToTokenPool
    kv: HybridLinearKVPool
    alloc: Any

    def params(self, **kw: Any) -> CacheInitParams:
        return CacheInitParams(
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            page_size=self.page,
            disable=False,
            **kw,
        )


def build_pools(
    page: int = 1,
    *,
    kv_tokens: int = 8192,
    reqs: int = 8,
    mamba: int = 32,
    context: int = 16384,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
) -> Pools:
    sa = ServerArgs(model_path="dummy", page_size=page)
    sa._mamba_cache_chunk_size = max(64, page)  # no HF config to read it from
    publish(sa, role="scheduler")
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("float32"):
        shape = Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=64,
            n_groups=1,
            num_heads=2,
            head_dim=32,
            state_size=16,
            conv_kernel=4,
        )
        params = Mamba2CacheParams(shape=shape, layers=LINEAR)
    r2t = HybridReqToTokenPool(
        size=reqs,
        mamba_size=mamba,
        mamba_spec_state_size=reqs,
        max_context_len=context,
        device=device,
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=LINEAR,
        enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False,
    )
    kv = HybridLinearKVPool(
        size=kv_tokens,
        dtype=dtype,
        page_size=page,
        head_num=2,
        head_dim=16,
        full_attention_layer_ids=FULL,
        device=device,
        enable_memory_saver=False,
        mamba_pool=r2t.mamba_pool,
    )
    if page == 1:
        alloc = TokenToKVPoolAllocator(kv_tokens, dtype, device, kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(kv_tokens, page, dtype, device, kv, need_sort=False)
    return Pools(page, r2t, kv, alloc)


def hybrid_cache(pools: Pools, chunk: int = 2048, **opts: Any) -> Any:
    from sglang_hybrid.sglang.cache import HybridRadixCache
    from sglang_hybrid.sglang.flags import HybridOptions, resolve

    options = HybridOptions(**{"host_cache_mib": 0, **opts})
    config = resolve(
        options,
        concurrency=pools.r2t.size,
        chunk_tokens=chunk,
        state_slots=pools.r2t.mamba_pool.size,
    )
    return HybridRadixCache(pools.params(), config=config, options=options)


def builtin_cache(pools: Pools) -> Any:
    """SGLang's UnifiedRadixCache (FULL + MAMBA) on the same pools, default tree core."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache(
        params=pools.params(tree_components=(ComponentType.FULL, ComponentType.MAMBA))
    )


@dataclass
class Served:
    rid: str
    prompt: int
    cached: int
    output: list[int]
    cache_seconds: float


@dataclass
class Driver:
    """Serves requests one at a time through SGLang's helpers; times only cache calls."""

    cache: Any
    pools: Pools
    chunk: int = 2048
    check: bool = True
    # SGLang's result processor holds the frees of a batch's results in a free group (the prompt
    # end's checkpoint and the release at finish), ended once per batch outside the cache: with
    # this, each request's result processing is such a batch (a chunk end is not one).
    free_groups: bool = False
    cache_seconds: float = 0.0
    _timed: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Time every cache method SGLang's helpers call on the scheduler's behalf.
        for name in (
            "match_prefix",
            "checkpoint",
            "lock",
            "unlock",
            "prefix_device_indices",
            "evict",
            "evict_for_alloc",
            "on_release",
            "free_kv_row",
        ):
            orig = getattr(self.cache, name)
            setattr(self.cache, name, self._timer(orig))

    def _timer(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cache_seconds += time.perf_counter() - t0

        return timed

    # ------------------------------------------------------------------ one request
    def serve(
        self,
        rid: str,
        prompt: list[int],
        max_new: int = 4,
        *,
        abort_after_chunks: int | None = None,
    ) -> Served:
        t_before = self.cache_seconds
        sp = SamplingParams(temperature=0, max_new_tokens=max_new)
        sp.normalize(None)
        req = Req(rid, "", array("q", prompt), sp)
        req.init_next_round_input(self.cache)
        cached = req.prefix_len
        req.extend_end = self._chunk_end(req, req.prefix_len)
        req.lock = self.cache.lock(req.last_node)
        self._alloc_first(req)
        self._pass(req)
        chunks = 1
        while req.extend_end < len(prompt):
            if abort_after_chunks is not None and chunks >= abort_after_chunks:
                return self._abort(req, rid, len(prompt), cached, t_before)
            checkpoint_kv_cache(req, self.cache)
            req.extend_end = self._chunk_end(req, req.prefix_len)
            self._alloc_more(req, req.extend_end - req.prefix_len)
            self._pass(req)
            chunks += 1
        out = [self._token(req)]
        req.output_ids.append(out[-1])
        if max_new > 1:
            with self._result_frees():
                checkpoint_kv_cache(req, self.cache)  # the prompt end, as the result processor does
        while len(out) < max_new:
            seq = len(req.origin_input_ids) + len(req.output_ids) - 1
            self._alloc_more(req, 1, decode=True)
            self._pass(req, prefix=seq, n=1)
            out.append(self._token(req))
            req.output_ids.append(out[-1])
        req.finished_reason = FINISH_LENGTH(length=len(out))
        with self._result_frees():
            release_kv_cache(req, self.cache, checkpoint=True)
        return Served(rid, len(prompt), cached, out, self.cache_seconds - t_before)

    @contextlib.contextmanager
    def _result_frees(self) -> Iterator[None]:
        """A free group around one result's processing when ``free_groups`` (see there)."""
        if not self.free_groups:
            yield
            return
        self.pools.alloc.free_group_begin()
        try:
            yield
        finally:
            self.pools.alloc.free_group_end()

    def _abort(self, req: Req, rid: str, n: int, cached: int, t0: float) -> Served:
        # The scheduler's chunked-abort path: it offers the cache the last computed chunk first.
        if hasattr(self.cache, "before_chunked_abort"):
            holder = type("S", (), {"_pending_chunked_abort_req": req})()
            self.cache.before_chunked_abort(holder, req)
        req.finished_reason = FINISH_ABORT("Aborted")
        release_kv_cache(req, self.cache, checkpoint=False)
        return Served(rid, n, cached, [], self.cache_seconds - t0)

    def _chunk_end(self, req: Req, prefix: int) -> int:
        n = len(req.full_untruncated_fill_ids)
        end = min(n, prefix + self.chunk)
        cut = chunking._cut(req, prefix, end, end < n)
        return cut if cut is not None else end

    # ------------------------------------------------------------------ allocation
    def _alloc_first(self, req: Req) -> None:
        p = self.pools
        prefix = (
            self.cache.prefix_device_indices(req)
            if req.prefix_len
            else torch.empty(0, dtype=torch.int64, device=p.kv.device)
        )
        allocation.alloc_req_slots(p.r2t, [req], self.cache)
        row = req.kv.req_pool_idx
        p.r2t.write((row, slice(0, req.prefix_len)), prefix.to(torch.int32))
        self._alloc_more(req, req.extend_end - req.prefix_len)

    def _alloc_more(self, req: Req, n: int, decode: bool = False) -> None:
        p = self.pools
        row = req.kv.req_pool_idx
        start = req.kv.kv_allocated_len if decode else req.prefix_len
        if p.page == 1:
            out = allocation.alloc_token_slots(self.cache, n)
        else:
            last = (
                p.r2t.req_to_token[row, start - 1 : start].to(torch.int64)
                if start
                else torch.full((1,), -1, dtype=torch.int64, device=p.kv.device)
            )
            pl = torch.tensor([start], dtype=torch.int64)
            sl = torch.tensor([start + n], dtype=torch.int64)
            dev = p.kv.device
            out = allocation.alloc_paged_token_slots_extend(
                self.cache, pl.to(dev), pl, sl.to(dev), sl, last, n
            )
        p.r2t.write((row, slice(start, start + n)), out.to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + n

    # ------------------------------------------------------------------ the pass
    def _pass(self, req: Req, prefix: int | None = None, n: int | None = None) -> None:
        p = self.pools
        mp = p.r2t.mamba_pool
        slot = int(req.kv.mamba_pool_idx)
        if req.kv.mamba_cow_src_index is not None:
            mp.copy_from(req.kv.mamba_cow_src_index, torch.tensor([slot], device=mp.device))
            req.kv.mamba_cow_src_index = None
        elif req.kv.mamba_needs_clear:
            mp.clear_slots(torch.tensor([slot], device=mp.device))
        req.kv.mamba_needs_clear = False
        prefix = req.prefix_len if prefix is None else prefix
        n = req.extend_end - prefix if n is None else n
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        hs = prefix_hashes(tokens, prefix + n) if self.check else [0] * (prefix + n)
        temporal = mp.mamba_cache.temporal
        row = p.r2t.req_to_token[req.kv.req_pool_idx].to(torch.int64)
        kbuf = p.kv.full_kv_pool.k_buffer[0]
        if self.check:
            want = float(hs[prefix - 1]) if prefix else 0.0
            got = float(temporal[0, slot].reshape(-1)[0])
            assert got == want, f"{req.rid}: state {got} != state after {prefix} tokens {want}"
            if prefix:
                want_kv = torch.tensor(hs[:prefix], device=kbuf.device)
                bad = (kbuf[row[:prefix], 0, 0] != want_kv).nonzero()
                assert bad.numel() == 0, f"{req.rid}: wrong KV at {bad[:5].flatten().tolist()}"
        vals = torch.tensor(hs[prefix : prefix + n], dtype=kbuf.dtype, device=kbuf.device)
        for buf in (*p.kv.full_kv_pool.k_buffer, *p.kv.full_kv_pool.v_buffer):
            buf[row[prefix : prefix + n]] = vals[:, None, None]
        temporal[:, slot] = float(hs[prefix + n - 1]) if prefix + n else 0.0

    @staticmethod
    def _token(req: Req) -> int:
        return 10 + (hash((req.rid, len(req.output_ids))) % 1000)

    # ------------------------------------------------------------------ pool identity
    def check_idle(self) -> None:
        """SGLang's idle identity for the KV pool and the mamba pool."""
        c, p = self.cache, self.pools
        kv = p.alloc.available_size() + c.full_evictable_size() + c.full_protected_size()
        assert kv == p.alloc.size, (kv, p.alloc.size)
        mamba = (
            p.r2t.mamba_allocator.available_size()
            + c.mamba_evictable_size()
            + c.mamba_protected_size()
        )
        assert mamba == p.r2t.mamba_pool.size, (mamba, p.r2t.mamba_pool.size)
