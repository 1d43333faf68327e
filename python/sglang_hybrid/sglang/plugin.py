"""SGLang plugin entry point (group ``sglang.srt.plugins``): the ``hybrid`` radix-cache backend.

SGLang calls :func:`register` in every process that loads plugins (the launcher, each scheduler,
the detokenizer, the DP controller). Processes are spawned, so it is idempotent: the backend is
registered once per process and hooks are registered with SGLang's ``HookRegistry``, which applies
them once after all plugins loaded. Everything here is plumbing; policy lives in ``index/``.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_SA = "sglang.srt.server_args.ServerArgs"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"


def register() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .flags import BACKEND

    if BACKEND in registered_radix_cache_backends():
        return
    register_radix_cache_backend(BACKEND, build_cache)
    after, around = HookType.AFTER, HookType.AROUND
    HookRegistry.register(f"{_SA}.add_cli_args", _add_cli_args, after)
    HookRegistry.register(f"{_SA}.from_cli_args", _from_cli_args, after)
    HookRegistry.register(f"{_SA}.resolve_once", _before_resolve, HookType.BEFORE)
    HookRegistry.register(f"{_SA}.resolve_once", _after_resolve, after)
    HookRegistry.register(
        "sglang.srt.arg_groups.mamba_hook.validate_mamba_no_buffer", _no_buffer_check, around
    )
    from . import chunking

    HookRegistry.register(
        f"{_ADDER}._select_prefill_admission", chunking.after_select_admission, after
    )
    HookRegistry.register(
        f"{_ADDER}._commit_prefill_admission", chunking.after_commit_admission, after
    )
    HookRegistry.register(f"{_ADDER}.add_chunked_req", chunking.after_add_chunked_req, after)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.process_pending_chunked_abort",
        _before_chunked_abort,
        around,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        _around_prefill_pass,
        around,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
        ".get_cached_tokens_details",
        _cached_tokens_details,
        after,
    )
    from . import chat_server

    chat = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
    HookRegistry.register(
        f"{chat}._convert_to_internal_request", chat_server.around_convert, around
    )
    HookRegistry.register(
        f"{chat}._render_and_encode_chat_template", chat_server.around_render, around
    )


# ---------------------------------------------------------------- CLI
def _add_cli_args(result: Any, parser: Any) -> None:
    from .flags import add_cli_args

    add_cli_args(parser)


def _from_cli_args(server_args: Any, cls: Any, args: Any) -> None:
    from .flags import ATTR, options_from_namespace

    if hasattr(args, "hybrid_host_cache_mib"):
        setattr(server_args, ATTR, options_from_namespace(args))


def _uses_hybrid(view: Any) -> bool:
    from .flags import BACKEND

    return getattr(view, "radix_cache_backend", None) == BACKEND


def _before_resolve(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Explicit flags the backend cannot honour, refused before SGLang's own resolution (whose
    messages do not know the fix for this backend)."""
    if _uses_hybrid(server_args):
        from .checks import check_server_args

        check_server_args(server_args, resolved=False)


def _after_resolve(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """What resolution decided (e.g. overlap scheduling), before any process is spawned."""
    if _uses_hybrid(server_args):
        from .checks import check_server_args

        check_server_args(_resolved(server_args), resolved=True)


def _resolved(server_args: Any) -> Any:
    """What SGLang's resolution decided (raw fields keep what the operator typed)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    return resolving_view(server_args)


def _no_buffer_check(orig: Any, view: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's no_buffer strategy allows page size 1 only, for its own cache's sake; the hybrid
    cache keys 64-token blocks and works with any page size dividing 64 (checked by us)."""
    if _uses_hybrid(view) and (getattr(view, "page_size", None) or 1) > 1:
        return None
    return orig(view, *args, **kwargs)


# ---------------------------------------------------------------- scheduler
def _before_chunked_abort(orig: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Cancel mid-prefill (§7.7): publish the last computed chunk before SGLang drops it."""
    from .cache import HybridRadixCache

    cache = getattr(scheduler, "tree_cache", None)
    req = getattr(scheduler, "chunked_req", None)
    if isinstance(cache, HybridRadixCache) and req is not None:
        cache.before_chunked_abort(scheduler, req)
    return orig(scheduler, *args, **kwargs)


def _around_prefill_pass(orig: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """An admission pass with coalescing requests held out of it (§12.2, ``coalesce.py``); after
    it, a head that could not start prefetches its host blocks (§6.6)."""
    from .cache import HybridRadixCache
    from .coalesce import around_prefill_pass

    result = around_prefill_pass(orig, scheduler, *args, **kwargs)
    cache = getattr(scheduler, "tree_cache", None)
    if isinstance(cache, HybridRadixCache) and cache.host is not None:
        queue = scheduler.waiting_queue
        if queue:
            cache.prefetch_head(queue[0])
    return result


def _cached_tokens_details(result: Any, streamer: Any, req: Any, *args: Any) -> Any:
    """Report what the host tier restored with the request's cached tokens: SGLang's
    ``cached_tokens_details`` then splits device and host hits, and carries the bytes."""
    from .request import ATTR

    state = getattr(req, ATTR, None)
    if state is None or not state.restored_tokens or not req.cached_tokens:
        return None
    host = min(state.restored_tokens, req.cached_tokens)
    details = dict(result or {})
    details.update(
        device=req.cached_tokens - host, host=host, hybrid_restored_bytes=state.restored_bytes
    )
    return details


# ---------------------------------------------------------------- the factory
def build_cache(ctx: Any) -> Any:
    """``register_radix_cache_backend`` factory: runs in each scheduler process at startup."""
    from ..index import ConfigError
    from .cache import HybridRadixCache
    from .checks import check_pools, check_server_args
    from .flags import get_options, resolve

    sa = ctx.server_args
    check_server_args(_resolved(sa), resolved=True)
    opts = get_options(sa)
    params = ctx.params
    pool = params.req_to_token_pool
    concurrency = int(pool.size)
    chunk = params.chunked_prefill_size or 0
    mamba_pool = getattr(pool, "mamba_pool", None)
    state_slots = int(mamba_pool.size) if mamba_pool is not None else None
    config = resolve(
        opts,
        concurrency=concurrency,
        chunk_tokens=chunk if chunk > 0 else 8192,
        state_slots=state_slots,
    )
    arch = ",".join(getattr(ctx.model_config.hf_config, "architectures", None) or ["the model"])
    if not params.disable:
        check_pools(
            is_hybrid_ssm=bool(ctx.is_hybrid_ssm) and mamba_pool is not None,
            mamba_slots=int(mamba_pool.size) if mamba_pool is not None else 0,
            max_running=concurrency,
            snapshot_slots=config.device_snapshot_slots,
            arch=arch,
        )
    elif mamba_pool is None:
        raise ConfigError(
            f"--radix-cache hybrid serves hybrid models; {arch} has no recurrent "
            f"layers: drop --radix-cache hybrid"
        )
    cache = HybridRadixCache(params, config=config, options=opts)
    logger.info(
        "sglang-hybrid cache%s: %s; page size %d, block bundle %d B, state image %d B",
        " (disabled by --disable-radix-cache)" if params.disable else "",
        config.describe(),
        params.page_size,
        cache.block_bytes,
        cache.image_bytes,
    )
    return cache
