"""Configurations the ``hybrid`` backend cannot honour, refused at startup with the fix.

Four moments:

- :func:`choices_for_unset`: where the operator did not choose, the plugin chooses what the cache
  needs (the ``no_buffer`` mamba strategy) before SGLang resolves its arguments, so
  ``--radix-cache hybrid`` alone starts;
- :func:`check_server_args` (and :func:`check_contradictions` on what was typed): explicit flags
  when the command line is parsed (``preflight.py``: before anything is loaded), again in the
  launching process before SGLang resolves its arguments (the raw record is exactly what the
  operator asked for, and a bad flag fails with our message before SGLang's own, which does not
  know the fix), and what resolution derived right after it (before any process is spawned);
- :func:`check_hooks_applied`: every hook the plugin registered is live (launcher and scheduler);
- :func:`check_pools` / :func:`check_kv_pool`: when the scheduler builds the cache and the pools
  exist.

Each message names the flag (or environment variable) and the fix.
"""

from __future__ import annotations

import importlib.metadata
import pkgutil
from typing import Any

from ..index import ConfigError
from ..index.config import FLAG_SLOTS

BLOCK = 64

# KV-cache dtypes whose pools keep per-token scale tensors beside K and V
# (``k_scale_buffer``/``v_scale_buffer``, FP4's ``native_*_scale_buffer``): ``nvfp4`` and
# ``fp4_mx_block16`` (``MHATokenToKVPoolFP4`` / the FP4 quant methods: per-16-element block
# scales per slot) and ``mxfp8`` (``MHATokenToKVPoolMXFP8``: UE8M0 scales per 32 elements, in an
# interleaved page layout at page 128). The cache moves a block's KV as its slot rows of K and V
# (tail copies, host images), so the scales would stay behind and a restored block would
# dequantize with another token's scales. ``fp8_e4m3`` / ``fp8_e5m2`` are served by the plain
# pool (SGLang: "ordinary CUDA FP8 uses the plain pool and has no specialized quant_method"; on a
# CPU ``cpu_fp8_e4m3`` creates no scale buffers either): one per-tensor scale per layer, held by
# the attention layer, so a slot row is self-contained and copies stay exact.
SCALED_KV_DTYPES = ("nvfp4", "fp4_mx_block16", "mxfp8")

HND_ENV = "SGLANG_USE_HND_KVCACHE"
# The speculative algorithm the CPU workers register (``cpu/speculative.py``; named here so this
# layer does not import the workers): SGLang's speculative path over them (issue #14).
SPEC_ON_CPU = "CPU_MTP"
# SGLang's algorithms whose draft is an attention-only model over the target's slot ids (an MTP
# head or an EAGLE draft): the cache copies the draft's KV pool with the target's (``draft.py``),
# with or without overlap scheduling (the V2 schema CPU_MTP follows). NEXTN resolves to EAGLE.
SPEC_WITH_DRAFT_KV = ("EAGLE", "EAGLE3", "NEXTN")


def _get(view: Any, name: str, default: Any = None) -> Any:
    return getattr(view, name, default)


def choices_for_unset(view: Any) -> dict[str, tuple[Any, str]]:
    """What the plugin sets where the operator left SGLang to choose: ``{field: (value, why)}``.

    ``view`` is the record before SGLang's resolution (its raw fields are what the operator typed;
    earlier declarations, if any, through the resolving view). Overlap scheduling is left as
    SGLang chooses: the cache captures pass ends as part of the pass (``publish.py``).
    ``mamba_radix_cache_strategy`` defaults to ``auto``, which asks SGLang
    to choose; an explicit ``extra_buffer`` strategy is refused by :func:`check_server_args`.
    """
    out: dict[str, tuple[Any, str]] = {}
    if _get(view, "mamba_radix_cache_strategy") == "auto":
        out["mamba_radix_cache_strategy"] = (
            "no_buffer",
            "--mamba-radix-cache-strategy no_buffer: the cache takes its own state snapshots, "
            "so SGLang's extra_buffer slots would only take memory (auto would pick extra_buffer "
            "with overlap scheduling or a page size above 1)",
        )
    return out


