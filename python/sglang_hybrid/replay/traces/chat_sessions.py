"""Hint-less multi-turn chat at load: what a chat product's token-id traffic looks like (issue #37).

Contract: ``chat_trace(sessions=400, session_rate_per_s=0.5, seed=0, ...) -> Trace``. Sessions
start as a Poisson process; each opens with one of a few shared system prompts (a product's
instructions, ``systems`` of them, ``system_len`` tokens each, Zipf-popular) and runs 2-12 turns.
A turn's prompt is the previous prompt, the previous answer and a new user message (30-1,500
tokens; one turn in eight pastes a 2-8k-token document), ending with the generation opener. Half
the sessions echo each answer token for token (an agent harness, or a template that keeps every
turn); the other half re-render it without its reasoning (the answer opens with a thinking block
the next prompt drops, as Qwen3-family templates do), so their next turn leaves the previous
prompt right after its opener. The user thinks 20-600 s between turns (closed loop: ``after``
the previous turn, ``delay_s`` later), so many sessions interleave and a conversation's next
turn comes long after the cache saw its last one: its reuse distance exceeds a device's memory.
No tap hints (token ids only, as ``/generate`` clients and routers send). Token ids are hashed
streams (``tokens.hashed_tokens``): the sharing structure is reproduced, not any tokenizer's text.
Same arguments, same trace.
"""

from __future__ import annotations

import random

import numpy as np

from ..tokens import hashed_tokens
from ..trace import Trace, TraceRequest

_SYSTEM, _USER, _ANSWER, _THINK, _MARKS = 1, 2, 3, 4, 5  # stream families of ``hashed_tokens``
# Fixed stand-ins for the generation opener ("<|im_start|>assistant\n", 3 tokens) and the
# thinking tags: the same ids in every session, as a template's markers are.
OPENER = hashed_tokens(0, _MARKS << 40, 3)
THINK = hashed_tokens(0, (_MARKS << 40) | 1, 2)


def chat_trace(
    *,
    sessions: int = 400,
    session_rate_per_s: float = 0.5,
    seed: int = 0,
    systems: int = 4,
    system_len: int = 3000,
    min_turns: int = 2,
    max_turns: int = 12,
    think_s: tuple[float, float] = (20.0, 600.0),
) -> Trace:
    if sessions < 1:
        raise ValueError(f"sessions must be positive, got {sessions}")
    if session_rate_per_s <= 0:
        raise ValueError(f"session_rate_per_s must be positive, got {session_rate_per_s}")
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"turns: need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    rng = random.Random(f"{seed}/chat")
    system_ids = [hashed_tokens(seed, (_SYSTEM << 40) | i, system_len) for i in range(systems)]
    weights = [1.0 / (i + 1) for i in range(systems)]  # Zipf: the first product is most used
    stream = 0

    def text(family: int, n: int) -> np.ndarray:
        nonlocal stream
        stream += 1
        return hashed_tokens(seed, (family << 40) | stream, n)

    requests: list[TraceRequest] = []
    t = 0.0
    for s in range(sessions):
        if s:
            t += rng.expovariate(session_rate_per_s)
        echo = rng.random() < 0.5
        history = system_ids[rng.choices(range(systems), weights)[0]]
        prev: str | None = None
        for turn in range(rng.randint(min_turns, max_turns)):
            user_len = rng.randint(30, 1500)
            if rng.random() < 1 / 8:
                user_len += rng.randint(2000, 8000)  # a pasted document
            prompt = np.concatenate([history, text(_USER, user_len), OPENER])
            body = text(_ANSWER, rng.randint(60, 800))
            if echo:
                answer = body
                history = np.concatenate([prompt, body])
            else:  # reasoning first, dropped when the next turn re-renders the history
                thought = text(_THINK, rng.randint(50, 400))
                answer = np.concatenate([THINK[:1], thought, THINK[1:], body])
                history = np.concatenate([prompt, body])
            rid = f"chat{s}-{turn}"
            requests.append(
                TraceRequest(
                    rid=rid,
                    input_ids=prompt,
                    output_len=len(answer),
                    output_ids=answer,
                    arrival_s=t if prev is None else None,
                    after=(prev,) if prev is not None else (),
                    delay_s=rng.uniform(*think_s) if prev is not None else 0.0,
                    session=f"chat{s}",
                    turn=turn,
                    tag="turn" if turn else "session_start",
                )
            )
            prev = rid
    desc = (
        f"chat_trace(sessions={sessions}, session_rate_per_s={session_rate_per_s}, seed={seed}, "
        f"systems={systems}, system_len={system_len}, turns={min_turns}..{max_turns}, "
        f"think_s={think_s})"
    )
    return Trace(name="chat", requests=requests, source=desc)
