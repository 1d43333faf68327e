"""The shape of SGLang bench_serving's ``generated-shared-prefix`` dataset, token by token.

Contract: ``shared_prefix_trace(num_groups=64, prompts_per_group=16, system_prompt_len=2048,
question_len=128, output_len=256, range_ratio=1.0, request_rate=inf, ordered=False, seed=1)``
mirrors ``sglang.benchmark.datasets.generated_shared_prefix`` (``--gsp-*`` flags, single turn,
uniform groups): each group has one system prompt, each of its prompts is that system prompt
followed by its own question, lengths drawn uniformly from ``[len * range_ratio, len]`` per
group / prompt, requests shuffled unless ``ordered``. Arrivals follow bench_serving's
``--request-rate``: all at t=0 when infinite, else a Poisson process of that rate. Token ids are
hashed (``tokens.hashed_tokens``), so the shape, not bench_serving's random text, is reproduced:
a different tokenizer would change lengths, never the sharing structure.
"""

from __future__ import annotations

import math
import random

import numpy as np

from ..tokens import hashed_tokens
from ..trace import Trace, TraceRequest


def _lens(rng: random.Random, full: int, ratio: float, count: int) -> list[int]:
    low = max(1, int(full * ratio))
    return [rng.randint(low, full) if low < full else full for _ in range(count)]


def shared_prefix_trace(
    *,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    range_ratio: float = 1.0,
    request_rate: float = math.inf,
    ordered: bool = False,
    seed: int = 1,
) -> Trace:
    """Requests of the generated-shared-prefix shape (see the module contract)."""
    if num_groups < 1 or prompts_per_group < 1:
        raise ValueError("num_groups and prompts_per_group must be positive")
    if min(system_prompt_len, question_len, output_len) < 1:
        raise ValueError("lengths must be positive")
    if not 0 < range_ratio <= 1:
        raise ValueError(f"range_ratio must be in (0, 1], got {range_ratio}")
    rng = random.Random(seed)
    sys_lens = _lens(rng, system_prompt_len, range_ratio, num_groups)
    q_lens = _lens(rng, question_len, range_ratio, num_groups * prompts_per_group)
    out_lens = _lens(rng, output_len, range_ratio, num_groups * prompts_per_group)
    systems = [hashed_tokens(seed, g, sys_lens[g]) for g in range(num_groups)]
    rows = []
    for slot in range(num_groups * prompts_per_group):
        g = slot // prompts_per_group
        question = hashed_tokens(seed, (1 << 40) | slot, q_lens[slot])
        rows.append((g, slot, np.concatenate([systems[g], question]), out_lens[slot]))
    if not ordered:
        rng.shuffle(rows)
    t = 0.0
    requests = []
    for g, slot, ids, out in rows:
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        requests.append(
            TraceRequest(
                rid=f"gsp{slot}",
                input_ids=ids,
                output_len=out,
                arrival_s=t,
                session=f"group{g}",
                tag="shared_prefix",
            )
        )
    desc = (
        f"shared_prefix_trace(num_groups={num_groups}, prompts_per_group={prompts_per_group}, "
        f"system_prompt_len={system_prompt_len}, question_len={question_len}, "
        f"output_len={output_len}, range_ratio={range_ratio}, request_rate={request_rate}, "
        f"ordered={ordered}, seed={seed})"
    )
    return Trace(name="shared_prefix", requests=requests, source=desc)
