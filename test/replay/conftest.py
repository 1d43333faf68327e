"""Fixtures for the replay tests: the template, a tiny agent trace and replays of it.

Replays build SGLang's real Scheduler (one alive at a time, the driver closes its own), so the
end-to-end fixture runs each cache once per session and the driver and report tests share it.
Budgets are small GiB figures of the 27B geometry; the CPU pools stay a few MB.
"""

from __future__ import annotations

import pytest
from replay_fixtures import CACHES, SMALL_AGENT, SMALL_SEED, SMALL_SESSIONS, settings


@pytest.fixture(scope="session")
def template():
    from sglang_hybrid.replay.generators.template import TemplateTokens

    return TemplateTokens.build()


@pytest.fixture(scope="session")
def small_agent_trace(template):
    from sglang_hybrid.replay.generators.workload import agent_workload

    return agent_workload(
        sessions=SMALL_SESSIONS,
        session_rate_per_s=0.5,
        seed=SMALL_SEED,
        config=SMALL_AGENT,
        template=template,
    )


@pytest.fixture(scope="session")
def agent_replays(small_agent_trace, qwen3_next_dir):
    """Each cache's replay of the small agent trace (run once, shared)."""
    from sglang_hybrid.replay.driver import replay

    cfg = settings(qwen3_next_dir)
    return {c: replay(small_agent_trace, c, cfg) for c in CACHES}
