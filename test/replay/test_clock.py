import pytest

from sglang_hybrid.cpu.token_worker import BatchWork
from sglang_hybrid.index.presets import COSTS, GEOMETRIES
from sglang_hybrid.replay.clock import DECODE_COSTS, BatchClock


@pytest.mark.parametrize("key", sorted(COSTS))
def test_every_preset_pair_has_a_clock(key):
    assert key in DECODE_COSTS
    BatchClock(*key)


def test_prefill_pass_prices_tokens_and_pairs():
    c = COSTS[("h200", "qwen3.5-27b")]
    clock = BatchClock("h200", "qwen3.5-27b")
    w = BatchWork("EXTEND", 2, 3000, 5_000_000, 0, 0)
    assert clock.pass_seconds(w) == pytest.approx(c.chunk_s + 3000 * c.token_s + 5e6 * c.pair_s)
    more = BatchWork("EXTEND", 2, 3000, 9_000_000, 0, 0)
    assert clock.pass_seconds(more) > clock.pass_seconds(w)


def test_decode_pass_prices_steps_requests_and_kv_reads():
    d = DECODE_COSTS[("rtx5090", "qwen3-next-80b")]
    g = GEOMETRIES["qwen3-next-80b"]
    clock = BatchClock("rtx5090", "qwen3-next-80b")
    w = BatchWork("DECODE", 4, 0, 40_000, 4, 0)
    expect = d.step_s + 4 * d.per_req_s + 40_000 * g.kv_bytes_per_token / d.hbm_bytes_per_s
    assert clock.pass_seconds(w) == pytest.approx(expect)


def test_restores_add_transfer_time_and_empty_passes_cost_nothing():
    c = COSTS[("h200", "qwen3.5-27b")]
    clock = BatchClock("h200", "qwen3.5-27b")
    w = BatchWork("EXTEND", 1, 100, 5050, 0, 0)
    extra = clock.pass_seconds(w, h2d_bytes=10**9) - clock.pass_seconds(w)
    assert extra == pytest.approx(1e9 / c.h2d_bytes_per_s + c.batch_s)
    assert clock.pass_seconds(BatchWork("IDLE", 0, 0, 0, 0, 0)) == 0.0
