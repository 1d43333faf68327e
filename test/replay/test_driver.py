"""End to end: tiny traces through SGLang's real Scheduler, for every cache."""

import json

import pytest
from replay_fixtures import CACHES, settings

from sglang_hybrid.replay.driver import replay
from sglang_hybrid.replay.errors import ReplayError
from sglang_hybrid.replay.trace import first
from sglang_hybrid.replay.traces.mooncake import load_mooncake


@pytest.mark.parametrize("cache", CACHES)
def test_numbers_are_consistent(agent_replays, small_agent_trace, cache):
    res = agent_replays[cache]
    assert res.plan.cache == cache
    assert len(res.records) == len(small_agent_trace.requests)
    by_rid = {r.rid: r for r in small_agent_trace.requests}
    for rec in res.records:
        req = by_rid[rec.rid]
        assert rec.finish_type == "length"
        assert rec.prompt_tokens == req.n
        # Two independent sources: SGLang's reported reuse and the worker's pass counts.
        if rec.recompute_tokens == 0:
            assert rec.cached_tokens + rec.prefill_tokens == rec.prompt_tokens, rec.rid
        assert 1 <= rec.prefill_tokens <= rec.prompt_tokens  # one token is always computed
        assert rec.release_s <= rec.first_token_s <= rec.finish_s
    s = res.summary()
    assert s.finished == s.requests == len(small_agent_trace.requests)
    assert s.reused_tokens + s.prefill_tokens - s.recompute_tokens == s.prompt_tokens
    assert 0 < s.ttft_p50_s <= s.ttft_p95_s
    assert res.passes == res.extend_passes + res.decode_passes
    assert res.wall_s > 0


def test_closed_loop_releases_follow_finishes(agent_replays, small_agent_trace):
    res = agent_replays["no_buffer"]
    rec = {r.rid: r for r in res.records}
    for req in small_agent_trace.requests:
        if req.after:
            done = max(rec[a].finish_s for a in req.after)
            assert rec[req.rid].release_s == pytest.approx(done + req.delay_s)
        else:
            assert rec[req.rid].release_s == req.arrival_s


def test_the_oracle_bounds_every_cache(agent_replays):
    oracle = agent_replays["oracle"].summary()
    for cache in CACHES:
        assert oracle.prefill_tokens <= agent_replays[cache].summary().prefill_tokens, cache


def test_the_hybrid_cache_reuses_and_counts_its_snapshots(agent_replays):
    res = agent_replays["hybrid"]
    assert res.summary().reused_tokens > 0
    assert res.cache_stats["taps_published"] > 0
    assert res.cache_stats["endpoints_published"] > 0
    assert agent_replays["no_buffer"].cache_stats == {}


def test_a_mooncake_trace_end_to_end(tmp_path, qwen3_next_dir):
    rows = [
        {"timestamp": 0, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 1700, "output_length": 3, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 20, "input_length": 1300, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 20, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]},
    ]
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_mooncake(p)
    cfg = settings(qwen3_next_dir)
    out = {c: replay(trace, c, cfg).summary() for c in ("no_buffer", "oracle", "lru")}
    # The oracle resumes the 2nd and 3rd requests after the shared full blocks (1024 tokens);
    # so does the LRU bound, whose budget holds the whole trace.
    assert out["oracle"].reused_tokens == out["lru"].reused_tokens == 2 * 1024
    assert out["no_buffer"].reused_tokens <= out["oracle"].reused_tokens
    for s in out.values():
        assert s.prompt_tokens == 1300 + 1700 + 1300 + 600


def test_the_replay_is_deterministic(small_agent_trace, qwen3_next_dir):
    part = first(small_agent_trace, 30)
    runs = [replay(part, "hybrid", settings(qwen3_next_dir)) for _ in range(2)]
    a, b = ([(r.prefill_tokens, r.first_token_s, r.finish_s) for r in x.records] for x in runs)
    assert a == b and len(a) == 30


def test_a_budget_too_small_for_a_request_is_refused(small_agent_trace, qwen3_next_dir):
    with pytest.raises((ReplayError, ValueError), match=r"budget|too small"):
        replay(small_agent_trace, "no_buffer", settings(qwen3_next_dir, device_bytes=1 << 28))


def test_the_hybrid_host_tier_restores_in_modelled_bytes(small_agent_trace, qwen3_next_dir):
    # A device too small for the working set (3 state slots, one running request): the host tier
    # must carry it. SGLang's caches would get the host bytes on the device instead.
    cfg = settings(qwen3_next_dir, device_bytes=int(1.5 * (1 << 30)), host_bytes=8 << 30)
    res = replay(first(small_agent_trace, 50), "hybrid", cfg)
    assert res.plan.host_bytes == 8 << 30 and res.notes == []
    s = res.summary()
    assert s.host_bytes_restored > 0
    # Restores move whole 64-token blocks and state images of the 27B geometry.
    g_block = 64 * 16 * 4 * 256 * 2 * 2
    assert s.host_bytes_restored >= g_block
    for rec in res.records:
        if rec.recompute_tokens == 0:
            assert rec.cached_tokens + rec.prefill_tokens == rec.prompt_tokens


def test_the_host_tier_charges_images_at_the_modelled_size(
    small_agent_trace, qwen3_next_dir, monkeypatch
):
    """A 27B state image takes 37 host slabs of 64 KV tokens, an 80B's 50: the replay's host
    tier charges the tiny model's images as many of its slabs (a tiny image fills 3)."""
    from sglang_hybrid.index.presets import GEOMETRIES
    from sglang_hybrid.replay import driver
    from sglang_hybrid.replay.caches import image_charge_bytes, tiny_kv_bytes_per_token

    tiny = tiny_kv_bytes_per_token(qwen3_next_dir)
    slab = -(-64 * tiny // 4096) * 4096
    assert image_charge_bytes(GEOMETRIES["qwen3.5-27b"], tiny) == 37 * slab
    assert image_charge_bytes(GEOMETRIES["qwen3-next-80b"], tiny) == 50 * slab
    seen = []
    collect = driver._Run._collect

    def spy(run):
        seen.append(run.sched.tree_cache.index.host.image_slabs)
        seen.append(run.sched.tree_cache.layout.image_slabs)
        collect(run)

    monkeypatch.setattr(driver._Run, "_collect", spy)
    cfg = settings(qwen3_next_dir, device_bytes=int(1.5 * (1 << 30)), host_bytes=8 << 30)
    res = replay(first(small_agent_trace, 10), "hybrid", cfg)
    assert seen == [37, 3] and res.summary().finished == 10


def test_overlap_scheduling_replays_the_same_requests(small_agent_trace, qwen3_next_dir):
    """``--overlap``: SGLang's overlap loop for hybrid (and extra_buffer); every request finishes,
    outputs follow their scripts (the driver checks), and the reuse stays what it is without."""
    part = first(small_agent_trace, 40)
    normal = replay(part, "hybrid", settings(qwen3_next_dir))
    overlap = replay(part, "hybrid", settings(qwen3_next_dir, overlap=True))
    assert all(r.finish_s is not None for r in overlap.records) and overlap.notes == []
    a, b = normal.summary(), overlap.summary()
    print(f"\nreused: normal {a.reused_tokens}, overlap {b.reused_tokens}")
    assert b.reused_tokens >= 0.9 * a.reused_tokens
