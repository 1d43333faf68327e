"""The token worker in SGLang's real Scheduler: scheduling, caching, work counts, idle checks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

CHUNK = 64


def _prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(16, 2048) for _ in range(200)]
    return {
        "long": base + [rng.randrange(16, 2048) for _ in range(37)],  # 4 chunks
        "shares_150": base[:150] + [rng.randrange(16, 2048) for _ in range(25)],
        "short": [rng.randrange(16, 2048) for _ in range(10)],
        "exact_chunk": base[:128],
    }


def _positions_computed(prompt: int, cached: int, max_new: int) -> range:
    """Positions a model computes: the uncached prompt tail, then max_new - 1 decode steps."""
    return range(cached, prompt + max_new - 1)


@pytest.mark.parametrize("page_size", [1, 64])
def test_requests_run_through_the_real_scheduler(make_scheduler, qwen35_dir: Path, page_size):
    overrides = {"page_size": page_size, "chunked_prefill_size": CHUNK}
    if page_size != 1:
        # SGLang's built-in hybrid cache (no_buffer) only supports page 1 on this platform.
        overrides["disable_radix_cache"] = True
    sched = make_scheduler(qwen35_dir, worker="tokens", **overrides)
    worker = sched.worker
    worker.keep_history = True
    prompts = _prompts(page_size)
    max_new = {"long": 5, "shares_150": 3, "short": 7, "exact_chunk": 4}
    # One request first, so the others can hit what it leaves in the tree.
    sched.submit("long", prompts["long"], max_new["long"])
    sched.run_until_idle()
    for rid in ("shares_150", "short", "exact_chunk"):
        sched.submit(rid, prompts[rid], max_new[rid])
    sched.run_until_idle()
    sched.on_idle()  # SGLang's pool-leak and tree invariant checks (raise on violation)

    results = sched.results()
    assert set(results) == set(prompts)
    for rid, ids in prompts.items():
        r = results[rid]
        assert r.finish_type == "length", rid
        assert r.prompt_tokens == len(ids)
        assert len(r.output_ids) == max_new[rid]
        assert 0 <= r.cached_tokens < len(ids)
        # The tokens depend on (rid, position) only, never on caching or batching.
        from sglang_hybrid.cpu.token_worker import deterministic_token

        eos = frozenset(sched.scheduler.model_config.hf_eos_token_id or ())
        expected = [deterministic_token(rid, len(ids) + i, 2048, eos) for i in range(max_new[rid])]
        assert r.output_ids == expected
    if page_size == 1:
        assert results["shares_150"].cached_tokens > 0  # the built-in cache did hit
    else:
        assert all(r.cached_tokens == 0 for r in results.values())

    # Chunked prefill happened: no extend pass is longer than the chunk budget.
    assert max(w.extend_tokens for w in worker.history) <= CHUNK
    assert sum(w.extend_tokens > 0 for w in worker.history) > len(prompts)

    # Work counts, from the per-request results alone: every computed position p costs p + 1
    # attention pairs (its own key and every earlier one), extend tokens are the uncached prompt
    # tails, decode steps are max_new - 1 per request.
    totals = worker.totals
    expect_extend = sum(r.prompt_tokens - r.cached_tokens for r in results.values())
    expect_decode = sum(max_new[rid] - 1 for rid in results)
    expect_pairs = sum(
        sum(p + 1 for p in _positions_computed(r.prompt_tokens, r.cached_tokens, max_new[rid]))
        for rid, r in results.items()
    )
    assert totals.extend_tokens == expect_extend
    assert totals.decode_reqs == expect_decode
    assert totals.attention_pairs == expect_pairs
    assert totals.batches == len(worker.history)


def test_idle_invariant_check_catches_a_leaked_kv_slot(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(qwen35_dir, worker="tokens")
    sched.submit("a", list(range(16, 100)), 3)
    sched.run_until_idle()
    sched.on_idle()
    leaked = sched.scheduler.token_to_kv_pool_allocator.alloc(5)
    assert leaked is not None
    with pytest.raises(ValueError, match="leak"):
        sched.on_idle()
    sched.scheduler.token_to_kv_pool_allocator.free(leaked)
    sched.on_idle()


def test_token_worker_honours_the_tap_protocol(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(qwen35_dir, worker="tokens", chunked_prefill_size=CHUNK)
    # 150 tokens: extends [0, 64), [64, 128), [128, 150). Taps at 64 and 128 are chunk ends
    # (not strictly inside an extend) and 0 / 150 are outside the prompt: left alone.
    taps = [(100, 3), (64, 4), (10, 5), (150, 6), (0, 7), (128, 8), (140, 9)]
    req = sched.submit("t", list(range(16, 166)), 2, hybrid_state_taps=list(taps))
    sched.run_until_idle()
    assert sorted(req.hybrid_state_taps_done) == [10, 100, 140]
    assert req.hybrid_state_taps == taps  # the request's list is not modified
    assert sched.worker.totals.taps_done == 3


def test_request_without_taps_gets_no_done_list(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(qwen35_dir, worker="tokens")
    req = sched.submit("plain", list(range(16, 80)), 2)
    sched.run_until_idle()
    assert not hasattr(req, "hybrid_state_taps_done")


def test_abort_finishes_a_waiting_request(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(qwen35_dir, worker="tokens")
    sched.submit("gone", list(range(16, 300)), 4)
    sched.abort("gone")
    sched.run_until_idle()
    sched.on_idle()
    assert sched.results()["gone"].finish_type == "abort"


def test_a_registered_radix_cache_backend_runs_in_the_loop(make_scheduler, qwen35_dir: Path):
    from sglang.srt.mem_cache.registry import (
        create_unified_radix_cache,
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class ProbeCache(UnifiedRadixCache):
        matches = 0

        def match_prefix(self, params):
            ProbeCache.matches += 1
            return super().match_prefix(params)

    built = []

    def factory(ctx):
        built.append(ctx)
        return create_unified_radix_cache(ctx, cache_class=ProbeCache)

    name = "sglang_hybrid_cpu_test_probe"
    if get_radix_cache_factory(name) is None:  # the registry is process-wide
        register_radix_cache_backend(name, lambda ctx: _current_factory[0](ctx))
    _current_factory[:] = [factory]
    sched = make_scheduler(qwen35_dir, worker="tokens", radix_cache_backend=name)
    assert isinstance(sched.tree_cache, ProbeCache)
    assert built and built[0].tp_worker is sched.worker
    sched.submit("x", list(range(16, 150)), 3)
    sched.submit("y", list(range(16, 120)) + [7, 8, 9], 3)
    sched.run_until_idle()
    assert ProbeCache.matches >= 2
    assert {r.finish_type for r in sched.results().values()} == {"length"}


# Indirection so a re-run in the same process registers the backend name only once.
_current_factory: list = []


def test_a_taken_process_group_port_is_drawn_again(make_scheduler, qwen35_dir: Path, monkeypatch):
    """SGLang draws the group's port before binding it; another process may take it meanwhile."""
    import socket

    import sglang.srt.server_args as server_args_module

    real_draw = server_args_module.get_free_port_below_ephemeral
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        drawn: list[int] = []

        def draw() -> int:  # the first draw returns the port another process holds
            drawn.append(taken.getsockname()[1] if not drawn else real_draw())
            return drawn[-1]

        monkeypatch.setattr(server_args_module, "get_free_port_below_ephemeral", draw)
        sched = make_scheduler(qwen35_dir, worker="tokens")
    assert len(drawn) == 2 and sched.port_args.nccl_port == drawn[1] != drawn[0]
    sched.submit("after", list(range(16, 100)), 3)
    sched.run_until_idle()
    sched.on_idle()
    assert sched.results()["after"].finish_type == "length"


def test_a_scheduler_left_mid_batch_never_signals_the_callers_parent(
    make_scheduler, qwen35_dir: Path
):
    """SGLang's hard watchdog sends SIGQUIT to the parent process once a batch stays current for
    its timeout (300 s by default). In process that parent is pytest's controller: a test that
    stopped mid-batch killed the whole CI run five minutes later. The in-process default never
    fires, and closing disarms the watchdogs (so a closed Scheduler can also be freed)."""
    sched = make_scheduler(qwen35_dir, worker="tokens")
    sched.submit("a", list(range(16, 300)), 4)
    assert sched.step() is not None  # a chunk ran; the test stops here, mid-request
    dog = sched.scheduler.watchdog
    assert dog.is_active()  # SGLang's rule: a current batch is watched
    assert dog.watchdog_timeout >= 86400 * 30
    sched.close()
    assert not dog.is_active() and dog.dump_info is None


def test_an_explicit_watchdog_timeout_is_kept(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(qwen35_dir, worker="tokens", watchdog_timeout=1234.0)
    assert sched.scheduler.watchdog.watchdog_timeout == 1234.0
