"""The free-state LRU bound's store (issue #37): the oracle's answers within a capacity, LRU."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hybrid.replay.lru_store import LruPrefixStore
from sglang_hybrid.replay.oracle_store import PrefixStore


def seq(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(16, 2000, n, dtype=np.int32)


def test_within_capacity_it_answers_as_the_oracle() -> None:
    lru, oracle = LruPrefixStore(1 << 20), PrefixStore()
    rng = np.random.default_rng(0)
    seqs = [seq(i, int(rng.integers(1, 700))) for i in range(40)]
    for i, s in enumerate(seqs):
        q = np.concatenate([seqs[int(rng.integers(0, i + 1))][: int(rng.integers(0, 600))], s])
        assert lru.lcp(q) == oracle.lcp(q)
        lru.insert(q)
        oracle.insert(q)
    assert lru.evicted_tokens == 0


def test_least_recently_used_goes_first_and_leaves_before_parents() -> None:
    a, b, c = seq(1, 640), seq(2, 640), seq(3, 640)
    lru = LruPrefixStore(1280)  # two of the three
    lru.insert(a)
    lru.insert(b)
    assert lru.lcp(a) == 640  # a used again: b is now the least recently used
    lru.insert(c)
    assert lru.tokens <= 1280
    assert lru.lcp(a) == 640 and lru.lcp(c) == 640 and lru.lcp(b) == 0
    # A sequence sharing a's first half: a's private half is evicted deepest first.
    d = np.concatenate([a[:320], seq(4, 960)])
    lru.insert(d)
    assert lru.lcp(d) == 1280 and lru.lcp(a) == 320


def test_partial_blocks_are_held_and_evicted() -> None:
    lru = LruPrefixStore(128)
    s = seq(5, 100)  # one full block and a 36-token partial one
    lru.insert(s)
    assert lru.tokens == 100 and lru.lcp(np.concatenate([s[:90], seq(6, 5)])) == 90
    lru.insert(seq(7, 100))
    assert lru.lcp(s) == 0 and lru.tokens == 100


def test_a_sequence_longer_than_the_capacity_is_kept_whole_once() -> None:
    lru = LruPrefixStore(256)
    lru.insert(seq(8, 100))
    long = seq(9, 1000)
    lru.insert(long)
    assert lru.lcp(long) == 1000 and lru.tokens == 1000


def test_no_block_fits_no_store() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        LruPrefixStore(10)
