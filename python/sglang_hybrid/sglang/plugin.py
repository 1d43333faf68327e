"""SGLang plugin entry point (group ``sglang.srt.plugins``): the ``hybrid`` radix-cache backend.

SGLang calls :func:`register` in every process that loads plugins (the launcher, each scheduler,
the detokenizer, the DP controller). Processes are spawned, so it is idempotent: the backend is
registered once per process and hooks are registered with SGLang's ``HookRegistry``, which applies
them once after all plugins loaded. Everything here is plumbing; policy lives in ``index/``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import HybridRadixCache

logger = logging.getLogger(__name__)

_SA = "sglang.srt.server_args.ServerArgs"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_CACHE_MODULE = f"{__package__}.cache"
_COALESCE_MODULE = f"{__package__}.coalesce"


def register() -> None:
    from .preflight import preflight

    # First, before anything of ours is imported or any hook applied: a launch the cache cannot
    # serve is refused in seconds, in one line (``preflight.py``).
    preflight()
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
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        _before_next_batch,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", _after_next_batch, after
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch", _after_run_batch, after
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        _before_batch_result,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.flush_cache", _after_flush, after
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle", _around_idle_sleep, around
    )
    # Speculative decoding: the draft model's KV pools, collected for the cache (``draft.py``).
    from . import draft

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.init_memory_pools",
        draft.after_init_memory_pools,
        after,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
        ".get_cached_tokens_details",
        _cached_tokens_details,
        after,
    )
    # In-pass taps on SGLang's own GPU worker (track.py: SGLang's prefill tracking filled by the
    # cache, gdn_taps.py for the other taps of a pass); inert unless a request carries them.
    from . import track

    gdn = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
    HookRegistry.register(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        track.after_init_new,
        after,
    )
    HookRegistry.register(f"{gdn}.init_forward_metadata", track.after_init_forward_metadata, after)
    HookRegistry.register(f"{gdn}.forward_extend", track.around_forward_extend, around)
    HookRegistry.register(
        "sglang.srt.layers.attention.linear.kernels.gdn_flashinfer"
        ".maybe_build_flashinfer_checkpoint_plan",
        track.around_checkpoint_plan,
        around,
    )
    from . import chat_server

    chat = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
    HookRegistry.register(
        f"{chat}._convert_to_internal_request", chat_server.around_convert, around
    )
    HookRegistry.register(
        f"{chat}._render_and_encode_chat_template", chat_server.around_render, around
    )
    HookRegistry.register(f"{chat}.handle_request", chat_server.around_handle_request, around)
    anthropic = "sglang.srt.entrypoints.anthropic.serving.AnthropicServing"
    HookRegistry.register(
        f"{anthropic}.handle_messages", chat_server.around_handle_messages, around
    )
    HookRegistry.register(
        f"{anthropic}._convert_to_chat_completion_request",
        chat_server.around_anthropic_convert,
        around,
    )
    # Empty prompts answer 400 instead of reaching the model (``prompts.py``); every server with
    # the package installed, since a zero-token prompt has no meaning under any cache.
    from . import prompts

    HookRegistry.register(
        "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
        prompts.before_normalize,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        prompts.before_validate_one,
        HookType.BEFORE,
    )
    # --hybrid-cache-file (``persistence.py``, spec §5.5): each scheduler installs its stop
    # handlers as its loop starts; the launcher waits for their saves once the server stopped.
    from . import persistence

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_event_loop",
        persistence.before_event_loop,
        HookType.BEFORE,
    )
    # The boundary API (issue #16): its routes on SGLang's app (``http_api.py``), answered by
    # each scheduler's cache through SGLang's control path (``boundaries.py``).
    from . import boundaries

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_dumper_control",
        boundaries.around_dumper_control,
        around,
    )
    if _http_server_importable():
        from . import http_api

        HookRegistry.register(
            "sglang.srt.utils.common.build_server_info", http_api.after_build_server_info, after
        )
        HookRegistry.register(
            "sglang.srt.entrypoints.http_server.launch_server",
            persistence.around_launch_server,
            around,
        )
        HookRegistry.register(
            "sglang.srt.entrypoints.http_server.launch_server",
            http_api.before_launch_server,
            HookType.BEFORE,
        )


def _http_server_importable() -> bool:
    """SGLang's HTTP server module imports only where FastAPI's form parsing is installed (every
    server install; not the GPU check's trimmed package set). Where it is missing no server can
    launch in this process, and hooking it would make every process fail to apply hooks."""
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("python_multipart", "multipart"))


# ---------------------------------------------------------------- CLI
def _add_cli_args(result: Any, parser: Any) -> None:
    from .flags import add_cli_args

    add_cli_args(parser)


def _from_cli_args(server_args: Any, cls: Any, args: Any) -> None:
    from .flags import ATTR, options_from_namespace

    if hasattr(args, "hybrid_host_cache_mib"):
        setattr(server_args, ATTR, options_from_namespace(args))
        # The command line's checks (``preflight.py``), for what did not pass the preflight: a
        # ``sglang serve`` launch, a ``--config`` file, a program parsing arguments in code.
        _refusing(_check_parsed, args)
    if _uses_hybrid(args):
        _check_hooks()  # the launcher's first call into the plugin that knows the backend


def _check_parsed(args: Any) -> None:
    from .preflight import check_namespace, from_cli

    check_namespace(args, launch=from_cli())


def _refusing(check: Any, *args: Any) -> None:
    """Run a startup check: on the server command line a refusal is one line and exit status 2
    (``preflight.refuse``); in a program it raises ``ConfigError``."""
    from ..index import ConfigError
    from .preflight import from_cli, refuse

    try:
        check(*args)
    except ConfigError as e:
        if from_cli():
            refuse(str(e))
        raise


def _check_hooks() -> None:
    """Refuse to start unless every hook this plugin registered is live (``checks.py``).

    Run in each process that loads plugins and serves the backend, as soon as the plugin knows
    the backend is selected: in the launcher when the CLI is parsed (``_from_cli_args``) and when
    SGLang resolves the arguments (``_before_resolve``, also the first call for ``Engine`` built
    in code), before any process is spawned; in each scheduler when it builds the cache
    (``build_cache``), before the first request. SGLang applies hooks in ``load_plugins`` before
    either, and every process applies all of them, so each check covers the whole list.
    """
    from .checks import check_hooks_applied

    check_hooks_applied(__name__.rpartition(".")[0] + ".")


def _uses_hybrid(view: Any) -> bool:
    from .flags import is_selected

    return is_selected(view)


def _before_resolve(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Explicit flags the backend cannot honour, refused before SGLang's own resolution (whose
    messages do not know the fix for this backend); then what the cache needs where the
    operator left SGLang to choose."""
    if _uses_hybrid(server_args):
        from .checks import check_contradictions, check_server_args

        _refusing(_check_hooks)
        _refusing(check_contradictions, server_args)
        _refusing(check_server_args, server_args)
        _choose_where_unset(server_args)


_CHOICE_SOURCE = "sglang_hybrid (--radix-cache hybrid)"


def _choose_where_unset(server_args: Any) -> None:
    """Declare overlap scheduling off and the no_buffer strategy unless the operator chose.

    The raw fields stay what the operator typed: the choice is a resolution declaration
    (``declare_resolution``, the way SGLang's own handlers decide), made before the pipeline runs
    so every later step reads it through the resolving view (``_mamba_radix_cache_resolution``
    and model overrides then see ``no_buffer`` rather than ``auto``; SGLang's no_buffer validation
    sees overlap off). ``run_resolution_pipeline`` keeps declarations made before it, they ride
    in ``_resolved_overrides`` through the pickle into the scheduler, and publication projects
    them into the config bags the scheduler reads (``get_schedule().disable_overlap_schedule``).
    Once per record: a resolved (or failed) record is never resolved again, and each spawned
    process receives the resolved one, so the choice is logged once, in the launching process.
    """
    if getattr(server_args, "_resolution_finished", False) or getattr(
        server_args, "_resolution_failed", False
    ):
        return
    stash = getattr(server_args, "_resolved_overrides", None) or ()
    if any(source == _CHOICE_SOURCE for source, _ in stash):
        return
    from sglang.srt.arg_groups.overrides import declare_resolution

    from .checks import choices_for_unset

    choices = choices_for_unset(_resolved(server_args))
    if not choices:
        return
    declare_resolution(
        server_args, _CHOICE_SOURCE, **{name: value for name, (value, _) in choices.items()}
    )
    for name, (_value, why) in choices.items():
        # Overlap scheduling off costs throughput the operator may expect: a warning.
        level = logging.WARNING if name == "disable_overlap_schedule" else logging.INFO
        logger.log(level, "--radix-cache hybrid: %s", why)


def _after_resolve(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """What resolution decided (e.g. overlap scheduling), before any process is spawned."""
    if _uses_hybrid(server_args):
        from .checks import check_server_args

        _refusing(check_server_args, _resolved(server_args))


def _resolved(server_args: Any) -> Any:
    """What SGLang's resolution decided (raw fields keep what the operator typed)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    return resolving_view(server_args)


def _no_buffer_check(orig: Any, view: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's no_buffer strategy allows page size 1 and no overlap scheduling only, for its own
    cache's sake (it copies live states at chunk ends); the hybrid cache keys 64-token blocks,
    works with any page size dividing 64 (checked by us) and captures pass ends as the pass runs,
    so overlap scheduling is fine. Its other condition (no trtllm_mha) still applies."""
    if _uses_hybrid(view) and getattr(view, "attention_backend", None) != "trtllm_mha":
        return None
    return orig(view, *args, **kwargs)


# ---------------------------------------------------------------- scheduler
def _cache_of(scheduler: Any) -> HybridRadixCache | None:
    """The scheduler's cache if it is ours, else None.

    Several of these hooks run on every scheduler pass, and a function-level ``from .cache
    import`` costs about a microsecond each time (the import machinery runs even for a loaded
    module), so the class is read from ``sys.modules``: where ``cache.py`` was never imported,
    no cache is ours."""
    module = sys.modules.get(_CACHE_MODULE)
    cache = getattr(scheduler, "tree_cache", None)
    if module is None or not isinstance(cache, module.HybridRadixCache):
        return None
    return cache


def _before_chunked_abort(orig: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Cancel mid-prefill (§7.7): publish the last computed chunk before SGLang drops it."""
    # Every pass calls this; only one with a cancel pending has anything to publish.
    if getattr(scheduler, "_pending_chunked_abort_req", None) is not None:
        cache = _cache_of(scheduler)
        req = getattr(scheduler, "chunked_req", None)
        if cache is not None and req is not None:
            cache.before_chunked_abort(scheduler, req)
    return orig(scheduler, *args, **kwargs)


def _around_prefill_pass(orig: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """An admission pass with coalescing requests held out of it (§12.2, ``coalesce.py``); after
    it, a head that could not start prefetches its host blocks (§6.6)."""
    cache = _cache_of(scheduler)
    if cache is None:
        return orig(scheduler, *args, **kwargs)
    cache.note_adder(None)  # this pass's adder is noted when it selects a candidate
    coalesce = sys.modules[_COALESCE_MODULE]  # imported by cache.py, as the class above
    result = coalesce.around_prefill_pass(cache, orig, scheduler, *args, **kwargs)
    if cache.host_tier is not None:
        queue = scheduler.waiting_queue
        if queue:
            cache.prefetch_head(queue[0])
    return result


def _after_flush(flushed: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """The cache takes its snapshot slots back right after a flush (``after_flush``)."""
    cache = _cache_of(scheduler)
    if flushed and cache is not None:
        cache.after_flush()


def _around_idle_sleep(orig: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """``--sleep-on-idle``: SGLang's idle scheduler waits up to a second for a request. Host and
    L3 copies retire only when the loop turns (``HostTier.poll``, ``L3Tier.poll``), and a
    finished request's blocks and endpoint reach L3 only once their host write retired; so while
    any copy or L3 job is in flight the loop turns again (after a millisecond) instead of
    sleeping. Without this a fleet's next turn on another server, arriving within that second,
    missed what the previous turn wrote (issue #39, ``docs/l3.md``)."""
    cache = _cache_of(scheduler)
    if cache is not None and cache.copies_in_flight():
        time.sleep(0.001)
        return None
    return orig(scheduler, *args, **kwargs)


def _before_next_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Once per scheduler iteration, on every rank: retire the host copies all ranks finished
    (``HostTier.poll``) before the batch is chosen. The first time, the cache learns how the
    scheduler runs (overlap scheduling, its forward stream: ``bind_scheduler``)."""
    cache = _cache_of(scheduler)
    if cache is not None:
        if cache.bound_to is not scheduler:
            cache.bind_scheduler(scheduler)
        cache.poll()


def _after_run_batch(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """A pass was launched: under overlap scheduling the cache copies the states at its requests'
    pass ends now, before the next pass is launched (``Publisher.capture_pass_ends``); a
    speculative round is counted (``Publisher.count_rounds``)."""
    if batch is None:
        return
    cache = _cache_of(scheduler)
    if cache is not None:
        if not batch.spec_algorithm.is_none():  # every pass calls this: count only rounds
            cache.count_rounds(batch, launched=True)
        if cache.overlap:
            cache.capture_pass_ends(batch)


def _before_batch_result(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """A pass's result is processed: its speculative round is counted as seen."""
    if batch is None or batch.spec_algorithm.is_none():
        return  # every pass calls this: nothing to count without speculation
    cache = _cache_of(scheduler)
    if cache is not None:
        cache.count_rounds(batch, launched=False)


def _after_next_batch(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """The batch is built, not launched: the cache mirrors the slots SGLang allocated for it to
    the host without waiting (``mirror.py``); the TP rank check (``ranks.py``) records what
    this pass decided and compares if asked."""
    batch = getattr(plan, "batch_to_run", None)
    cache = _cache_of(scheduler)
    if cache is not None and batch is not None:
        cache.after_batch_built(batch)
    check = getattr(getattr(scheduler, "tree_cache", None), "rank_check", None)
    if check is not None:
        check.after_pass(scheduler, batch)


def _cached_tokens_details(result: Any, streamer: Any, req: Any, *args: Any) -> Any:
    """The tokens the host tier restored, as the host part of SGLang's ``cached_tokens_details``.

    Token counts only, as SGLang's own details are (issue #38: the restored bytes used to sit
    beside them, where a client summing the values would add bytes to tokens). The bytes are
    ``sglang_hybrid:host_tier_restored_bytes_total``: SGLang 0.5.23 gives a plugin no
    per-request ``meta_info`` field of its own (its customized-info path is gated by a class
    constant of the output streamer, and editing ``meta_info`` after the tokenizer manager built
    it races the request's reader)."""
    from .request import ATTR

    state = getattr(req, ATTR, None)
    if state is None or not state.restored_tokens or not req.cached_tokens:
        return None
    details = dict(result or {"device": req.cached_tokens, "host": 0})
    # An asynchronous restore lands before admission, so SGLang sees a device hit
    # (``host_loaded_length`` 0): the tokens the restore brought back are the host's.
    host = min(state.restored_tokens, req.cached_tokens)
    if host > int(details.get("host", 0) or 0):
        details["device"] = req.cached_tokens - host
        details["host"] = host
    l3 = getattr(req, "_hybrid_l3_tokens", 0)  # ``l3_tier.TOKENS``: fetched from L3 first
    if l3:
        details["hybrid_l3_tokens"] = min(l3, req.cached_tokens)
    return details


# ---------------------------------------------------------------- the factory
def _resolve_tap_mode(opts: Any, worker: Any) -> tuple[Any, int]:
    """The tap mode to run and its capture grid (1: any position; g > 1: positions a multiple of
    g past the pass start; 0: split), from what the worker captures inside a pass
    (``inpass.capture_of``: the CPU workers anywhere, SGLang's GPU worker through its own prefill
    tracking and ``gdn_taps``). ``auto`` takes in-pass capture only where it is exact and
    verified (``inpass.resolve_mode``), and logs which and why; explicit ``zero-split`` on a
    worker that captures nothing is refused."""
    import dataclasses

    from ..index import ConfigError
    from .flags import FLAG_TAP_MODE
    from .inpass import capture_of, resolve_mode

    capture = capture_of(worker)
    try:
        choice = resolve_mode(opts.tap_mode, capture)
    except ValueError as e:
        raise ConfigError(
            f"{FLAG_TAP_MODE} {opts.tap_mode}: {e} ({type(worker).__name__}); use "
            f"{FLAG_TAP_MODE} split or auto"
        ) from None
    log = logger.warning if choice.mode == "zero-split" and not capture.exact else logger.info
    log("sglang-hybrid %s %s", FLAG_TAP_MODE, choice.message)
    return dataclasses.replace(opts, tap_mode=choice.mode), choice.grid


def build_cache(ctx: Any) -> Any:
    """``register_radix_cache_backend`` factory: runs in each scheduler process at startup."""
    from ..index import ConfigError
    from .cache import HybridRadixCache
    from .checks import check_kv_pool, check_pools, check_server_args
    from .draft import draft_kv_pools_of
    from .flags import get_options, resolve

    sa = ctx.server_args
    _check_hooks()
    check_server_args(_resolved(sa))
    opts = get_options(sa)
    params = ctx.params
    check_kv_pool(params.token_to_kv_pool_allocator.get_kvcache())
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
    opts, grid = _resolve_tap_mode(opts, ctx.tp_worker)
    drafts = draft_kv_pools_of(ctx.tp_worker)
    cache = HybridRadixCache(
        params, config=config, options=opts, capture_grid=grid, draft_kv_pools=drafts
    )
    if opts.check_ranks:
        from .ranks import RankCheck

        cache.rank_check = RankCheck(params.tp_cache_group)
        if cache.coalescer is not None:
            cache.coalescer.record_held()
    logger.info(
        "sglang-hybrid cache%s: %s; page size %d, block bundle %d B%s, state image %d B",
        " (disabled by --disable-radix-cache)" if params.disable else "",
        config.describe(),
        params.page_size,
        cache.block_bytes,
        f" (with {cache.pools.draft_layers} draft KV layers)" if drafts else "",
        cache.image_bytes,
    )
    from .persistence import setup as load_host_tier

    load_host_tier(cache, ctx, opts)  # --hybrid-cache-file: before any request (§5.5)
    if opts.l3:
        from .l3_tier import setup as setup_l3

        setup_l3(cache, ctx, opts)  # --hybrid-l3 (issue #39)
    if cache.metrics is not None:
        cache.metrics.refresh(cache)  # the gauges from the start (a loaded file's snapshots)
    return cache
