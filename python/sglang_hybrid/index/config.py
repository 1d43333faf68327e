"""Configuration and its defaults (spec §14.2): the host budget is the only capacity to choose.

Every other value derives from the concurrency C, the prefill chunk and whether a host tier exists:

=================  ==========================  ==================================================
value              default                     reason
=================  ==========================  ==================================================
host budget        8 GiB; 0 = device only      the one capacity a deployment picks
snapshot slots     C + 1 (host) / C + 2        one resident snapshot per live conversation plus
                                               staging; without a host the slots are all there is
taps per request   8 (host) / 2                without a host, taps would evict other lineages
tap ladder G       max(4096, 2 * chunk)        ladder taps land on chunk boundaries anyway
tap min gap        max(1024, chunk)            the same
demote reserve     2 * (chunk + 64 * C)        a pass's evictions, twice: the least the device
                                               LRU keeps backed ahead of eviction (``demotion``)
=================  ==========================  ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from .hit_density import HOST_ORDERS
from .host_slabs import ConfigError
from .keys import BLOCK_TOKENS

DEFAULT_HOST_CACHE_MIB = 8192
DEFAULT_HOST_EXCLUSIVE = False  # ``demotion``

FLAG_HOST = "--hybrid-host-cache-mib"
FLAG_SLOTS = "--hybrid-device-snapshot-slots"
FLAG_TAPS = "--hybrid-taps-per-request"
FLAG_LADDER = "--hybrid-tap-ladder"
FLAG_MIN_GAP = "--hybrid-tap-min-gap"
FLAG_HOST_ORDER = "--hybrid-host-order"
FLAG_HOST_EXCLUSIVE = "--hybrid-host-exclusive"
HOST_ORDER_CHOICES = tuple(HOST_ORDERS)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    host_cache_bytes: int
    device_snapshot_slots: int
    taps_per_request: int
    tap_ladder_tokens: int
    tap_min_gap_tokens: int
    chunk_tokens: int
    concurrency: int
    host_order: str = "duel"  # the host's victim order once learned (``hit_density``)
    host_exclusive: bool = False  # each block on one tier (``demotion``)

    @property
    def has_host(self) -> bool:
        return self.host_cache_bytes > 0

    @property
    def demote_reserve_tokens(self) -> int:
        """The least device tokens an exclusive host keeps backed at the LRU's evicting end
        (``demotion.Reserve`` follows the evictions seen): a pass's prefill evicts at most a
        chunk and a page per running request; twice that, so that the demotions issued after
        one pass have landed before the next pass's evictions need them. 0 without an
        exclusive host."""
        if not (self.host_exclusive and self.has_host):
            return 0
        return 2 * (self.chunk_tokens + BLOCK_TOKENS * self.concurrency)

    def describe(self) -> str:
        host = f"{self.host_cache_bytes / 2**20:.0f} MiB" if self.has_host else "off"
        return (
            f"host tier {host}, {self.device_snapshot_slots} device snapshot slots, "
            f"{self.taps_per_request} taps/request, ladder {self.tap_ladder_tokens}, "
            f"min gap {self.tap_min_gap_tokens} (concurrency {self.concurrency}, "
            f"chunk {self.chunk_tokens})"
            + (f", host order {self.host_order}" if self.host_order != "duel" else "")
            + (", exclusive host" if self.host_exclusive and self.has_host else "")
        )


def _positive(value: int | None, flag: str, *, allow_zero: bool = False) -> int | None:
    if value is None:
        return None
    if value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"{flag} must be {bound}, got {value}")
    return value


def resolve_config(
    *,
    concurrency: int,
    chunk_tokens: int,
    host_cache_mib: int | None = None,
    device_snapshot_slots: int | None = None,
    taps_per_request: int | None = None,
    tap_ladder_tokens: int | None = None,
    tap_min_gap_tokens: int | None = None,
    host_order: str = "duel",
    host_exclusive: bool | None = None,
) -> CacheConfig:
    if concurrency <= 0:
        raise ConfigError(f"concurrency must be positive, got {concurrency}")
    if chunk_tokens <= 0:
        raise ConfigError(f"prefill chunk must be positive, got {chunk_tokens}")
    mib = _positive(host_cache_mib, FLAG_HOST, allow_zero=True)
    host_bytes = (DEFAULT_HOST_CACHE_MIB if mib is None else mib) << 20
    has_host = host_bytes > 0
    slots = _positive(device_snapshot_slots, FLAG_SLOTS)
    taps = _positive(taps_per_request, FLAG_TAPS, allow_zero=True)
    ladder = _positive(tap_ladder_tokens, FLAG_LADDER)
    gap = _positive(tap_min_gap_tokens, FLAG_MIN_GAP, allow_zero=True)
    if host_order not in HOST_ORDER_CHOICES:
        raise ConfigError(
            f"{FLAG_HOST_ORDER} {host_order!r}: give one of {', '.join(HOST_ORDER_CHOICES)}"
        )
    return CacheConfig(
        host_cache_bytes=host_bytes,
        device_snapshot_slots=slots if slots is not None else concurrency + (1 if has_host else 2),
        taps_per_request=taps if taps is not None else (8 if has_host else 2),
        tap_ladder_tokens=ladder if ladder is not None else max(4096, 2 * chunk_tokens),
        tap_min_gap_tokens=gap if gap is not None else max(1024, chunk_tokens),
        chunk_tokens=chunk_tokens,
        concurrency=concurrency,
        host_order=host_order,
        host_exclusive=has_host
        and (DEFAULT_HOST_EXCLUSIVE if host_exclusive is None else host_exclusive),
    )
