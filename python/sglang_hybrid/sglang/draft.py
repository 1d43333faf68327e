"""The draft model's KV pools under speculative decoding (issue #14).

An EAGLE / NEXTN draft runner keeps its own KV pool over the target's slot ids: SGLang's
``Scheduler.init_memory_pools`` hands the draft worker the target's request-to-token table and
allocator, so a slot holds the target's K/V in the target's pool and the draft's K/V of the same
position in the draft's. SGLang's caches leave shared slots in place, so they need nothing; this
cache also *moves* KV (a tail copied to private pages, blocks written to and restored from the
host tier, §6.4, §11), and a moved block must carry the draft's rows or the next drafts attend to
stale keys (lower acceptance; the target's verify keeps outputs exact either way).

SGLang builds the cache after the pools (``init_memory_pools`` in ``init_model_worker``, then
``init_cache_with_memory_pool``) but hands a cache the draft pools only for its own HiCache
(``CacheInitParams.sidecar_draft_device_pools``). An AFTER hook on ``init_memory_pools`` therefore
collects them from the draft worker (``_draft_model_runners``, the method SGLang's HiCache plan
reads) and leaves them on the target worker, which the cache factory receives
(:func:`draft_kv_pools_of`). ``store.device.DevicePools`` then treats their K/V buffers as more
full-attention layers: every copy, slab and restore includes them.
"""

from __future__ import annotations

from typing import Any

from ..index import ConfigError
from .checks import check_kv_pool

ATTR = "_sglang_hybrid_draft_kv_pools"  # on the target worker, from the hook to the factory


def after_init_memory_pools(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """The draft worker's pools exist now; the cache is built next (see the module docstring)."""
    from .flags import is_selected

    spec = getattr(scheduler, "draft_worker", None)
    if spec is None or not is_selected(scheduler.server_args):
        return
    setattr(scheduler.tp_worker, ATTR, collect(spec, scheduler.tp_worker))


def collect(spec_worker: Any, target_worker: Any) -> tuple[Any, ...]:
    """The KV pools of ``spec_worker``'s draft runners that are not the target's own.

    A draft runner that keeps recurrent state of its own (a MambaPool apart from the target's)
    is refused: snapshots hold the target's state image only, so a resume would hand the draft a
    state from another request.
    """
    runners_of = getattr(spec_worker, "_draft_model_runners", None)
    runners = tuple(runners_of()) if callable(runners_of) else ()
    target = target_worker.model_runner
    target_kv = target.token_to_kv_pool
    target_state = getattr(target.req_to_token_pool, "mamba_pool", None)
    pools: list[Any] = []
    for runner in runners:
        pool = runner.token_to_kv_pool
        if pool is target_kv or any(pool is p for p in pools):
            continue
        state = getattr(getattr(runner, "req_to_token_pool", None), "mamba_pool", None)
        if state is not None and state is not target_state:
            raise ConfigError(
                f"--speculative-algorithm: the draft model ({type(runner).__name__}) keeps "
                f"recurrent state of its own, which --radix-cache hybrid does not snapshot with "
                f"the target's; use a draft whose layers are attention only (an MTP head), or "
                f"drop --speculative-algorithm"
            )
        check_kv_pool(pool)
        pools.append(pool)
    return tuple(pools)


def draft_kv_pools_of(target_worker: Any) -> tuple[Any, ...]:
    """What the hook left on the target worker (none without speculative decoding)."""
    return tuple(getattr(target_worker, ATTR, ()))
