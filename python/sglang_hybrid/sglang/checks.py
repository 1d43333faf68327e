"""Configurations the ``hybrid`` backend cannot honour, refused at startup with the fix.

Two moments: :func:`check_server_args` runs in the launching process right after SGLang resolves
its arguments (a bad flag fails before any process is spawned), and :func:`check_pools` runs when
the scheduler builds the cache and the pools exist. Each message names the flag and the fix.
"""

from __future__ import annotations

from typing import Any

from ..index import ConfigError
from ..index.config import FLAG_SLOTS

BLOCK = 64


def _get(view: Any, name: str, default: Any = None) -> Any:
    return getattr(view, name, default)


def check_server_args(view: Any, *, resolved: bool = True) -> None:
    """Flag combinations the cache cannot serve.

    ``resolved=False`` checks only explicit flags (raw ServerArgs before SGLang's resolution);
    values SGLang derives (overlap scheduling) are checked once resolved.
    """
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
    strategy = _get(view, "mamba_radix_cache_strategy")
    if strategy in ("extra_buffer", "extra_buffer_lazy"):
        raise ConfigError(
            f"--mamba-radix-cache-strategy {strategy}: --radix-cache hybrid takes its own "
            f"snapshots; use --mamba-radix-cache-strategy no_buffer"
        )
    if resolved and not _get(view, "disable_overlap_schedule", True):
        # The cache copies a lane's live state at chunk ends, which overlap would race.
        raise ConfigError(
            "overlap scheduling is on: --radix-cache hybrid copies live states at chunk "
            "boundaries; pass --disable-overlap-schedule"
        )
    algo = _get(view, "speculative_algorithm")
    if algo not in (None, "", "NONE"):
        raise ConfigError(
            f"--speculative-algorithm {algo}: not supported with --radix-cache hybrid yet "
            f"(committed frontiers would lag the snapshots); drop it"
        )
    if (_get(view, "pp_size") or 1) > 1:
        raise ConfigError("--pp-size > 1: not supported with --radix-cache hybrid")


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
