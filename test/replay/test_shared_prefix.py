import math

import numpy as np

from sglang_hybrid.replay.traces.shared_prefix import shared_prefix_trace


def lcp(a, b):
    n = min(len(a), len(b))
    neq = np.nonzero(a[:n] != b[:n])[0]
    return int(neq[0]) if len(neq) else n


def test_groups_share_exactly_their_system_prompt():
    t = shared_prefix_trace(
        num_groups=3, prompts_per_group=4, system_prompt_len=200, question_len=30, output_len=5
    )
    assert len(t.requests) == 12
    groups: dict[str, list] = {}
    for r in t.requests:
        groups.setdefault(r.session, []).append(r)
        assert r.n == 230 and r.output_len == 5
    assert len(groups) == 3
    for rs in groups.values():
        assert len(rs) == 4
        for a in rs[1:]:
            assert lcp(a.input_ids, rs[0].input_ids) == 200  # questions differ at once
    firsts = [rs[0].input_ids for rs in groups.values()]
    assert lcp(firsts[0], firsts[1]) < 5


def test_arrivals_order_and_lengths():
    burst = shared_prefix_trace(num_groups=2, prompts_per_group=3)
    assert all(r.arrival_s == 0.0 for r in burst.requests)
    ordered = shared_prefix_trace(num_groups=2, prompts_per_group=3, ordered=True)
    assert [r.rid for r in ordered.requests] == [f"gsp{i}" for i in range(6)]
    assert [r.rid for r in burst.requests] != [r.rid for r in ordered.requests]
    poisson = shared_prefix_trace(num_groups=2, prompts_per_group=50, request_rate=10.0)
    times = [r.arrival_s for r in poisson.requests]
    assert times == sorted(times) and times[0] > 0
    assert math.isclose(times[-1] / len(times), 0.1, rel_tol=0.5)
    ranged = shared_prefix_trace(
        num_groups=4, prompts_per_group=8, system_prompt_len=100, question_len=50, range_ratio=0.5
    )
    lens = {r.n for r in ranged.requests}
    assert len(lens) > 1 and all(75 <= n <= 150 for n in lens)


def test_seeded():
    a = shared_prefix_trace(num_groups=2, prompts_per_group=2, seed=4)
    b = shared_prefix_trace(num_groups=2, prompts_per_group=2, seed=4)
    c = shared_prefix_trace(num_groups=2, prompts_per_group=2, seed=5)
    assert all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a.requests, b.requests))
    assert not np.array_equal(a.requests[0].input_ids, c.requests[0].input_ids)


def test_hybrid_computes_each_shared_system_prompt_about_once_per_group(qwen35_dir) -> None:
    """bench_serving's shape in small (16 groups of 8, 2,048-token system prompts, 128-token
    questions, all at once): block-aligned prompts whose follow-ups leave them 128 tokens before
    the end. With the follow-up tap one token short (n - 1 - q, floored a block below the
    divergence) each group computed its system prompt 2.0 times here; at n - q, 1.5."""
    from replay_fixtures import settings

    from sglang_hybrid.replay.driver import replay

    groups, per, system, question = 16, 8, 2048, 128
    trace = shared_prefix_trace(
        num_groups=groups,
        prompts_per_group=per,
        system_prompt_len=system,
        question_len=question,
        output_len=16,
        seed=0,
    )
    s = replay(trace, "hybrid", settings(qwen35_dir, device_bytes=8 << 30)).summary()
    per_group = (s.prefill_tokens - groups * per * question) / system / groups
    assert per_group <= 1.75, per_group
