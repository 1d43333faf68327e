"""Shared data of the replay tests (a uniquely named module: every test folder has a conftest)."""

from __future__ import annotations

from pathlib import Path

from sglang_hybrid.replay.generators.agent import AgentConfig
from sglang_hybrid.replay.generators.compaction import CompactionConfig

CACHES = ("hybrid", "no_buffer", "extra_buffer", "oracle")
# The small workload: sessions and seed chosen so that every event occurs (asserted).
SMALL_SESSIONS, SMALL_SEED = 3, 5

# A small agent workload in which every event happens at least once (asserted in the tests).
SMALL_AGENT = AgentConfig(
    turns=(2, 3),
    steps=(1, 3),
    system_tokens=300,
    tools=3,
    tool_def_tokens=(40, 90),
    user_tokens=(20, 80),
    reasoning_tokens=(10, 60),
    call_tokens=(5, 20),
    answer_tokens=(10, 50),
    result_tokens=(30, 300),
    retry_prob=0.25,
    edit_prob=0.5,
    subagent_prob=0.3,
    subagents=(2, 3),
    subagent_steps=(1, 2),
    fanout_prob=0.2,
    fanout=(2, 3),
    document_tokens=(300, 700),
    compaction=CompactionConfig(at_tokens=1400, head_tokens=300, summary_tokens=(50, 150)),
)


def settings(model_dir: Path, **kw):
    from sglang_hybrid.replay.driver import ReplaySettings

    base = dict(
        device="h200",
        geometry="qwen3.5-27b",
        device_bytes=4 << 30,
        max_running=8,
        chunk=256,
        max_prefill_tokens=512,
        model_dir=str(model_dir),
        progress=False,
    )
    base.update(kw)
    return ReplaySettings(**base)
