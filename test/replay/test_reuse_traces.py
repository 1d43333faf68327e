"""The generated traces of issue #37: hint-less chat at load, prompts re-sending a prefix."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hybrid.replay.trace import check_trace
from sglang_hybrid.replay.traces.chat_sessions import OPENER, chat_trace
from sglang_hybrid.replay.traces.prefix_resend import BLOCK, prefix_trace


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.nonzero(a[:n] != b[:n])[0]
    return int(neq[0]) if len(neq) else n


def fingerprint(t) -> list:
    return [
        (r.rid, r.input_ids.tobytes(), r.output_len, r.arrival_s, r.after, r.delay_s)
        for r in t.requests
    ]


def test_chat_turns_echo_or_rerender_the_last_answer() -> None:
    t = chat_trace(sessions=30, seed=3)
    check_trace(t)
    assert fingerprint(t) == fingerprint(chat_trace(sessions=30, seed=3))  # same args, same trace
    by_rid = {r.rid: r for r in t.requests}
    echoed = rerendered = 0
    for r in t.requests:
        assert not r.hint_positions  # token ids only
        assert (r.input_ids[-3:] == OPENER).all()
        if not r.after:
            continue
        prev = by_rid[r.after[0]]
        assert 20 <= r.delay_s <= 600  # the user thinks between turns
        assert lcp(r.input_ids, prev.input_ids) == prev.n  # it continues the previous prompt
        assert prev.output_ids is not None
        answer = prev.output_ids
        if lcp(r.input_ids[prev.n :], answer) == len(answer):
            echoed += 1  # the answer, token for token
        else:
            rerendered += 1  # the answer without its reasoning: it leaves right after the opener
            assert lcp(r.input_ids[prev.n :], answer) == 0
    assert echoed and rerendered
    starts = [r.arrival_s for r in t.requests if r.arrival_s is not None]
    assert starts == sorted(starts) and len(starts) == 30


def test_prefix_requests_resend_a_prefix_of_an_earlier_prompt() -> None:
    t = prefix_trace(requests=300, seed=2)
    check_trace(t)
    assert fingerprint(t) == fingerprint(prefix_trace(requests=300, seed=2))
    seen: list[np.ndarray] = []
    tags = set()
    for r in t.requests:
        tags.add(r.tag)
        best = max((lcp(r.input_ids, p) for p in seen), default=0)
        if r.tag == "prefix":  # whole 512-token blocks of an earlier prompt, nothing else
            assert best == r.n and r.n % BLOCK == 0
        elif r.tag == "prefix_question":
            assert best >= BLOCK and best % BLOCK == 0 and best < r.n
        elif r.tag == "drop_last":
            assert best == r.n  # an earlier prompt without its last tokens
        seen.append(r.input_ids)
    assert tags == {"fresh", "prefix", "prefix_question", "drop_last"}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="sessions"):
        chat_trace(sessions=0)
    with pytest.raises(ValueError, match="turns"):
        chat_trace(min_turns=3, max_turns=2)
    with pytest.raises(ValueError, match="lengths"):
        prefix_trace(min_len=100)
