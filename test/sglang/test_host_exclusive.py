"""The exclusive host (``--hybrid-host-exclusive``, ``index/demotion.py``) in SGLang's real
Scheduler: each cached block on one tier, so the two hold their sum.

Conversations return after others have pushed them off the device; the host is too small to hold
them all alongside copies of what the device holds. ``CheckingWorker`` proves every resumed state
and prefix KV slot equal to an uncached run's, demoted blocks included; the copies run on the
host tier's worker thread (the asynchronous queue), so demotions are in flight across passes.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_host_async import slow_copies  # noqa: F401  # its fixture: copies slowed


def _toks(r: random.Random, n: int) -> list[int]:
    return [r.randrange(10, 2000) for _ in range(n)]


def _conversations(h: Any, seed: int, n: int, rounds: int) -> tuple[int, int]:
    """``n`` conversations of ~600-token turns, interleaved, ``rounds`` turns each; returns the
    tokens resumed by every turn after the first and the tokens those turns sent."""
    r = random.Random(seed)
    history = [_toks(r, 600 + 64 * i % 200) for i in range(n)]
    cached = sent = 0
    for turn in range(rounds):
        for i in range(n):
            res = h.run(history[i], max_new=16)
            if turn:
                cached += res.cached_tokens
                sent += len(history[i])
            history[i] = history[i] + list(res.output_ids) + _toks(r, 40)
        h.cache.index.check_integrity()
    return cached, sent


def _build(build: Any, exclusive: bool) -> Any:
    return build(
        total=4096,
        running=2,
        mamba=24,
        chunk=256,
        opts={"host_cache_mib": 12, "host_exclusive": exclusive},
    )


def _tiers(idx: Any) -> tuple[int, int]:
    """(blocks a request can resume through: a live snapshot below them, on either tier; the
    blocks among them with a copy on both)."""
    held = both = 0
    for n in idx.tree.subtree_postorder(idx.tree.root):
        if n is idx.tree.root or n.live_snapshots_below == 0:
            continue
        held += 1
        both += n.on_device and n.on_host
    return held, both


def test_two_tiers_hold_their_sum(build) -> None:
    """The same conversations with and without exclusivity, every resume exact: the exclusive
    host gives up copies of what the device holds and demotes what the device evicts next, so
    fewer blocks sit on both tiers. (Whether more turns resume depends on the traffic and is
    printed, not asserted: measured on replays in ``docs/benchmarks.md``, "One tier per
    block".)"""
    resumed, both = {}, {}
    for exclusive in (False, True):
        h = _build(build, exclusive)
        assert h.cache.index.config.host_exclusive is exclusive
        cached, sent = _conversations(h, 5, n=8, rounds=3)
        h.cache.host_tier.drain()
        st = h.cache.stats()
        held, both[exclusive] = _tiers(h.cache.index)
        print(
            f"\nexclusive={exclusive}: resumed {cached} of {sent} tokens; {held} live blocks "
            f"held, {both[exclusive]} on both tiers; demoted {st['blocks_demoted']} blocks, "
            f"{st['host_duplicates_dropped']} duplicates given up"
        )
        # Demotions happen only when exclusive, and their bytes are counted apart.
        assert (st["blocks_demoted"] > 0) is exclusive
        assert (st["host_duplicates_dropped"] > 0) is exclusive
        assert (st["host_demoted_bytes"] > 0) is exclusive
        assert st["device_evicted_backed"] > 0  # pressure reached the device in both
        resumed[exclusive] = cached
    assert both[True] < both[False]
    print(f"resumed {resumed[True]} exclusive, {resumed[False]} with write-through alone")


def test_demotions_in_flight_across_passes(build, slow_copies) -> None:  # noqa: F811
    """Copies slowed on the copy worker: demotions are still in flight when later passes evict
    and restore (their blocks out of the LRU meanwhile), and land or are shed; every resume
    is exact. (The stream model runs this one too: ``test_stream_sanitizer_suites``.)"""
    h = _build(build, True)
    _conversations(h, 7, n=10, rounds=3)
    st = h.cache.stats()
    print(f"\n{slow_copies['ops']} copy operations; demoted {st['blocks_demoted']} blocks")
    assert st["blocks_demoted"] > 0 and st["host_duplicates_dropped"] > 0
    h.cache.host_tier.drain()
    h.cache.index.check_integrity()


def test_a_flag_that_needs_a_host_is_refused_without_one() -> None:
    from sglang_hybrid.index.host_slabs import ConfigError
    from sglang_hybrid.sglang.flags import HybridOptions, check_options

    with pytest.raises(ConfigError, match="--hybrid-host-exclusive"):
        check_options(HybridOptions(host_cache_mib=0, host_exclusive=True))
    check_options(HybridOptions(host_cache_mib=0, host_exclusive=False))  # saying no is fine
