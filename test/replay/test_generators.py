"""Generated workloads: seeded, and shaped like the cases the issue names."""

import numpy as np
from replay_fixtures import SMALL_AGENT, SMALL_SEED, SMALL_SESSIONS

from sglang_hybrid.replay.generators.workload import agent_workload
from sglang_hybrid.replay.trace import check_trace


def lcp(a, b):
    n = min(len(a), len(b))
    neq = np.nonzero(a[:n] != b[:n])[0]
    return int(neq[0]) if len(neq) else n


def by_rid(trace):
    return {r.rid: r for r in trace.requests}


def previous_in_session(trace):
    """rid -> the request before it in the same conversation (subagents are their own)."""
    last, prev = {}, {}
    for r in trace.requests:
        if r.session in last:
            prev[r.rid] = last[r.session]
        last[r.session] = r
    return prev


def test_seeded_determinism(template, small_agent_trace):
    again = agent_workload(
        sessions=SMALL_SESSIONS,
        session_rate_per_s=0.5,
        seed=SMALL_SEED,
        config=SMALL_AGENT,
        template=template,
    )
    assert [r.rid for r in again.requests] == [r.rid for r in small_agent_trace.requests]
    for a, b in zip(again.requests, small_agent_trace.requests):
        assert np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.output_ids, b.output_ids)
        assert (a.after, a.delay_s, a.arrival_s, a.hint_positions) == (
            b.after,
            b.delay_s,
            b.arrival_s,
            b.hint_positions,
        )
    other = agent_workload(
        sessions=SMALL_SESSIONS,
        session_rate_per_s=0.5,
        seed=SMALL_SEED + 1,
        config=SMALL_AGENT,
        template=template,
    )
    assert not np.array_equal(other.requests[1].input_ids, small_agent_trace.requests[1].input_ids)


def test_every_event_occurs_and_the_trace_is_valid(small_agent_trace):
    check_trace(small_agent_trace)
    tags = {r.tag for r in small_agent_trace.requests}
    assert {
        "session_start",
        "tool_step",
        "turn",
        "retry",
        "edit",
        "subagent",
        "fanout",
        "compaction",
    } <= tags
    for r in small_agent_trace.requests:
        assert r.input_ids.min() >= 0 and r.input_ids.max() < 2048
        assert r.output_ids[-1] == 2  # <|im_end|>
        assert all(0 < p <= r.n for p in r.hint_positions)
        assert r.hint_kinds[-1] == "opener" and r.hint_positions[-1] == r.n - 3


def test_tool_steps_echo_the_previous_answer(small_agent_trace):
    rids = by_rid(small_agent_trace)
    steps = [r for r in small_agent_trace.requests if r.tag == "tool_step" and len(r.after) == 1]
    assert steps
    for r in steps:
        prev = rids[r.after[0]]
        echoed = np.concatenate([prev.input_ids, prev.output_ids])
        assert np.array_equal(r.input_ids[: len(echoed)], echoed), r.rid


def test_new_turns_re_render_history_without_thinking(template, small_agent_trace):
    rids = by_rid(small_agent_trace)
    turns = [r for r in small_agent_trace.requests if r.tag == "turn"]
    assert turns
    for r in turns:
        prev = rids[r.after[0]]  # the previous turn's final answer
        assert template.think in prev.output_ids.tolist()
        # The new prompt holds no thinking at all, although the previous prompt did echo it.
        assert template.think not in r.input_ids.tolist()
        assert lcp(r.input_ids, np.concatenate([prev.input_ids, prev.output_ids])) < prev.n


def test_sessions_and_subagents_share_a_preamble_that_diverges_inside_a_block(
    small_agent_trace,
):
    starts = [r for r in small_agent_trace.requests if r.tag in ("session_start", "subagent")]
    firsts = [r for r in starts if r.tag == "session_start" or r.rid.endswith(".r0")]
    preamble = firsts[0].hint_positions[0]
    assert firsts[0].hint_kinds[0] == "structural"
    assert preamble % 64
    for r in firsts[1:]:
        assert r.hint_positions[0] == preamble
        shared = lcp(r.input_ids, firsts[0].input_ids)
        # Everything up to the preamble's end (and the next user header) is shared, then the
        # conversations diverge inside the block that holds the preamble's end.
        assert preamble <= shared < preamble + 8
        assert shared // 64 == preamble // 64 or shared % 64 < 8


def test_retries_resend_the_same_prompt(small_agent_trace):
    before = previous_in_session(small_agent_trace)
    retries = [r for r in small_agent_trace.requests if r.tag == "retry"]
    assert retries
    for r in retries:
        prev = before[r.rid]
        assert r.after == (prev.rid,)
        assert np.array_equal(r.input_ids, prev.input_ids)
        assert not np.array_equal(r.output_ids, prev.output_ids)


def test_deep_edits_diverge_inside_the_history(small_agent_trace):
    before = previous_in_session(small_agent_trace)
    edits = [r for r in small_agent_trace.requests if r.tag == "edit"]
    assert edits
    for r in edits:
        prev = before[r.rid]
        shared = lcp(r.input_ids, prev.input_ids)
        # An earlier user message was edited: the prompts diverge right after its header
        # (<|im_start|>user\n, three tokens past a message boundary), well before the end.
        assert shared < prev.n - 64
        assert shared - 3 in prev.hint_positions
        assert (
            r.input_ids[shared - 3] == 1 and r.input_ids[shared - 2] == prev.input_ids[shared - 2]
        )


def test_compaction_keeps_a_marked_head_and_replaces_the_middle(small_agent_trace):
    before = previous_in_session(small_agent_trace)
    comps = [r for r in small_agent_trace.requests if r.tag == "compaction"]
    assert comps
    for r in comps:
        prev = before[r.rid]
        head = [p for p, k in zip(r.hint_positions, r.hint_kinds) if k == "explicit"]
        assert len(head) == 1
        # The harness marked the head before compacting: the previous prompt carries it too.
        assert head[0] in prev.hint_positions
        assert lcp(r.input_ids, prev.input_ids) >= head[0]
        assert r.n < prev.n + prev.output_len  # the middle was replaced by a shorter summary


def test_fanout_workers_arrive_together_on_a_new_shared_document(small_agent_trace):
    groups: dict = {}
    for r in small_agent_trace.requests:
        if r.tag == "fanout":
            groups.setdefault((r.after, r.delay_s), []).append(r)
    assert groups
    for rs in groups.values():
        assert len(rs) >= 2
        preamble = rs[0].hint_positions[0]
        shared = lcp(rs[0].input_ids, rs[1].input_ids)
        assert shared >= preamble + SMALL_AGENT.document_tokens[0]
