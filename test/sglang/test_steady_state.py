"""Reuse that holds in a server that has run for a while (issue #11), in SGLang's real Scheduler.

A server that has served for an hour has a device pool full of evictable cache, requests that
arrive together, and clients that send the same prompt twice. ``CheckingWorker`` proves every
resumed prefix is what an uncached run computes.
"""

from __future__ import annotations

import random

import pytest

from sglang_hybrid.sglang.hints import make_envelope

rng = random.Random(23)


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def promised_repeat(n: int) -> int:
    """docs/index.md: a repeat of an n-token prompt resumes at n - 1, the prompt-tail tap (one
    token is always prefilled, so a state at n - 1 is the deepest usable), whatever n mod 64 is
    (issue #37; floor64(n - 1) before). Within a block of the root no tap is worth its slot."""
    return n - 1 if n - 1 >= 64 else 0


def promised_hinted_repeat(n: int) -> int:
    """A chat request's repeat (hints as the chat template gives them: the system block's end
    at n // 2, the opener OPENER_GAP tokens before n) resumes at the opener: it is the
    request's end, keeps its own position and absorbs the tail (issue #37). An opener within a
    block of the root is dropped (64-token proximity), and the tail serves."""
    opener = n - OPENER_GAP
    return opener if opener > 64 else promised_repeat(n)


OPENER_GAP = 3  # "<|im_start|>assistant\n"
LENGTHS = [*range(1, 301), 4095, 4096, 4097, 4160, 4161, 8127, 8128, 8129]


def _chat_hints(n: int) -> dict | None:
    """The chat template's hints for an n-token request (positions within (0, n])."""
    marks = [(n // 2, "structural"), (n - OPENER_GAP, "opener")]
    marks = [(p, k) for p, k in marks if p > 0]
    if not marks:
        return None
    return make_envelope([p for p, _ in marks], [k for _, k in marks])


@pytest.mark.parametrize("hinted", [False, True])
def test_repeats_of_every_length_reuse_the_prompt_tail_tap(build, hinted: bool) -> None:
    """The cache flushed before each length, as a client probing it would see it: token ids
    only (a /generate client), or with the chat template's hints."""
    h = build(total=40000, running=2, mamba=12)
    promised = promised_hinted_repeat if hinted else promised_repeat
    wrong = []
    for n in LENGTHS:
        assert h.s.scheduler.flush_cache()
        p = toks(n)
        attrs = {"kv_hints": _chat_hints(n)} if hinted and _chat_hints(n) else {}
        first = h.run(p, max_new=1, **attrs).cached_tokens
        again = h.run(p, max_new=1, **attrs).cached_tokens
        if first != 0 or again != promised(n):
            wrong.append((n, first, again, promised(n)))
    assert not wrong, f"(length, first, repeat, promised): {wrong[:12]}"


def test_repeats_keep_reusing_once_the_snapshot_slots_are_full(build) -> None:
    """No flush: after a few lengths every snapshot slot holds a state that was hit once. New
    taps still get slots (a refused newcomer raises GDSF's L, so residents age out)."""
    h = build(total=40000, running=2, mamba=12)
    served = 0
    for n in LENGTHS[64:]:
        p = toks(n)
        h.run(p, max_new=1)
        served += h.run(p, max_new=1).cached_tokens == promised_repeat(n)
    print(f"\nrepeats served without flushes: {served} of {len(LENGTHS) - 64}")
    print(f"  skipped: {h.cache.skips.as_dict()}")
    # Measured: 210 of 244 (tap_no_slot 37); 17 of 244 (454 refusals) before L rose on refusals.
    assert served >= 0.8 * (len(LENGTHS) - 64)


def _chat(h, first_prompt: list[int], turns: int, news: list[list[int]]) -> list[int]:
    """A chat whose template re-renders history: each turn re-sends history + the answer with
    its reasoning stripped (the first 30 generated tokens dropped) + a new user message, with
    the generation opener (the template's assistant header, 3 tokens) hinted as the chat
    endpoint does. Each turn resumes from the previous turn's opener tap, which sits inside a
    block and so needs a tail copy."""
    prompt, reuse = list(first_prompt), []
    for t in range(turns):
        hint = make_envelope([len(prompt) - 3], ["opener"])
        r = h.run(prompt, max_new=90, kv_hints=hint)
        reuse.append(r.cached_tokens)
        prompt = prompt + list(r.output_ids)[30:] + news[t]
    return reuse


@pytest.mark.parametrize("chunk", [8192, 128])
def test_a_full_pool_of_evictable_cache_reuses_like_a_flushed_one(build, chunk: int) -> None:
    """Five unrelated 3.5k-token prompts fill the device pool first: taps evict for their tails
    like any allocation, so the chat reuses what it reuses on a flushed pool."""
    first = toks(300)
    news = [toks(40) for _ in range(6)]
    fill = [toks(3500) for _ in range(5)]
    kw = dict(total=16384, running=4, mamba=24, chunk=chunk)
    flushed = _chat(build(**kw), first, 6, news)
    h = build(**kw)
    for p in fill:
        h.run(p, max_new=4)
    free = h.s.scheduler.token_to_kv_pool_allocator.available_size()
    assert free < 2000 and h.cache.evictable_size() > 10000, (free, h.cache.evictable_size())
    full = _chat(h, first, 6, news)
    print(f"\nchat, chunk {chunk}: flushed {flushed}, full pool {full}")
    print(f"  skipped: {h.cache.skips.as_dict()}")
    assert full == flushed
    assert flushed[1:] == sorted(flushed[1:]) and all(x % 64 for x in flushed[1:])


def test_a_concurrent_wave_restores_from_host(build) -> None:
    """14 distinct 3,000-token prompts one at a time (they spill to the host tier), then each
    + 5 tokens one at a time, then each + 2 tokens eight at a time: every request of the wave
    resumes at the prompt-tail tap (n - 1) from the host, waiting for room rather than
    recomputing."""
    h = build(
        total=12288,
        running=8,
        mamba=40,
        chunk=2048,
        opts={"host_cache_mib": 256, "device_snapshot_slots": 12},
    )
    prompts = [toks(3000) for _ in range(14)]
    for p in prompts:
        assert h.run(p, max_new=4).cached_tokens == 0
    ones = [h.run(p + toks(5), max_new=4).cached_tokens for p in prompts]
    assert ones == [2999] * 14  # the prompt-tail tap at n - 1
    restored = h.cache.host_tier.restored_bytes
    got = []
    for wave in (prompts[:8], prompts[8:]):
        tag = f"w{len(got)}"
        for i, p in enumerate(wave):
            h.s.submit(f"{tag}-{i}", p + toks(2), 4)
        h.step_all()
        res = h.s.results()
        got += [res[f"{tag}-{i}"].cached_tokens for i in range(len(wave))]
    print(f"\nconcurrent wave: {got}; skipped {h.cache.skips.as_dict()}")
    assert got == [2999] * 14
    assert h.cache.host_tier.restored_bytes > restored
    assert h.cache.skips.counts["recomputed_held"] == 0
