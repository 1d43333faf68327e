import pytest

from sglang_hybrid.index.presets import GEOMETRIES
from sglang_hybrid.replay.budget import CACHES, GIB, plan_pools

G27 = GEOMETRIES["qwen3.5-27b"]


@pytest.mark.parametrize("gib", [4, 32, 100])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_every_cache_gets_the_same_pools_within_the_budget(gib, geometry):
    g = GEOMETRIES[geometry]
    plans = {c: plan_pools(c, device_bytes=gib * GIB, geometry=g, max_running=16) for c in CACHES}
    kv = {p.kv_tokens for p in plans.values()}
    slots = {p.state_slots for p in plans.values()}
    assert len(kv) == 1 and len(slots) == 1
    p = plans["no_buffer"]
    used = p.kv_tokens * g.kv_bytes_per_token + (p.state_slots + 1) * g.state_bytes
    assert used <= gib * GIB  # SGLang's padding slot included
    # What is left is less than one page of KV: the budget is spent.
    assert gib * GIB - used < 64 * g.kv_bytes_per_token + g.state_bytes
    assert p.kv_tokens % 64 == 0
    # SGLang's split: r / (1 + r) of the budget to states, r = 0.9 (hand-computed bound).
    assert abs(p.state_slots * g.state_bytes - gib * GIB * 0.9 / 1.9) <= 2 * g.state_bytes


def test_running_caps_and_snapshot_slots():
    b = 32 * GIB
    nb = plan_pools("no_buffer", device_bytes=b, geometry=G27, max_running=1000)
    eb = plan_pools("extra_buffer", device_bytes=b, geometry=G27, max_running=1000)
    hy = plan_pools("hybrid", device_bytes=b, geometry=G27, max_running=1000)
    assert nb.max_running == nb.state_slots // 3  # three state slots per running request
    assert eb.max_running == eb.state_slots // 4  # one tracking slot more
    assert hy.max_running == nb.max_running
    assert hy.snapshot_slots == hy.state_slots - hy.max_running
    small = plan_pools("hybrid", device_bytes=b, geometry=G27, max_running=4, snapshot_slots=6)
    assert (small.max_running, small.snapshot_slots) == (4, 6)
    with pytest.raises(ValueError, match="exceed"):
        plan_pools("hybrid", device_bytes=b, geometry=G27, max_running=4, snapshot_slots=10**6)


def test_host_bytes_go_to_hybrid_host_and_to_sglang_device():
    dev, host = 16 * GIB, 48 * GIB
    hy = plan_pools("hybrid", device_bytes=dev, host_bytes=host, geometry=G27, max_running=8)
    nb = plan_pools("no_buffer", device_bytes=dev, host_bytes=host, geometry=G27, max_running=8)
    same = plan_pools("no_buffer", device_bytes=dev + host, geometry=G27, max_running=8)
    assert hy.host_bytes == host and hy.device_bytes == dev
    assert nb == same._replace(cache="no_buffer")
    assert nb.kv_tokens > hy.kv_tokens


def test_too_small_a_budget_is_refused():
    with pytest.raises(ValueError, match="too small"):
        plan_pools("no_buffer", device_bytes=GIB // 2, geometry=G27, max_running=4)
    with pytest.raises(ValueError, match="unknown cache"):
        plan_pools("fifo", device_bytes=GIB, geometry=G27, max_running=4)
