import numpy as np

from sglang_hybrid.replay.tokens import TOKEN_FLOOR, VOCAB_SIZE, hashed_tokens


def test_same_stream_same_tokens_and_streams_differ():
    a = hashed_tokens(0, 7, 512)
    assert np.array_equal(a, hashed_tokens(0, 7, 512))
    assert a.dtype == np.int32
    assert not np.array_equal(a, hashed_tokens(0, 8, 512))
    assert not np.array_equal(a, hashed_tokens(1, 7, 512))
    # A shorter run is a prefix of a longer one: a block cut to length keeps its head.
    assert np.array_equal(hashed_tokens(0, 7, 100), a[:100])


def test_range_and_spread():
    t = hashed_tokens(5, 123, 20000)
    assert t.min() >= TOKEN_FLOOR and t.max() < VOCAB_SIZE
    # Every id of the range shows up in 20k draws over ~2k values (a crude spread check).
    assert len(np.unique(t)) > 0.95 * (VOCAB_SIZE - TOKEN_FLOOR)


def test_avoided_ids_never_appear():
    avoid = set(range(1000, 1100)) | {TOKEN_FLOOR, VOCAB_SIZE - 1}
    t = hashed_tokens(1, 2, 50000, avoid)
    assert not set(np.unique(t).tolist()) & avoid
    assert t.min() >= TOKEN_FLOOR and t.max() < VOCAB_SIZE