def check_server_args(view: Any) -> None:
    """Flag combinations the cache cannot serve: called on what the operator asked for (the raw
    ServerArgs before SGLang's resolution) and on SGLang's resolving view, which also holds what
    resolution derived (a strategy a model override picked, say).
    """
    from sglang.srt.environ import envs

    page = _get(view, "page_size") or 1
    if BLOCK % page:
        raise ConfigError(
            f"--page-size {page}: --radix-cache hybrid keys 64-token blocks and needs a page "
            f"size dividing 64 (1, 2, 4, 8, 16, 32 or 64)"
        )
    if _get(view, "enable_int8_mamba_checkpoint"):
        raise ConfigError(
            "--enable-int8-mamba-checkpoint: --radix-cache hybrid snapshots the pool's own "
            "state dtype; drop the flag"
        )
    if _get(view, "enable_hierarchical_cache"):
        raise ConfigError(
            "--enable-hierarchical-cache: SGLang's HiCache cannot attach to --radix-cache "
            "hybrid, which has its own host tier; drop the flag and size the host tier with "
            "--hybrid-host-cache-mib"
        )
    if _get(view, "hicache_storage_backend"):
        raise ConfigError(
            "--hicache-storage-backend: storage backends are not supported with --radix-cache "
            "hybrid; drop the flag"
        )
    if _get(view, "enable_kv_cache_sharding"):
        raise ConfigError(
            "--enable-kv-cache-sharding: --radix-cache hybrid keeps whole 64-token blocks per "
            "rank; drop the flag"
        )
    if _get(view, "enable_unified_cache_external_linker"):
        raise ConfigError(
            "--enable-unified-cache-external-linker: drop it with --radix-cache hybrid"
        )
    if _get(view, "enable_unified_memory"):
        # The unified pool turns each state tensor into a strided view of one envelope and KV
        # slot ids into virtual ids: the cache's slot copies and host images assume plain
        # per-slot rows.
        raise ConfigError(
            "--enable-unified-memory: the unified pool's strided state views and virtual KV "
            "slots are not supported with --radix-cache hybrid; drop the flag"
        )
    kv_dtype = _get(view, "kv_cache_dtype")
    if kv_dtype in SCALED_KV_DTYPES:
        raise ConfigError(
            f"--kv-cache-dtype {kv_dtype}: its KV pool keeps per-token scale tensors, which "
            f"--radix-cache hybrid does not copy with a block's K and V; use auto, bf16 or "
            f"fp8_e4m3 (per-tensor scales)"
        )
    if envs.SGLANG_USE_HND_KVCACHE.get():
        raise ConfigError(
            f"{HND_ENV}=1: the page-major (HND) KV layout is not supported with --radix-cache "
            f"hybrid, which copies KV as token rows; unset {HND_ENV}"
        )
    if _get(view, "enable_linear_replayssm"):
        # A decoding slot's last updates live in the ReplaySSM ring until it flushes; the cache
        # publishes a finished request's slot as a snapshot (and copies states), which keeps only
        # the flushed state (MambaPool.copy_from requires a flushed source).
        raise ConfigError(
            "--enable-linear-replayssm: a state snapshot would miss the updates still in the "
            "ReplaySSM ring; not supported with --radix-cache hybrid; drop the flag"
        )
    disagg = _get(view, "disaggregation_mode") or "null"
    if disagg != "null":
        raise ConfigError(
            f"--disaggregation-mode {disagg}: PD disaggregation transfers KV and states "
            f"through SGLang's own prefill/decode pools, which --radix-cache hybrid does not "
            f"manage; drop --disaggregation-mode or --radix-cache hybrid"
        )
    strategy = _get(view, "mamba_radix_cache_strategy")
    if strategy in ("extra_buffer", "extra_buffer_lazy"):
        raise ConfigError(
            f"--mamba-radix-cache-strategy {strategy}: --radix-cache hybrid takes its own "
            f"snapshots; use --mamba-radix-cache-strategy no_buffer (or leave it out)"
        )
    algo = _get(view, "speculative_algorithm")
    if algo not in (None, "", "NONE", SPEC_ON_CPU, *SPEC_WITH_DRAFT_KV):
        raise ConfigError(
            f"--speculative-algorithm {algo}: not supported with --radix-cache hybrid: the cache "
            f"copies a draft model's KV pool with the target's ({', '.join(SPEC_WITH_DRAFT_KV)}"
            f"), not the state or buffers other speculative workers keep; use one of those or "
            f"drop it"
        )
    if (_get(view, "pp_size") or 1) > 1:
        raise ConfigError("--pp-size > 1: not supported with --radix-cache hybrid")


def check_contradictions(raw: Any) -> None:
    """Flags that contradict ``--radix-cache hybrid`` as typed (the raw record or the parsed
    namespace; resolution may derive them for its own reasons, and then says so itself)."""
    if _get(raw, "disable_radix_cache"):
        raise ConfigError(
            "--disable-radix-cache turns off the prefix cache --radix-cache hybrid selects: drop "
            "--disable-radix-cache to cache, or --radix-cache hybrid to run uncached"
        )


