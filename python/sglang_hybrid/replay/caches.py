"""The compared configurations, as SGLang Scheduler settings on the CPU.

========================  ==================================================================
cache                     what runs
========================  ==================================================================
``hybrid``                our backend (``--radix-cache hybrid``) at page size 1 by default,
                          host tier off unless host bytes are given (``host_cache_mib``).
                          Page 1 is no_buffer's: the same allocator and rounding, and SGLang's
                          paged allocator has only a torch fallback on the CPU
                          (``alloc_extend_naive``, ~30 ms per prefill pass, over half of a
                          Mooncake replay at page 64). The backend keys 64-token blocks at any
                          page size dividing 64; ``page_size`` overrides it.
``no_buffer``             SGLang's built-in ``UnifiedRadixCache`` with
                          ``--mamba-radix-cache-strategy no_buffer`` at page size 1, the only
                          page size it accepts (what a default SGLang server runs)
``extra_buffer``          SGLang's built-in cache with ``extra_buffer`` at page size 64, run for
                          real: SGLang refuses it on non-GPU platforms only through a platform
                          gate, which a HookRegistry REPLACE opens, and it pins one CPU mask per
                          batch, which ``Tensor.pin_memory`` made the identity does on a machine
                          without CUDA (the recipe of ``sglang-cpu-scheduler.md``); nothing is
                          emulated, so its numbers are SGLang's own placement
``oracle``                ``oracle_cache.OracleCache`` (``replay_oracle``): infinite memory
``lru``                   the same backend with ``lru_store``: the free-state LRU bound, KV of
                          the whole budget (device + host), states free
========================  ==================================================================

Contract: ``scheduler_kwargs(plan, chunk=..., max_prefill_tokens=..., context_length=..., **tap
options)`` returns the ``InProcessScheduler`` keyword arguments of a ``PoolPlan`` (the tap
options are the hybrid backend's ``--hybrid-*`` flags, None keeping its defaults; ``page_size``
replaces the table's; ``host_mib`` sizes the hybrid host tier, 0 turning it off; ``l3_url`` gives
it an L3, ``l3_model.py``).
``cache_environment(cache)`` is the context in which that scheduler must be built and run
(plugin and oracle registered, the two CPU patches of ``extra_buffer`` in place;
``pin_memory`` is restored on exit).
``host_cache_mib`` turns a modelled host budget into the CPU host tier's size and
``host_bytes_restored`` reads back what it restored, in modelled bytes (see each).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sglang_hybrid.index.cost import CostModel
from sglang_hybrid.index.presets import Geometry

from .budget import PoolPlan

if TYPE_CHECKING:
    from sglang_hybrid.sglang.flags import TailTap, TapMode

BLOCK = 64

PAGE_SIZE = {"hybrid": 1, "no_buffer": 1, "extra_buffer": 64, "oracle": 1, "lru": 1}
_GATE = "sglang.srt.arg_groups.mamba_hook._platform_supports_mamba_cache_extra_buffer"
_LONG_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def _open_gate(*args: Any, **kwargs: Any) -> bool:
    """SGLang's extra_buffer platform gate, answered yes on the CPU (see the module table)."""
    return True


