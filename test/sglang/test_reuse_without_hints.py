"""Reuse a client sending token ids would expect (issue #37), in SGLang's real Scheduler.

What it sent before, or a part of it, is not computed twice while memory holds it: a resent chat
request resumes at its own end, a prompt that is a strict prefix of an earlier one resumes inside
it, and a cyclic working set larger than the cache keeps a stable part of itself instead of
evicting what the next request needs. (Repeats of every length, hinted and not, are in
``test_steady_state.py``.) ``CheckingWorker`` proves every resumed prefix is what an uncached run
computes; SGLang's own cache runs the same steps where it can, for comparison.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from test_boundaries import ask

from sglang_hybrid.index.taps import END_TOKENS
from sglang_hybrid.sglang.boundaries import BOUNDARIES
from sglang_hybrid.sglang.chat_hints import hints_envelope, message_boundaries

rng = random.Random(37)
WORDS = ["the", "cache", "keeps", "what", "a", "client", "sent", "before", "so", "it", "is"]


def toks(n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def _render(tok: Any, messages: list[dict], gen: bool) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
    if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def test_a_resent_chat_request_resumes_at_its_opener(build, qwen3_next_dir) -> None:
    """The chat resend of issue #37: the opener lies less than a block after the system block's
    end. Clustered with it, the state sat at the system block's end and every resend resumed
    there, named ``opener``; now the opener keeps its own position (the request's end) and each
    checkpoint is named by the rule that made it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_next_dir)
    messages = [
        {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(150))},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))},
    ]
    ids = _render(tok, messages, True)
    hints = message_boundaries(lambda m, g: _render(tok, list(m), g), messages, ids)
    system_end = hints[0].position
    opener = hints[-1].position
    assert opener - system_end < 64 and len(ids) - opener <= END_TOKENS, (hints, len(ids))
    h = build()
    got = [h.run(ids, max_new=4, kv_hints=hints_envelope(hints)).cached_tokens for _ in range(3)]
    print(f"\nchat resend ({len(ids)} tokens, opener at {opener}): hybrid reuse {got}")
    assert got == [0, opener, opener]
    reply = ask(h, BOUNDARIES, {"input_ids": ids})
    kinds = {c["position"]: c["kind"] for c in reply.response[0]["checkpoints"]}
    assert kinds[system_end] == "structural" and kinds[opener] == "opener", kinds
    builtin = build("builtin")
    again = [builtin.run(ids, max_new=4).cached_tokens for _ in range(3)]
    print(f"  built-in cache reuse: {again}")


def test_strict_prefixes_of_earlier_prompts_resume_inside_them(build) -> None:
    """Issue #37's sequences: a prompt of a few thousand tokens, then a strict prefix of it. The
    ladder's rungs are spaced relative to the prompt (the spec's first rung is n - 16,384), and
    where clients stop inside earlier prompts is learned like follow-ups are."""
    h = build(total=32768, running=2, mamba=16)
    q = toks(4000)
    h.run(q, max_new=1)
    got = h.run(q[:3000], max_new=1).cached_tokens
    print(f"\nfirst 3,000 of a 4,000-token prompt: {got}")
    assert got == 2944  # the rung at n - 1000 on the grid (was 0 before the relative ladder)
    # A client that re-sends its prompt without the last message (250-300 tokens): once a few
    # of these were seen, each prompt taps where such a prefix will stop, and the prefix
    # resumes there: at e - 320 (the learned bin covering offsets up to 320) on the grid, so
    # at most 320 - 250 + 63 tokens short of its end.
    late = []
    for i in range(16):
        p = toks(rng.randrange(3000, 5000))
        h.run(p, max_new=1)
        short = p[: len(p) - rng.randrange(250, 301)]
        r = h.run(short, max_new=1)
        if i >= 10:
            late.append(len(short) - r.cached_tokens)
    print(f"  prefixes re-sent without their last message, tokens recomputed: {late}")
    assert max(late) <= 320 - 250 + 63, late
    assert h.cache.index.followups.observations >= 16


def _cycle(h: Any, prompts: list[list[int]], together: int = 1) -> list[int]:
    """Each prompt once, then each again with 5 more tokens, ``together`` at a time."""
    for p in prompts:
        h.run(p, max_new=4)
    again = [p + toks(5) for p in prompts]
    if together == 1:
        return [h.run(p, max_new=4).cached_tokens for p in again]
    got: list[int] = []
    for w in range(0, len(again), together):
        wave = again[w : w + together]
        for i, p in enumerate(wave):
            h.s.submit(f"cy{w}-{i}", p, 4)
        h.s.run_until_idle()
        res = h.s.results()
        got += [res[f"cy{w}-{i}"].cached_tokens for i in range(len(wave))]
    return got


@pytest.mark.parametrize("host_mib", [0, 16])
def test_a_cycle_larger_than_the_cache_keeps_a_stable_part(build, host_mib: int) -> None:
    """Issue #37's cyclic scan: 14 distinct 3,000-token prompts (42k tokens) through a 16,384-token
    device pool (and a 16 MiB host tier: 128 slabs of 64 tokens, images included), then each
    again with 5 more tokens, in the same order. LRU kept nothing of it (0 of 14): each request
    evicted what the next one needed. The device holds four such prompts beside the one running,
    so at most four can reuse without a host tier; with one, more."""
    prompts = [toks(3000) for _ in range(14)]
    h = build(total=16384, running=4, mamba=32, opts={"host_cache_mib": host_mib})
    got = _cycle(h, prompts)
    served = sum(g > 0 for g in got)
    print(f"\ncycle, host {host_mib} MiB: hybrid reuse {got} ({served} of 14)")
    assert served >= (4 if host_mib == 0 else 6), got
    assert h.cache.index.thrash.ghost_hits_total > 0
    if host_mib == 0:
        builtin = _cycle(build("builtin", total=16384, running=4, mamba=32), prompts)
        print(f"  built-in cache reuse: {builtin}")


def test_a_cycle_arriving_eight_at_a_time(build) -> None:
    """The same cycle, its second pass eight at a time with the host tier: the waves' running
    requests take most of the device, and the stable part the host kept is restored."""
    prompts = [toks(3000) for _ in range(14)]
    h = build(total=16384, running=8, mamba=40, opts={"host_cache_mib": 16})
    got = _cycle(h, prompts, together=8)
    served = sum(g > 0 for g in got)
    print(f"\ncycle eight at a time, host 16 MiB: hybrid reuse {got} ({served} of 14)")
    assert served >= 4, got