def check_pools(
    *, is_hybrid_ssm: bool, mamba_slots: int, max_running: int, snapshot_slots: int, arch: str
) -> None:
    if not is_hybrid_ssm:
        raise ConfigError(
            f"--radix-cache hybrid serves hybrid models (recurrent + attention layers); {arch} "
            f"has no recurrent layers, so SGLang's default radix cache already reuses every "
            f"page: drop --radix-cache hybrid"
        )
    need = max_running + snapshot_slots
    if mamba_slots < need:
        raise ConfigError(
            f"--max-mamba-cache-size {mamba_slots}: {max_running} running requests plus "
            f"{snapshot_slots} device snapshot slots need {need} state slots; raise "
            f"--max-mamba-cache-size to {need} or lower {FLAG_SLOTS}"
        )


def check_kv_pool(kv_pool: Any) -> None:
    """The KV pool holds plain token rows of K and V: what the cache's copies assume.

    The flag checks above name the usual causes; this one looks at the pool SGLang actually
    built, so a layout or scale tensor reached another way (a platform default such as ROCm's
    ``vectorized_5d``, a checkpoint's quantization) is refused too rather than copied wrongly.
    """
    pool = getattr(kv_pool, "full_kv_pool", kv_pool)
    name = type(pool).__name__
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if getattr(pool, "use_hnd", False) or layout not in (None, "nhd"):
        raise ConfigError(
            f"the KV pool ({name}) uses the {layout!r} layout; --radix-cache hybrid copies KV "
            f"as token rows (the default 'nhd' layout): unset {HND_ENV} and drop "
            f"--enable-unified-memory"
        )
    scales = [
        attr
        for attr in (
            "k_scale_buffer",
            "v_scale_buffer",
            "native_k_scale_buffer",
            "native_v_scale_buffer",
        )
        if getattr(pool, attr, None) is not None
    ]
    if scales:
        raise ConfigError(
            f"the KV pool ({name}) keeps per-token scales ({', '.join(scales)}), which "
            f"--radix-cache hybrid does not copy with a block's K and V; pass --kv-cache-dtype "
            f"auto, bf16 or fp8_e4m3"
        )


def check_hooks_applied(module_prefix: str) -> None:
    """Every hook registered from ``module_prefix`` is live on its target, or no start.

    SGLang's ``HookRegistry.apply_hooks`` logs and skips a target it cannot resolve (a method
    renamed or moved in another SGLang version) and records only the targets it patched
    (``HookRegistry._patched``). A skipped hook would leave the cache running with part of its
    contract missing (e.g. no chunk clamping for exact taps, no publish before a cancel), so the
    plugin refuses to start instead, naming the target. The registry's records (``_hooks``: target
    -> hooks with their functions) say which hooks are ours; the live attribute says whether each
    took effect: every wrapper SGLang builds (``_wrap_fn``) closes over the hook and keeps the
    function it wraps in ``__wrapped__``, so walking that chain finds the hook, or finds that the
    attribute was never wrapped (or was replaced after the patch).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing: list[str] = []
    for target, hooks in list(HookRegistry._hooks.items()):
        ours = [
            hook
            for _kind, hook, _source in hooks
            if (getattr(hook, "__module__", None) or "").startswith(module_prefix)
        ]
        if not ours:
            continue
        live = _live_attribute(target)
        if live is None or not all(_carries(live, hook) for hook in ours):
            state = (
                "applied, then replaced"
                if target in HookRegistry._patched
                else "not applied: SGLang could not resolve it (see 'Failed to apply hooks')"
            )
            missing.append(f"{target} ({state})")
    if missing:
        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        raise ConfigError(
            "--radix-cache hybrid needs every hook it registers with SGLang, and these did not "
            f"take effect: {'; '.join(missing)}. The plugin is written for SGLang 0.5.23 (this "
            f"is {version}); install sglang==0.5.23"
        )


def _live_attribute(target: str) -> Any:
    """What ``target`` names now, as ``HookRegistry._apply_target`` resolves it (None if gone)."""
    obj_path, _, attr = target.rpartition(".")
    if not obj_path:
        return None
    try:
        obj = pkgutil.resolve_name(obj_path)
    except (ImportError, AttributeError, ValueError):
        return None
    raw = vars(obj).get(attr) if isinstance(obj, type) else None
    if raw is None:
        raw = getattr(obj, attr, None)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return raw


def _carries(fn: Any, hook: Any) -> bool:
    """``fn`` is ``hook`` (a REPLACE) or a chain of SGLang hook wrappers one of which calls it."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if fn is hook:
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False
