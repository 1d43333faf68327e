"""The cache driven through SGLang's own helpers (``match_kv_cache``, ``checkpoint_kv_cache``,
``release_kv_cache``) with real ``Req`` objects and pools, next to SGLang's built-in cache."""

from __future__ import annotations

import random

import pytest
from direct import Driver, build_pools, builtin_cache, hybrid_cache

rng = random.Random(3)


@pytest.fixture(autouse=True)
def _fresh_tokens() -> None:
    """Every test draws the same tokens whichever tests ran before it (or alone, with -k)."""
    rng.seed(3)


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def drivers(page: int, chunk: int = 2048) -> list[tuple[str, Driver]]:
    out = []
    pools = build_pools(page)
    out.append(("hybrid", Driver(hybrid_cache(pools, chunk=chunk), pools, chunk=chunk)))
    if page == 1:  # SGLang's no_buffer cache needs page size 1
        pools = build_pools(page)
        out.append(("built-in", Driver(builtin_cache(pools), pools, chunk=chunk)))
    return out


@pytest.mark.parametrize("page", [1, 16, 64])
def test_repeat_multiturn_and_tail_resume(page: int) -> None:
    prompt = toks(300)
    reuse: dict[str, list[int]] = {}
    for name, d in drivers(page):
        a = d.serve("a", prompt, max_new=80)
        b = d.serve("b", prompt, max_new=2)
        turn2 = prompt + a.output + toks(30)
        c = d.serve("c", turn2, max_new=2)
        reuse[name] = [a.cached, b.cached, c.cached]
        d.check_idle()
    print(f"\npage {page}: " + ", ".join(f"{k} {v}" for k, v in reuse.items()))
    # Repeat: the prompt-tail tap at n - 1 = 299 (issue #37, a partial page as its tail); next
    # turn: the endpoint at 300 + 80 - 1.
    assert reuse["hybrid"] == [0, 299, 379]


@pytest.mark.parametrize("page", [1, 64])
def test_abort_mid_prefill_keeps_the_committed_chunks(page: int) -> None:
    pools = build_pools(page)
    d = Driver(hybrid_cache(pools, chunk=128), pools, chunk=128)
    prompt = toks(700)
    d.serve("x", prompt, abort_after_chunks=3)
    d.check_idle()
    assert d.cache.index.stats.endpoints_published == 1
    assert d.serve("y", prompt, max_new=2).cached == 384  # 3 chunks of 128
    d.check_idle()


def test_disabled_request_leaves_nothing_behind() -> None:
    pools = build_pools(1)
    d = Driver(hybrid_cache(pools), pools)
    d.serve("warm", toks(200), max_new=70)
    idx = d.cache.index
    nodes, snaps = idx.tree.n_nodes, len(idx.snapshots)
    orig = d.cache.match_prefix

    def match(params):
        if params.req is not None:
            params.req.skip_radix_cache_insert = True
        return orig(params)

    d.cache.match_prefix = match
    d.serve("cold", toks(400), max_new=70)
    assert (idx.tree.n_nodes, len(idx.snapshots)) == (nodes, snaps)
    d.check_idle()


def test_snapshot_slots_are_extra_mamba_slots() -> None:
    pools = build_pools(1, reqs=4, mamba=12)
    free0 = pools.r2t.mamba_allocator.available_size()
    cache = hybrid_cache(pools, device_snapshot_slots=6)
    # Cache, not load (issue #38): SGLang's usage gauges count them as evictable.
    assert (cache.mamba_evictable_size(), cache.mamba_protected_size()) == (6, 0)
    assert pools.r2t.mamba_allocator.available_size() == free0 - 6
    # A flush: SGLang resets the cache, then clears its pools; the slots come back lazily.
    cache.reset()
    pools.r2t.clear()
    pools.alloc.clear()
    assert cache.mamba_evictable_size() == 0
    Driver(cache, pools).serve("a", toks(100), max_new=2)
    assert cache.mamba_evictable_size() == 6


@pytest.mark.parametrize("page", [1, 64])
def test_result_free_groups_change_no_decision(page: int) -> None:
    """``Driver.free_groups`` (the benchmark's setting): the frees of a result's processing held
    in SGLang's free group until it ends change no hit, and the checking worker still proves
    every resumed state and prefix slot."""
    first, news = toks(700), [toks(150) for _ in range(4)]
    cached: dict[bool, list[int]] = {}
    for grouped in (False, True):
        pools = build_pools(page)
        d = Driver(hybrid_cache(pools, chunk=256), pools, chunk=256, free_groups=grouped)
        prompt, hits = first, []
        for i, new in enumerate(news):
            r = d.serve(f"t{i}", prompt, max_new=30)
            hits.append(r.cached)
            prompt = prompt + r.output + new
        d.check_idle()
        cached[grouped] = hits
    assert cached[True] == cached[False] and cached[True][-1] > 0
