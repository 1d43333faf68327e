"""Speculative decoding with ``--radix-cache hybrid`` (issue #14): ``--speculative-algorithm
CPU_MTP`` runs SGLang's own speculative scheduler path (slot reserve, verify commits of 1..D
tokens, release of the rejected slots, bigram keys for its own cache) over the CPU workers.

The worker is ``CheckingWorker``: a verify writes the K/V of every chain input, rejected drafts
included, as the hash of the sequence it was fed, and the state after the accepted inputs. A
block, tail or frontier that took in a rejected input fails the next pass that reads it.
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.cpu.speculative import ALGORITHM, DraftSchedule, run_chain
from sglang_hybrid.index import SnapshotKind

SPEC = dict(speculative_algorithm=ALGORITHM, speculative_num_steps=3)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def _spec_worker(h):
    worker = h.s.scheduler.model_worker
    assert type(worker).__name__ == "CpuSpecWorker"
    return worker


def _endpoints(h) -> set[int]:
    snaps = h.cache.index.snapshots.values()
    return {s.frontier for s in snaps if s.kind is SnapshotKind.ENDPOINT}


def test_run_chain_accepts_up_to_the_first_wrong_draft() -> None:
    """The accept rule alone: targets are position + 100; drafts miss where scheduled."""
    drafts = DraftSchedule(miss_every=3)
    fed: list[tuple[int, int]] = []
    commits: list[int] = []

    def step(token: int, position: int) -> int:
        fed.append((token, position))
        return position + 101

    for start in range(40):
        fed.clear()
        commits.clear()
        run = run_chain(
            step,
            lambda: commits.append(len(fed)),
            bonus=7,
            start=start,
            num_draft_tokens=4,
            drafts=drafts,
            vocab_size=1 << 20,
        )
        want = [start + 101]
        for p in range(start + 1, start + 4):  # draft for position p, right unless scheduled
            if drafts.draft(p, p + 100, 1 << 20) != p + 100:
                break
            want.append(p + 101)
        assert run == want
        assert commits == [len(run)]  # the state after exactly the accepted inputs
        assert [p for _, p in fed] == list(range(start, start + 4))  # every input ran


def _overlapped(h, overlap: bool) -> None:
    """The scheduler runs SGLang's overlap loop exactly when asked (and the cache knows it)."""
    assert h.s.overlap is overlap and h.cache.overlap is overlap


