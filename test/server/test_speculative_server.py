"""``python -m sglang.launch_server --radix-cache hybrid --speculative-algorithm CPU_MTP``:
SGLang's speculative server path with the cache, under SGLang's overlap loop, the draft model's
KV pool found through SGLang's own ``Scheduler.init_memory_pools`` (issue #14). Outputs equal
the non-speculative server's (``hybrid_server``, same seeded weights) turn by turn, and later
turns resume from the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import generate, serve_hybrid, toks

from sglang_hybrid.cpu.server import CpuServer


@pytest.fixture(scope="module")
def spec_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CpuServer]:
    spec = ("--speculative-algorithm", "CPU_MTP", "--speculative-num-steps", "3")
    yield from serve_hybrid(tiny_models, tmp_path_factory, "speculative", *spec)


def test_a_speculative_server_serves_a_conversation_as_the_plain_one_does(
    spec_server: CpuServer, hybrid_server: CpuServer
) -> None:
    info = spec_server.get_json("/get_server_info")
    assert info["speculative_algorithm"] == "CPU_MTP"
    # Overlap scheduling stays on (SGLang turns it off on a CPU for its EAGLE family only): the
    # server's own event_loop_overlap runs the verify rounds.
    assert info["disable_overlap_schedule"] is False
    log = spec_server.log_path.read_text(errors="replace")
    assert "with 1 draft KV layers" in log  # the MTP layer's pool, copied with every block
    seq, last_prompt = toks(70, 300), 0
    for turn in range(3):
        spec = generate(spec_server, seq, max_new=40)
        plain = generate(hybrid_server, seq, max_new=40)
        assert spec["output_ids"] == plain["output_ids"], f"turn {turn}"
        # At least from the last prompt's end tap (its 64-token grid point): a verify round that
        # crosses the length limit leaves no endpoint (docs/sglang-backend.md).
        assert spec["meta_info"]["cached_tokens"] >= 64 * (last_prompt // 64)
        last_prompt = len(seq)
        seq = seq + spec["output_ids"] + toks(71 + turn, 30)
