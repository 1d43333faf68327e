"""Scenarios SGLang's built-in cache gets wrong, in SGLang's real Scheduler (spec §13.3 subset).

Each asserts the reuse the spec promises under ``--radix-cache hybrid`` and prints the built-in
cache's reuse on the same steps (SGLang's no_buffer cache runs at page size 1 only on this
machine). ``CheckingWorker`` proves every resumed prefix is the one an uncached run computes.
The chunk size is SGLang's default for smaller GPUs (2048) unless a scenario needs chunking.
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.sglang.hints import make_envelope

rng = random.Random(7)


def toks(n: int, lo: int = 10, hi: int = 2000) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def compare(build, steps, page: int) -> list[int]:
    """Run ``steps(h)`` under the built-in cache (page 1) and print its reuse."""
    if page != 1:
        print("  built-in cache: n/a (SGLang's no_buffer strategy needs page size 1)")
        return []
    h = build("builtin", page=1)
    cached = steps(h)
    print(f"  built-in cache reuse: {cached}")
    return cached


@pytest.mark.parametrize("page", [1, 64])
def test_same_prompt_twice(build, page: int) -> None:
    prompts = [toks(300), toks(320)]  # 320 is a multiple of 64

    def steps(h):
        return [h.run(p).cached_tokens for p in prompts for _ in range(2)]

    h = build(page=page)
    got = steps(h)
    print(f"\nsame prompt twice, page {page}: hybrid reuse {got}")
    # The prompt-tail tap: a repeat resumes at n - 1 (one token is always prefilled; issue #37,
    # on the 64-token grid before: 256 and 256).
    assert got == [0, 299, 0, 319]
    compare(build, steps, page)


@pytest.mark.parametrize("page", [1, 64])
def test_sessions_sharing_a_preamble_that_diverge_inside_a_block(build, page: int) -> None:
    preamble = toks(1000)  # diverges at 1000, inside block 15 (960..1024)
    users = [preamble + toks(150) for _ in range(4)]

    def steps(h):
        return [h.run(u).cached_tokens for u in users]

    h = build(page=page)
    got = steps(h)
    print(f"\nshared preamble, page {page}: hybrid reuse {got}")
    # The second request proves the divergence at block 15 and taps there (the branch point);
    # every later one resumes from it. The second resumes at the first's ladder rung (n - 512,
    # spacing relative to a short prompt's span, issue #37).
    assert got == [0, 576, 960, 960]
    assert h.cache.index.stats.taps_published >= 3
    compare(build, steps, page)


@pytest.mark.parametrize("page", [1, 64])
def test_preamble_boundary_hint_serves_the_second_session(build, page: int) -> None:
    """An exact tap inside a block (1000 = 15 blocks + 40) is published with a 40-token tail."""
    preamble = toks(1000)
    users = [preamble + toks(120) for _ in range(3)]
    hint = make_envelope([1000], ["structural"])
    h = build(page=page)
    got = [h.run(u, kv_hints=hint).cached_tokens for u in users]
    print(f"\nstructural hint at 1000, page {page}: hybrid reuse {got}")
    assert got == [0, 1000, 1000]


@pytest.mark.parametrize("page", [1, 64])
def test_multi_turn_concurrency_one(build, page: int) -> None:
    """Turn k+1 extends turn k's prompt and output: it resumes at turn k's endpoint exactly."""
    h = build(page=page)
    prompt = toks(200)
    reuse, ends = [], []
    for _ in range(4):
        r = h.run(prompt, max_new=90)
        reuse.append(r.cached_tokens)
        out = list(r.output_ids)
        ends.append(len(prompt) + len(out) - 1)  # the last token has no KV yet
        prompt = prompt + out + toks(40)
    print(f"\nmulti-turn, page {page}: reuse {reuse}, endpoints {ends}")
    assert reuse[0] == 0
    assert reuse[1:] == ends[:-1]
    assert h.cache.index.stats.endpoints_published == 4


def test_multi_turn_builtin_resumes_at_each_turns_end(build) -> None:
    """SGLang's own cache (no_buffer, page 1) on the same turns: it keeps the state where each
    request ended, so turn k+1 resumes at turn k's end too (docs/sglang-backend.md's table:
    0, 289, 419)."""
    h = build("builtin")
    prompt, reuse, ends = toks(200), [], []
    for _ in range(3):
        r = h.run(prompt, max_new=90)
        reuse.append(r.cached_tokens)
        out = list(r.output_ids)
        ends.append(len(prompt) + len(out) - 1)
        prompt = prompt + out + toks(40)
    print(f"\nmulti-turn, built-in cache reuse {reuse}")
    assert reuse == [0, *ends[:-1]] == [0, 289, 419]


@pytest.mark.parametrize("page", [1, 64])
def test_eviction_under_device_pressure_while_a_request_runs(build, page: int) -> None:
    h = build(page=page, total=2048, running=2, mamba=16, chunk=256)
    for _ in range(5):  # fill the device cache with finished conversations
        h.run(toks(300), max_new=8)
    cache = h.cache
    assert cache.evictable_size() > 0
    before = cache.index.stats.device_evicted_unbacked
    big = toks(1500)
    r = h.run(big, max_new=120)  # needs most of the pool while it grows
    assert r.finish_reason["type"] == "length" and len(r.output_ids) == 120
    assert cache.index.stats.device_evicted_unbacked > before
    # What survived is still exact: the last conversation's repeat resumes and is checked.
    assert h.run(big, max_new=2).cached_tokens == 1499


@pytest.mark.parametrize("page", [1, 64])
def test_cancel_mid_prefill_publishes_what_it_computed(build, page: int) -> None:
    h = build(page=page, chunk=64)
    s = h.s
    long = toks(900)
    s.submit("cancel", long, 4)
    for _ in range(5):  # five 64-token chunks
        s.step()
    s.abort("cancel")
    h.step_all()
    assert s.results()["cancel"].finish_reason["type"] == "abort"
    stats = h.cache.index.stats
    assert stats.endpoints_published == 1  # at the last computed chunk's end
    r = h.run(long, max_new=2)
    # The cancelled request committed 5 chunks (320 tokens) and published its endpoint there.
    assert r.cached_tokens == 320


def _together(h, prompts: list[list[int]], tag: str) -> list[int]:
    """Submit every prompt at once (one waiting queue), run to idle; reuse in submit order."""
    for i, p in enumerate(prompts):
        h.s.submit(f"{tag}-{i}", p, 4)
    if h.cache.__class__.__name__ == "HybridRadixCache":
        h.step_all()  # with our mamba pool identity checked after every step
    else:
        h.s.run_until_idle()
    res = h.s.results()
    return [res[f"{tag}-{i}"].cached_tokens for i in range(len(prompts))]


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("chunk", [2048, 256])
def test_a_new_prefix_arriving_together_is_prefilled_once(build, page: int, chunk: int) -> None:
    """Spec §12.2: requests sharing a prefix nobody has computed yet wait for the first one's
    state at the divergence. With chunk 256 the first one is prefilled over several passes while
    the others wait; at 2048 the others would otherwise be admitted in its own pass."""
    shared = toks(1000)
    prompts = [shared + toks(100) for _ in range(6)]
    h = build(page=page, chunk=chunk, running=8, mamba=40)
    got = _together(h, prompts, "co")
    print(f"\nnew prefix together, page {page}, chunk {chunk}: hybrid reuse {got}")
    assert got == [0] + [960] * 5
    assert h.cache.stats()["coalesce_waiters"] >= 1  # the rest may be beyond the window

    off = build(page=page, chunk=chunk, running=8, mamba=40, opts={"coalesce": False})
    without = _together(off, prompts, "nc")
    print(f"  without coalescing: {without}")
    # Without it at least two recompute part of the shared prefix (the first from the root;
    # others from a ladder rung the first published mid-prefill, issue #37).
    short = sum(x < 960 for x in without)
    assert short >= 2 and off.cache.stats()["coalesce_waiters"] == 0
    if page == 1:
        builtin = _together(build("builtin", chunk=chunk, running=8, mamba=40), prompts, "bi")
        print(f"  built-in cache reuse: {builtin}")


def test_a_waiting_group_gets_its_tap_from_the_queue(build) -> None:
    """Beyond the spec: the first of a group that waits behind others taps where the rest of the
    group (still waiting, admitted passes later) will resume, though none of them is in flight."""
    groups = [toks(700) for _ in range(3)]
    # One request runs at a time, so no member is ever in flight beside another: only the
    # queue tells the first member of each group that the others will follow.
    prompts = [groups[i % 3] + toks(50) for i in range(9)]
    h = build(running=1, mamba=24)
    got = _together(h, prompts, "qd")
    print(f"\nwaiting groups, one running: hybrid reuse {got}")
    assert got == [0, 0, 0] + [640] * 6


def test_aborts_while_coalescing_leave_nothing_behind(build) -> None:
    """The sibling is cancelled mid-prefill while others wait for it, and a waiting request is
    aborted while held: the rest go on (from what the sibling published), nothing leaks (SGLang's
    idle and busy pool checks, the index's invariant checker)."""
    shared = toks(1000)
    h = build(chunk=128, running=8, mamba=40)
    s = h.s
    for i in range(5):
        s.submit(f"ab-{i}", shared + toks(60), 4)
    for _ in range(3):  # the first one's first chunks; the others are held
        s.step()
        h.check_mamba()
    assert h.cache.coalescer.holds, "the later requests should be waiting for the first"
    s.abort("ab-0")  # the sibling leaves
    s.abort("ab-3")  # a held request leaves
    h.step_all()
    res = s.results()
    assert res["ab-0"].finish_reason["type"] == "abort"
    assert res["ab-3"].finish_reason["type"] == "abort"
    rest = sorted(res[f"ab-{i}"].cached_tokens for i in (1, 2, 4))
    print(f"\naborts while coalescing: reuse of the rest {rest}")
    # ab-0 published an endpoint where it was cancelled; one of the rest carries on from there
    # to the divergence and the other two resume at it.
    assert rest[0] > 0 and rest[1:] == [960, 960]
    assert not h.cache.coalescer.holds and not h.cache.coalescer.cuts


def test_token_id_follow_ups_resume_where_they_diverge(build) -> None:
    """Issue #15: hint-less token-id conversations whose next turn rewrites the last 200 tokens
    of the previous prompt. Once the cache has seen eight such follow-ups it taps each new prompt
    where they leave it (n - 1 - 256, floored to the grid: 320 for 600 tokens), and the next turn
    resumes there instead of from the start (its prompt-tail tap at 576 lies past the rewrite)."""
    h = build(running=4, mamba=40)
    got = []
    for _ in range(11):
        first = toks(600)
        h.run(first)
        got.append(h.run(first[:400] + toks(150)).cached_tokens)
    print(f"\ntoken-id follow-ups, reuse per conversation: {got}")
    assert got[:8] == [0] * 8 and got[8:] == [320] * 3
    assert h.cache.index.followups.observations == 11
