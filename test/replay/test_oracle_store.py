import random

import numpy as np

from sglang_hybrid.replay.oracle_store import PrefixStore


def naive_lcp(query, seqs):
    best = 0
    for s in seqs:
        n = min(len(s), len(query))
        k = 0
        while k < n and s[k] == query[k]:
            k += 1
        best = max(best, k)
    return best


def test_matches_a_brute_force_lcp_on_branching_sequences():
    rng = random.Random(11)
    store, seqs = PrefixStore(), []
    base = [rng.randrange(2048) for _ in range(700)]
    for _ in range(120):
        # Branch off an earlier sequence (or the base) at any position, often inside a block.
        src = rng.choice(seqs) if seqs and rng.random() < 0.7 else base
        cut = rng.randrange(0, len(src) + 1)
        tail = [rng.randrange(4) for _ in range(rng.randrange(0, 300))]  # tiny alphabet: near-ties
        q = np.asarray(src[:cut] + tail, dtype=np.int32)
        assert store.lcp(q) == naive_lcp(q.tolist(), seqs)
        store.insert(q)
        seqs.append(q.tolist())
    assert store.lcp(np.asarray(seqs[5], dtype=np.int32)) == len(seqs[5])


def test_empty_store_and_empty_query():
    store = PrefixStore()
    assert store.lcp(np.asarray([1, 2, 3], dtype=np.int32)) == 0
    store.insert(np.arange(200, dtype=np.int32))
    assert store.lcp(np.asarray([], dtype=np.int32)) == 0
    assert store.lcp(np.arange(150, dtype=np.int32)) == 150
    assert store.lcp(np.arange(300, dtype=np.int32)) == 200