def register_backends() -> None:
    """Our plugin and the oracle backend, in this process (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.sglang import plugin

    from .oracle_cache import register_oracle

    plugin.register()
    register_oracle()
    HookRegistry.apply_hooks()


def _open_extra_buffer_gate() -> None:
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if mamba_hook._platform_supports_mamba_cache_extra_buffer():
        return
    HookRegistry.register(_GATE, _open_gate, HookType.REPLACE)
    HookRegistry.apply_hooks()
    if not mamba_hook._platform_supports_mamba_cache_extra_buffer():
        raise RuntimeError(f"could not open SGLang's extra_buffer platform gate ({_GATE})")


@contextmanager
def cache_environment(cache: str) -> Iterator[None]:
    import torch

    register_backends()
    # The tiny model declares 8192 positions; replayed prompts are longer and never computed.
    old_env = os.environ.get(_LONG_CONTEXT_ENV)
    os.environ[_LONG_CONTEXT_ENV] = "1"
    pin = torch.Tensor.pin_memory
    try:
        if cache == "extra_buffer":
            _open_extra_buffer_gate()
            if not torch.cuda.is_available():
                torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]  # patched, restored below
        yield
    finally:
        torch.Tensor.pin_memory = pin  # type: ignore[method-assign]  # the restore
        if old_env is None:
            os.environ.pop(_LONG_CONTEXT_ENV, None)
        else:
            os.environ[_LONG_CONTEXT_ENV] = old_env


# The caches that run SGLang's overlap loop when a replay asks for it (``--overlap``): SGLang's
# no_buffer strategy refuses overlap scheduling ("no_buffer do not support overlap schedule"), so
# it always runs without.
OVERLAP_CACHES = ("hybrid", "extra_buffer", "oracle", "lru")


def scheduler_kwargs(
    plan: PoolPlan,
    *,
    chunk: int,
    max_prefill_tokens: int,
    context_length: int,
    tail_tap: TailTap = "exact",
    coalesce: bool = True,
    tap_mode: TapMode = "split",
    split_threshold: float = 1.0,
    host_order: str = "duel",
    host_exclusive: bool | None = None,
    split_cost: CostModel | None = None,
    taps_per_request: int | None = None,
    tap_ladder: int | None = None,
    tap_min_gap: int | None = None,
    page_size: int | None = None,
    host_mib: int = 0,
    overlap: bool = False,
    l3_url: str | None = None,
    image_charge_bytes: int | None = None,
) -> dict[str, Any]:
    """``InProcessScheduler`` keyword arguments for ``plan`` (see the module contract)."""
    from sglang_hybrid.sglang.flags import HybridOptions

    kw: dict[str, Any] = {
        "page_size": page_size or PAGE_SIZE[plan.cache],
        "chunked_prefill_size": chunk,
        "max_prefill_tokens": max_prefill_tokens,
        "max_total_tokens": plan.kv_tokens,
        "max_running_requests": plan.max_running,
        "max_mamba_cache_size": plan.state_slots,
        "context_length": context_length,
    }
    if overlap and plan.cache in OVERLAP_CACHES:
        kw["disable_overlap_schedule"] = False
    if plan.cache == "hybrid":
        kw["radix_cache_backend"] = "hybrid"
        opts = HybridOptions(
            host_cache_mib=host_mib,
            device_snapshot_slots=plan.snapshot_slots,
            tail_tap=tail_tap,
            coalesce=coalesce,
            tap_mode=tap_mode,
            split_threshold=split_threshold,
            host_order=host_order,
            host_exclusive=host_exclusive,
            split_cost=split_cost,
            taps_per_request=taps_per_request,
            tap_ladder=tap_ladder,
            tap_min_gap=tap_min_gap,
            # The replay counts prefill in modelled time: copies on the scheduler thread keep
            # its admissions independent of a copy thread's timing (reproducible figures).
            host_copy="inline",
            l3=l3_url,  # the replay's modelled L3 (``l3_model.py``), None: none
            image_charge_bytes=image_charge_bytes,  # ``image_charge_bytes`` below
        )
        kw["server_args_attrs"] = {"_hybrid_options": opts}
    elif plan.cache == "extra_buffer":
        kw["mamba_radix_cache_strategy"] = "extra_buffer"
    elif plan.cache in ("oracle", "lru"):
        kw["radix_cache_backend"] = "replay_oracle"
    return kw


def tiny_kv_bytes_per_token(model_dir: str | os.PathLike[str]) -> int:
    """K + V bytes per token of the tiny model the CPU pools hold (float32, from config.json)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    return layers * int(cfg["num_key_value_heads"]) * int(cfg["head_dim"]) * 2 * 4


def host_cache_mib(host_bytes: int, geometry: Geometry, tiny_token_bytes: int) -> int:
    """The CPU host tier that holds as many 64-token KV blocks as ``host_bytes`` of the geometry.

    The backend sizes its slabs from the pools it runs on (the tiny model's); scaling the budget
    by the block ratio keeps the number of KV blocks the host holds. Images are charged at the
    geometry's size (``image_charge_bytes``), so the host holds as many images as it would too.
    """
    if host_bytes <= 0:
        return 0
    blocks = host_bytes // (BLOCK * geometry.kv_bytes_per_token)
    return max(1, (blocks * _tiny_slab(tiny_token_bytes)) >> 20)


def image_charge_bytes(geometry: Geometry, tiny_token_bytes: int) -> int:
    """The tiny slabs' bytes a state image of ``geometry`` spans, as KV blocks do the same ratio.

    A tiny model's image takes about 3 of its host slabs, a 27B's 37 and an 80B's 50 of theirs:
    charged its own bytes, an image cost the replay's host tier a twelfth of what it costs on a
    GPU server, and host-tier figures (chat, Mooncake) kept states a server could not (before
    issue #37's review they did). The index charges this many bytes per image instead (host
    slabs, GDSF's size, admission); the copies still move the tiny image's bytes.
    """
    blocks = -(-geometry.state_bytes // (BLOCK * geometry.kv_bytes_per_token))
    return blocks * _tiny_slab(tiny_token_bytes)


def _tiny_slab(tiny_token_bytes: int) -> int:
    """A tiny model's host slab: one block bundle, rounded to 4 KiB as the host layout does."""
    return -(-BLOCK * tiny_token_bytes // 4096) * 4096


def host_bytes_restored(tree_cache: Any, geometry: Geometry) -> int:
    """Host-to-device bytes the cache restored so far, in the modelled geometry's bytes.

    Reads the hybrid backend's host tier (``tree_cache.host_tier``: ``restored_bytes``,
    ``restored_blocks``; ``block_bytes`` / ``image_bytes`` of its CPU layout): blocks convert by
    the KV block size, the rest (state images, and the small snapshot tails) by the image size.
    0 for caches without a host tier.
    """
    host = getattr(tree_cache, "host_tier", None)
    if host is None:
        return 0
    moved = int(getattr(host, "restored_bytes", 0))
    blocks = int(getattr(host, "restored_blocks", 0))
    block_cpu = int(getattr(tree_cache, "block_bytes", 0))
    image_cpu = int(getattr(tree_cache, "image_bytes", 0))
    if not moved or not block_cpu or not image_cpu:
        return 0
    images = max(0, moved - blocks * block_cpu) / image_cpu
    return int(blocks * BLOCK * geometry.kv_bytes_per_token + images * geometry.state_bytes)
