"""The replay's L3 (``replay/l3_model.py``): ``hybrid`` with a store behind its host tier, the real
L3 path (write-through, lookup, verified fetch, host restore) on SGLang's Scheduler, its transfers
timed on a modelled link."""

from __future__ import annotations

import json

import pytest
from replay_fixtures import settings

from sglang_hybrid.replay.driver import replay
from sglang_hybrid.replay.errors import ReplayError
from sglang_hybrid.replay.traces.mooncake import load_mooncake

GIB = 1 << 30


@pytest.fixture(scope="module")
def evicted_prefix_trace(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A 1,536-token prompt, 30 unrelated ones each sent twice (46k tokens: more than the device
    and the host hold), then a prompt continuing the first: only a store behind the host still
    has it. Twice, so that they are used more often than the first one: the tiers' scan
    resistance (``index/newcomers.py``) keeps a resident against newcomers used no more often."""
    rows = [{"timestamp": 0, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2, 3]}]
    for i in range(30):
        ids = [100 + 3 * i, 101 + 3 * i, 102 + 3 * i]
        for t in (0, 250):
            rows.append(
                {
                    "timestamp": 1000 + 500 * i + t,
                    "input_length": 1536,
                    "output_length": 2,
                    "hash_ids": ids,
                }
            )
    rows.append(
        {"timestamp": 20_000, "input_length": 2000, "output_length": 2, "hash_ids": [1, 2, 3, 4]}
    )
    p = tmp_path_factory.mktemp("l3") / "mc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_mooncake(p)


@pytest.fixture(scope="module")
def l3_runs(evicted_prefix_trace, qwen3_next_dir):  # type: ignore[no-untyped-def]
    cfg = settings(qwen3_next_dir, device_bytes=4 * GIB, host_bytes=1 * GIB, l3_bytes=64 * GIB)
    return {
        c: replay(evicted_prefix_trace, c, cfg)
        for c in ("hybrid", "hybrid+l3-tcp", "hybrid+l3-rdma")
    }


def test_a_state_gone_from_device_and_host_comes_back_from_l3(l3_runs):  # type: ignore[no-untyped-def]
    last = {c: r.records[-1] for c, r in l3_runs.items()}
    assert last["hybrid"].cached_tokens < 1024  # evicted from both tiers
    for c in ("hybrid+l3-tcp", "hybrid+l3-rdma"):
        st, l3 = l3_runs[c].cache_stats, l3_runs[c].l3
        assert last[c].cached_tokens >= 1024, (c, last[c], st)
        assert st["l3_fetches_landed"] >= 1 and st["l3_fetched_tokens"] > 0, st
        assert l3["read_bytes"] > 0 and l3["write_bytes"] > 0 and l3["store_evicted"] == 0, l3
        # what is counted reused was either fetched or computed, never both or neither
        for rec in l3_runs[c].records:
            assert rec.cached_tokens + rec.prefill_tokens == rec.prompt_tokens, rec


def test_the_fetch_takes_the_links_time(l3_runs):  # type: ignore[no-untyped-def]
    """The same hit waits longer for its fetch over TCP than over RDMA (4.6x the bytes' time)."""
    tcp, rdma = (l3_runs[c].records[-1] for c in ("hybrid+l3-tcp", "hybrid+l3-rdma"))
    assert tcp.cached_tokens == rdma.cached_tokens
    assert tcp.ttft_s is not None and rdma.ttft_s is not None
    assert tcp.ttft_s > rdma.ttft_s
    x = l3_runs["hybrid+l3-tcp"].l3
    assert x["read_s"] > x["read_bytes"] / x["link_bytes_per_s"] > 0  # bytes plus round trips


def test_writing_at_host_eviction_would_write_less(l3_runs):  # type: ignore[no-untyped-def]
    x = l3_runs["hybrid+l3-tcp"].l3
    assert 0 < x["eviction_write_bytes"] < x["write_bytes"]  # the last prompts stay on the host


def test_an_l3_cache_needs_a_store_size(evicted_prefix_trace, qwen3_next_dir):  # type: ignore[no-untyped-def]
    cfg = settings(qwen3_next_dir, host_bytes=1 * GIB)
    with pytest.raises(ReplayError, match="--l3-gib"):
        replay(evicted_prefix_trace, "hybrid+l3-tcp", cfg)