@pytest.mark.parametrize(
    ("page", "miss_every", "overlap"),
    [(1, 1, False), (1, 3, False), (64, 1, False), (64, 3, False), (1, 3, True), (64, 1, True)],
)
def test_only_accepted_tokens_reach_the_index(
    build, page: int, miss_every: int, overlap: bool
) -> None:
    """Turns of a conversation decode through verify rounds (every draft wrong, or a third of
    them); the next turn resumes from the endpoint and every pass's prefix checks out. Under
    overlap scheduling each round is launched before the previous round's result is processed
    (SGLang's future map carries the bonus token and the lengths between them)."""
    h = build(
        page=page,
        chunk=256,
        opts={"tap_mode": "split"},
        disable_overlap_schedule=not overlap,
        **SPEC,
    )
    worker = _spec_worker(h)
    worker.drafts = DraftSchedule(miss_every=miss_every)
    seq = _prompt(1, 300)
    for turn in range(3):
        r = h.run(seq, max_new=61 + turn)
        out = list(r.output_ids)
        assert len(out) == 61 + turn
        seq = seq + out + _prompt(10 + turn, 40)
    assert worker.rounds > 0
    if miss_every == 1:
        assert worker.accepted_drafts == 0
    else:
        assert 0 < worker.accepted_drafts < worker.rounds * 3
    assert h.s.worker.checked_states > 0 and h.s.worker.checked_tokens > 0
    assert h.run(seq, max_new=3).cached_tokens > 300  # resumed past the first prompt
    _overlapped(h, overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_endpoint_where_the_last_round_ends(build, overlap: bool) -> None:
    """A round that ends exactly at the budget: its accepted state is the state after the
    request's committed tokens, published as the endpoint the next turn resumes from. A length
    limit is seen coming, so under overlap scheduling no extra round runs and the endpoint sits
    where it does without."""
    h = build(chunk=256, opts={"tap_mode": "split"}, disable_overlap_schedule=not overlap, **SPEC)
    _spec_worker(h).drafts = DraftSchedule(miss_every=1)  # one token per round: no overshoot
    a = _prompt(2, 200)
    out = list(h.run(a, max_new=80).output_ids)  # ends >= a block past the prompt tap
    end = len(a) + len(out) - 1
    assert end in _endpoints(h)
    assert h.run(a + out + _prompt(3, 20), max_new=2).cached_tokens == end
    _overlapped(h, overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_endpoint_after_a_stop_token(build, overlap: bool) -> None:
    """A stop token (not a length limit) is seen only when the round's result is processed.
    Without overlap scheduling the endpoint sits at the stop. Under it the next round was
    launched already and advanced the live state, while SGLang keeps none of its tokens (unlike
    a plain decode's extra step, ``test_overlap.py``): no endpoint (publishing one at the
    committed length failed this worker's state check), and the next turn resumes exactly from
    the deepest snapshot below."""
    h = build(opts={"tap_mode": "split"}, disable_overlap_schedule=not overlap, **SPEC)
    _spec_worker(h).drafts = DraftSchedule(miss_every=1)  # one token per round: no overshoot
    n, k = 200, 70
    a = _prompt(6, n)
    out = h.run_to_stop("a", a, k)
    r = h.run(a + out + _prompt(7, 20), max_new=3)
    if overlap:  # no state at the stop: the next turn resumes below it, exactly
        assert not _endpoints(h) & {n + k, n + k + 1}
        assert 64 * (n // 64) <= r.cached_tokens < n + k  # the prompt's tap on the grid
    else:
        assert n + k in _endpoints(h)
        assert r.cached_tokens == n + k
    _overlapped(h, overlap)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_overshooting_round_publishes_no_endpoint_past_the_stop(build, overlap: bool) -> None:
    """A verify round that accepts past the budget commits KV and state past the last token
    the client sees; the cache then publishes no endpoint (there is no state at the stop), and
    a next turn still resumes exactly, from the deepest snapshot below."""
    h = build(chunk=256, opts={"tap_mode": "split"}, disable_overlap_schedule=not overlap, **SPEC)
    _spec_worker(h).drafts = DraftSchedule(miss_every=0)  # every draft right: runs of 4
    a = _prompt(4, 200)
    req_out = list(h.run(a, max_new=50, rid="over").output_ids)
    assert len(req_out) == 50
    assert not _endpoints(h) & {len(a) + 49}
    follow = h.run(a + req_out + _prompt(5, 20), max_new=2)
    assert follow.cached_tokens < len(a) + 49
    assert follow.cached_tokens >= 192  # a snapshot on the prompt's grid still serves
    _overlapped(h, overlap)


# Pools small enough for conversations to evict each other, with a host tier behind them.
SMALL_HOST = dict(
    chunk=128,
    opts={"tap_mode": "zero-split", "host_cache_mib": 16},
    total=2048,
    running=2,
    mamba=12,
    **SPEC,
)


def test_host_tier_and_eviction_under_speculation(build) -> None:
    """Small pools with a host tier: verify reserves (2·D slots a round) evict cached blocks,
    which the host tier keeps; later turns restore them and resume exactly."""
    h = build(**SMALL_HOST)
    convs = [_prompt(20 + i, 450) for i in range(6)]  # ~3k tokens: more than the pool
    for rnd in range(2):
        for i, c in enumerate(convs):
            r = h.run(c, max_new=40)
            convs[i] = c + list(r.output_ids) + _prompt(30 + 6 * rnd + i, 30)
    stats = h.cache.index.stats
    assert stats.device_evicted_backed > 0
    assert h.cache.host_tier.restored_blocks > 0
    assert _spec_worker(h).accepted_drafts > 0


def _draft_scenario(h) -> None:
    """Conversations on small pools with a host tier and taps inside blocks: endpoint tails are
    copied to private pages at resume, evicted blocks restored from the host. One token per
    round, so no round overshoots the budget and every finish publishes its endpoint."""
    _spec_worker(h).drafts = DraftSchedule(miss_every=1)
    convs = [_prompt(50 + i, 430) for i in range(6)]
    for rnd in range(2):
        for i, c in enumerate(convs):
            r = h.run(c, max_new=37)
            convs[i] = c + list(r.output_ids) + _prompt(60 + 6 * rnd + i, 29)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_draft_kv_moves_with_the_targets(build, overlap: bool) -> None:
    """The draft model's KV pool (an MTP layer's, over the target's slot ids) is found through
    the draft runners and copied with every tail and host restore: before every pass each
    request's reused prefix holds its own draft rows (``DraftKV.check``)."""
    h = build(**SMALL_HOST, disable_overlap_schedule=not overlap)
    worker = _spec_worker(h)
    worker.check_draft = True
    assert h.cache.pools.draft_kv_pools == (worker.draft_kv.pool,)
    assert h.cache.pools.draft_layers == 1
    n_kv = len(h.cache.pools.kv_buffers) // 2
    assert h.cache._forward_order()[-1] == ("kv", n_kv - 1)  # restored after the target's
    tails = [0]
    copy_tail = h.cache._copy_tail

    def counted(source):
        tails[0] += 1
        return copy_tail(source)

    h.cache._copy_tail = counted
    _draft_scenario(h)
    assert h.cache.host_tier.restored_blocks > 0
    assert tails[0] > 0
    assert worker.draft_kv.checked_tokens > 5000
    assert h.s.worker.checked_tokens > 0  # the target's rows checked too (CheckingWorker)
    _overlapped(h, overlap)


def test_without_the_draft_pools_the_draft_check_fails(build, monkeypatch) -> None:
    """The control: a cache that does not know the draft pools moves the target's KV alone,
    and the first resume from a moved block or tail hands the draft another request's rows."""
    from sglang_hybrid.sglang import draft

    monkeypatch.setattr(draft, "collect", lambda spec, target: ())
    h = build(**SMALL_HOST)
    _spec_worker(h).check_draft = True
    assert h.cache.pools.draft_layers == 0
    with pytest.raises(AssertionError, match="moved the target's KV without the draft's"):
        _draft_scenario(h)


def test_the_cache_accepts_the_algorithm_the_workers_register() -> None:
    """The cache's flag check names the CPU algorithm without importing the workers; the
    other algorithms' refusals are in test_plugin.py."""
    from sglang_hybrid.sglang.checks import SPEC_ON_CPU

    assert SPEC_ON_CPU == ALGORITHM


def test_retraction_under_speculation_resumes_exactly(build, monkeypatch) -> None:
    """Decode that outgrows the pool (each round reserves 2·D slots per request): SGLang retracts
    requests, releasing their rows with the reserved slots, and readmits them; every pass's
    prefix still checks out and outputs equal an unretracted run without speculation."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    shared = _prompt(40, 400)
    prompts = [shared + _prompt(41 + i, 60) for i in range(6)]
    opts = {"host_cache_mib": 16, "device_snapshot_slots": 4, "tap_mode": "zero-split"}

    def serve(h) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            h.s.submit(f"q{i}", p, 300)
        h.step_all()
        return {f"q{i}": list(h.s.results()[f"q{i}"].output_ids) for i in range(len(prompts))}

    ref = serve(build(total=20000, running=6, mamba=20, opts=opts))
    calls = [0]
    retract = ScheduleBatch.retract_decode

    def counted(*a, **kw):
        calls[0] += 1
        return retract(*a, **kw)

    monkeypatch.setattr(ScheduleBatch, "retract_decode", counted)
    monkeypatch.setenv("SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS", "30")
    h = build(
        total=1800,
        running=6,
        mamba=20,
        chunk=256,
        opts=opts,
        schedule_conservativeness=0.05,
        **SPEC,
    )
    assert serve(h) == ref
    assert calls[0] > 0, "the pool should have forced a retraction"
    assert _spec_worker(h).accepted_drafts > 0
    idx = h.cache.index
    idx.check_integrity()
    assert not idx.lanes and idx.protected_tokens == 0


def test_the_request_to_token_write_in_torch() -> None:
    """The CPU twin of SGLang's Triton write: each row gets the next ``end - start`` slots of
    ``out_cache_loc`` at ``[start, end)``, rows in batch order; CUDA tensors go to SGLang's."""
    import torch

    from sglang_hybrid.cpu.spec_register import assign_req_to_token_pool

    def never(*args: object) -> None:
        raise AssertionError("the Triton kernel was called for CPU tensors")

    table = torch.zeros((4, 16), dtype=torch.int32)
    rows, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 5]), torch.tensor([6, 7])
    locs = torch.arange(100, 105, dtype=torch.int64)
    assign_req_to_token_pool(never, rows, table, starts, ends, locs, 2)
    assert table[2, 3:6].tolist() == [100, 101, 102]
    assert table[0, 5:7].tolist() == [103, 104]
    assert int(table.count_nonzero()) == 5
