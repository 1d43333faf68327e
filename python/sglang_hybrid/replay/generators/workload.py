"""The generated agent workload of the benchmark: many agent sessions arriving over time.

Contract: ``agent_workload(sessions=24, session_rate_per_s=0.1, seed=0, config=AgentConfig())
-> Trace``: sessions start as a Poisson process of ``session_rate_per_s`` (the first at t=0);
each is ``AgentGenerator.session`` (tool loops, re-rendered history, retries, deep edits,
subagents and fan-outs sharing the preamble, compaction). Same arguments, same trace.
"""

from __future__ import annotations

import random

from ..trace import Trace
from .agent import AgentConfig, AgentGenerator
from .template import TemplateTokens


def agent_workload(
    *,
    sessions: int = 24,
    session_rate_per_s: float = 0.1,
    seed: int = 0,
    config: AgentConfig | None = None,
    template: TemplateTokens | None = None,
) -> Trace:
    if sessions < 1:
        raise ValueError(f"sessions must be positive, got {sessions}")
    if session_rate_per_s <= 0:
        raise ValueError(f"session_rate_per_s must be positive, got {session_rate_per_s}")
    cfg = config or AgentConfig()
    gen = AgentGenerator(cfg, seed, template or TemplateTokens.build())
    rng = random.Random(f"{seed}/arrivals")
    t = 0.0
    requests = []
    for i in range(sessions):
        if i:
            t += rng.expovariate(session_rate_per_s)
        requests += gen.session(i, t)
    desc = (
        f"agent_workload(sessions={sessions}, session_rate_per_s={session_rate_per_s}, seed={seed})"
    )
    return Trace(name="agent", requests=requests, source=desc)
