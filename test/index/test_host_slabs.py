"""HostSlabPool accounting (spec §5.4, §13.1 HostSlabPool) and configuration defaults (§14.2)."""

from __future__ import annotations

import pytest

from sglang_hybrid.index import ConfigError, HostSlabPool, resolve_config


def test_exhaustion_and_reuse() -> None:
    pool = HostSlabPool(budget_bytes=10 * 4096, slab_bytes=4096, image_bytes=3 * 4096)
    assert pool.n_slabs == 10 and pool.image_slabs == 3
    a = pool.alloc(7)
    assert a is not None and len(set(a)) == 7
    assert pool.alloc(4) is None and pool.free == 3  # nothing taken on failure
    pool.release(a[:2])
    b = pool.alloc(5)
    assert b is not None and pool.free == 0 and set(b) >= set(a[:2])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release([a[0], a[0]])


def test_image_slabs_round_up() -> None:
    pool = HostSlabPool(budget_bytes=100 * 4096, slab_bytes=4096, image_bytes=3 * 4096 + 1)
    assert pool.image_slabs == 4


def test_chunked_allocation_never_crosses_a_chunk() -> None:
    slab = 3000  # not a divisor of the chunk: the chunk's tail bytes stay unused
    pool = HostSlabPool(
        budget_bytes=25 * slab, slab_bytes=slab, image_bytes=slab, chunk_bytes=10_000
    )
    assert pool.slabs_per_chunk == 3 and pool.n_chunks == 9 and pool.chunk_slabs(8) == 1
    for s in range(pool.n_slabs):
        chunk, off = pool.address(s)
        assert off + slab <= 10_000 and chunk == s // 3
    assert pool.alloc(3) == [0, 1, 2]  # a fresh pool fills the first chunk first


def test_budget_below_one_snapshot_plus_one_block_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"--hybrid-host-cache-mib.*one snapshot \(3 slabs\)"):
        HostSlabPool(budget_bytes=3 * 4096, slab_bytes=4096, image_bytes=3 * 4096)
    HostSlabPool(budget_bytes=4 * 4096, slab_bytes=4096, image_bytes=3 * 4096)


def test_config_defaults_follow_the_host_tier() -> None:
    with_host = resolve_config(concurrency=8, chunk_tokens=8192)
    assert with_host.host_cache_bytes == 8192 << 20
    assert with_host.device_snapshot_slots == 9 and with_host.taps_per_request == 8
    assert with_host.tap_ladder_tokens == 16384 and with_host.tap_min_gap_tokens == 8192
    without = resolve_config(concurrency=8, chunk_tokens=512, host_cache_mib=0)
    assert not without.has_host and without.device_snapshot_slots == 10
    assert without.taps_per_request == 2 and without.tap_ladder_tokens == 4096
    assert without.tap_min_gap_tokens == 1024
    explicit = resolve_config(concurrency=2, chunk_tokens=512, device_snapshot_slots=7)
    assert explicit.device_snapshot_slots == 7


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"host_cache_mib": -1}, "--hybrid-host-cache-mib"),
        ({"device_snapshot_slots": 0}, "--hybrid-device-snapshot-slots"),
        ({"taps_per_request": -2}, "--hybrid-taps-per-request"),
        ({"tap_ladder_tokens": 0}, "--hybrid-tap-ladder"),
    ],
)
def test_bad_values_name_their_flag(kw: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        resolve_config(concurrency=4, chunk_tokens=512, **kw)
