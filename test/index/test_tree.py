"""BlockTree and lookup (spec §13.1 BlockTree): exact identity, hashes only select."""

from __future__ import annotations

import pytest
from helpers import Device, key, make_index, run

from sglang_hybrid.index import PromptKey, SnapshotKind
from sglang_hybrid.index.keys import media_key


def test_insert_and_match_exact_tokens_and_extra_keys() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(1, 300))
    run(idx, dev, ids, taps=[128, 256])
    m = idx.match(key(ids + [7]))
    assert len(m.path) == 4 and m.best is not None and m.best.frontier == 299
    # One token changed in block 2: the path stops there and only the tap at 128 serves.
    other = ids[:]
    other[150] += 1
    m = idx.match(key(other + [7]))
    assert len(m.path) == 2 and m.best is not None and m.best.frontier == 128
    # Same tokens, a media key on block 1: block 0 matches, block 1 does not.
    m = idx.match(key(ids + [7], extras={1: 12345}))
    assert len(m.path) == 1 and m.best is None


@pytest.mark.parametrize("const", [False, True])
def test_match_leaves_the_prompts_own_hashes_on_its_key(const: bool) -> None:
    """The walk copies matched nodes' lookup hashes into the key instead of hashing (a chain's
    only child is compared directly); every hash the key then holds is the one it would compute
    itself, also when every hash collides."""
    kw: dict = {"hash_fn": lambda data, seed: 42} if const else {}
    idx, dev = make_index(), Device()
    shared = list(range(1, 129))  # blocks 0-1 shared, then a fork at block 2
    for tail in (range(500, 700), range(800, 1000)):
        ids = shared + list(tail)
        k = PromptKey.from_ids(ids, **kw)
        lane = idx.open_lane(idx.match(k), None)
        idx.commit(lane, k, len(ids), lambda b: dev.new())
        idx.release(lane)
    probe = shared + list(range(800, 1000)) + [7]
    for miss_at in (None, 3):  # the whole path; a miss inside the chain below the fork
        if miss_at is not None:
            probe[64 * miss_at + 5] += 1
        k = PromptKey.from_ids(probe, **kw)
        m = idx.match(k)
        own = PromptKey.from_ids(probe, **kw).ensure_hashes(k.full_blocks)
        assert len(m.path) == (5 if miss_at is None else miss_at)
        assert len(k.hashes) >= len(m.path) and k.hashes == own[: len(k.hashes)]


def test_constant_lookup_hash_gives_no_false_hit() -> None:
    idx, dev = make_index(), Device()
    const = {"hash_fn": lambda data, seed: 42}
    a = list(range(1000, 1200))
    b = list(range(2000, 2200))
    for ids in (a, b):
        k = PromptKey.from_ids(ids, **const)
        m = idx.match(k)
        lane = idx.open_lane(m, None)
        idx.commit(lane, k, len(ids), lambda blk: dev.new())
        idx.release(lane)
    idx.check_integrity()
    # Both chains hang under one hash: every lookup compares tokens and finds its own chain.
    assert idx.tree.n_nodes == 6
    for ids in (a, b):
        m = idx.match(PromptKey.from_ids(ids, **const))
        assert [n.tokens for n in m.path] == [key(ids).block(i) for i in range(3)]
    m = idx.match(PromptKey.from_ids(list(range(3000, 3200)), **const))
    assert m.path == []


def test_different_media_digest_same_tokens_misses() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(10, 210))
    span = (0, 130)  # an image occupying tokens [0, 130)
    k1 = key(
        ids,
        extras={
            0: media_key([(b"A" * 32, 1, 16, 0, 130)]),
            1: media_key([(b"A" * 32, 1, 16, 0, 130)]),
            2: media_key([(b"A" * 32, 1, 16, 0, 130)]),
        },
        vision_spans=[span],
    )
    m = idx.match(k1)
    lane = idx.open_lane(m, None)
    idx.commit(lane, k1, len(ids), lambda b: dev.new())
    idx.release(lane)
    same = key(ids, extras=k1._extra_at, vision_spans=[span])
    assert len(idx.match(same).path) == 3
    digest_b = media_key([(b"B" * 32, 1, 16, 0, 130)])
    other = key(ids, extras={0: digest_b, 1: digest_b, 2: digest_b}, vision_spans=[span])
    assert idx.match(other).path == []


def test_tail_snapshot_matches_on_exact_tail_tokens_only() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(1, 101))  # endpoint at 100: anchor block 0, tail tokens [64, 100)
    (end,) = run(idx, dev, ids)
    assert end.kind is SnapshotKind.ENDPOINT and end.tail_len == 36
    assert idx.match(key(ids + [5])).best is end
    changed = ids[:]
    changed[99] += 1  # the last tail token differs
    assert idx.match(key(changed + [5])).best is None
    assert idx.match(key(ids[:90] + [5] * 20)).best is None


def test_frontier_at_most_n_minus_one() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(1, 129))  # 128 tokens, endpoint at 128 (no tail)
    (end,) = run(idx, dev, ids)
    assert end.frontier == 128
    # The same 128-token prompt cannot resume at 128: one token must be prefilled.
    m = idx.match(key(ids))
    assert m.best is None and len(m.path) == 1
    assert idx.match(key(ids + [9])).best is end


def test_duplicate_publication_is_a_noop() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(1, 200))
    first = run(idx, dev, ids, taps=[128], endpoint=False)
    assert len(first) == 1
    n_snap, free = len(idx.snapshots), idx.slots.free
    again = run(idx, dev, ids + [1, 2], taps=[128], endpoint=False, source="root")
    assert again == [] and len(idx.snapshots) == n_snap and idx.slots.free == free
    assert idx.stats.duplicate_publications == 1


def test_vision_span_frontier_is_not_a_resume_point() -> None:
    idx, dev = make_index(), Device()
    ids = list(range(1, 101))
    run(idx, dev, ids)  # endpoint at 100
    inside = key(ids + [3] * 10, vision_spans=[(90, 105)])
    assert idx.match(inside).best is None
    outside = key(ids + [3] * 10, vision_spans=[(100, 105)])
    assert idx.match(outside).best is not None


def test_prompt_key_rejects_ragged_bytes() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        PromptKey(b"abc")
