"""Equal budgets: one byte budget, in the modelled geometry's bytes, mapped to each cache's pools.

The CPU replay runs SGLang's real pools with a tiny model, so their tensors are small; what must
be equal across caches is what the pools would hold on the modelled device. A budget is device
bytes for KV and recurrent states (what SGLang's memory profiler hands its pool configurator
after weights and activations) plus, optionally, host bytes.

How a device budget ``B`` becomes pools (``plan_pools``), for every cache alike:

- SGLang's own auto-fit (``KVCacheConfigurator._handle_max_mamba_cache``): the state pool gets
  ``B * r / (1 + r)`` bytes (``r = --mamba-full-memory-ratio``, default 0.9), i.e.
  ``K = floor((B * r / (1 + r) - S) / S)`` state slots of ``S`` bytes (one slot is SGLang's
  padding); the rest is KV: ``T = floor((B - (K + 1) * S) / kv_bytes_per_token)`` tokens, floored
  to 64 (a page).
- Running requests are capped as SGLang caps them (``resolve_max_num_reqs``): ``K // 3`` with
  its radix cache on (no_buffer and our backend alike: three state slots per running request),
  ``K // 4`` with ``extra_buffer`` (one tracking slot more without overlap), and at the
  requested ``max_running``.
- ``no_buffer`` / ``extra_buffer``: SGLang's tree keeps its states in the same ``K`` slots, as many
  as running requests leave free.
- ``hybrid``: the same ``K`` slots and ``T`` tokens; ``max_running`` slots serve running requests
  and the other ``K - max_running`` are our device snapshot slots (``--hybrid-device-snapshot-
  slots``), unless ``snapshot_slots`` says otherwise. Its host tier gets the host bytes.
- With host bytes ``H``, SGLang's caches get ``B + H`` on the device: the same total memory
  (SGLang's own host tier, HiCache, does not run on the CPU; see ``docs/benchmarks.md``).
- ``oracle``: the pools of ``no_buffer`` for what its running requests compute; what it caches
  costs nothing (see ``oracle_cache``).
- ``lru``: the oracle's pools, and what it caches is limited to ``B + H`` bytes of KV (states free,
  LRU: ``lru_store``); its plan's ``device_bytes`` is that total.
"""

from __future__ import annotations

from typing import NamedTuple

from sglang_hybrid.index.presets import Geometry

GIB = 1 << 30
MIB = 1 << 20
PAGE = 64
# SGLang's fallback for --mamba-full-memory-ratio (sglang/srt/arg_groups/fields/schedule.py).
DEFAULT_MAMBA_RATIO = 0.9
DEFAULT_CACHES: tuple[str, ...] = ("hybrid", "no_buffer", "extra_buffer", "oracle")
# ``lru``: the free-state LRU bound (``lru_store``), run only when asked for.
CACHES: tuple[str, ...] = (*DEFAULT_CACHES, "lru")


class PoolPlan(NamedTuple):
    cache: str
    kv_tokens: int  # max_total_tokens
    state_slots: int  # max_mamba_cache_size
    max_running: int
    snapshot_slots: int  # hybrid: device snapshot slots among state_slots; others 0
    host_bytes: int  # hybrid: host tier; others 0
    device_bytes: int  # the budget these pools stand for, in geometry bytes

    def describe(self, geometry: Geometry) -> str:
        kv = self.kv_tokens * geometry.kv_bytes_per_token / GIB
        st = self.state_slots * geometry.state_bytes / GIB
        extra = f", {self.snapshot_slots} snapshot slots" if self.cache == "hybrid" else ""
        if self.cache == "lru":
            held = self.device_bytes // geometry.kv_bytes_per_token
            extra = f"; caches {held} KV tokens, LRU, states free"
        host = f", host {self.host_bytes / GIB:.1f} GiB" if self.host_bytes else ""
        return (
            f"{self.cache}: {self.kv_tokens} KV tokens ({kv:.1f} GiB) + {self.state_slots} "
            f"state slots ({st:.1f} GiB), max running {self.max_running}{extra}{host}"
        )


def _running_ratio(cache: str) -> int:
    """State slots SGLang reserves per running request (its ``_calculate_mamba_ratio``)."""
    from sglang.srt.mem_cache.allocation_sizing import get_mamba_tracking_slots
    from sglang.srt.mem_cache.kv_cache_configurator import (
        MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO,
    )

    extra = get_mamba_tracking_slots(extra_buffer=cache == "extra_buffer", overlap=False)
    return MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO + extra


def sglang_split(budget_bytes: int, geometry: Geometry, ratio: float) -> tuple[int, int]:
    """(KV tokens, state slots) SGLang's auto-fit makes of ``budget_bytes``."""
    s = geometry.state_bytes
    slots = int((budget_bytes * ratio / (1 + ratio) - s) // s)
    kv = int((budget_bytes - (slots + 1) * s) // geometry.kv_bytes_per_token)
    return kv - kv % PAGE, max(slots, 0)


def plan_pools(
    cache: str,
    *,
    device_bytes: int,
    geometry: Geometry,
    max_running: int,
    host_bytes: int = 0,
    mamba_ratio: float = DEFAULT_MAMBA_RATIO,
    snapshot_slots: int | None = None,
) -> PoolPlan:
    """The pools of ``cache`` for a budget (see the module contract)."""
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; expected one of {', '.join(CACHES)}")
    if max_running < 1:
        raise ValueError(f"max_running must be positive, got {max_running}")
    sglang_side = cache != "hybrid"
    total = device_bytes + (host_bytes if sglang_side else 0)
    kv, slots = sglang_split(total, geometry, mamba_ratio)
    running = min(max_running, slots // _running_ratio(cache))
    if running < 1 or kv < PAGE:
        raise ValueError(
            f"a {total / GIB:.2f} GiB budget leaves {slots} state slots and {kv} KV tokens for "
            f"{geometry.name}: too small for {cache}"
        )
    if cache != "hybrid":
        return PoolPlan(cache, kv, slots, running, 0, 0, total)
    snap = slots - running if snapshot_slots is None else snapshot_slots
    if snap < 1 or running + snap > slots:
        raise ValueError(
            f"hybrid: {running} running requests + {snap} snapshot slots exceed the "
            f"{slots} state slots of the budget"
        )
    return PoolPlan(cache, kv, slots, running, snap, host_bytes, device_bytes)
