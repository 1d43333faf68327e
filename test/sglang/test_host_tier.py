"""The host tier in SGLang's real Scheduler: write-through, host-only restore, pressure, prefetch.

``CheckingWorker`` proves after every restore that the resumed state and every prefix KV slot
are exactly what an uncached run would hold, so "resumes from host" here also means "computes
what a device resume or no cache would".
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.index.taps import TapSource

rng = random.Random(11)


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def host(build, mib: int = 16, **kw):
    kw.setdefault("opts", {})
    kw["opts"] = {"host_cache_mib": mib, **kw["opts"]}
    return build(**kw)


@pytest.mark.parametrize("page", [1, 64])
def test_a_conversation_evicted_from_the_device_resumes_from_host(build, page: int) -> None:
    h = host(
        build,
        page=page,
        total=2048,
        running=2,
        mamba=8,
        chunk=256,
        opts={"device_snapshot_slots": 2},
    )
    cache = h.cache
    prompt = toks(300)
    first = h.run(prompt, max_new=80)
    end = len(prompt) + len(first.output_ids) - 1
    assert cache.index.stats.endpoints_published == 1
    for _ in range(6):  # other conversations push it off the device: pages and snapshot slot
        h.run(toks(500), max_new=70)
    e = next(s for s in cache.index.snapshots.values() if s.frontier == end)
    assert not e.image_on_device and e.image_on_host
    assert cache.index.stats.device_evicted_backed > 0
    turn2 = prompt + list(first.output_ids) + toks(30)
    r = h.run(turn2, max_new=4)
    assert r.cached_tokens == end  # resumed exactly at the endpoint, from host
    state = h.s.scheduler  # noqa: F841 - the worker checked the restored contents
    assert cache.host_tier.restored_bytes > 0
    h.s.on_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_short_answer_stopped_by_a_token_resumes_from_its_endpoint_on_host(
    build, overlap: bool
) -> None:
    """The GPU check's ``host_only_restore`` as its bf16 run played it (stage B): a 400-token
    prompt answered in 43 tokens, ended by a stop token, the device emptied, the next turn
    continuing past the answer. The endpoint (442, 443 under overlap: SGLang ran the stop
    token's extra decode) is 58 tokens past the prompt's block grid (384): while the prompt's
    tail tap sat on that grid, spec §7.7's spacing (an endpoint >= 64 past the deepest state
    below) withheld the endpoint, and the next turn resumed at 384 from the host. The tail tap
    at n - 1 (issue #37) lets an endpoint more than END_TOKENS past it be published, and written
    through: the next turn resumes at the endpoint from the host alone."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_hybrid.index import SnapshotKind

    h = host(build, chunk=128, opts={"tap_mode": "split"}, disable_overlap_schedule=not overlap)
    cache = h.cache
    prompt = toks(400)
    out = h.run_to_stop("short", prompt, 42)
    end = len(prompt) + 42 + (1 if overlap else 0)
    ends = [s for s in cache.index.snapshots.values() if s.kind is SnapshotKind.ENDPOINT]
    assert [s.frontier for s in ends] == [end]
    assert ends[0].image_on_host  # written through at finish
    cache.evict(EvictParams(num_tokens=1 << 30))  # the device forgets everything unpinned
    for s in list(cache.index.snapshots.values()):
        if s.image_on_host and s.image_on_device and not s.restore_pins:
            cache.index.drop_image_device(s)
    assert not ends[0].image_on_device
    r = h.run(prompt + out + toks(20), max_new=4)  # the worker checks the restored state
    assert r.cached_tokens == end
    assert cache.host_tier.restored_bytes > 0
    h.s.on_idle()


def test_restored_bytes_are_reported_with_cached_tokens(build) -> None:
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )

    h = host(build, total=2048, running=2, mamba=8, opts={"device_snapshot_slots": 2})
    prompt = toks(300)
    first = h.run(prompt, max_new=80)
    for _ in range(6):
        h.run(toks(500), max_new=70)
    seen = []
    orig = SchedulerOutputStreamer.get_cached_tokens_details

    def spy(self, req):
        out = orig(self, req)
        seen.append(out)
        return out

    SchedulerOutputStreamer.get_cached_tokens_details = spy
    try:
        h.run(prompt + list(first.output_ids) + toks(30), max_new=2)
    finally:
        SchedulerOutputStreamer.get_cached_tokens_details = orig
    details = [d for d in seen if d and d.get("host")]
    # Token counts only (issue #38: the restored bytes sat among them).
    assert details and set(details[-1]) == {"device", "host"}, details


