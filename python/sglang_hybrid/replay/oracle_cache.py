"""The infinite-memory oracle as an SGLang prefix cache, so it runs in the same Scheduler loop.

What it models: a cache that kept every token of every request released before (prompt and
answer), with a recurrent state at every position, and that coalesces perfectly: a request
resumes at its longest common prefix with anything released earlier (``PrefixStore``), capped
by SGLang's own rule that at least one prompt token is computed. It is an upper bound on reuse
for every real cache in the same replay, not a cache one could build.

How it plugs in: registered as radix-cache backend ``replay_oracle``. The replay driver computes
each request's hit when it releases it and stores it as ``req.replay_oracle_len``;
``match_prefix`` reports it. The token worker never reads KV or states, so the cached prefix
needs no memory: every prefix position points at one reserved KV slot (``cache_protected_len``
covers it, so SGLang never frees it), and the request's state slot is SGLang's ordinary fresh
one. Running requests still take SGLang's pools for what they compute and decode, so
admission, chunking and memory pressure stay SGLang's.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)

BACKEND = "replay_oracle"
HIT_ATTR = "replay_oracle_len"


class _Handle:
    __slots__ = ("children", "length")

    def __init__(self, length: int) -> None:
        self.length = length
        self.children: dict = {}  # SGLang's dfs_weight_order walks .children


class OracleCache(BasePrefixCache):
    def __init__(self, params: Any) -> None:
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        # SGLang's admission reads this: a cache without it counts as disabled.
        self.disable = bool(params.disable)
        if self.page_size != 1:
            raise ValueError("the replay oracle points prefixes at one slot: it needs page size 1")
        self.mamba_allocator = self.req_to_token_pool.mamba_allocator
        self.device = self.token_to_kv_pool_allocator.get_kvcache().device
        self.root_node = _Handle(0)
        self._slot: torch.Tensor | None = None
        self._reserve()

    def _reserve(self) -> None:
        if self._slot is None:
            got = self.token_to_kv_pool_allocator.alloc(1)
            if got is None:
                raise RuntimeError("the replay oracle could not reserve its KV slot")
            self._slot = got.to(torch.int64)

    # ------------------------------------------------------------------ sizes
    def supports_mamba(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0 if self._slot is None else 1  # the reserved slot

    def full_protected_size(self) -> int:
        return self.protected_size()

    def mamba_evictable_size(self) -> int:
        return 0

    def mamba_protected_size(self) -> int:
        return 0

    def total_size(self) -> tuple[int, int]:
        return self.protected_size(), 0

    def reset(self) -> None:
        self._slot = None  # SGLang clears its pools after a flush; reserve again lazily

    # ------------------------------------------------------------------ match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        hit = int(getattr(req, HIT_ATTR, 0)) if req is not None and not self.disable else 0
        hit = min(hit, len(params.key))
        if hit:
            self._reserve()
        handle = _Handle(hit)
        return MatchResult(
            device_prefix_len=hit,
            last_device_node=handle,
            last_host_node=handle,
            best_match_node=handle,
            cache_protected_len=hit,
        )

    def path_device_indices(self, node: Any) -> torch.Tensor:
        n = node.length
        if not n:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        assert self._slot is not None
        return self._slot.expand(n).clone()

    # ------------------------------------------------------------------ lifecycle
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if req.finished():
            self._free_state_slot(req)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        if not checkpointed:
            self._free_state_slot(req)

    def _free_state_slot(self, req: Any) -> None:
        if req.kv.holds_mamba:
            self.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1).to(torch.int64))
            req.kv.mamba_pool_idx = None

    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult()

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        return IncLockRefResult()

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        return DecLockRefResult()

    # ------------------------------------------------------------------ diagnostics
    def pretty_print(self) -> None:
        """Nothing to print: the oracle holds no tree."""

    def sanity_check(self) -> None:
        """Nothing to check: the oracle holds no tree."""

    def all_values_flatten(self) -> torch.Tensor:
        if self._slot is None:
            return torch.empty(0, dtype=torch.int64)
        return self._slot

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)


def build_oracle(ctx: Any) -> OracleCache:
    """``register_radix_cache_backend`` factory."""
    return OracleCache(ctx.params)


def register_oracle() -> None:
    """Make ``--radix-cache-backend replay_oracle`` available in this process (idempotent)."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, build_oracle)
