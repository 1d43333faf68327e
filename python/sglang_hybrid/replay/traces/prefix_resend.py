"""Requests that re-send a prefix of an earlier prompt (issue #37): shorter prompts after longer.

Contract: ``prefix_trace(requests=1500, rate_per_s=2.0, seed=0, ...) -> Trace``. Arrivals are a
Poisson process. A request is, with these probabilities:

- 35 % a fresh prompt of 2,000-24,000 tokens (a document, a long context);
- 25 % the first k of an earlier prompt's 512-token blocks, k uniform in [1, blocks - 1], sent
  as is (Mooncake-style block-hash reuse of a prefix: a client that truncates its context);
- 20 % the same prefix and a new question of 20-400 tokens (a retrieval system re-asking over
  the first part of a document);
- 20 % an earlier prompt without its last 50-600 tokens (its last message dropped: a client
  regenerating from the previous turn).

The earlier prompt is drawn from the last ``window`` prompts (recent documents are asked about
again more often). Answers are 50-400 hashed tokens, never echoed. No hints (token ids only).
Same arguments, same trace.
"""

from __future__ import annotations

import random

import numpy as np

from ..tokens import hashed_tokens
from ..trace import Trace, TraceRequest

BLOCK = 512  # Mooncake's hash block


def prefix_trace(
    *,
    requests: int = 1500,
    rate_per_s: float = 2.0,
    seed: int = 0,
    window: int = 200,
    min_len: int = 2000,
    max_len: int = 24000,
) -> Trace:
    if requests < 1:
        raise ValueError(f"requests must be positive, got {requests}")
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
    if not BLOCK * 2 <= min_len <= max_len:
        raise ValueError(f"lengths: need {2 * BLOCK} <= min_len <= max_len")
    rng = random.Random(f"{seed}/prefixes")
    prompts: list[np.ndarray] = []  # every prompt sent, for later ones to re-send a prefix of
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(requests):
        if i:
            t += rng.expovariate(rate_per_s)
        r = rng.random()
        if not prompts or r < 0.35:
            ids, tag = hashed_tokens(seed, i, rng.randint(min_len, max_len)), "fresh"
        else:
            base = prompts[-rng.randint(1, min(window, len(prompts)))]
            blocks = len(base) // BLOCK
            if r < 0.80 and blocks >= 2:
                head = base[: BLOCK * rng.randint(1, blocks - 1)]
                if r < 0.60:
                    ids, tag = head, "prefix"
                else:
                    question = hashed_tokens(seed, (1 << 40) | i, rng.randint(20, 400))
                    ids, tag = np.concatenate([head, question]), "prefix_question"
            else:
                cut = min(len(base) - 1, rng.randint(50, 600))
                ids, tag = base[: len(base) - cut], "drop_last"
        prompts.append(ids)
        out.append(
            TraceRequest(
                rid=f"pre{i}",
                input_ids=ids,
                output_len=rng.randint(50, 400),
                arrival_s=t,
                tag=tag,
            )
        )
    desc = (
        f"prefix_trace(requests={requests}, rate_per_s={rate_per_s}, seed={seed}, "
        f"window={window}, min_len={min_len}, max_len={max_len})"
    )
    return Trace(name="prefixes", requests=out, source=desc)