def test_host_pressure_reclaims_dead_kv_and_superseded_first(build) -> None:
    # A tiny host tier: eviction runs all the time; every idle point checks the invariants.
    h = host(build, mib=4, total=4096, running=2, mamba=10)
    # Six conversations, four turns: with the prompt-tail tap at n - 1 (issue #37) four and
    # three left no superseded snapshot on the host to reclaim.
    convs = [toks(200) for _ in range(6)]
    for _ in range(4):
        for i, c in enumerate(convs):
            r = h.run(c, max_new=70)
            convs[i] = c + list(r.output_ids) + toks(20)
    stats = h.cache.index.stats
    assert stats.host_dead_swept > 0 and stats.host_superseded_evicted > 0
    usage = h.cache.host_tier.usage()
    assert usage.kv_bytes + usage.image_bytes + usage.free_bytes == 4 << 20
    print(f"\nhost pressure: {stats}; usage {usage}")


def test_a_prompt_leaving_an_earlier_one_before_its_end_resumes_from_its_ladder_tap(build) -> None:
    """Token-id traffic: a later prompt shares 1,300 tokens of a 2,000-token prompt and leaves it
    there. The earlier prompt's ladder taps (512-token ladder: 1,024 and 1,536) are placed for
    exactly that prompt. With a host tier under write pressure (1 MiB, eight slabs) its
    superseded snapshots go first, both copies: before ladder taps were exempt from supersession
    by their own prompt's later taps, the tail tap's publication superseded them and the
    write-through at release deleted them, and the later prompt recomputed everything (the
    scale-out Mooncake anomaly, ``docs/scale-out.md``)."""
    h = host(
        build,
        mib=1,
        total=16384,
        running=2,
        mamba=8,
        chunk=256,
        opts={"tap_ladder": 512, "tap_min_gap": 256},
    )
    a = toks(2000)
    h.run(a, max_new=4)
    ladder = sorted(
        s.frontier for s in h.cache.index.snapshots.values() if s.origin == TapSource.LADDER
    )
    assert ladder == [1024, 1536]
    b = h.run(a[:1300] + toks(200), max_new=4)
    assert b.cached_tokens == 1024


def test_random_admissions_cancels_and_pressure_leave_nothing_pinned(build) -> None:
    h = host(build, mib=8, total=3072, running=3, mamba=12, chunk=128)
    s = h.s
    pool = [toks(rng.randrange(100, 700)) for _ in range(5)]
    for step in range(40):
        base = rng.choice(pool)
        ids = base[: rng.randrange(1, len(base) + 1)] + toks(rng.randrange(1, 120))
        rid = f"q{step:03d}"  # SGLang aborts every rid with the given prefix
        s.submit(rid, ids, rng.randrange(1, 90))
        if rng.random() < 0.3:
            for _ in range(rng.randrange(1, 4)):
                s.step()
                h.check_mamba()
            s.abort(rid)
        if rng.random() < 0.5:
            h.step_all()
        pool.append(ids)
    h.step_all()
    idx = h.cache.index
    idx.check_integrity()
    assert not idx.lanes and idx.protected_tokens == 0
    assert all(
        n.restore_pins == 0 and n.active_refs == 0
        for n in idx.tree.subtree_postorder(idx.tree.root)
    )
    assert all(x.restore_pins == 0 for x in idx.snapshots.values())
